"""A ``torch.autograd.Function`` called in the forward, exported with its own backward.

torch.export traces through a Function's forward and drops its backward (a
straight-through estimator's input gets round()'s zero gradient). Here the
call becomes one higher-order op carrying both, as subgraphs traced from the
user's ``forward`` and ``backward``::

    ste_0 = predispatch_autograd_function(self.ste_0_fwd, self.ste_0_bwd, x, name='STE', ...)

* ``fwd(*inputs) -> (*outputs, *saved)``: the forward (run under no_grad, as
  eager runs it), then what the backward reads: the tensors
  ``ctx.save_for_backward`` saved and those kept as ctx attributes;
* ``bwd(*grads, *saved) -> grads of inputs``: the backward, traced once at
  export with fake gradients of the outputs' metadata (contiguous, as the
  program makes them at run time), non-tensor ctx attributes baked in.

Both are traced by the same pipeline as the module (functional, regions,
kept histories: see :func:`subgraph`); the op's keyword arguments say the
rest (``num_outputs``, the ``non_differentiable`` outputs, which outputs'
gradients ``bwd`` takes, which inputs its results are the gradients of, and
``materialize_grads``). At run time the op is an autograd.Function running
the two graphs (:class:`_RunFunction`); under a trace below autograd
(AOTAutograd, ``compile_training``) that Function is traced like the user's,
so the custom backward lands in the backward graph.

``ctx.needs_input_grad`` is traced as every floating input requiring grad
(the caller decides at run time): the backward computes every gradient it
would then, and autograd drops those of inputs that do not require grad, as
it does with eager's. What cannot be captured soundly is refused
(``ExportError`` naming the Function and the line): an output that is an
input or a view of one, an input updated in place (``mark_dirty``), ctx
state or globals the backward reads that are not fixed at export time.
"""
from __future__ import annotations

import builtins
import dataclasses
import dis
import enum
import re
import types
from typing import Callable

import torch
import torch.utils._pytree as pytree

from . import _torch
from .errors import ExportError, exception_location, user_location
from .patching import patched, patches_suspended

# --------------------------------------------------------------------------
# The higher-order op and its rules.


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

    def as_kwargs(self) -> dict:
        kwargs = {"name": self.name, "num_outputs": self.num_outputs}
        for field in ("grad_outputs", "grad_inputs", "non_differentiable"):
            if getattr(self, field):
                kwargs[field] = list(getattr(self, field))
        if not self.materialize_grads:
            kwargs["materialize_grads"] = False
        return kwargs


def _forward_outputs(fwd, inputs, num_outputs):
    return tuple(fwd(*inputs)[:num_outputs])


@AUTOGRAD_FUNCTION.py_impl(_torch.DispatchKey.CompositeExplicitAutograd)
def _dense(fwd, bwd, *inputs, **spec):
    return _forward_outputs(fwd, inputs, spec["num_outputs"])


@AUTOGRAD_FUNCTION.py_impl(_torch.FakeTensorMode)
def _fake(mode, fwd, bwd, *inputs, **spec):
    with mode:
        return _forward_outputs(fwd, inputs, spec["num_outputs"])


@AUTOGRAD_FUNCTION.py_autograd_impl
def _autograd(fwd, bwd, *inputs, **spec):
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
    values = _output_values(lowered_fwd)
    outs, saved = values[:spec.num_outputs], values[spec.num_outputs:]
    grads = [torch.empty(outs[i].shape, dtype=outs[i].dtype, device=outs[i].device)
             for i in spec.grad_outputs]
    saved = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in saved]
    return lowered_fwd, _named_as(bwd, _torch.retrace_subgraph(bwd, [*grads, *saved]))


