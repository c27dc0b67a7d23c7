"""The seam: every private PyTorch API predispatch uses is imported here.

A torch upgrade should touch this file only. Each name says what we use it
for; the rest of the package imports from here, never from ``torch._*``.
"""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
import types

import torch
import torch._dynamo
import torch.fx
import torch.utils.checkpoint
from torch._functorch._aot_autograd.functional_utils import (
    are_all_mutations_hidden_from_autograd,
    are_all_mutations_under_no_grad_or_inference_mode,
    has_data_mutation,
)
from torch._higher_order_ops.wrap import (
    WrapWithAutocast,
    WrapWithSetGradEnabled,
    wrap_with_autocast,
    wrap_with_set_grad_enabled,
)
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.export import _trace as _export_trace
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.proxy_tensor import _AttrProxy, get_proxy_mode, get_proxy_slot
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode

__all__ = [
    "FunctionalTensor",
    "TorchFunctionMode",
    "are_all_mutations_hidden_from_autograd",
    "are_all_mutations_under_no_grad_or_inference_mode",
    "has_data_mutation",
    "wrap_with_autocast",
    "wrap_with_set_grad_enabled",
    "ENTER_AUTOCAST",
    "EXIT_AUTOCAST",
    "SET_GRAD_ENABLED",
]

SET_GRAD_ENABLED = torch._C._set_grad_enabled
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


# --------------------------------------------------------------------------
# Capture: torch.export's non-strict front end, with our own aten stage.


# torch.export's non-strict front end (fake inputs, dynamic shapes, guards,
# signature, constants, placeholder names, module call graph): reused as is.
export_trace = _export_trace
compiling_state_context = _export_trace._compiling_state_context
reparametrize_module = torch.nn.utils.stateless._reparametrize_module
# torch.export's guard around its own aten stage: tensors the forward assigns to
# plain module attributes (a cache, a last value) are put back after the trace,
# with a warning, so the user's module holds no traced tensor.
from torch._functorch._aot_autograd.frontend_utils import (  # noqa: E402
    _detect_attribute_assignment as restoring_module_attributes,
)
UserError = _export_trace.UserError
UserErrorType = _export_trace.UserErrorType
ConstraintViolationError = _export_trace.ConstraintViolationError
ValueRangeError = _export_trace.ValueRangeError


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


def autocast_devices() -> list[str]:
    return [d for d in torch._C._autocast_supported_devices() if hasattr(torch, d)]


def autocast_nesting() -> int:
    """How many autocast blocks are open (torch has no getter: read it by a
    balanced increment/decrement, which changes nothing)."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


def current_node(t: torch.Tensor) -> torch.fx.Node | None:
    """The graph node holding the current value of a traced FunctionalTensor
    (a stale view is brought up to date first, in the current grad mode)."""
    if not isinstance(t, FunctionalTensor):
        return None
    torch._sync(t)
    return materialized_node(t)


def materialized_node(t: FunctionalTensor) -> torch.fx.Node | None:
    """The graph node of the value ``t`` last got, up to date or not."""
    inner = torch._from_functional_tensor(t.elem)
    mode = get_proxy_mode()
    if mode is None:
        return None
    slot = get_proxy_slot(inner, mode.tracer, None)
    return None if slot is None else slot.proxy.node


def is_view(t: FunctionalTensor) -> bool:
    return not torch._is_functional_tensor_base(t.elem)


def hides_an_alias(out: FunctionalTensor, inputs: list[FunctionalTensor]) -> bool:
    """Is ``out`` a new tensor to functionalization (not an input, not a view)
    whose traced value shares an input's storage? An op kept whole whose
    schema says functional but which returns an alias (a liar) does that."""
    if any(out is i for i in inputs) or is_view(out):
        return False
    return any(shares_storage(out, i) for i in inputs)


def shares_storage(a: FunctionalTensor, b: FunctionalTensor) -> bool:
    """Do two traced tensors' values share memory (one is a view of the other)?"""
    from torch.multiprocessing.reductions import StorageWeakRef

    def storage(t):
        return StorageWeakRef(torch._from_functional_tensor(t.elem).untyped_storage())

    return storage(a) == storage(b)


def mutation_kind(t: torch.Tensor) -> str | None:
    """How a traced input was mutated: None, "hidden" (hidden from autograd,
    like BatchNorm's running stats), "no_grad" or "grad"."""
    if not isinstance(t, FunctionalTensor) or not has_data_mutation(t):
        return None
    if are_all_mutations_hidden_from_autograd(t):
        return "hidden"
    if are_all_mutations_under_no_grad_or_inference_mode(t):
        return "no_grad"
    return "grad"


_GRAD_MODE_FILE = "autograd" + ("\\" if sys.platform == "win32" else "/") + "grad_mode.py"


def grad_mode_caller() -> tuple[str, object] | None:
    """Which grad-mode context manager is calling ``_set_grad_enabled`` now.

    Returns ("enter" | "exit", the context manager object), or None for a
    bare call. The outermost consecutive frame of torch/autograd/grad_mode.py
    is the user-facing method (no_grad.__exit__ calls set_grad_enabled(prev),
    which calls _set_grad_enabled)."""
    frame = sys._getframe(1)
    found = None
    while frame is not None:
        code = frame.f_code
        if code in _GRAD_REGION_CODES:  # a region of a program being exported again
            return _GRAD_REGION_CODES[code], frame.f_locals["self"]
        if code.co_filename.endswith(_GRAD_MODE_FILE):
            # clone() (the decorator form) makes a fresh object: its methods own the block
            if code.co_name in ("__init__", "__enter__", "__exit__", "__call__"):
                found = frame
        elif found is not None:
            break
        frame = frame.f_back
    if found is None:
        return None
    # set_grad_enabled.__call__ (decorating, inside forward) restores what __init__ set
    phase = "exit" if found.f_code.co_name in ("__exit__", "__call__") else "enter"
    return phase, found.f_locals.get("self")


