"""The op an autograd.Function call becomes: what it is in a graph, and at run time.

    ste_0 = predispatch_autograd_function(self.ste_0_fwd, self.ste_0_bwd, x, name='STE',
                                          num_outputs=1, grad_outputs=[0], grad_inputs=[0])

* ``fwd(*inputs) -> (*outputs, *saved)``: the Function's forward, then what
  its backward reads (the tensors ``ctx.save_for_backward`` saved, those kept
  as ctx attributes); an output may be an input, or a view of one, as
  eager's Function may return one;
* ``bwd(*grads, *saved) -> (*gradients, *updated)``: its backward, then the
  new values of the gradients and saved tensors it updates in place;
* keywords: ``num_outputs``; ``grad_outputs``, the outputs whose gradients
  ``bwd`` takes (contiguous, as traced); ``grad_inputs``, the inputs its
  results are the gradients of; the ``non_differentiable`` outputs;
  ``materialize_grads`` when False; ``updates``, the inputs the forward
  updates in place (not dirty), whose new values are its last outputs;
  ``backward_updates``, the inputs of ``bwd`` it updates, written at run
  time to the tensors the backward was given, as eager's backward writes them.

How the subgraphs are traced: :mod:`predispatch.trace.autograd_function.capture`. At run
time the op is an autograd.Function running the two graphs
(:class:`_RunFunction`). The op has a rule for each layer a trace stacks:
functionalization (the subgraphs are functional already), make_fx's proxy
mode (the node, its subgraphs registered; below autograd, in
``run_decompositions``, the subgraphs are traced again with the rest),
fake tensors and the dense kernel (the forward's outputs), autograd (the
Function; AOTAutograd traces it like any, so ``compile_training``'s backward
graph holds the custom backward). ``ep.module()``'s code calls
:func:`run_autograd_function`: the autograd.Function directly (dynamo traces
it as one), the op while an export traces the code.
"""
from __future__ import annotations

import dataclasses
import re

import torch

from .. import _torch
from .bodies import call_body


class _AutogradFunctionOp(_torch.HigherOrderOperator):
    """``(fwd, bwd, *inputs, **spec) -> outputs``: see the module docs."""

    def __init__(self):
        super().__init__("predispatch_autograd_function")

    def __call__(self, fwd, bwd, *inputs, **spec):
        return super().__call__(fwd, bwd, *inputs, **spec)


AUTOGRAD_FUNCTION = _AutogradFunctionOp()


@dataclasses.dataclass(frozen=True)
class FunctionSpec:
    """The op's keyword arguments (an empty list or a default is left out:
    torch.export's serializer cannot tell an empty list's type)."""

    name: str  # the Function's class name: its subgraphs are named for it
    num_outputs: int  # fwd returns the outputs, then the saved tensors
    grad_outputs: list = ()  # the outputs whose gradients bwd takes, in order
    grad_inputs: list = ()  # the inputs bwd's results are the gradients of, in order
    non_differentiable: list = ()  # outputs marked non-differentiable
    materialize_grads: bool = True  # ctx.set_materialize_grads
    # the inputs the forward updates in place (not marked dirty): its last
    # outputs are their new values, in this order
    updates: list = ()
    # the inputs of bwd (gradients, saved tensors) it updates in place: its
    # results after the gradients are their new values, written to them
    backward_updates: list = ()

    def as_kwargs(self) -> dict:
        kwargs = {"name": self.name, "num_outputs": self.num_outputs}
        for field in ("grad_outputs", "grad_inputs", "non_differentiable", "updates", "backward_updates"):
            if getattr(self, field):
                kwargs[field] = list(getattr(self, field))
        if not self.materialize_grads:
            kwargs["materialize_grads"] = False
        return kwargs


def _forward_outputs(fwd, inputs, num_outputs):
    """The forward's outputs, below autograd: new tensors (an input the
    Function returns is copied; autograd's rule returns it, as eager does)."""
    outputs = call_body(fwd, inputs, {})[:num_outputs]
    return tuple(o.clone() if any(_aliases(o, i) for i in inputs) else o for o in outputs)


def _aliases(a: torch.Tensor, b) -> bool:
    return isinstance(b, torch.Tensor) and (a is b or _torch.same_storage(a, b))


@AUTOGRAD_FUNCTION.py_impl(_torch.DispatchKey.CompositeExplicitAutograd)
def _dense(fwd, bwd, *inputs, **spec):
    return _forward_outputs(fwd, inputs, spec["num_outputs"])


@AUTOGRAD_FUNCTION.py_impl(_torch.FakeTensorMode)
def _fake(mode, fwd, bwd, *inputs, **spec):
    with mode:
        return _forward_outputs(fwd, inputs, spec["num_outputs"])