def _named_as(original: torch.fx.GraphModule, new: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``new``'s placeholders named as ``original``'s."""
    for old, node in zip(_placeholders(original), _placeholders(new)):
        _torch.rename_placeholder(node, old.target)
    new.recompile()
    return new


def _placeholders(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _snake(name: str) -> str:
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower() or "function"


def _free_name(root, base: str) -> str:
    i = 0
    while hasattr(root, f"{base}_{i}_fwd"):
        i += 1
    return f"{base}_{i}"


def run_autograd_function(fwd, bwd, *inputs, **spec):
    """The op as ``ep.module()``'s code calls it: under dynamo
    (``torch.compile``), as the autograd.Function it is at run time, which
    dynamo traces (into its own ``autograd_function_apply``) where it does not
    know the op; elsewhere the op itself (a re-export keeps it)."""
    if torch.compiler.is_dynamo_compiling():
        return _RunFunction.apply(fwd, bwd, FunctionSpec(**spec), *inputs)
    return AUTOGRAD_FUNCTION(fwd, bwd, *inputs, **spec)


class _RunFunction(torch.autograd.Function):
    """The op at run time: an autograd.Function running the two graphs."""

    @staticmethod
    def forward(ctx, fwd, bwd, spec: FunctionSpec, *inputs):
        results = fwd(*inputs)
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
        fed = []
        for i in spec.grad_outputs:
            g = grads[i]
            if g is None:
                shape, dtype, device = ctx.output_meta[i]
                g = torch.zeros(shape, dtype=dtype, device=device)
            fed.append(g.contiguous())  # as traced
        results = ctx.bwd(*fed, *ctx.saved_tensors)
        grad_inputs = [None] * len(ctx.needs_input_grad)  # fwd, bwd, spec, *inputs
        for i, g in zip(spec.grad_inputs, results):
            grad_inputs[3 + i] = g
        return tuple(grad_inputs)


# --------------------------------------------------------------------------
# Capture: the Function's forward and backward traced at the call.


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
                return capture_call(cls, args, kwargs)
            return apply(cls, *args, **kwargs)
        return call

    return patched(torch.autograd.Function, "apply", capturing)


class _TracedCtx:
    """The ``ctx`` of a Function's forward and backward while they are traced.
    What the user sets on it is kept in ``__dict__``; ours, in ``_state``."""

    def __init__(self, cls_name: str, needs_input_grad: tuple, where: str):
        object.__setattr__(self, "_state", {
            "name": cls_name, "where": where, "saved": (), "non_differentiable": (),
            "materialize_grads": True})
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self._state["saved"] = tensors

    @property
    def saved_tensors(self):
        return self._state["saved"]

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors):
        self._state["non_differentiable"] = tensors

    def set_materialize_grads(self, value: bool):
        self._state["materialize_grads"] = bool(value)

    def save_for_forward(self, *tensors):
        """For forward-mode AD only, which the program does not run."""

    def mark_dirty(self, *tensors):
        raise _refused(self._state["name"], self._state["where"], (
            "it updates its input in place (ctx.mark_dirty): cannot be exported soundly as one "
            "op; return a new tensor, and update the input outside the Function"))

    def user_attributes(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("_state", "needs_input_grad")}


# values a ctx attribute or a global the backward reads may hold: fixed at export
_FIXED = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.Size, enum.Enum, type, range, slice,
          types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType,
          type(Ellipsis), frozenset,
          torch._ops.OpOverload, torch._ops.OpOverloadPacket)


def _is_fixed(value) -> bool:
    return isinstance(value, _FIXED)


def _unfixed_state(value) -> str | None:
    """What in ``value`` is neither fixed at export time nor passed to the
    backward (see :func:`_passed`), or None."""
    for leaf in _leaves(value)[0]:
        if _passed(leaf) is None and not _is_fixed(leaf):
            return type(leaf).__name__
    return None


def _leaves(value):
    """A ctx attribute flattened; a torch.Size stays whole (pytree would give it back as a tuple)."""
    return pytree.tree_flatten(value, is_leaf=lambda v: isinstance(v, torch.Size))


@dataclasses.dataclass(frozen=True)
class _Passed:
    """How a ctx attribute's leaf reaches the backward: as a saved tensor, the
    leaf itself or (a size of a dynamic dimension, which the backward's trace
    must read from one of its inputs) a one-element tensor of that shape."""

    carrier: Callable  # the leaf -> the tensor saved
    value: Callable  # the saved tensor -> the leaf's value in the backward


def _carrier(shape) -> torch.Tensor:
    return torch.zeros(()).expand(shape)


_AS_TENSOR = _Passed(lambda t: t, lambda t: t)
_AS_SIZE = _Passed(_carrier, lambda t: t.shape)
_AS_INT = _Passed(lambda n: _carrier((n,)), lambda t: t.shape[0])


def _passed(leaf) -> _Passed | None:
    if isinstance(leaf, torch.Tensor):
        return _AS_TENSOR
    if isinstance(leaf, torch.SymInt):
        return _AS_INT
    if isinstance(leaf, torch.Size) and any(isinstance(d, torch.SymInt) for d in leaf):
        return _AS_SIZE
    return None


def _backward_function(cls):
    backward = cls.backward
    base = torch.autograd.Function.backward
    return cls.vjp if getattr(backward, "__func__", backward) is getattr(base, "__func__", base) else backward


def _state_the_backward_reads(fn) -> tuple[str, str] | None:
    """(name, type) of a global or closure variable the backward's own code
    reads that holds state not fixed at export time (a list, a dict, a
    tensor, a module, an object), or None. Code it calls is not searched."""
    import inspect

    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    for instr in dis.get_instructions(code):
        if instr.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            name = instr.argval
            if name in fn.__globals__:
                value = fn.__globals__[name]
            elif hasattr(builtins, name):
                continue
            else:
                continue
        elif instr.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and instr.argval in cells:
            name = instr.argval
            try:
                value = cells[name].cell_contents
            except ValueError:
                continue
        else:
            continue
        if not _is_fixed(value):
            return name, type(value).__name__
    return None


class _Body(torch.nn.Module):
    """A function as a module, for the pipeline that traces modules."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class _MutatedInput(Exception):
    """A subgraph updates one of its inputs in place."""


def subgraph(fn, fake_inputs: list, names: list[str], autocast_cache: bool) -> torch.fx.GraphModule:
    """``fn(*fake_inputs)`` traced by the module's pipeline (capture, kept
    histories, dead code, copies, regions, G1's net), placeholders named
    ``names``; an autocast block that does not say gets ``autocast_cache``."""
    from types import SimpleNamespace

    from torch.export.graph_signature import (
        InputKind,
        InputSpec,
        OutputKind,
        OutputSpec,
        TensorArgument,
    )

    from .capture import history_nodes
    from .copy_pass import replace_copies
    from .export import keep_histories, refuse_remaining_mutations
    from .functional_trace import functional_trace
    from .region_pass import replace_blocks_with_regions
    from .trace_events import TraceRecord, recording

    body, record = _Body(fn), TraceRecord()
    with _torch.autocast_cache_enabled(autocast_cache), recording(body, record, str), \
            _torch.autocast_cache_enabled(False):  # as make_fx traces
        gm, signature = functional_trace(body, fake_inputs, {}, keep=lambda: history_nodes(record))
    if signature.user_inputs_to_mutate:
        raise _MutatedInput()
    placeholders = _placeholders(gm)
    for node, name in zip(placeholders, names):
        _torch.rename_placeholder(node, name)
    outputs = gm.graph.output_node().args[0]
    signature = SimpleNamespace(
        input_specs=[InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None) for n in placeholders],
        output_specs=[OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(getattr(o, "name", "")), None)
                      for o in outputs])
    keep_histories(SimpleNamespace(gm=gm, signature=signature, record=record), body)
    gm.graph.eliminate_dead_code()
    replace_copies(gm)
    replace_blocks_with_regions(gm)
    refuse_remaining_mutations(gm)
    gm.recompile()
    return gm