def refresh_fake_values(gm: torch.fx.GraphModule, before_node=lambda node: None) -> None:
    """Recompute every node's ``meta["val"]`` from the placeholders' (after a
    pass that changes what nodes compute, e.g. inlining an autocast region);
    ``before_node(node)`` may adjust a node whose inputs' values are new."""
    from torch._guards import detect_fake_mode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    class _Refresh(FakeTensorProp):
        def run_node(self, node):
            before_node(node)
            return super().run_node(node)

    inputs = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(inputs)
    with mode:
        _Refresh(gm, mode).propagate_dont_convert_inputs(*inputs)


def grad_mode_call_frame() -> types.FrameType | None:
    """The frame that called into torch/autograd/grad_mode.py (e.g. the line
    ``torch.set_grad_enabled(prev)``), or None."""
    frame, inside = sys._getframe(1), False
    while frame is not None:
        if frame.f_code.co_filename.endswith(_GRAD_MODE_FILE):
            inside = True
        elif inside:
            return frame
        frame = frame.f_back
    return None


# --------------------------------------------------------------------------
# Run time: torch's wrap_with_set_grad_enabled restores grad mode without
# `finally`, so an exception inside a region leaks its mode to the caller.


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


def backward_hooks(module: torch.nn.Module) -> list[tuple[str | None, object]]:
    """(module path, hook) of every module backward (pre-)hook; global ones have path None."""
    g = _nn_module
    found = [(None, h) for h in (*g._global_backward_hooks.values(), *g._global_backward_pre_hooks.values())]
    for path, m in module.named_modules():
        found += [(path, h) for h in (*m._backward_hooks.values(), *m._backward_pre_hooks.values())]
    return found


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
    known: dict[int, bool] = {}

    def is_impure(node: torch.fx.Node) -> bool:
        target = node.target
        if node.op != "call_function" or type(target) is not torch._ops.OpOverload:
            return node.is_impure(impure_random)
        found = known.get(id(target))  # overloads live as long as torch: ids stay theirs
        if found is None:
            found = known[id(target)] = node.is_impure(impure_random)
        return found
    return is_impure


def mark_side_effectful(fn) -> None:
    """``Graph.eliminate_dead_code`` keeps calls of ``fn`` (whose result may be unused)."""
    from torch.fx.node import has_side_effect

    has_side_effect(fn)


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


# --------------------------------------------------------------------------
# Run time: the unlifted module's generated code calls aten ops through the
# C++ entry point ``OpOverload.__call__`` forwards to (``self._op``), without
# that Python frame (0.5-0.8 us an op).

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


# --------------------------------------------------------------------------
# Program: the tail of torch.export's _export_for_training, unchanged.


def _lazy_program_graph_module(make):
    """The program's GraphModule generates its Python code on first use:
    ``ep.module()`` copies the graph into a module of its own, so an export
    followed by ``module()`` never needs the program's code."""
    @functools.wraps(make)
    def run(root, graph):
        return lazy_graph_module(root, graph, "GraphModule")
    return run


def build_exported_program(cls, module, artifact, signature, *, args, kwargs, dynamic_shapes,
                           state_dict, verify_additional_inputs):
    """An ``ExportedProgram`` (of class ``cls``) from a finished artifact."""
    from torch._export.verifier import TrainingIRVerifier
    from torch.export import exported_program as _exported_program

    from .patching import patched

    t = _export_trace
    t._EXPORT_MODULE_HIERARCHY = t._get_module_hierarchy(module)
    artifact.aten.sig = signature
    forward_arg_names = t._get_forward_arg_names(module, args, kwargs)
    artifact.aten.gm.meta["inline_constraints"] = t._get_inline_constraints(artifact.fake_mode)
    range_constraints = t._get_range_constraints(module, artifact, args, kwargs, dynamic_shapes)
    gm, module_call_graph = t._get_module_call_graph(artifact, (), False, forward_arg_names)
    with patched(_exported_program, "_create_graph_module_for_export", _lazy_program_graph_module):
        ep = cls(
            root=gm, graph=gm.graph, graph_signature=signature, state_dict=state_dict,
            range_constraints=range_constraints, module_call_graph=module_call_graph,
            example_inputs=(args, kwargs), constants=artifact.aten.constants,
            verifiers=[TrainingIRVerifier])
    verify_additional_inputs(ep)
    return ep


def _has_unbacked_symbols(shape_env) -> bool:
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return any(symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))
               for s in shape_env.var_to_range)


def _unbacked_bindings_recomputed_where_any(recompute):
    """torch.export's pass recomputing each node's unbacked bindings; where
    the shape environment has no unbacked symbol every node's comes out
    empty, so it only drops the old ones (instead of walking every value's
    sizes and strides: a tenth of an export's passes on a large model)."""
    from torch._export.utils import _get_shape_env_from_gm

    @functools.wraps(recompute)
    def run(gm):
        shape_env = _get_shape_env_from_gm(gm)
        if shape_env is None or _has_unbacked_symbols(shape_env):
            return recompute(gm)
        for node in gm.graph.nodes:
            node.meta.pop("unbacked_bindings", None)
    return run


