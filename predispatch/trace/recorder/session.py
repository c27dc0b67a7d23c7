"""One recorded forward: the module's forward run under the recorder and its patches.

One recorded forward: :func:`recording` runs the module's forward under the
recorder and everything else the trace needs while it runs, all named in
one place (:func:`_forward_recorded`), then finishes what the recorder
could not see until the forward returned, and notes how each input was
mutated."""
from __future__ import annotations

import contextlib
import functools

import torch

from ... import _torch
from ...ir.records import TraceRecord
from ..autocast_cache import CastCache
from ..autograd_function.capture import capturing_autograd_functions
from ..control_flow.capture import capturing_control_flow
from ..grad_mode_reads import noting_grad_mode_reads
from ..host_random import HostDraws, refusing_host_randomness
from ..layer_reuse import LayerReuse, note_no_reuse, reuse_enabled
from ..outputs import checked_outputs
from ..random_state import generator_calls_as_ops
from ..refusals import refuse_buffers_gained, refusing_new_state, refusing_state_calls
from ..stack_traces import stamping_stack_traces
from ..vmap import tracing_vmap_as_plain_ops
from ..translations import as_rebound, autocast_blocks_as_in_eager, buffer_rebinding_checked, inference_mode_as_no_grad
from ..translations import rebound_buffers, was_rebound
from ..translations import scalar_tensors_formatted_as_in_eager
from . import grad_blocks, leaves, requires_grad_reads, script_objects, spans, swaps, views
from .functional_ops import before_functional_op
from .mode import Recorder
from .observing import observing_ops
from .state import TraceState
from .unregistered import UnregisteredGradTensor, named_in


@contextlib.contextmanager
def recording(module: torch.nn.Module, record: TraceRecord, strip, reuse_layers: bool = False):
    """Run ``module``'s forward under the recorder while it is traced
    (``reuse_layers``: repeated layers traced once, see :mod:`predispatch.trace.layer_reuse`)."""
    forward = module.forward
    eager_autocast_cache = torch.is_autocast_cache_enabled()  # make_fx turns it off

    def recorded_forward(*args, **kwargs):
        # one walk of the module tree each, before the forward (what a rebinding replaces too)
        params = dict(module.named_parameters(remove_duplicate=False))
        buffers = dict(module.named_buffers(remove_duplicate=False))
        inputs = _torch.pytree.tree_leaves((args, kwargs))
        state = TraceState(record, _cast_sources(params, buffers, args, kwargs), HostDraws())
        views.note_input_views(state, inputs)
        state.graph_inputs = _graph_input_keys(params, buffers, inputs, strip)
        try:
            tensors = (*params.values(), *buffers.values(), *inputs)
            with _forward_recorded(module, state, tensors, eager_autocast_cache, reuse_layers) as reuse:
                out = forward(*args, **kwargs)
                if reuse is not None:
                    reuse.check_stamped()
                out = _finish(state, out)
        except UnregisteredGradTensor as e:
            raise named_in(module, e, strip) from None
        buffers_after = dict(module.named_buffers(remove_duplicate=False))
        refuse_buffers_gained(buffers, buffers_after, strip)
        rebound = rebound_buffers(buffers, as_rebound(buffers_after), strip)
        record.rebound_buffers = {f"buffer:{name}": t for name, t in rebound.items()}
        _note_mutation_kinds(record, module.named_parameters(remove_duplicate=False), buffers_after, inputs, strip)
        return out

    # torch.export's wrapper flattens what the user's module (its _export_root) returns: checked before
    root = getattr(module, "_export_root", None)
    with _forward_replaced(module, recorded_forward), \
            _forward_replaced(root, _outputs_checked(root)) if root is not None else contextlib.nullcontext():
        yield


def _outputs_checked(module: torch.nn.Module):
    forward = module.forward

    def checked_forward(*args, **kwargs):
        return checked_outputs(module, forward(*args, **kwargs))
    return checked_forward


@contextlib.contextmanager
def _forward_replaced(module: torch.nn.Module, forward):
    had_own_forward, own = "forward" in module.__dict__, module.__dict__.get("forward")
    module.forward = forward
    try:
        yield
    finally:
        if had_own_forward:
            module.forward = own
        else:
            del module.forward


def _cast_sources(params: dict, buffers: dict, args, kwargs) -> CastCache:
    """What autocast may cache casts of: parameters, buffers, inputs (what at run time)."""
    return CastCache({id(t): _torch.current_node(t) for t in (
        *params.values(), *buffers.values(), *_torch.pytree.tree_leaves((args, kwargs)))
        if _torch.is_traced(t) and t.is_floating_point()})


