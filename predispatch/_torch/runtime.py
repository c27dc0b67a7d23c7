"""What a program runs on: torch's region higher-order ops, aten entry points for generated code, unlifted-module checks."""
from __future__ import annotations

import contextlib
import functools
import sys

import torch
import torch._dynamo
import torch.fx
from torch._higher_order_ops.wrap import (
    WrapWithAutocast,
    WrapWithSetGradEnabled,
    wrap_with_autocast,
    wrap_with_set_grad_enabled,
)
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from torch.nn.modules import module as _nn_module
from torch.export._unlift import (
    _check_input_constraints_for_module,
    _check_inputs_match,
)


class _GradRegion:
    """The cheapest exception-safe grad-mode block (a region runs in one)."""

    __slots__ = ("enable", "prev")

    def __init__(self, enable: bool):
        self.enable = enable

    def __enter__(self):
        self.prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(self.enable)

    def __exit__(self, *exc):
        torch._C._set_grad_enabled(self.prev)


_GRAD_REGION_CODES = {_GradRegion.__enter__.__code__: "enter", _GradRegion.__exit__.__code__: "exit"}


def _exception_safe_call(self, enable_grad, wrapped_func, *args, **kwargs):
    if torch.compiler.is_dynamo_compiling():  # dynamo knows torch's own call, not this one
        return _TORCH_REGION_CALLS[WrapWithSetGradEnabled](self, enable_grad, wrapped_func, *args, **kwargs)
    if torch._C._is_torch_function_mode_enabled():  # being traced: the recorder reads _GradRegion's frames
        with _GradRegion(enable_grad):
            return wrapped_func(*args, **kwargs)
    prev = torch.is_grad_enabled()
    torch._C._set_grad_enabled(enable_grad)
    try:
        return _call_region_body(wrapped_func, args, kwargs)
    finally:
        torch._C._set_grad_enabled(prev)


def _call_region_body(body, args, kwargs):
    """A region's submodule runs once per call of the program: skip
    nn.Module.__call__'s bookkeeping (a few microseconds) unless hooks need it."""
    if isinstance(body, torch.nn.Module):
        if not _has_module_hooks(body):
            return body.forward(*args, **kwargs)
        _LazyGraphModule.force_recompile(body)  # else its first call runs the hooks twice
    return body(*args, **kwargs)


def _has_module_hooks(m: torch.nn.Module) -> bool:
    g = _nn_module
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or g._global_forward_hooks or g._global_forward_pre_hooks
                or g._global_backward_hooks or g._global_backward_pre_hooks)


@functools.lru_cache(maxsize=64)
def _validated_autocast(device_type, dtype, enabled, cache_enabled):
    """What torch.autocast makes of these arguments (its checks may disable it)."""
    a = torch.autocast(device_type, dtype, enabled, cache_enabled)
    return a.device, a.fast_dtype, a._enabled, a._cache_enabled


def _autocast_call(self, device_type, dtype, enabled, cache_enabled, wrapped_func, *args, **kwargs):
    if torch.compiler.is_dynamo_compiling():
        return _TORCH_REGION_CALLS[WrapWithAutocast](
            self, device_type, dtype, enabled, cache_enabled, wrapped_func, *args, **kwargs)
    if torch._C._is_torch_function_mode_enabled():  # being traced: torch.autocast records itself
        with torch.autocast(device_type, dtype, enabled, cache_enabled):
            return wrapped_func(*args, **kwargs)
    # torch.autocast.__enter__/__exit__ without their per-call Python overhead
    if dtype is None:  # the block gave none: the one current now, as torch.autocast takes it
        dtype = torch.get_autocast_dtype(device_type)
    device, fast_dtype, on, cache = _validated_autocast(device_type, dtype, enabled, cache_enabled)
    prev = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device),
            torch.is_autocast_cache_enabled())
    torch.set_autocast_enabled(device, on)
    torch.set_autocast_dtype(device, fast_dtype)
    torch.autocast_increment_nesting()
    torch.set_autocast_cache_enabled(cache)
    try:
        return _call_region_body(wrapped_func, args, kwargs)
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device, prev[0])
        torch.set_autocast_dtype(device, prev[1])
        torch.set_autocast_cache_enabled(prev[2])