def produce_aten_artifact(**kwargs):
    """torch.export's ``_produce_aten_artifact`` (its passes after the trace),
    with torch-function modes off: torch.export's own mode, still on around its
    aten stage, would see each of the passes' metadata reads (a sixth of their time)."""
    from .patching import patched

    with patched(_export_trace, "_replace_unbacked_bindings", _unbacked_bindings_recomputed_where_any), \
            torch._C.DisableTorchFunction():
        return _export_trace._produce_aten_artifact(**kwargs)


@contextlib.contextmanager
def module_stacks_renamed_once():
    """torch.export's wrapper renames every node's module stack after the
    trace (its root stripped), through a pytree map per node: a tenth of an
    export's time outside the trace on a large model. In this block, the
    stacks of the graph module given to the function it yields are held back
    from that renaming, and renamed on exit by the same functions once per
    distinct stack, each node given its own dict in its place among the
    node's metadata."""
    held = {}

    def hold(gm):
        for node in gm.graph.nodes:
            if "nn_module_stack" in node.meta:
                position = list(node.meta).index("nn_module_stack")
                held[node] = (node.meta.pop("nn_module_stack"), position)

    yield hold
    renamed = {}
    for node, (stack, position) in held.items():
        key = tuple(stack.items())
        if key not in renamed:
            renamed[key] = {_export_trace._fixup_key(k): v for k, v in _stack_unrooted(stack).items()}
        meta = node.meta
        if position == len(meta):
            meta["nn_module_stack"] = dict(renamed[key])
            continue
        items = list(meta.items())
        items.insert(position, ("nn_module_stack", dict(renamed[key])))
        meta.clear()
        meta.update(items)


def _stack_unrooted(stack: dict) -> dict:
    """``pytree.tree_map(_strip_root, stack)``, directly where every entry is
    a plain (path, class) tuple, as the tracer makes them."""
    strip = _export_trace._strip_root
    if all(type(v) is tuple and all(type(x) is str or isinstance(x, type) for x in v) for v in stack.values()):
        return {k: tuple(strip(x) for x in v) for k, v in stack.items()}
    return torch.utils._pytree.tree_map(strip, stack)


preserve_version_counter = torch.autograd._unsafe_preserve_version_counter


REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction


def is_traced(t: torch.Tensor) -> bool:
    return isinstance(t, FunctionalTensor)


def requires_grad_in_trace(t: torch.Tensor) -> bool:
    """Whether ``t`` requires grad, as eager would say: while tracing above
    autograd, the functional wrapper does not know; the tensor below it does."""
    if isinstance(t, FunctionalTensor):
        return torch._from_functional_tensor(t.elem).requires_grad
    return t.requires_grad


def functional_write(target: FunctionalTensor, value: FunctionalTensor, *, hidden: bool) -> None:
    """Replay ``target.copy_(value)`` while tracing, as data flow with no node:
    later reads of ``target`` read ``value``, and the mutation is recorded
    (under the current grad mode; hidden from autograd if asked)."""
    torch._sync(value)
    target.replace_(torch._from_functional_tensor(value.elem))
    target.commit_update()
    if hidden:
        target.mark_mutation_hidden_from_autograd()


def data_dependence_errors() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, GuardOnDataDependentSymNode)


# --------------------------------------------------------------------------
# Training: AOTAutograd's joint forward/backward trace.

from torch._functorch._aot_autograd.graph_capture_wrappers import disable_autocast  # noqa: E402
from torch._functorch.aot_autograd import aot_module_simplified  # noqa: E402


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


def autocast_kernel_key(device: str) -> str:
    return "Autocast" + {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS",
                         "hpu": "HPU", "xla": "XLA", "mtia": "MTIA"}.get(device, device.upper())


def has_autocast_kernel(op, device: str) -> bool:
    """Would autocast on ``device`` treat this op differently (cast its inputs)?"""
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), autocast_kernel_key(device))
    except RuntimeError:
        return False


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated on first use, not now:
    outlining a region must not cost a code generation and compile."""
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph, class_name=class_name)


def lazy_codegen():
    """While exporting, graph modules made (by make_fx, by torch.export's
    passes) and recompiled generate their Python code on first use only: the
    program's own GraphModule is generated once, at the end."""
    return _use_lazy_graph_module(True)


# --------------------------------------------------------------------------
# Capture in one pass: make_fx on the PreDispatch key with a FunctionalTensorMode
# inside (aot_export_module traces twice: once for metadata, once for the graph).

from torch._dispatch.python import enable_python_dispatcher  # noqa: E402
from torch._functorch._aot_autograd.graph_capture_wrappers import create_functional_call  # noqa: E402
from torch._functorch._aot_autograd.input_output_analysis import (  # noqa: E402
    _graph_input_names as graph_input_names,
    _graph_output_names as graph_output_names,
)
from torch._functorch._aot_autograd.schemas import GraphSignature  # noqa: E402
from torch._functorch._aot_autograd.utils import create_tree_flattened_fn  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402


_WRITTEN: dict = {}