def _inline_no_grad_regions(gm: torch.fx.GraphModule) -> None:
    """The forward's top-level no_grad block (ours: the op runs the forward
    under no_grad, as eager does) inlined."""
    from .region_pass import delete_unused_submodules
    from .region_utils import inline_region, regions

    for region in [r for r in regions(gm) if r.depth == 0 and r.owner is gm and r.args == (False,)]:
        inline_region(gm, region)
    gm.graph.eliminate_dead_code()  # the inlined region's get_attr
    delete_unused_submodules(gm)
    gm.recompile()


@dataclasses.dataclass
class _Traced:
    fwd: torch.fx.GraphModule
    bwd: torch.fx.GraphModule
    spec: FunctionSpec
    outputs: tuple  # the forward's outputs: a tensor's position among the op's, or a constant
    single: bool  # the forward returned one value, not a tuple


class _TensorAt(int):
    """An output that is the op's output at this position."""


class _Refused(ExportError):
    """A Function that cannot be captured soundly; the message names it and its call."""


def _refused(name: str, where: str, why: str) -> _Refused:
    return _Refused(f"torch.autograd.Function {name} at {where}: {why}")


def capture_call(cls, args: tuple, kwargs: dict):
    """``cls.apply(*args, **kwargs)`` while tracing: the op, its subgraphs traced now."""
    where, name = user_location(), cls.__name__
    if kwargs or _torch.defines_setup_context(cls):
        import inspect

        bound = inspect.signature(cls.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        args = tuple(bound.args)
    read = _state_the_backward_reads(_backward_function(cls))
    if read is not None:
        raise _refused(name, where, (
            f"its backward reads the global {read[0]!r} (a {read[1]}), state that may change "
            "between calls, which the graph would fix at export time; pass it to the Function, "
            "or keep a value fixed at export"))
    positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    tensors = [args[i] for i in positions]
    if not all(_torch.is_traced(t) for t in tensors):
        raise _refused(name, where, (
            "it takes a tensor that is neither a parameter, a buffer, an input nor computed from "
            "them (a global tensor): cannot be exported soundly; register it as a buffer"))
    traced = _trace_call(cls, args, positions, tensors, where)
    results = AUTOGRAD_FUNCTION(traced.fwd, traced.bwd, *tensors, **traced.spec.as_kwargs())
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
    except _MutatedInput:
        raise _refused(name, where, (
            f"its {phase} updates an input in place (an input of the forward, or a saved tensor "
            "or a gradient in the backward): cannot be exported soundly; compute a new tensor "
            "instead")) from None
    except _Refused:
        raise
    except ExportError as e:  # what the module's trace refuses, refused in the Function
        raise _refused(name, where, f"in its {phase}: {e}") from e
    except _torch.data_dependence_errors() as e:
        raise _refused(name, where, (
            f"data-dependent Python control flow in its {phase} (a Python bool/int/float/item() "
            f"of a tensor's value) at {exception_location(e)} cannot be exported soundly")) from e
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _refused(name, where, f"its {phase} could not be traced into a graph: {first}") from e
    spec = FunctionSpec(name=name, num_outputs=state["num_outputs"],
                        non_differentiable=state["non_differentiable"], grad_outputs=grad_outputs,
                        grad_inputs=grad_inputs, materialize_grads=state["materialize_grads"])
    return _Traced(fwd, bwd, spec, state["outputs"], state["single"])


def _forward_parameter_names(cls, count: int) -> list[str]:
    import inspect

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
        ctx = _TracedCtx(name, needs_input_grad, where)
        with torch.no_grad():  # as eager runs it; inlined below
            if _torch.defines_setup_context(cls):
                out = cls.forward(*full)
                cls.setup_context(ctx, tuple(full), out)
            else:
                out = cls.forward(ctx, *full)
        outs = out if isinstance(out, tuple) else (out,)
        out_tensors, layout = [], []
        for o in outs:
            if isinstance(o, torch.Tensor):
                if any(o is t or _torch.shares_storage(o, t) for t in tensors):
                    raise _refused(name, where, (
                        "it returns one of its inputs or a view of one: cannot be exported "
                        "soundly as one op (the program could not keep the alias); return a new "
                        "tensor (e.g. x.clone())"))
                layout.append(_TensorAt(len(out_tensors)))
                out_tensors.append(o)
            elif any(isinstance(leaf, torch.Tensor) for leaf in pytree.tree_leaves(o)):
                raise _refused(name, where, (
                    f"it returns tensors inside a {type(o).__name__}: autograd does not "
                    "differentiate those; return them as elements of the output tuple"))
            else:
                layout.append(o)
        saved_slots = [t is None for t in ctx.saved_tensors]
        saved = [t for t in ctx.saved_tensors if t is not None]
        attributes = {}
        for attr, value in ctx.user_attributes().items():
            kind = _unfixed_state(value)
            if kind is not None:
                raise _refused(name, where, (
                    f"it keeps a {kind} in ctx.{attr}: state the backward would read when it "
                    "runs, which the graph fixes at export time; keep tensors and plain values "
                    "(numbers, strings, dtypes) on ctx"))
            leaves, treespec = _leaves(value)
            attributes[attr] = ([_passed(leaf) or leaf for leaf in leaves], treespec)
            saved += [how.carrier(leaf) for leaf in leaves if (how := _passed(leaf)) is not None]
        marked = ctx._state["non_differentiable"]
        state.update(
            num_outputs=len(out_tensors), outputs=tuple(layout), single=not isinstance(out, tuple),
            non_differentiable=[i for i, o in enumerate(out_tensors) if any(o is m for m in marked)],
            materialize_grads=ctx._state["materialize_grads"], saved_slots=saved_slots,
            attributes=attributes)
        return (*out_tensors, *saved)

    names = _forward_parameter_names(cls, len(args))
    fwd = subgraph(forward, inputs, [names[p] for p in positions], cache)
    _inline_no_grad_regions(fwd)
    return fwd, state


def _output_values(gm: torch.fx.GraphModule) -> list:
    return [o.meta["val"] for o in gm.graph.output_node().args[0]]


def _trace_backward(cls, args, positions, fwd, state, needs_input_grad, where, cache):
    name = cls.__name__
    n_out = state["num_outputs"]
    values = _output_values(fwd)
    outs, saved_vals = values[:n_out], values[n_out:]
    differentiable = [i for i, v in enumerate(outs) if i not in state["non_differentiable"]
                      and (v.is_floating_point() or v.is_complex())]
    # eager materializes zeros for every gradient not given; without, only
    # differentiable outputs can have one
    grad_outputs = list(range(n_out)) if state["materialize_grads"] else differentiable
    grads = [torch.empty(outs[i].shape, dtype=outs[i].dtype, device=outs[i].device) for i in grad_outputs]
    saved = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) for v in saved_vals]
    grad_inputs: list[int] = []
    backward_fn = _backward_function(cls)

    def backward(*placeholders):
        given, kept = placeholders[:len(grad_outputs)], iter(placeholders[len(grad_outputs):])
        ctx = _TracedCtx(name, needs_input_grad, where)
        ctx._state["materialize_grads"] = state["materialize_grads"]
        ctx._state["saved"] = tuple(None if empty else next(kept) for empty in state["saved_slots"])
        for attr, (leaves, treespec) in state["attributes"].items():
            setattr(ctx, attr, pytree.tree_unflatten(
                [leaf.value(next(kept)) if isinstance(leaf, _Passed) else leaf for leaf in leaves],
                treespec))
        by_output = dict(zip(grad_outputs, given))  # a non-tensor output's gradient is None
        full = [by_output.get(o) if isinstance(o, _TensorAt) else None for o in state["outputs"]]
        result = backward_fn(ctx, *full)
        result = result if isinstance(result, tuple) else (result,)
        if len(result) < len(args) or any(r is not None for r in result[len(args):]):
            raise _refused(name, where, f"its backward returns {len(result)} gradients for "
                           f"{len(args)} inputs")
        grad_inputs.clear()
        grads_out = []
        for k, p in enumerate(positions):
            if result[p] is not None:
                grad_inputs.append(k)
                grads_out.append(result[p])
        return tuple(grads_out)

    bwd = subgraph(backward, [*grads, *saved], _backward_names(backward_fn, grad_outputs, fwd, n_out),
                   cache)
    return bwd, grad_outputs, list(grad_inputs)


def _backward_names(backward_fn, grad_outputs, fwd, n_out) -> list[str]:
    """Gradients named as the backward names them; saved inputs as the
    forward's placeholders; other saved tensors ``saved_<k>``."""
    import inspect

    params = [p for p in list(inspect.signature(backward_fn).parameters.values())[1:]
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [params[i].name if i < len(params) else f"grad_{i}" for i in grad_outputs]
    for k, o in enumerate(fwd.graph.output_node().args[0][n_out:]):
        names.append(o.name if o.op == "placeholder" else f"saved_{k}")
    unique, seen = [], set()
    for n in names:
        candidate, i = n, 0
        while candidate in seen:
            i += 1
            candidate = f"{n}_{i}"
        seen.add(candidate)
        unique.append(candidate)
    return unique
