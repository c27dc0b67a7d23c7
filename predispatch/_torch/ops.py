"""What torch says about an op: its kernels, tags, aliasing, and what its backward saves."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.fx
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator, _set_mode_pre_dispatch

from .patching import patched


SET_GRAD_ENABLED = torch._C._set_grad_enabled


WITH_EFFECTS = torch.ops.higher_order.with_effects  # an op with effects, ordered by a token


ENTER_AUTOCAST = torch.amp.autocast_mode._enter_autocast


EXIT_AUTOCAST = torch.amp.autocast_mode._exit_autocast


CIA_KEY = "CompositeImplicitAutograd"


def has_composite_implicit_kernel(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), CIA_KEY)


def has_own_functionalization_kernel(op: torch._ops.OpOverload) -> bool:
    """Does functionalization know ``op`` itself (not only through its boxed
    fallback, which refuses an op returning an alias)? torch has no query
    for it but the dispatch table's text."""
    table = torch._C._dispatch_dump_table(op.name())
    line = next((entry for entry in table.splitlines() if entry.startswith("Functionalize:")), "")
    return bool(line) and "[backend fallback]" not in line


# Composites decomposed as eager runs them, through their C++ kernel, not the
# Python decomposition torch registers for tracing: aten.dropout's calls
# native_dropout, whose backward rounds a bf16 input's gradient otherwise than
# eager's CPU composite (input * bernoulli mask / (1 - p)), and clones where
# eager returns the input itself (train=False).
_AS_EAGER = (torch.ops.aten.dropout.default,)


@contextlib.contextmanager
def decompose_by(should_decompose):
    """Let ``should_decompose(func) -> bool | None`` decide, while tracing,
    which composites FunctionalTensorMode keeps (None = torch's own rule)."""
    original = FunctionalTensorMode._can_decompose

    def _can_decompose(self, func, args, kwargs):
        verdict = should_decompose(func)
        if verdict is None:
            return original(self, func, args, kwargs)
        return verdict

    cia = torch._C.DispatchKey.CompositeImplicitAutograd
    python_kernels = {op: op.py_kernels.pop(cia) for op in _AS_EAGER if cia in op.py_kernels}
    for op in python_kernels:
        op._dispatch_cache.clear()
    FunctionalTensorMode._can_decompose = _can_decompose
    try:
        yield
    finally:
        FunctionalTensorMode._can_decompose = original
        for op, kernel in python_kernels.items():
            op.py_kernels[cia] = kernel
            op._dispatch_cache.clear()


@contextlib.contextmanager
def pre_dispatch_pushes_without_uncaching():
    """While tracing, a pre-dispatch mode pushed (FunctionalTensorMode entering
    itself again for each composite it decomposes, ``with self:``) skips
    torch's loop over every cached op that drops the op's PreDispatch entry:
    torch never caches that entry (Note [Not Caching Per-Dispatch-Key Mode
    Handlers] in torch/_ops.py: ``_get_dispatch`` returns the pre-dispatch
    handler uncached), so the loop drops nothing; it cost ~90 calls a push,
    8k of a 4-block ResNet export's 415k. tests/test_trace_cost.py checks
    that no op caches the key."""
    from torch.utils import _python_dispatch

    def replacement(original):
        def push(mode):
            if getattr(mode, "_dispatch_key", None) == DispatchKey.PreDispatch:
                _set_mode_pre_dispatch(mode)
            else:
                original(mode)
        return push

    with patched(_python_dispatch, "_push_mode", replacement):
        yield


def pre_dispatch_cached_ops() -> list:
    """The ops whose Python dispatch cache holds a pre-dispatch entry (none, as torch caches them)."""
    keys = set(torch._C._functionality_to_backend_keys(DispatchKey.PreDispatch))
    return [op for op in torch._ops.get_cached_ops() if keys & set(op._dispatch_cache)]


