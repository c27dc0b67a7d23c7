"""A ``torch.autograd.Function`` called in the forward, exported with its own backward.

torch.export traces through a Function's forward and drops its backward (a
straight-through estimator's input gets round()'s zero gradient). Here, while
the forward is traced, the call becomes one op carrying both
(:mod:`predispatch.ir.autograd_function_op`), as subgraphs traced at the call
from the user's ``forward`` and ``backward`` by the module's own pipeline
(:func:`predispatch.trace.autograd_function.subgraphs.subgraph`: functional,
regions, kept histories), with the running trace suspended:

* the forward, on fresh fake inputs of the arguments' metadata, under
  no_grad as eager runs it, returning its outputs and what its ctx keeps for
  the backward (:mod:`predispatch.trace.autograd_function.ctx`);
* the backward, once, on fake gradients of the outputs' metadata and the
  saved tensors, under the autocast state the forward ran in (the one the
  program's backward assumes; ``torch.amp.custom_bwd`` sets it itself, a
  region in the backward).

``ctx.needs_input_grad`` is traced as every floating input requiring grad
(the caller decides at run time): the backward computes every gradient it
then would, and autograd drops those of inputs that do not require grad, as
it does eager's. With ``set_materialize_grads(False)`` the backward is traced
with a gradient for each differentiable output; at run time one not given is
zeros. An input the Function returns or updates in place, in its forward or
its backward, reaches the caller as eager's does (:mod:`.results`,
:mod:`.updates`). What cannot be captured soundly is refused (``ExportError``
naming the Function, its call and why): an input given another layout or
storage in place, an update the program could not write where eager does
(:mod:`.updates`), state the backward reads that is not fixed at export
time, what the module's trace refuses (autograd run in the backward,
data-dependent control flow).
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from ..._torch import pytree
from ... import _torch
from .ctx import (
    Passed,
    Refused,
    TracedCtx,
    backward_function,
    leaves,
    passed,
    refused,
    state_the_backward_reads,
    unfixed_state,
)
from ...ir.autograd_function_op import AUTOGRAD_FUNCTION, FunctionSpec, output_values, placeholders
from ...ir.regions import inline_region, regions
from .results import reach_the_caller, refuse_dirty_not_returned, returned_input
from .subgraphs import RelaidInput, subgraph
from .updates import place_forward_updates, refuse_unsound_updates
from ..vmap import inside_vmap
from ...errors import ExportError, exception_location, user_location
from ..._torch.patching import patched, patches_suspended


def capturing_autograd_functions():
    """While the forward is traced, ``torch.autograd.Function.apply`` becomes
    the op (:func:`capture_call`) where the custom backward could run: in grad
    mode, on a traced tensor that requires grad or may at run time (a floating
    one: the caller decides whether inputs require grad). Elsewhere the
    forward is traced inline (under no_grad its backward never runs), and
    calls on tensors below the functional layer are torch's own (the autograd
    kernel of a custom op, of the op itself): not ours to capture.

    torch.utils.checkpoint's reentrant Function is traced inline, in grad
    mode: its backward recomputes the forward (with the same random state)
    and differentiates it, which is what the graph does anyway (when to
    recompute is the compiler's choice in a graph)."""
    def capturing(apply):
        def call(cls, *args, **kwargs):
            if cls is _torch.REENTRANT_CHECKPOINT:
                run_function, _preserve_rng_state, *inputs = args
                return run_function(*inputs)
            if torch.is_grad_enabled() and any(
                    _torch.is_traced(t) and (t.is_floating_point() or t.is_complex()
                                             or _torch.requires_grad_in_trace(t))
                    for t in pytree.tree_leaves((args, kwargs))):
                _refuse_inside_vmap(cls)
                return capture_call(cls, args, kwargs)
            return apply(cls, *args, **kwargs)
        return call

    return patched(torch.autograd.Function, "apply", capturing)


def _refuse_inside_vmap(cls) -> None:
    if inside_vmap():
        raise ExportError(
            f"torch.autograd.Function {cls.__name__} called inside a vmapped function at "
            f"{user_location()} on tensors a gradient can flow through cannot be exported "
            "soundly: below vmap's batching the trace records ops below autograd, where the "
            "Function's own backward would be lost; call it outside torch.vmap")


def _inline_no_grad_regions(gm: torch.fx.GraphModule) -> None:
    """The forward's top-level no_grad block (ours: the op runs the forward
    under no_grad, as eager does) inlined."""
    for region in [r for r in regions(gm) if r.depth == 0 and r.owner is gm and r.args == (False,)]:
        inline_region(gm, region)
    gm.recompile()


@dataclasses.dataclass
class _Traced:
    fwd: torch.fx.GraphModule
    bwd: torch.fx.GraphModule
    spec: FunctionSpec
    outputs: tuple  # the forward's outputs: a tensor's position among the op's, or a constant
    single: bool  # the forward returned one value, not a tuple
    constants: list  # tensors made from data in the Function's code: the op's last inputs
    tensor_outputs: int  # the Function's tensor outputs: the op's first (its updates follow)
    returned: list  # its outputs that are its inputs or views of them (results.ReturnedInput)


class _TensorAt(int):
    """An output that is the op's output at this position."""


def capture_call(cls, args: tuple, kwargs: dict):
    """``cls.apply(*args, **kwargs)`` while tracing: the op, its subgraphs traced now."""
    where, name = user_location(), cls.__name__
    if kwargs or _torch.defines_setup_context(cls):
        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        if bound.kwargs:
            raise refused(name, where, f"keyword-only arguments {sorted(bound.kwargs)} to its "
                          "forward are not supported; pass them positionally")
        args = tuple(bound.args)
    read = state_the_backward_reads(backward_function(cls))
    if read is not None:
        raise refused(name, where, (
            f"its backward reads {read[0]!r} (a {read[1]}, global or from a closure), state that may change "
            "between calls, which the graph would fix at export time; pass it to the Function, "
            "or keep a value fixed at export"))
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors = [args[i] for i in positions]
    if not all(_torch.is_traced(t) for t in tensors):
        raise refused(name, where, (
            "it takes a tensor that is neither a parameter, a buffer, an input nor computed from "
            "them (a global tensor): cannot be exported soundly; register it as a buffer"))
    traced = _trace_call(cls, args, positions, tensors, where)
    constants = [_torch.traced_constant(c) for c in traced.constants]
    results = AUTOGRAD_FUNCTION(traced.fwd, traced.bwd, *tensors, *constants, **traced.spec.as_kwargs())
    results = reach_the_caller(tensors, results, traced.tensor_outputs, traced.spec.updates, traced.returned)
    outputs = tuple(results[o] if isinstance(o, _TensorAt) else o for o in traced.outputs)
    return outputs[0] if traced.single else outputs


def _trace_call(cls, args, positions, tensors, where) -> _Traced:
    """Both subgraphs, traced with the running trace suspended (its modes and
    its wrappers), on fresh fake inputs of the arguments' metadata."""
    name, phase = cls.__name__, "forward"
    fake_mode = _torch.fake_mode_of(tensors[0])
    metas = [(t.shape, t.stride(), t.dtype, t.device) for t in tensors]
    # traced as every floating input requiring grad: the caller decides at run time
    needs_input_grad = tuple(isinstance(a, torch.Tensor) and (a.is_floating_point() or a.is_complex())
                             for a in args)
    cache = _torch.autocast_cache_default()
    try:
        with _torch.outer_trace_suspended(fake_mode), patches_suspended():
            inputs = [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d, dev in metas]
            fwd, state = _trace_forward(cls, args, positions, inputs, needs_input_grad, where, cache)
            phase = "backward"
            bwd, grad_outputs, grad_inputs = _trace_backward(cls, args, positions, fwd, state,
                                                             needs_input_grad, where, cache)
        refuse_unsound_updates(tensors, fwd, state, name, where)
    except RelaidInput:
        raise refused(name, where, (
            f"its {phase} gives an input another layout or storage in place (transpose_, t_, "
            "set_, ...; an input of the forward, or a saved tensor or a gradient in the "
            "backward): cannot be exported soundly; compute a new tensor instead")) from None
    except Refused:
        raise
    except ExportError as e:  # what the module's trace refuses, refused in the Function
        raise refused(name, where, f"in its {phase}: {e}") from e
    except _torch.data_dependence_errors() as e:
        raise refused(name, where, (
            f"data-dependent Python control flow in its {phase} (a Python bool/int/float/item() "
            f"of a tensor's value) at {exception_location(e)} cannot be exported soundly")) from e
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise refused(name, where, f"its {phase} could not be traced into a graph: {first}") from e
    spec = FunctionSpec(name=name, num_outputs=state["num_outputs"],
                        non_differentiable=state["non_differentiable"], grad_outputs=grad_outputs,
                        grad_inputs=grad_inputs, materialize_grads=state["materialize_grads"],
                        updates=state["updates"], backward_updates=state["backward_updates"])
    return _Traced(fwd, bwd, spec, state["outputs"], state["single"], state["constants"],
                   state["tensor_outputs"], state["returned"])


def _forward_parameter_names(cls, count: int) -> list[str]:
    params = list(inspect.signature(cls.forward).parameters.values())
    if not _torch.defines_setup_context(cls):
        params = params[1:]  # ctx
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return [names[i] if i < len(names) else f"arg{i}" for i in range(count)]


def _trace_forward(cls, args, positions, inputs, needs_input_grad, where, cache):
    name = cls.__name__
    state = {}

    def forward(*tensors):
        full = list(args)
        for p, t in zip(positions, tensors):
            full[p] = t
        ctx = TracedCtx(name, needs_input_grad, where)
        with torch.no_grad():  # as eager runs it; inlined below
            if _torch.defines_setup_context(cls):
                out = cls.forward(*full)
                cls.setup_context(ctx, tuple(full), out)
            else:
                out = cls.forward(ctx, *full)
        outs = out if isinstance(out, tuple) else (out,)
        out_tensors, layout, returned = [], [], []
        for o in outs:
            if isinstance(o, torch.Tensor):
                if (r := returned_input(o, len(out_tensors), tensors, ctx._state["dirty"])) is not None:
                    returned.append(r)
                layout.append(_TensorAt(len(out_tensors)))
                out_tensors.append(o)
            elif any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(o)):
                raise refused(name, where, (
                    f"it returns tensors inside a {type(o).__name__}: autograd does not "
                    "differentiate those; return them as elements of the output tuple"))
            else:
                layout.append(o)
        refuse_dirty_not_returned(ctx._state["dirty"], tensors, out_tensors, name, where)
        saved_slots = [t is None for t in ctx.saved_tensors]
        saved = [t for t in ctx.saved_tensors if t is not None]
        attributes = {}
        for attr, value in ctx.user_attributes().items():
            kind = unfixed_state(value)
            if kind is not None:
                raise refused(name, where, (
                    f"it keeps a {kind} in ctx.{attr}: state the backward would read when it "
                    "runs, which the graph fixes at export time; keep tensors and plain values "
                    "(numbers, strings, dtypes) on ctx"))
            flat, treespec = leaves(value)
            attributes[attr] = ([passed(leaf) or leaf for leaf in flat], treespec)
            saved += [how.carrier(leaf) for leaf in flat if (how := passed(leaf)) is not None]
        marked = ctx._state["non_differentiable"]
        non_differentiable = [i for i, o in enumerate(out_tensors) if any(o is m for m in marked)]
        # eager gives no history to a dirty input it returns non-differentiable: a plain update
        returned = [dataclasses.replace(r, dirty=False) if r.output in non_differentiable else r for r in returned]
        state.update(
            tensor_outputs=len(out_tensors), returned=returned, outputs=tuple(layout),
            single=not isinstance(out, tuple), non_differentiable=non_differentiable,
            materialize_grads=ctx._state["materialize_grads"], saved_slots=saved_slots,
            attributes=attributes)
        return (*out_tensors, *saved)

    names = _forward_parameter_names(cls, len(args))
    traced = subgraph(forward, inputs, [names[p] for p in positions], cache)
    fwd, state["constants"] = traced.gm, traced.constants
    place_forward_updates(fwd, state, traced.updated)
    _inline_no_grad_regions(fwd)
    return fwd, state


