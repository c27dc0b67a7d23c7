"""AOTAutograd: the joint forward/backward trace compile_training makes."""
from __future__ import annotations

import contextlib

import torch
import torch.fx
from torch._functorch._aot_autograd.graph_capture_wrappers import disable_autocast
from torch._functorch._aot_autograd.utils import _is_tangent
from torch._functorch.aot_autograd import aot_module_simplified
from torch._functorch.partitioners import default_partition


@contextlib.contextmanager
def backward_pass_autocast(value):
    """AOTAutograd's own knob for the autocast state the backward is traced under.

    force_non_lazy_backward_lowering: trace the backward now, not at its first
    run. Structured trace logging is paused meanwhile: it JSON-dumps this
    config, and a torch.dtype in the list form is not JSON serializable."""
    from torch._logging._internal import trace_log

    handlers = trace_log.handlers
    if not isinstance(value, str):
        trace_log.handlers = []
    try:
        with torch._functorch.config.patch(backward_pass_autocast=value,
                                           force_non_lazy_backward_lowering=True):
            yield
    finally:
        trace_log.handlers = handlers


def autocast_skipped():
    """Autocast's dispatch keys skipped while compiled graphs run (their casts
    are in them), as AOTAutograd runs its own: a C++ guard, cheap, where
    ``disable_autocast`` enters ``torch.autocast(enabled=False)`` per device."""
    return torch._C._DisableAutocast() if torch._C._is_any_autocast_enabled() else contextlib.nullcontext()


def is_compiled_backward_node(node) -> bool:
    """Is this autograd node the backward of an AOTAutograd compiled function?"""
    return node.name() == "CompiledFunctionBackward"


def is_tangent(node: torch.fx.Node) -> bool:
    """Is this placeholder of an AOTAutograd backward graph a tangent (the
    gradient of one of the compiled function's outputs)?"""
    return _is_tangent(node)


def tangents_are_plain(backward: torch.fx.GraphModule) -> bool:
    """Is each tangent placeholder of ``backward`` the gradient of one output
    (not a part of a tensor subclass's gradient, which AOTAutograd unwraps
    into several placeholders)?"""
    from torch._functorch._aot_autograd.descriptors import TangentAOTInput

    return all(isinstance(n.meta.get("desc"), TangentAOTInput)
               for n in backward.graph.nodes if _is_tangent(n))


def pass_absent_gradients(node) -> None:
    """The compiled function's backward ``node`` gets ``None`` for an output
    that got no gradient, not zeros: AOTAutograd's node is an
    ``autograd.Function``'s, itself the function's ctx."""
    node.set_materialize_grads(False)


def backward_node_wrapped(node, wrap) -> None:
    """Autograd runs ``wrap(apply, grads)`` for the compiled function's
    backward ``node``, where ``grads`` is a list (one per output, ``None``
    or a tensor) and ``apply(grads)`` its own backward. The engine calls a
    method of the node's Python object (the function's ctx): ``apply_boxed``
    with one list where the function asks for its gradients boxed, as
    AOTAutograd's does, else ``apply``; an attribute of the instance stands
    in for the class's."""
    if getattr(node._forward_cls, "boxed_grads_call", False):
        apply_boxed = node.apply_boxed
        node.apply_boxed = lambda grads: wrap(apply_boxed, grads)
    else:
        apply = node.apply
        node.apply = lambda *grads: wrap(lambda g: apply(*g), list(grads))


def inputs_of_node(node) -> int:
    """How many inputs the compiled function of backward ``node`` took (its
    backward returns one gradient or ``None`` per input)."""
    return len(node.needs_input_grad)


def saved_tensors_freed(node) -> bool:
    """Did a backward (without ``retain_graph``) free what ``node`` saved?"""
    try:
        node.saved_tensors
    except RuntimeError:
        return True
    return False


@contextlib.contextmanager
def rnns_for_training():
    """While AOTAutograd traces: torch's decompositions of the recurrent
    layers (``aten.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``) as eager
    runs them in training.

    - mkldnn's inference kernel for an lstm layer only where nothing
      requires grad. torch takes it where the input does not (the weights
      may): that kernel saves no workspace, and AOTAutograd's forward fails
      on the ``None`` it saves for the backward.
    - Dropout between the layers (``dropout=`` of a multi-layer RNN in
      train mode). torch's ``_rnn_helper`` sets it to zero before the first
      layer (``num_layers < i - 1`` is never true), and the compiled step
      drew no mask at all."""
    from torch._decomp import decompositions

    from .patching import patched

    def select(original):
        def select_one_layer_lstm_function(input, hx, params):
            tensors = [input, *hx, *(p for layer in params for p in layer)]
            if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
                return decompositions.one_layer_lstm
            return original(input, hx, params)
        return select_one_layer_lstm_function

    with patched(decompositions, "select_one_layer_lstm_function", select), \
            patched(decompositions, "_rnn_helper", lambda original: _rnn_layers):
        yield


def _rnn_layers(input, hidden, params, has_biases, num_layers, dropout, train, bidirectional, batch_first,
                layer_fn):
    """torch's ``decompositions._rnn_helper`` with the dropout eager applies
    after each layer but the last, in train mode."""
    from torch._decomp.decompositions import params_hiddens

    input = input.transpose(0, 1) if batch_first else input
    final_hiddens = []
    for i in range(num_layers):
        cur_params, cur_hidden, bidir_params, bidir_hidden = params_hiddens(params, hidden, i, bidirectional)
        fwd_inp, fwd_hidden = layer_fn(input, cur_hidden, cur_params, has_biases)
        final_hiddens.append(fwd_hidden)
        if bidirectional:
            bwd_inp, bwd_hidden = layer_fn(input, bidir_hidden, bidir_params, has_biases, reverse=True)
            final_hiddens.append(bwd_hidden)
            input = torch.cat([fwd_inp, bwd_inp], fwd_inp.dim() - 1)
        else:
            input = fwd_inp
        if dropout != 0 and train and i < num_layers - 1:
            input = torch.dropout(input, dropout, train=True)
    input = input.transpose(0, 1) if batch_first else input
    return input, final_hiddens


@contextlib.contextmanager
def no_donated_buffers():
    """While AOTAutograd compiles: no "donated buffers" (saved tensors the
    compiled backward may free, which makes running it again an error), so
    that the backward can run again (``retain_graph=True``) as eager's can.
    Our backward is a plain graph, which frees nothing early anyway."""
    from torch._functorch._aot_autograd import graph_compile

    original = graph_compile.collect_bw_donated_buffer_idxs
    graph_compile.collect_bw_donated_buffer_idxs = lambda *args, **kwargs: []
    try:
        yield
    finally:
        graph_compile.collect_bw_donated_buffer_idxs = original


def retrace_subgraph(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """``gm`` traced again by the make_fx trace in progress (its decompositions,
    the autocast state now), as a subgraph of its own."""
    from torch._higher_order_ops.utils import reenter_make_fx

    return reenter_make_fx(gm)(*example_inputs)


def partitioned_after(rewrite):
    """AOTAutograd's default partitioner (``aot_module_simplified``'s
    ``partition_fn``), after ``rewrite`` changed the joint graph in place."""
    def partition(joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        rewrite(joint.graph)
        joint.recompile()
        return default_partition(joint, joint_inputs, **kwargs)

    return partition