@AUTOGRAD_FUNCTION.py_impl(_torch.DispatchKey.Autograd)
def _autograd(fwd, bwd, *inputs, **spec):
    """The Function, as :func:`run_autograd_function` calls it, on real
    tensors (a copy of ``ep.module()`` calls the op itself) whatever the grad
    mode: eager applies a Function under no_grad too, which decides what it
    returns (an input's alias, a view of one that requires grad). Traced,
    autograd's rule for a higher-order op: below autograd where no gradient
    can flow."""
    tensors = [t for t in inputs if isinstance(t, torch.Tensor)]
    if not _torch.on_real_tensors(tensors) and not (
            torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        with _torch.below_autograd():
            return AUTOGRAD_FUNCTION(fwd, bwd, *inputs, **spec)
    return _RunFunction.apply(fwd, bwd, FunctionSpec(**spec), *inputs)


@AUTOGRAD_FUNCTION.py_functionalize_impl
def _functionalize(ctx, fwd, bwd, *inputs, **spec):
    unwrapped = ctx.unwrap_tensors(inputs)
    with ctx.redispatch_to_next():
        out = AUTOGRAD_FUNCTION(fwd, bwd, *unwrapped, **spec)
    return ctx.wrap_tensors(out)


@AUTOGRAD_FUNCTION.py_impl(_torch.ProxyTorchDispatchMode)
def _proxy(mode, fwd, bwd, *inputs, **spec):
    if not _torch.traces_above_autograd(mode):  # run_decompositions: the subgraphs too
        fwd, bwd = _lowered(fwd, bwd, inputs, FunctionSpec(**spec))
    # the values below the tracer: the subgraphs' ops are not the trace's
    with _torch.torch_function_modes_suspended():
        out = AUTOGRAD_FUNCTION(fwd, bwd, *inputs, **spec)
    base = _free_name(mode.tracer.root, _snake(spec["name"]))
    return _torch.record_higher_order_call(
        mode, AUTOGRAD_FUNCTION, (fwd, bwd, *inputs), spec, out,
        {f"{base}_fwd": fwd, f"{base}_bwd": bwd})


def _lowered(fwd, bwd, inputs, spec: FunctionSpec):
    """Both subgraphs traced by a trace below autograd (``run_decompositions``):
    decomposed as the rest of the program, with the autocast casts of the
    state the op runs in (the forward's, which the backward assumes)."""
    lowered_fwd = _named_as(fwd, _torch.retrace_subgraph(fwd, list(inputs)))
    values = output_values(lowered_fwd)
    outs, saved = values[:spec.num_outputs], values[spec.num_outputs:]
    grads = [torch.empty(outs[i].shape, dtype=outs[i].dtype, device=outs[i].device)
             for i in spec.grad_outputs]
    saved = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in saved]
    return lowered_fwd, _named_as(bwd, _torch.retrace_subgraph(bwd, [*grads, *saved]))


def _named_as(original: torch.fx.GraphModule, new: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``new``'s placeholders named as ``original``'s."""
    for old, node in zip(placeholders(original), placeholders(new)):
        _torch.rename_placeholder(node, old.target)
    new.recompile()
    return new


def placeholders(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def output_values(gm: torch.fx.GraphModule) -> list:
    return [o.meta["val"] for o in gm.graph.output_node().args[0]]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower() or "function"


def _free_name(root, base: str) -> str:
    i = 0
    while hasattr(root, f"{base}_{i}_fwd"):
        i += 1
    return f"{base}_{i}"


def run_autograd_function(fwd, bwd, *inputs, **spec):
    """The op as ``ep.module()``'s code calls it: the autograd.Function it is
    at run time, called directly (the op's dispatch costs some 50 us a call),
    which dynamo (``torch.compile``) traces into its own
    ``autograd_function_apply``; the op itself while an export traces the
    code (a re-export keeps it)."""
    if _torch.being_traced() and not torch.compiler.is_dynamo_compiling():
        return AUTOGRAD_FUNCTION(fwd, bwd, *inputs, **spec)
    return _RunFunction.apply(fwd, bwd, FunctionSpec(**spec), *inputs)


class _RunFunction(torch.autograd.Function):
    """The op at run time: an autograd.Function running the two graphs."""

    @staticmethod
    def forward(ctx, fwd, bwd, spec: FunctionSpec, *inputs):
        results = call_body(fwd, inputs, {})
        outputs, saved = results[:spec.num_outputs], results[spec.num_outputs:]
        ctx.bwd, ctx.spec = bwd, spec
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(*[outputs[i] for i in spec.non_differentiable])
        ctx.set_materialize_grads(spec.materialize_grads)
        if not spec.materialize_grads:  # a gradient not given is then zeros (see subgraph docs)
            ctx.output_meta = [(o.shape, o.dtype, o.device) for o in outputs]
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        spec = ctx.spec
        given = []  # the gradients as eager's backward would get them
        for i in spec.grad_outputs:
            g = grads[i]
            if g is None:
                shape, dtype, device = ctx.output_meta[i]
                g = torch.zeros(shape, dtype=dtype, device=device)
            given.append(g)
        given += ctx.saved_tensors
        fed = [g.contiguous() for g in given[:len(spec.grad_outputs)]]  # as traced
        results = call_body(ctx.bwd, (*fed, *given[len(fed):]), {})
        for k, value in zip(spec.backward_updates, results[len(spec.grad_inputs):]):
            given[k].copy_(value)  # as eager's backward writes them: the tensors it was given
        grad_inputs = [None] * len(ctx.needs_input_grad)  # fwd, bwd, spec, *inputs
        for i, g in zip(spec.grad_inputs, results):
            grad_inputs[3 + i] = g
        return tuple(grad_inputs)