def _trace_backward(cls, args, positions, fwd, state, needs_input_grad, where, cache):
    name = cls.__name__
    n_out = state["num_outputs"]
    values = output_values(fwd)
    outs, saved_vals = values[:n_out], values[n_out:]
    differentiable = [i for i, v in enumerate(outs) if i not in state["non_differentiable"]
                      and (v.is_floating_point() or v.is_complex())]
    # eager materializes zeros for every gradient not given; without, only
    # differentiable outputs can have one
    grad_outputs = list(range(state["tensor_outputs"])) if state["materialize_grads"] else differentiable
    grads = [torch.empty(outs[i].shape, dtype=outs[i].dtype, device=outs[i].device) for i in grad_outputs]
    saved = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in saved_vals]
    grad_inputs: list[int] = []
    backward_fn = backward_function(cls)

    def backward(*placeholders):
        given, kept = placeholders[:len(grad_outputs)], iter(placeholders[len(grad_outputs):])
        ctx = TracedCtx(name, needs_input_grad, where)
        ctx._state["materialize_grads"] = state["materialize_grads"]
        ctx._state["saved"] = tuple(None if empty else next(kept) for empty in state["saved_slots"])
        for attr, (flat, treespec) in state["attributes"].items():
            setattr(ctx, attr, pytree.tree_unflatten(
                [leaf.value(next(kept)) if isinstance(leaf, Passed) else leaf for leaf in flat],
                treespec))
        by_output = dict(zip(grad_outputs, given))  # a non-tensor output's gradient is None
        full = [by_output.get(o) if isinstance(o, _TensorAt) else None for o in state["outputs"]]
        result = backward_fn(ctx, *full)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) < len(args) or any(r is not None for r in result[len(args):]):
            raise refused(name, where, f"its backward returns {len(result)} gradients for "
                           f"{len(args)} inputs")
        grad_inputs.clear()
        grads_out = []
        for k, p in enumerate(positions):
            if result[p] is not None:
                grad_inputs.append(k)
                grads_out.append(result[p])
        return tuple(grads_out)

    names = _backward_names(backward_fn, grad_outputs, state["outputs"], fwd, n_out)
    traced = subgraph(backward, [*grads, *saved], names, cache)
    bwd = traced.gm
    state["backward_updates"] = traced.updated
    state["saved_updated"] = [k - len(grads) for k in traced.updated if k >= len(grads)]
    _pass_through(fwd, placeholders(bwd)[len(names):])
    state["constants"] += traced.constants
    return bwd, grad_outputs, list(grad_inputs)