def written_arguments(func) -> tuple:
    """(position, name) of the arguments ``func`` writes, from its schema."""
    if func not in _WRITTEN:
        schema = getattr(func, "_schema", None)
        _WRITTEN[func] = tuple(
            (i, a.name) for i, a in enumerate(schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write) if schema is not None else ()
    return _WRITTEN[func]


def functional_mode() -> FunctionalTensorMode:
    return FunctionalTensorMode(pre_dispatch=True, export=True, _allow_token_discovery=True)


def to_functional(t):
    return FunctionalTensor.to_functional(t) if isinstance(t, torch.Tensor) else t


# A FunctionalTensor wraps each tensor the trace makes. Its wrapper computes a
# storage size for itself from the sizes and strides, some ten SymInt
# operations when they are symbolic: sympy work, each recorded in the graph by
# make_fx (a node and a dispatch-mode switch) and dropped as dead code at the
# end, for a storage nothing reads. torch.export's graph wraps nothing. While
# predispatch traces, a wrapper of a tensor with a symbolic layout takes the
# wrapped tensor's storage size instead: the same storage, known already.
_wrapping = threading.local()  # .nbytes: the storage size for the wrapper being made


def wrapper_sized_by_wrapped_storage(new):
    """Replacement of ``FunctionalTensor.__new__`` (with
    :func:`wrapper_subclass_with_known_size`)."""
    @functools.wraps(new)
    def run(cls, elem, mode):
        if not _symbolic_layout(elem):
            return new(cls, elem, mode)
        _wrapping.nbytes = elem.untyped_storage().nbytes()
        try:
            return new(cls, elem, mode)
        finally:
            _wrapping.nbytes = None
    return run


def wrapper_subclass_with_known_size(make):
    """Replacement of ``torch.Tensor._make_wrapper_subclass``: a FunctionalTensor
    made in :func:`wrapper_sized_by_wrapped_storage` gets its storage size."""
    @functools.wraps(make)
    def run(cls, *args, **kwargs):
        nbytes = getattr(_wrapping, "nbytes", None)
        if nbytes is not None and cls is FunctionalTensor and "storage_size" not in kwargs:
            _wrapping.nbytes = None  # this wrapper's only
            kwargs["storage_size"] = nbytes
        return make(cls, *args, **kwargs)
    return run


def _symbolic_layout(t: torch.Tensor) -> bool:
    """Strided, with a symbolic size, stride or offset."""
    return t.layout == torch.strided and any(
        isinstance(v, torch.SymInt) for v in (*t.shape, *t.stride(), t.storage_offset()))


def fake_as_strided(value: torch.Tensor, size, stride, offset) -> torch.Tensor:
    """``value.as_strided(...)`` on a node's fake value, out of the trace."""
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        return value.as_strided(size, stride, offset)


def from_functional(t):
    if not isinstance(t, FunctionalTensor):
        return t
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)


def has_metadata_mutation(t: FunctionalTensor) -> bool:
    return torch._functionalize_has_metadata_mutation(t.elem)


def storage_extent(size, stride, offset: int) -> int:
    """The elements a storage needs for a tensor of that layout."""
    if 0 in tuple(size):
        return offset
    return offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1


def storage_changed(t: FunctionalTensor) -> bool:
    return torch._functionalize_was_storage_changed(t.elem)


def storage_elements(t: FunctionalTensor) -> int:
    """How many elements of ``t``'s dtype its (functional) storage holds."""
    return torch._functionalize_get_storage_size(t.elem, True) // t.element_size()


def layout(t: FunctionalTensor) -> tuple[tuple, tuple, int]:
    """``t``'s size, strides and storage offset as functionalization keeps them
    (the Python wrapper's are not updated by ``set_()``)."""
    return tuple(t.elem.size()), tuple(t.elem.stride()), t.elem.storage_offset()


def sync_wrapper_layout(t: FunctionalTensor) -> None:
    """After ``set_()``: the Python wrapper's size and strides as the inner
    tensor's (torch's mode updates them for other layout changes, not for
    set_, so Python indexing would read the old shape)."""
    size, stride, _ = layout(t)
    if (tuple(t.size()), tuple(t.stride())) != (size, stride):
        with torch.utils._mode_utils.no_dispatch():
            # the wrapper's own storage cannot grow: give it one that holds the layout
            # (memory the wrapper never reads; the values live in the inner tensor)
            room = torch.empty_strided(size, stride, dtype=t.dtype, device=t.device)
            torch.ops.aten.set_.source_Storage_storage_offset(t, room.untyped_storage(), 0, size, stride)


def storage_offset(t) -> int | None:
    return t.elem.storage_offset() if isinstance(t, FunctionalTensor) else None