def install_unflatten_write_backs(fix) -> None:
    """After ``torch.export.unflatten`` turns a program's mutations into
    ``copy_`` nodes, ``fix(graph, graph_signature)`` may change them."""
    _unflatten = sys.modules["torch.export.unflatten"]  # the module (torch.export.unflatten is its function)
    original = _unflatten._inplace_buffer_and_input_mutations

    def inplace_mutations(graph, graph_signature):
        original(graph, graph_signature)
        fix(graph, graph_signature)

    _unflatten._inplace_buffer_and_input_mutations = inplace_mutations


_TORCH_REGION_CALLS = {WrapWithSetGradEnabled: WrapWithSetGradEnabled.__call__,
                       WrapWithAutocast: WrapWithAutocast.__call__}


def install_region_runtime() -> None:
    """Run regions exception-safely and cheaply (torch's HOPs restore grad mode
    without `finally` and build a dynamo-disabled wrapper per call)."""
    WrapWithSetGradEnabled.__call__ = _exception_safe_call
    WrapWithAutocast.__call__ = _autocast_call


@contextlib.contextmanager
def torch_region_runtime():
    """torch's own region calls, for a while (the benchmark's reference)."""
    ours = {cls: cls.__call__ for cls in _TORCH_REGION_CALLS}
    for cls, call in _TORCH_REGION_CALLS.items():
        cls.__call__ = call
    try:
        yield
    finally:
        for cls, call in ours.items():
            cls.__call__ = call


_ENTRY_POINTS: dict = {}


def op_entry_point(op: torch._ops.OpOverload):
    """An object calling exactly what ``op(...)`` calls, named for generated
    code (``aten_mul_Tensor``), that dynamo writes into its graph as a call
    (``torch.compile`` of the module still sees the op); None for ops that are
    not aten ops returning only tensors."""
    if op not in _ENTRY_POINTS:
        _ENTRY_POINTS[op] = _make_entry_point(op) if _has_entry_point(op) else None
    return _ENTRY_POINTS[op]


def _has_entry_point(op) -> bool:
    schema = op._schema
    return (isinstance(op, torch._ops.OpOverload) and op.namespace == "aten" and not schema.is_mutable
            and len(schema.returns) > 0
            and all(isinstance(r.type, torch.TensorType) for r in schema.returns))


def _make_entry_point(op):
    name = f"{op._schema.name.split('::')[1]}_{op._overloadname}"
    cls = type(name, (), {"__call__": staticmethod(op._op), "__module__": "aten",
                          "__repr__": lambda self: f"<entry point of {op}>"})
    entry = cls()
    entry.__name__ = name
    torch._dynamo.allow_in_graph(entry)
    return entry


def generate_code_with(gm: torch.fx.GraphModule, targets: dict) -> None:
    """Generate ``gm``'s code now with some node targets replaced (``targets``:
    node -> callable), leaving the graph as it was: passes and pattern
    matchers still see the aten ops, and a later recompile is plain."""
    saved = {node: node.target for node in targets}
    try:
        for node, target in targets.items():
            node.target = target
        if isinstance(gm, _LazyGraphModule):
            _LazyGraphModule.force_recompile(gm)
        else:
            gm.recompile()
    finally:
        for node, target in saved.items():
            node.target = target


def call_leaves(unlifted: torch.fx.GraphModule, args, kwargs) -> list:
    """The call's input leaves in the program's order, keyword arguments in
    any order; ValueError for another input structure (as ep.module())."""
    return [x for _, x in _check_inputs_match(args, kwargs, unlifted._in_spec)]


def check_call_inputs(unlifted: torch.fx.GraphModule, args, kwargs) -> None:
    """RuntimeError naming the input where ``ep.module()`` (``unlifted``) would
    refuse the call: a size outside the program's shapes and dynamic ranges, a
    non-tensor input other than the exported value."""
    _check_input_constraints_for_module(unlifted, args, kwargs)


def call_subgraph(gm: torch.fx.GraphModule, *args):
    """A subgraph called as a region's body is (without nn.Module.__call__'s
    bookkeeping unless hooks need it)."""
    return _call_region_body(gm, args, {})