def _pass_through(fwd: torch.fx.GraphModule, lifted: list) -> None:
    """The backward's constants (its ``lifted`` last placeholders) become the
    forward's last inputs, returned last: the backward takes what the forward
    saves after the gradients, in order."""
    output = fwd.graph.output_node()
    passed = []
    for node in lifted:
        with fwd.graph.inserting_after(placeholders(fwd)[-1]):
            passed.append(fwd.graph.placeholder(f"backward_{node.name}"))
        passed[-1].meta.update(node.meta)
    output.args = ((*output.args[0], *passed),)
    fwd.recompile()


def _backward_names(backward_fn, grad_outputs, layout, fwd, n_out) -> list[str]:
    """Gradients named as the backward names them; saved inputs as the
    forward's placeholders; other saved tensors ``saved_<k>``."""
    params = [p.name for p in list(inspect.signature(backward_fn).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    at = [k for k, o in enumerate(layout) if isinstance(o, _TensorAt)]  # tensor output -> position
    names = [params[at[i]] if at[i] < len(params) else f"grad_{at[i]}" for i in grad_outputs]
    saved = fwd.graph.output_node().args[0][n_out:]
    computed = iter(range(len(saved)))
    names += [o.name if o.op == "placeholder" else f"saved_{next(computed)}" for o in saved]
    unique, seen = [], set()
    for n in names:
        candidate, i = n, 0
        while candidate in seen:
            i += 1
            candidate = f"{n}_{i}"
        seen.add(candidate)
        unique.append(candidate)
    return unique