# eager's profiling marks (torch.profiler.record_function): dead code, as torch.export
# drops them; a program carries no C++ profiler object a copy or save would choke on
_PROFILING = (torch.ops.profiler._record_function_enter.default,
              torch.ops.profiler._record_function_enter_new.default,
              torch.ops.profiler._record_function_exit._RecordFunction)


def impure_by_op(impure_random: bool | None = None):
    """``Node.is_impure`` as ``Graph.eliminate_dead_code`` asks it (``impure_random``
    as it decides where not given), its answer for an op overload, which
    depends on the op alone, computed once per op: a schema and effect lookup
    per node is a few percent of a large export's time, in each dead-code pass."""
    if impure_random is None:
        impure_random = True
        from torch._guards import TracingContext

        if TracingContext.try_get():
            from torch._inductor import config as inductor_config

            impure_random = inductor_config.fallback_random
    known: dict[int, bool] = {id(op): False for op in _PROFILING}

    def is_impure(node: torch.fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or type(target) is not torch._ops.OpOverload:
            return node.is_impure(impure_random) and not (node.op == "call_function" and target in _PROFILING)
        found = known.get(id(target))  # overloads live as long as torch: ids stay theirs
        if found is None:
            found = known[id(target)] = node.is_impure(impure_random)
        return found
    return is_impure


def mark_side_effectful(fn) -> None:
    """``Graph.eliminate_dead_code`` keeps calls of ``fn`` (whose result may be unused)."""
    from torch.fx.node import has_side_effect

    has_side_effect(fn)


def autocast_kernel_key(device: str) -> str:
    return "Autocast" + {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS",
                         "hpu": "HPU", "xla": "XLA", "mtia": "MTIA"}.get(device, device.upper())


def has_autocast_kernel(op, device: str) -> bool:
    """Would autocast on ``device`` treat this op differently (cast its inputs)?"""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), autocast_kernel_key(device))
    except RuntimeError:
        return False


_WRITTEN: dict = {}


def written_arguments(func) -> tuple:
    """(position, name) of the arguments ``func`` writes, from its schema."""
    if func not in _WRITTEN:
        schema = getattr(func, "_schema", None)
        _WRITTEN[func] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write) if schema is not None else ()
    return _WRITTEN[func]


def returns_new_memory(op) -> bool:
    """Is ``op`` an op overload whose results alias none of its inputs (its schema says so)?"""
    return isinstance(op, torch._ops.OpOverload) and all(r.alias_info is None for r in op._schema.returns)


OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, HigherOrderOperator)


def is_functional_overload(target) -> bool:
    """Is ``target`` an op overload (``aten.add.Tensor``) whose schema writes nothing?"""
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable


def op_library(func) -> str | None:
    """The library (namespace) an op overload or overload packet belongs to
    (``aten``, ``prims``, a custom op's own); None for anything else."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name.split("::")[0]
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.split("::")[0]
    return None


def may_return_a_view(op) -> bool:
    """Can ``op``'s eager result be a view (a view op, or a composite whose
    decomposition may return one: ``linear`` of a vector, ``reshape``)? True
    where unknown (a higher-order op's ``getitem``, another library's op)."""
    if not isinstance(op, torch._ops.OpOverload):
        return op is not None
    return bool(op.is_view) or torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd")


def saved_for_backward(op) -> tuple[frozenset, bool] | None:
    """(the names of the inputs ``op``'s backward saves, whether it saves its
    result) as torch's derivatives.yaml says; None where it has no formula
    there (a composite, a higher-order op, an op of another library)."""
    return _saved_for_backward().get(op_overload_name(op))


def op_overload_name(op) -> str | None:
    """``mul.Tensor``, ``relu`` (an aten op's name as derivatives.yaml writes it)."""
    name = getattr(op, "_schema", None) and op._schema.name.removeprefix("aten::")
    overload = getattr(op, "_overloadname", "")
    return f"{name}.{overload}" if overload and overload != "default" else name


@functools.cache
def _saved_for_backward() -> dict[str, tuple[frozenset, bool]]:
    """aten overload name -> (the inputs its backward saves, whether it
    saves its result), from the derivatives.yaml torch ships, as torchgen
    reads it for torch's own autograd code."""
    from pathlib import Path

    import torchgen
    from torchgen.packaged.autograd.load_derivatives import load_derivatives

    root = Path(torchgen.__file__).parent / "packaged"
    paths = (root / "autograd" / "derivatives.yaml", root / "ATen" / "native" / "native_functions.yaml",
             root / "ATen" / "native" / "tags.yaml")
    if not all(p.exists() for p in paths):
        return {}
    infos, _ = load_derivatives(*map(str, paths))
    saved = {}
    for schema, by_key in infos.items():
        info = by_key.get("Default")
        if info is not None:
            saved[str(schema.name)] = (frozenset(a.nctype.name for a in info.all_saved_inputs),
                                       bool(info.all_saved_outputs))
    return saved


OpOverload = torch._ops.OpOverload  # one overload of an op: what a graph node calls
OpOverloadPacket = torch._ops.OpOverloadPacket  # torch.ops.aten.linear: every overload of it
# the Python binding of ``_assert_tensor_metadata`` (one overload: the binding cannot pick another)
ASSERT_TENSOR_METADATA_BINDING = torch._C._VariableFunctions._assert_tensor_metadata


def known_to_dispatcher(op: OpOverload) -> bool:
    """False for TorchScript-only overloads (``aten::add.t``): no traced graph can call them."""
    try:
        torch._C._dispatch_find_schema_or_throw(op._schema.name, op._schema.overload_name)
    except RuntimeError:
        return False
    return True


def redispatch_below_autograd(op: OpOverload, keyset, *args):
    """``op`` run past the autograd keys of ``keyset`` (an op's kernel calling the layer below it)."""
    with torch._C._AutoDispatchBelowAutograd():
        return op.redispatch(keyset & torch._C._after_autograd_keyset, *args)


def has_no_kernel_for_its_shape(e: BaseException) -> bool:
    """Is ``e`` fake tensors' answer for an op whose output shape its inputs'
    values decide and that has no fake kernel saying it (``aten._ctc_loss``,
    ``aten.linalg_lstsq``)?"""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    return isinstance(e, DynamicOutputShapeException)


def is_uncaptured_control_flow(e: BaseException) -> bool:
    """Is ``e`` torch's failure to capture a control-flow operator's branches
    or body (``torch.cond``, ``while_loop``, ``map``, ``scan`` called
    outside torch.compile trace them with dynamo)?"""
    from torch._dynamo.exc import UncapturedHigherOrderOpError

    return isinstance(e, UncapturedHigherOrderOpError)


def op_name_parts(op: OpOverload) -> tuple[str, str, str]:
    """(namespace, op name, overload name) of an op overload: ("aten", "mul", "Tensor")."""
    return op.namespace, op._opname, op._overloadname


def without_default_arguments(op, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``op``'s arguments as the tracer records them: trailing positional
    arguments and keyword-only ones equal to their schema default left out
    (as torch's C++ to Python conversion of an op call leaves them)."""
    schema = getattr(op, "_schema", None)
    if schema is None:
        return args, kwargs
    positional = [a for a in schema.arguments if not a.kwarg_only]
    args = list(args)
    while args and len(args) <= len(positional) and _is_default(positional[len(args) - 1], args[-1]):
        args.pop()
    named = {a.name: a for a in schema.arguments if a.kwarg_only}
    kwargs = {k: v for k, v in kwargs.items() if k not in named or not _is_default(named[k], v)}
    return tuple(args), kwargs


def _is_default(argument, value) -> bool:
    return (argument.has_default_value() and type(value) in (int, float, bool, type(None))
            and type(argument.default_value) is type(value) and argument.default_value == value)