def storage_of(t):
    """A handle comparing equal for FunctionalTensors sharing their (functional)
    storage, as aliases and tensors swapped by ``set_()`` do; None for others."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.elem.untyped_storage()) if isinstance(t, FunctionalTensor) else None


# --- node stack traces (predispatch.stack_traces)
from torch.fx.experimental.symbolic_shapes import uninteresting_files  # noqa: E402
from torch.fx.proxy import _STACK_TRACE_ANCHORS  # noqa: E402


def current_tracer():
    """The fx tracer of the make_fx trace in progress, or None."""
    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


def grad_mode_marker(enabled: bool) -> torch.fx.Node:
    """Set grad mode, and record it in the trace as make_fx's pre-dispatch
    torch-function mode records a ``_set_grad_enabled`` call it sees."""
    node = current_tracer().create_node("call_function", SET_GRAD_ENABLED, (enabled,), {})
    node.meta["val"] = None
    with torch._C.DisableTorchFunction():
        SET_GRAD_ENABLED(enabled)
    return node


def last_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """The graph's last node (its root sentinel when empty): the mark before
    a call whose new nodes :func:`nodes_after` then walks."""
    return graph._root.prev


def nodes_after(node: torch.fx.Node):
    node = node.next
    while node.op != "root":
        yield node
        node = node.next


def is_user_stack_frame(filename: str, name: str) -> bool:
    """Whether torch's tracer shows this frame in a node's stack trace (the
    forward-only filter of ``TracerBase._filter_traceback_frames``)."""
    return ((name == "forward" or filename.endswith("torch/__init__.py")
             or (filename, name) in _STACK_TRACE_ANCHORS)
            and filename not in uninteresting_files())


# --------------------------------------------------------------------------
# compile_training (predispatch.training): ep.module()'s own checks of a
# call's inputs (the compiled module accepts and refuses what it does), and
# the AOTAutograd details its run-time checks and retain_graph depend on.

from torch.export._unlift import (  # noqa: E402
    _check_input_constraints_for_module,
    _check_inputs_match,
)


def call_leaves(unlifted: torch.fx.GraphModule, args, kwargs) -> list:
    """The call's input leaves in the program's order, keyword arguments in
    any order; ValueError for another input structure (as ep.module())."""
    return [x for _, x in _check_inputs_match(args, kwargs, unlifted._in_spec)]


def check_call_inputs(unlifted: torch.fx.GraphModule, args, kwargs) -> None:
    """RuntimeError naming the input where ``ep.module()`` (``unlifted``) would
    refuse the call: a size outside the program's shapes and dynamic ranges, a
    non-tensor input other than the exported value."""
    _check_input_constraints_for_module(unlifted, args, kwargs)


def is_compiled_backward_node(node) -> bool:
    """Is this autograd node the backward of an AOTAutograd compiled function?"""
    return node.name() == "CompiledFunctionBackward"


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


# --------------------------------------------------------------------------
# autograd.Function as a higher-order op (predispatch.autograd_functions): the
# op's rules for each layer a trace stacks (functionalization, make_fx's proxy
# mode, fake tensors, autograd, the dense kernel), and the nested trace of a
# Function's forward and backward in the middle of the module's trace.

from torch._C import DispatchKey  # noqa: E402
from torch._ops import HigherOrderOperator  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.autograd.function import _is_setup_context_defined  # noqa: E402
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, track_tensor_tree  # noqa: E402


def defines_setup_context(cls) -> bool:
    """Does this autograd.Function split its forward from ``setup_context``?"""
    return _is_setup_context_defined(cls.setup_context)


def fake_mode_of(t: torch.Tensor):
    """The fake mode of a traced tensor (or of the trace now running)."""
    from torch._guards import detect_fake_mode

    inner = torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t
    return inner.fake_mode if isinstance(inner, FakeTensor) else detect_fake_mode()


@contextlib.contextmanager
def torch_function_modes_suspended():
    """No torch-function mode (the trace's recorders) sees the calls made meanwhile."""
    modes = []
    while torch._C._len_torch_function_stack() > 0:
        modes.append(torch._C._pop_torch_function_stack())
    try:
        yield
    finally:
        for mode in reversed(modes):
            torch._C._push_on_torch_function_stack(mode)


@contextlib.contextmanager
def outer_trace_suspended(fake_mode):
    """A trace of its own in the middle of a trace: every mode of the running
    one (torch-function modes, dispatch modes on the PreDispatch and Python
    keys) off, its fake mode back on; all restored on exit."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch_function_modes_suspended(), _disable_current_modes():
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            yield


def record_higher_order_call(mode, op, args: tuple, kwargs: dict, out, submodules: dict):
    """In make_fx's proxy ``mode``: register ``submodules`` (name -> graph
    module; a name taken gets a suffix) on the traced root, add the node
    ``op(*args, **kwargs)`` (graph-module arguments become its get_attr
    nodes) and tie ``out`` to it. Returns ``out``."""
    tracer = mode.tracer
    for name, gm in submodules.items():
        tracer.root.register_module(name, gm)
    proxy_args = torch.utils._pytree.tree_map(tracer.unwrap_proxy, args)
    proxy_kwargs = torch.utils._pytree.tree_map(tracer.unwrap_proxy, kwargs)
    proxy = tracer.create_proxy("call_function", op, proxy_args, proxy_kwargs)
    return track_tensor_tree(out, proxy, constant=None, tracer=tracer)


def free_module_name(root: torch.nn.Module, base: str) -> str:
    """``base_0``, ``base_1``, ...: the first name ``root`` does not hold."""
    i = 0
    while hasattr(root, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def autocast_cache_default() -> bool:
    """The cast-cache flag a block that does not say gets (while the forward
    is traced: eager's, see ``translations.autocast_blocks_as_in_eager``)."""
    return torch.autocast("cpu", enabled=False)._cache_enabled


@contextlib.contextmanager
def autocast_cache_enabled(value: bool):
    previous = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(value)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(previous)


def rename_placeholder(node: torch.fx.Node, name: str) -> None:
    """A placeholder's name and argument name (the graph's namespace kept unique)."""
    node.target = name
    node._rename(name)


def traces_above_autograd(mode) -> bool:
    """Is make_fx's proxy ``mode`` tracing above autograd (pre-dispatch)?"""
    return mode.pre_dispatch


def retrace_subgraph(gm: torch.fx.GraphModule, example_inputs: list) -> torch.fx.GraphModule:
    """``gm`` traced again by the make_fx trace in progress (its decompositions,
    the autocast state now), as a subgraph of its own."""
    from torch._higher_order_ops.utils import reenter_make_fx

    return reenter_make_fx(gm)(*example_inputs)


OP_TYPES = (torch._ops.OpOverload, torch._ops.OpOverloadPacket, HigherOrderOperator)


def traced_constant(t: torch.Tensor) -> torch.Tensor:
    """A tensor constant, in the trace in progress, as ``torch.tensor(data)`` is
    traced (a lifted copy of a constant the program holds)."""
    return torch.ops.aten.lift_fresh_copy.default(t)


def call_subgraph(gm: torch.fx.GraphModule, *args):
    """A subgraph called as a region's body is (without nn.Module.__call__'s
    bookkeeping unless hooks need it)."""
    return _call_region_body(gm, args, {})


def being_traced() -> bool:
    """Is a torch-function mode on (an export tracing the code that asks)?"""
    return torch._C._is_torch_function_mode_enabled()


def may_return_a_view(op) -> bool:
    """Can ``op``'s eager result be a view (a view op, or a composite whose
    decomposition may return one: ``linear`` of a vector, ``reshape``)? True
    where unknown (a higher-order op's ``getitem``, another library's op)."""
    if not isinstance(op, torch._ops.OpOverload):
        return getattr(op, "__module__", None) != "predispatch.ops" and op is not None
    if op.namespace == "predispatch":
        return False  # its own ops return new tensors
    return bool(op.is_view) or torch._C._dispatch_has_kernel_for_dispatch_key(
        op.name(), "CompositeImplicitAutograd")


def clear_fake_dispatch_cache() -> None:
    """Forget FakeTensorMode's dispatch cache (shared by every fake mode of
    the process): entries an earlier export left made a later export of the
    same module fail a view's storage bounds check (fuzz bug 89); each
    export starts from an empty cache."""
    FakeTensorMode.cache_clear()


def returns_a_view(node: torch.fx.Node) -> bool:
    """Is ``node``'s eager result a view? A view op's is; a composite's is
    found by running it on meta tensors laid out as its inputs (``linear``
    of a vector returns one, of a matrix not). True where unknown (symbolic
    shapes, another library's op)."""
    op = node.target
    if node.op != "call_function" or not may_return_a_view(op):
        return node.op != "call_function"
    if not isinstance(op, torch._ops.OpOverload) or op.is_view:
        return True
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with torch_function_modes_suspended(), _disable_current_modes(), torch.no_grad():
            args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _meta_like)
            out = op(*args, **kwargs)
    except Exception:  # noqa: BLE001 (unknown: assume a view)
        return True
    return any(isinstance(o, torch.Tensor) and o._is_view() for o in torch.utils._pytree.tree_leaves(out))