@contextlib.contextmanager
def _forward_recorded(module, state: TraceState, tensors: tuple, eager_autocast_cache: bool, reuse_layers: bool):
    """Everything the forward runs under while it is recorded, entered in
    this order (left in the reverse one); yields the layer reuse (or None)."""
    recorder = Recorder(state)
    with contextlib.ExitStack() as stack:
        enter = stack.enter_context
        # autocast enter/exit as eager runs them, a hidden grad-mode change marked at each
        enter(autocast_blocks_as_in_eager(eager_autocast_cache, functools.partial(grad_blocks.sync_grad_mode, state)))
        enter(recorder)
        # the stamper on top: nodes the recorder's own calls make get the user's stack too
        # (and it stamps autocast's enter/exit as wrapped for the cache flag below it)
        stamper = enter(stamping_stack_traces())
        # what bypasses torch-function modes, wrapped where it lives (see predispatch._torch.patching)
        enter(swaps.set_calls_to_aliases(state))  # t.set_(source)
        # torch.is_grad_enabled() read by the module's code (after a hidden change's marker)
        enter(noting_grad_mode_reads(functools.partial(grad_blocks.sync_grad_mode, state)))
        enter(capturing_autograd_functions())  # autograd.Function.apply
        enter(capturing_control_flow())  # torch.cond, while_loop, map: their ops, branches traced
        enter(refusing_host_randomness(state.draws))  # Python's and numpy's generators
        enter(scalar_tensors_formatted_as_in_eager())  # f"{t}" of a 0-dim tensor: its value
        enter(inference_mode_as_no_grad())
        enter(_torch.script_functions_run_as_scripted())  # torch.jit.is_scripting() true in a script function
        enter(script_objects.python_values_refused())  # a torchbind object's method returning an int
        enter(requires_grad_reads.answered_as_eager(tensors, state))  # t.requires_grad of a tensor the forward made
        enter(buffer_rebinding_checked())  # self.buf = new: refused where no write-back can follow
        enter(refusing_state_calls())
        enter(refusing_new_state(module))  # register_buffer / register_parameter of a new name
        enter(generator_calls_as_ops(state.generators))  # manual_seed, fork_rng, get/set_rng_state
        enter(tracing_vmap_as_plain_ops())  # torch.vmap: the trace below its batching
        # each op where functionalization sees it (in-place updates inside library calls too)
        enter(observing_ops(functools.partial(before_functional_op, state)))
        yield enter(_reusing_layers(module, recorder, stamper, reuse_layers))


def _finish(state: TraceState, out):
    """At the forward's end, under the recorder: what it could not see until
    the forward returned. Returns the outputs as the trace returns them."""
    grad_blocks.refuse_unrestored_hidden_blocks(state)
    if not torch.is_grad_enabled():  # a bare switch left grad mode off: the no_grad span ends
        spans.end_no_grad_span(state)  # with the forward, before the outputs are read
        with torch.enable_grad():  # the outputs read as eager's tensors are: with their histories
            out = _outputs_read(state, out)
    else:
        out = _outputs_read(state, out)
    state.draws.note_torch_call(out, None)  # a draw returned is replayed too
    return out


def _outputs_read(state: TraceState, out):
    """The outputs as the program returns them: read through their ops (a
    leaf, an own history), views brought up to date."""
    out = leaves.read_leaf_outputs(state, out)
    views.sync_no_grad_view_outputs(state, out)
    spans.end_grad_mode_segment(state)
    views.sync_grad_view_outputs(state, out)
    return out


def _graph_input_keys(params: dict, buffers: dict, flat_inputs, strip) -> dict:
    """id of each parameter, buffer and input -> its key in the record (one
    given twice, or tied: its first, as it is written back)."""
    keys = {}
    for n, p in params.items():
        keys.setdefault(id(p), f"param:{strip(n)}")
    for n, b in buffers.items():
        keys.setdefault(id(b), f"buffer:{strip(n)}")
    for i, t in enumerate(flat_inputs):
        if isinstance(t, torch.Tensor):
            keys.setdefault(id(t), f"input:{i}")
    return keys


def _note_mutation_kinds(record: TraceRecord, named_params, buffers: dict, flat_inputs, strip) -> None:
    """The kind of each mutation of a parameter, buffer (as the forward left them) and input."""
    for name, t in named_params:
        if (kind := _mutation_kind(record, f"param:{strip(name)}", t)) is not None:
            record.mutation_kinds[f"param:{strip(name)}"] = kind
    for name, t in buffers.items():
        if f"buffer:{name}" in record.rebound_buffers or was_rebound(t):  # written back as the forward left it
            record.mutation_kinds[f"buffer:{strip(name)}"] = "rebound"
        elif (kind := _mutation_kind(record, f"buffer:{strip(name)}", t)) is not None:
            record.mutation_kinds[f"buffer:{strip(name)}"] = kind
    for i, t in enumerate(flat_inputs):
        if isinstance(t, torch.Tensor) and (kind := _mutation_kind(record, f"input:{i}", t)) is not None:
            record.mutation_kinds[f"input:{i}"] = kind


def _mutation_kind(record: TraceRecord, key: str, t) -> str | None:
    """torch's kind of ``t``'s mutation, but "hidden" where every write went
    through ``.data``: eager's version counter does not move (a value saved
    for backward before is read as updated, without autograd's error)."""
    kind = _torch.mutation_kind(t)
    if kind is not None and key in record.written_through_data and key not in record.written_otherwise:
        return "hidden"
    return kind


@contextlib.contextmanager
def _reusing_layers(module, recorder: Recorder, stamper, enabled: bool):
    if not (enabled and reuse_enabled()):
        if enabled:
            note_no_reuse()
        yield None
        return
    with LayerReuse(module, recorder, stamper).installed() as reuse:
        yield reuse