def _meta_like(node: torch.fx.Node) -> torch.Tensor:
    val = node.meta["val"]
    return torch.empty_strided(tuple(int(n) for n in val.shape), tuple(int(s) for s in val.stride()),
                               dtype=val.dtype, device="meta")


# ops autograd knows without a derivatives.yaml formula, whose backward saves no tensor:
# copy (its gradient is grad, cast; copy_'s is written by hand), the *_like factories
# (no gradient reaches their input)
_SAVE_NOTHING = frozenset({"copy", "full_like", "zeros_like", "ones_like", "empty_like", "rand_like",
                           "randn_like", "randint_like"})


def saves_its_result(op) -> bool:
    """Does ``op``'s backward read its own output (``relu``, ``exp``: their
    formulas in the derivatives.yaml torch ships)? True where unknown (a
    composite, a higher-order op, an op of another library)."""
    if getattr(op, "namespace", None) == "predispatch":
        return False  # its own ops save nothing
    if _overload_key(op) in _SAVE_NOTHING:
        return False
    saved = _saved_for_backward().get(_overload_key(op))
    return True if saved is None else saved[1]


def saves_its_input(op, position: int | None) -> bool:
    """Does ``op``'s backward read the tensor it takes at positional
    ``position`` (``mul`` its factors; ``add`` none; predispatch's ops
    none)? True where unknown."""
    if getattr(op, "namespace", None) == "predispatch" or _overload_key(op) in _SAVE_NOTHING:
        return False  # its own ops save nothing
    saved = _saved_for_backward().get(_overload_key(op))
    schema = getattr(op, "_schema", None)
    if saved is None or position is None or schema is None or position >= len(schema.arguments):
        return True
    return schema.arguments[position].name in saved[0]


def _overload_key(op) -> str | None:
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


# --- DTensor / torch.distributed (predispatch.sharding), imported on first use:
# a module that never imported torch.distributed.tensor holds no DTensor.

def distributed_in_use() -> bool:
    """Has anything imported DTensor or FSDP2 (so a module may hold them)?"""
    return "torch.distributed.tensor" in sys.modules or "torch.distributed.fsdp" in sys.modules


@functools.cache
def _distributed_names() -> dict:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import _StridedShard

    return {"DTensor": DTensor, "DTensorSpec": DTensorSpec, "TensorMeta": TensorMeta,
            "Replicate": Replicate, "Shard": Shard, "Partial": Partial, "FSDPModule": FSDPModule,
            "MixedPrecisionPolicy": MixedPrecisionPolicy, "OffloadPolicy": OffloadPolicy,
            "StridedShard": _StridedShard}


def __getattr__(name: str):
    names = _distributed_names()
    if name in names:
        return names[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mesh_group_name(mesh, dim: int) -> str:
    """The name of the process group of a device mesh's dimension (what
    ``_c10d_functional`` collectives take)."""
    return mesh.get_group(dim).group_name


def current_mesh():
    """The device mesh DTensor.from_local uses when none is given."""
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh()


def global_tensor_info(local: torch.Tensor, mesh, placements) -> tuple:
    """(global shape, global stride) of a local shard, as DTensor.from_local computes them."""
    from torch.distributed.tensor._utils import compute_global_tensor_info

    shape, stride = compute_global_tensor_info(local, mesh, placements)
    return tuple(shape), tuple(stride)


def dtensor_dispatch_module():
    """The module whose ``redistribute_local_tensor`` DTensor's op dispatch
    calls to move an input inside an op (an implicit redistribution)."""
    import torch.distributed.tensor._dispatch as dispatch

    return dispatch


def make_dtensor(local: torch.Tensor, spec, requires_grad: bool):
    """A DTensor around ``local`` made without its ``__init__``, which (while
    exporting) would record its construction in the graph: here it is a
    carrier of placements that no node sees."""
    from torch.distributed.tensor import DTensor

    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def local_tensor(dtensor) -> torch.Tensor:
    """A DTensor's local shard, without the autograd.Function ``to_local`` is."""
    return dtensor._local_tensor


def dtensor_spec(dtensor):
    return dtensor._spec


def state_table(owner: torch.nn.Module, name: str) -> dict:
    """The dict of ``owner`` (its parameters' or its buffers') that holds ``name``."""
    return owner._parameters if name in owner._parameters else owner._buffers


def forward_hooks_of(module: torch.nn.Module) -> tuple[list, list]:
    """(forward pre-hooks, forward hooks) registered on ``module`` itself."""
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


@contextlib.contextmanager
def module_call_wrapped(module: torch.nn.Module, wrap):
    """Until exit, ``module(...)`` — its hooks, then its forward — runs
    ``wrap(call)(...)``, ``call`` being what it ran before: nn.Module's
    ``__call__`` looks ``_call_impl`` up on the instance."""
    call = module._call_impl
    had_own = "_call_impl" in module.__dict__
    module._call_impl = wrap(call)
    try:
        yield
    finally:
        if had_own:
            module._call_impl = call
        else:
            del module._call_impl


# FSDP2's record of a fully_shard-ed module (torch.distributed.fsdp._fully_shard)

def fsdp_param_groups(module: torch.nn.Module) -> list:
    return module._get_fsdp_state()._fsdp_param_groups


def fsdp_forward_hooks(module: torch.nn.Module) -> list:
    """(hook dict, key) of the forward pre-hook and the forward hook
    ``fully_shard`` registered on ``module``."""
    state = module._get_fsdp_state()
    return [(module._forward_pre_hooks, state._pre_forward_hook_handle.id),
            (module._forward_hooks, state._post_forward_hook_handle.id)]


def fsdp_param_place(fsdp_param) -> tuple:
    """(module, parameter name, modules sharing it) of a parameter FSDP manages."""
    info = fsdp_param._module_info
    return info.module, info.param_name, info.shared_modules


def fsdp_param_unsharded_size(fsdp_param) -> torch.Size:
    """The size FSDP all-gathers back (with TP: the TP shard's)."""
    return fsdp_param._orig_size


def fsdp_param_tensor_parallel_spec(fsdp_param):
    """The DTensor spec of the all-gathered parameter (FSDP x TP), or None."""
    return fsdp_param._unsharded_dtensor_spec


# --- layer reuse (predispatch.layer_reuse)
from torch.fx.experimental.proxy_tensor import set_proxy_slot  # noqa: E402,F401
from torch.utils._python_dispatch import _detect_infra_mode, _disable_infra_mode  # noqa: E402


@contextlib.contextmanager
def trace_suspended():
    """Until exit, torch calls run on plain tensors as if no trace ran: no
    torch-function mode, no dispatch mode (functionalization, proxy, fake), no
    Python dispatcher, the thread's patches (:mod:`predispatch.patching`) serving as the originals."""
    from .patching import patches_suspended

    popped, dispatch_modes = [], []
    try:
        while torch._C._len_torch_function_stack() > 0:
            popped.append(torch._C._pop_torch_function_stack())
        while torch._C._len_torch_dispatch_stack() > 0:  # fake, and any other
            dispatch_modes.append(torch._C._pop_torch_dispatch_stack(None))
        # the pre-dispatch modes (the trace's functionalization and proxy) skipped
        # rather than popped: pushing one back clears every op's dispatch cache
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)), \
                torch._C._DisablePythonDispatcher(), patches_suspended():
            yield
    finally:
        for mode in reversed(dispatch_modes):
            torch._C._push_on_torch_dispatch_stack(mode)
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def copy_node(graph: torch.fx.Graph, node: torch.fx.Node, arg_transform) -> torch.fx.Node:
    """``graph.node_copy(node, arg_transform)``, made without its arguments and
    given them after: ``create_node`` walks every argument looking for raw
    symbolic values (a warning), which a copy of a node made by the tracer
    cannot hold; the node is the same."""
    args = torch.fx.node.map_arg(node.args, arg_transform)
    kwargs = torch.fx.node.map_arg(node.kwargs, arg_transform)
    hooks = getattr(graph.owning_module, "_create_node_hooks", None)
    if kwargs or hooks:  # one update of both (the users' order), or hooks that read them
        return graph.node_copy(node, arg_transform)
    copy = graph.create_node(node.op, node.target, (), {}, node.name, node.type)
    copy.args = args
    copy.meta = dict(node.meta)  # as node_copy: a shallow copy
    return copy


def storage_counters(t: FunctionalTensor) -> tuple:
    """What changes when ``t``'s (functional) storage or layout is mutated
    (a symbolic size as its node: compared by identity, not by sympy)."""
    return (torch._functionalize_mutation_counter(t.elem),
            torch._functionalize_storage_changed_counter(t.elem),
            has_metadata_mutation(t), *map(_dim_identity, (*t.elem.size(), *t.elem.stride(), t.elem.storage_offset())))


def _dim_identity(value):
    return value.node if isinstance(value, torch.SymInt) else value


def inner_value(t: FunctionalTensor) -> torch.Tensor:
    """The traced (fake) value a FunctionalTensor wraps, as it is now."""
    return torch._from_functional_tensor(t.elem)


def traced_output(value: torch.Tensor, node: torch.fx.Node) -> FunctionalTensor:
    """``value`` (a fresh fake tensor) as the traced value of ``node``: tracked
    by the running proxy mode and wrapped for the running FunctionalTensorMode,
    as an op's output is."""
    tracer = current_tracer()
    track_tensor_tree(value, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)
    mode = _detect_infra_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL)
    return FunctionalTensor(torch._to_functional_tensor(value), mode)


def fresh_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor | None:
    """A new (fake) tensor with ``t``'s metadata, made out of the trace, with
    an autograd history when ``requires_grad`` (as an op's output has); None
    when its layout cannot be made so."""
    # the pre-dispatch modes (functionalization, the proxy) skipped rather than
    # popped: pushing one back clears every op's dispatch cache
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)), _size_arithmetic_unrecorded(t):
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device,
                                  requires_grad=requires_grad)
        if requires_grad:
            with torch.enable_grad():  # torch-function modes off: no trace sees it
                out = out.clone(memory_format=torch.preserve_format)
        if out.stride() != t.stride() or out.storage_offset() != t.storage_offset():
            return None
    return out


@contextlib.contextmanager
def _size_arithmetic_unrecorded(t: torch.Tensor):
    """Symbolic-size arithmetic on ``t``'s layout, unseen by the trace's proxy
    mode. make_fx records each such operation as a graph node, with a captured
    stack each, that dead-code elimination drops at the end (a fresh tensor of
    a symbolic layout: some 20 ms, mostly those stacks). The proxies of ``t``'s
    own symbolic sizes, strides and offset are made first, as recording the
    arithmetic would make them (a later layer reads them as symbols made
    before). The proxy mode is hidden from ``get_proxy_mode`` rather than
    popped (popping clears every op's dispatch cache), and the fake tensor
    cache is off meanwhile: an entry with symbolic sizes made unseen would
    give later traced ops sizes the proxy mode does not know."""
    tracer = current_tracer()
    if tracer is None or not any(isinstance(v, torch.SymInt) for v in (*t.size(), *t.stride(), t.storage_offset())):
        yield
        return
    for v in (*t.size(), *t.stride(), t.storage_offset()):
        if isinstance(v, torch.SymInt) and v.node.constant is None and not v.node.expr.is_number:
            get_proxy_slot(v, tracer).force()
    pre_dispatch = torch._ops.mode_stack_state_for_pre_dispatch()
    proxy_mode, fake_mode = pre_dispatch.get(0), getattr(t, "fake_mode", None)
    cache_enabled = fake_mode is not None and fake_mode.cache_enabled
    pre_dispatch.set(0, None)
    if fake_mode is not None:
        fake_mode.cache_enabled = False
    try:
        yield
    finally:
        if fake_mode is not None:
            fake_mode.cache_enabled = cache_enabled
        pre_dispatch.set(0, proxy_mode)


def free_unbacked_symbols(value) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols as free

    return bool(free(value)) if isinstance(value, torch.Tensor) else False


def size_hint(value) -> int | None:
    """An int, or a symbolic size's example value (None where it has none)."""
    if isinstance(value, int):
        return value
    try:
        return value.node.hint
    except AttributeError:
        return None


def global_module_hooks() -> bool:
    """Are module hooks registered for every module (``register_module_forward_hook``...)?"""
    return any((_nn_module._global_forward_hooks, _nn_module._global_forward_pre_hooks,
                _nn_module._global_backward_hooks, _nn_module._global_backward_pre_hooks))



def below_autograd():
    """Ops run without autograd (their results require no grad, as traced
    FunctionalTensors' do), grad mode as it is."""
    return torch._C._AutoDispatchBelowAutograd()


def ambient_modes() -> tuple:
    """The global modes a layer's Python code can switch without a block: grad mode, the default dtype."""
    return torch.is_grad_enabled(), torch.get_default_dtype()


def restore_ambient_modes(saved: tuple) -> bool:
    """Put back what :func:`ambient_modes` saved; whether anything had changed."""
    grad, dtype = saved
    if (grad, dtype) == ambient_modes():
        return False
    torch._C._set_grad_enabled(grad)
    torch.set_default_dtype(dtype)
    return True


_CALL_IMPL_CODE = _nn_module.Module._call_impl.__code__


def bound_to_receiver(forward, module: torch.nn.Module, caller) -> object:
    """``forward`` bound to the object ``module`` was called through, where
    ``caller`` is the module call's frame: torch's module-stack tracer calls a
    module shared between paths through an attribute proxy (its attributes the
    module's) that names its submodules by the path it was reached by."""
    if getattr(forward, "__self__", None) is not module or caller.f_code is not _CALL_IMPL_CODE:
        return forward
    receiver = caller.f_locals.get("self")
    if isinstance(receiver, _AttrProxy) and receiver.get_base() is module:
        return forward.__func__.__get__(receiver)
    return forward
