"""make_fx's tracer, fake tensors and the mode stacks: reading and suspending the running trace."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import types

import torch
import torch.fx
import torch.utils.checkpoint
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import _AttrProxy, get_proxy_mode, get_proxy_slot
from torch.nn.modules import module as _nn_module
from torch.overrides import TorchFunctionMode
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import uninteresting_files
from torch.fx.passes.shape_prop import _extract_tensor_metadata
from torch.fx.proxy import _STACK_TRACE_ANCHORS
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.autograd.function import _is_setup_context_defined
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode, _ProxyTensor, set_proxy_slot, track_tensor_tree
from torch.utils._python_dispatch import TorchDispatchMode, _detect_infra_mode, _disable_infra_mode

from .fake_kernels import by_meta_rule
from .ops import SET_GRAD_ENABLED, may_return_a_view
from .patching import patched, patches_suspended


_AUTOCAST_DEVICES: list = []


def autocast_devices() -> list[str]:
    """The device types autocast supports here, read once: a program's check
    of the caller's autocast then reads no builtin dynamo cannot trace
    (``torch.compile(ep.module())`` warned of it)."""
    if not _AUTOCAST_DEVICES:
        _AUTOCAST_DEVICES.extend(d for d in torch._C._autocast_supported_devices() if hasattr(torch, d))
    return list(_AUTOCAST_DEVICES)


# Is autocast on for any device? (a global state an op's result metadata depends on)
any_autocast_enabled = torch._C._is_any_autocast_enabled


def autocast_switches():
    """Which devices have autocast on, as one value compared with ``==``
    (the thread's excluded dispatch keys, among which autocast's keys are
    where it is off): one C call, where asking each device is many."""
    return torch._C._dispatch_tls_local_exclude_set()

# A block whose torch calls reach no torch-function mode nor subclass override: predispatch's
# own reads of tensor metadata, which are not the traced module's torch calls
torch_function_disabled = torch._C.DisableTorchFunction

# Inside torch_function_disabled, a block whose torch calls reach the modes again (the module's own)
torch_function_enabled = torch._C._EnableTorchFunction


def autocast_nesting() -> int:
    """How many autocast blocks are open (torch has no getter: read it by a
    balanced increment/decrement, which changes nothing)."""
    depth = torch.autocast_increment_nesting()
    torch.autocast_decrement_nesting()
    return depth - 1


_GRAD_MODE_FILE = "autograd" + ("\\" if sys.platform == "win32" else "/") + "grad_mode.py"


_GRAD_MODE_BLOCKS: dict = {}  # code of a grad-mode block's __enter__ / __exit__ -> "enter" / "exit"


def register_grad_mode_block(cls) -> None:
    """``cls`` (a context manager of predispatch's own, whose ``__enter__`` and
    ``__exit__`` set grad mode) opens and closes a block as torch's do."""
    _GRAD_MODE_BLOCKS.update({cls.__enter__.__code__: "enter", cls.__exit__.__code__: "exit"})


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
        if code in _GRAD_MODE_BLOCKS:  # a region of a program being exported again
            return _GRAD_MODE_BLOCKS[code], frame.f_locals["self"]
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


def backward_hooks(module: torch.nn.Module) -> list[tuple[str | None, object]]:
    """(module path, hook) of every module backward (pre-)hook; global ones have path None."""
    g = _nn_module
    found = [(None, h) for h in (*g._global_backward_hooks.values(), *g._global_backward_pre_hooks.values())]
    for path, m in module.named_modules():
        found += [(path, h) for h in (*m._backward_hooks.values(), *m._backward_pre_hooks.values())]
    return found


REENTRANT_CHECKPOINT = torch.utils.checkpoint.CheckpointFunction


def data_dependence_errors() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import DataDependentOutputException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return (DataDependentOutputException, GuardOnDataDependentSymNode)


def current_tracer():
    """The fx tracer of the make_fx trace in progress, or None."""
    mode = get_proxy_mode()
    return None if mode is None else mode.tracer


@contextlib.contextmanager
def torch_fns_recorded(tracer, made_under: dict):
    """Each node ``tracer`` makes meanwhile -> the torch function its
    ``torch_fn`` metadata names (by name and count only, which can be
    ambiguous: every property getter is ``__get__``)."""
    had_own = "create_node" in tracer.__dict__
    create = tracer.create_node

    def create_node(*args, **kwargs):
        node = create(*args, **kwargs)
        if "torch_fn" in node.meta:
            made_under[node] = tracer.torch_fn_metadata
        return node

    tracer.create_node = create_node
    try:
        yield made_under
    finally:
        if had_own:
            tracer.create_node = create
        else:
            del tracer.create_node


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


def defines_setup_context(cls) -> bool:
    """Does this autograd.Function split its forward from ``setup_context``?"""
    return _is_setup_context_defined(cls.setup_context)


def function_running_in(frame) -> type | None:
    """The autograd.Function whose forward ``frame`` runs under torch's own
    apply (its first argument a context torch made), or None."""
    code = frame.f_code
    ctx = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    if isinstance(ctx, torch.autograd.function.BackwardCFunction):
        return getattr(type(ctx), "_forward_cls", None)
    return None


def fake_mode_of(t: torch.Tensor):
    """The fake mode of a traced tensor (or of the trace now running)."""
    from torch._guards import detect_fake_mode

    inner = torch._from_functional_tensor(t.elem) if isinstance(t, FunctionalTensor) else t
    return inner.fake_mode if isinstance(inner, FakeTensor) else detect_fake_mode()


def is_fake(t) -> bool:
    """A fake tensor: a value the trace computed, or a constant it converted (not a real tensor)."""
    return isinstance(t, FakeTensor)


def torch_function_off():
    """No torch-function handling at all (modes and subclasses alike) for the
    calls made meanwhile: a torch-function mode's own bookkeeping calls."""
    return torch._C.DisableTorchFunction()


# the Tensor attributes whose ``__get__`` / ``__set__`` torch-function modes see as the func called
TENSOR_DATA = torch._C.TensorBase.__dict__["data"]
TENSOR_REQUIRES_GRAD = torch._C.TensorBase.__dict__["requires_grad"]


# the code that traces, whose reads of a traced tensor's flags are about the trace's own tensors
_TRACING_MACHINERY = tuple(os.path.join(os.path.dirname(torch.__file__), d) for d in (
    "_subclasses", "fx", "_functorch", "_export", "export", "_dynamo", "utils", "_ops.py", "_library",
    "_higher_order_ops", "_prims", "_refs", "_decomp", "_guards.py", "_C")) + (
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),)


@contextlib.contextmanager
def requires_grad_answered(answer):
    """While tracing, ``t.requires_grad`` of a FunctionalTensor (read on this
    thread, outside torch's tracing machinery and predispatch) is
    ``answer(t)``: torch-function modes see its setter, not its getter.
    Every other read and every write is torch's own."""
    thread = threading.get_ident()

    def read(t):
        if threading.get_ident() == thread and not sys._getframe(1).f_code.co_filename.startswith(_TRACING_MACHINERY):
            return answer(t)
        return TENSOR_REQUIRES_GRAD.__get__(t)

    previous = FunctionalTensor.__dict__.get("requires_grad")  # an outer trace's (a Function's body is traced inside)
    FunctionalTensor.requires_grad = property(read, TENSOR_REQUIRES_GRAD.__set__, doc=TENSOR_REQUIRES_GRAD.__doc__)
    try:
        yield
    finally:
        if previous is None:
            del FunctionalTensor.requires_grad
        else:
            FunctionalTensor.requires_grad = previous


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


def traces_above_autograd(mode) -> bool:
    """Is make_fx's proxy ``mode`` tracing above autograd (pre-dispatch)?"""
    return mode.pre_dispatch


def traced_constant(t: torch.Tensor) -> torch.Tensor:
    """A tensor constant, in the trace in progress, as ``torch.tensor(data)`` is
    traced (a lifted copy of a constant the program holds)."""
    return torch.ops.aten.lift_fresh_copy.default(t)


def being_traced() -> bool:
    """Is a torch-function mode on (an export tracing the code that asks)?"""
    return torch._C._is_torch_function_mode_enabled()


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


@contextlib.contextmanager
def trace_suspended():
    """Until exit, torch calls run on plain tensors as if no trace ran: no
    torch-function mode, no dispatch mode (functionalization, proxy, fake), no
    Python dispatcher, the thread's patches (:mod:`predispatch._torch.patching`) serving as the originals,
    and modules called and read as in eager (not through make_fx's tracer)."""
    popped, dispatch_modes, tracer = [], [], current_tracer()
    try:
        while torch._C._len_torch_function_stack() > 0:
            popped.append(torch._C._pop_torch_function_stack())
        while torch._C._len_torch_dispatch_stack() > 0:  # fake, and any other
            dispatch_modes.append(torch._C._pop_torch_dispatch_stack(None))
        # the pre-dispatch modes (the trace's functionalization and proxy) skipped
        # rather than popped: pushing one back clears every op's dispatch cache
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)), \
                torch._C._DisablePythonDispatcher(), patches_suspended(), _module_calls_as_eager(tracer):
            yield
    finally:
        for mode in reversed(dispatch_modes):
            torch._C._push_on_torch_dispatch_stack(mode)
        for mode in reversed(popped):
            torch._C._push_on_torch_function_stack(mode)


def _called_through(module, forward, args, kwargs):
    return forward(*args, **kwargs)


def _read_through(name, value, parameter_proxy_cache):
    return value


_PASSED_THROUGH = {"call_module": _called_through, "getattr": _read_through}


@contextlib.contextmanager
def _module_calls_as_eager(tracer):
    """make_fx's tracer sees each module call (for its module stack) and each
    submodule read (made a proxy of it) through ``nn.Module.__call__`` and
    ``__getattr__``, patched to ask the tracer: meanwhile this tracer passes
    them through. (The tracer's methods are changed, not the class's: a
    class attribute set on ``nn.Module`` costs ~1 ms, every subclass's
    method cache flushed.)"""
    if tracer is None:
        yield
        return
    own = {name: tracer.__dict__.get(name) for name in _PASSED_THROUGH}
    tracer.__dict__.update(_PASSED_THROUGH)
    try:
        yield
    finally:
        for name, method in own.items():
            if method is None:
                del tracer.__dict__[name]
            else:
                tracer.__dict__[name] = method


class _DispatchLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, args, kwargs or {}))
        out = by_meta_rule(func, args, kwargs or {})  # the op is logged; how its outputs are made is not
        return func(*args, **(kwargs or {})) if out is NotImplemented else out


def dispatched_ops(arguments, fn) -> list:
    """The aten calls (overload, args, kwargs) ``fn(*args, **kwargs)`` makes
    on meta tensors below autograd, as if no trace ran (``arguments()`` makes
    ``(args, kwargs)`` there): CompositeImplicitAutograd ops as their
    decompositions, which may depend on a scalar argument's value."""
    log = _DispatchLog()
    with trace_suspended(), torch.device("meta"), below_autograd():
        args, kwargs = arguments()
        with log:
            fn(*args, **kwargs)
    return log.ops


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


def traced_output(value: torch.Tensor, node: torch.fx.Node) -> FunctionalTensor:
    """``value`` (a fresh fake tensor) as the traced value of ``node``: tracked
    by the running proxy mode and wrapped for the running FunctionalTensorMode,
    as an op's output is."""
    tracer = current_tracer()
    if value._has_symbolic_sizes_strides:
        track_tensor_tree(value, torch.fx.Proxy(node, tracer), constant=None, tracer=tracer)
    else:  # no size to track; the node's metadata stays (a stamp's node: its template's, the same)
        set_proxy_slot(value, tracer, _ProxyTensor(torch.fx.Proxy(node, tracer), None))
    mode = _detect_infra_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL)
    return FunctionalTensor(torch._to_functional_tensor(value), mode)


def fresh_like(t: torch.Tensor, requires_grad: bool) -> torch.Tensor | None:
    """A new (fake) tensor with ``t``'s metadata, made out of the trace, with
    an autograd history when ``requires_grad`` (as an op's output has); None
    when its layout cannot be made so."""
    if not requires_grad and type(t) is FakeTensor and not t._has_symbolic_sizes_strides:
        return _fresh_fake(t)
    # the pre-dispatch modes (functionalization, the proxy) skipped rather than
    # popped: pushing one back clears every op's dispatch cache
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)), _size_arithmetic_unrecorded(t), \
            _pre_dispatch_proxy_hidden():
        out = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device,
                                  requires_grad=requires_grad)
        if requires_grad:
            with torch.enable_grad():  # torch-function modes off: no trace sees it
                out = out.clone(memory_format=torch.preserve_format)
        if out.stride() != t.stride() or out.storage_offset() != t.storage_offset():
            return None
    return out


_NO_MODES = torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(torch._C.DispatchKey.PythonTLSSnapshot)


def _fresh_fake(t: FakeTensor) -> FakeTensor | None:
    """:func:`fresh_like` at static sizes, no history: a meta tensor made below
    every mode, made fake directly (fake mode's own ``empty_strided`` is a
    cache lookup, a third of a stamped layer's state updates)."""
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(_NO_MODES):
        meta = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device="meta")
    if meta.stride() != t.stride() or t.storage_offset() != 0:
        return None
    return t.fake_mode.fake_tensor_converter.from_meta_and_device(t.fake_mode, meta, t.device)


@contextlib.contextmanager
def fake_kernels_only():
    """Until exit, ops on the trace's fake tensors run by fake mode's kernels
    alone, below autograd: no torch-function mode, no pre-dispatch mode
    (functionalization, the proxy) sees them, and their outputs have no
    history, as a node's recorded value has none."""
    with torch._C.DisableTorchFunction(), torch._C._ExcludeDispatchKeyGuard(
            torch._C.DispatchKeySet(torch._C.DispatchKey.PreDispatch)), _pre_dispatch_proxy_hidden(), \
            torch._C._AutoDispatchBelowAutograd():
        yield


def set_value(node: torch.fx.Node, value) -> None:
    """``node``'s recorded value (and tensor metadata, where it has one) made ``value``'s, as the tracer records an op's."""
    node.meta["val"] = value
    if "tensor_meta" in node.meta and isinstance(value, torch.Tensor):
        node.meta["tensor_meta"] = _extract_tensor_metadata(value)


@contextlib.contextmanager
def _pre_dispatch_proxy_hidden():
    """The pre-dispatch proxy mode hidden, not popped: the fake tensor cache
    turns proxy modes off around each cache hit, which finds this one set
    (its key is skipped, not its mode) and pushes it back, clearing every
    op's dispatch cache (a tenth of a stamped layer's export)."""
    pre_dispatch = torch._ops.mode_stack_state_for_pre_dispatch()
    proxy_mode = pre_dispatch.get(0)
    if proxy_mode is None:
        yield
        return
    pre_dispatch.set(0, None)
    try:
        yield
    finally:
        pre_dispatch.set(0, proxy_mode)


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


def laid_out_contiguous(t: torch.Tensor) -> bool:
    """Is ``t`` laid out contiguously (row-major), read at its sizes' example
    values, adding no guard? A dimension of size 1 may have any stride."""
    expected = 1
    for size, stride in reversed(list(zip(t.shape, t.stride()))):
        size, stride = size_hint(size), size_hint(stride)
        if size is None or stride is None:
            return True  # no example value: taken as traced
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


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


def on_real_tensors(tensors) -> bool:
    """Plain tensors, no dispatch mode on: a call at run time, not in a trace."""
    return torch._C._len_torch_dispatch_stack() == 0 and all(
        type(t) in (torch.Tensor, torch.nn.Parameter) for t in tensors)


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


FAKE_TENSOR_LOGGER = "torch._subclasses.fake_tensor"  # the logger that prints a shape error's traceback


@contextlib.contextmanager
def fake_tensor_log_quiet():
    """A shape error in the model (a Linear given the wrong width) fails a
    fake kernel: torch's fake tensor logger prints the kernel's traceback at
    ERROR level before the exception, which the export reports itself (an
    ExportError naming the call and the line, the original chained)."""
    import logging

    logger = logging.getLogger(FAKE_TENSOR_LOGGER)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def placeholders_without_stack_traces():
    """make_fx's placeholders made without a captured Python stack each: the
    tracer keeps only the frames of a ``forward`` (none while it makes the
    inputs: the stack shows the exporter's code), so every capture is thrown
    away, at ~0.1 ms a parameter."""
    def replacement(original):
        def create_args_for_root(tracer, *args, **kwargs):
            recording = tracer.record_stack_traces
            tracer.record_stack_traces = False
            try:
                return original(tracer, *args, **kwargs)
            finally:
                tracer.record_stack_traces = recording
        return create_args_for_root
    return patched(torch.fx.Tracer, "create_args_for_root", replacement)


def state_tables(module: torch.nn.Module) -> tuple[dict, dict]:
    """The dicts holding a module's own parameters and buffers, by name (writable in place)."""
    return module._parameters, module._buffers


def has_own_hooks(module: torch.nn.Module) -> bool:
    """Does ``module`` itself have forward or backward hooks (not global ones)?"""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or getattr(module, "_backward_pre_hooks", None))


def rng_freezing_owners() -> list:
    """The modules ``freeze_rng_state`` (torch's test helper, which forks the
    generator under ``no_dispatch``, out of the trace's sight) lives in:
    ``torch.testing._utils``, and ``common_utils`` where it is loaded (it
    defines its own in some releases)."""
    import sys

    owners = [m for m in (sys.modules.get("torch.testing._utils"),
                          sys.modules.get("torch.testing._internal.common_utils"))
              if m is not None and hasattr(m, "freeze_rng_state")]
    return owners


def vmap_entry() -> tuple[object, str]:
    """(module, name) of functorch's vmap implementation, which every
    ``torch.vmap`` / ``torch.func.vmap`` call reaches (however it was imported)."""
    import torch._functorch.apis as apis

    return apis, "vmap_impl"


def pre_dispatch_tracing() -> bool:
    """Is a pre-dispatch trace (its proxy or functional mode) running?"""
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch

    return _len_torch_dispatch_stack_pre_dispatch() > 0


@contextlib.contextmanager
def pre_dispatch_modes_below_batching(on_op):
    """The pre-dispatch trace's modes (functionalization, make_fx's proxy)
    moved to the ordinary mode stack, below functorch's batching rules, and
    ``on_op(func, args, kwargs, out)`` told of each op above them: a
    ``torch.vmap`` run inside batches first, and the trace records the
    batched ops on whole tensors, as ``make_fx(vmap(f))`` does (on the
    PreDispatch key, above the batching, it would record ops on BatchedTensors,
    which a functional tensor cannot be wrapped in). Put back in ``finally``."""
    from torch._ops import _len_torch_dispatch_stack_pre_dispatch, _pop_mode_from_pre_dispatch
    from torch.utils._python_dispatch import TorchDispatchMode, _pop_mode, _push_mode

    class Watching(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            on_op(func, args, kwargs or {}, out)
            return out

    modes = []
    while _len_torch_dispatch_stack_pre_dispatch() > 0:
        modes.append(_pop_mode_from_pre_dispatch())  # innermost first
    keys = [m._dispatch_key for m in modes]
    pushed = []
    try:
        for m in reversed(modes):
            m._dispatch_key = None  # an ordinary mode while it is on the ordinary stack
            _push_mode(m)
            pushed.append(m)
        with Watching():
            yield
    finally:
        for m in reversed(pushed):
            _pop_mode(m._mode_key)
        for m, key in zip(reversed(modes), reversed(keys)):
            m._dispatch_key = key
            _push_mode(m)


@contextlib.contextmanager
def script_functions_run_as_scripted():
    """While the forward is traced, a ``torch.jit.script`` function it calls
    runs its Python source (torch's tensors wrapped for tracing make the
    ScriptFunction call its ``_torchdynamo_inline``), where eager runs its
    TorchScript: ``torch.jit.is_scripting()`` reads True inside it there, as
    TorchScript compiles it. A ``torch.jit.trace`` function (also a
    ScriptFunction, not in script's cache) traced its source with it False."""
    from torch import _jit_internal
    from torch.jit import _state

    def scripted(fn) -> bool:
        source = getattr(fn, "_torchdynamo_inline", None)
        return source is not None and _state._jit_caching_layer.get(source) == fn.qualified_name

    def call(original):
        def run(fn, *args, **kwargs):
            if not scripted(fn):
                return original(fn, *args, **kwargs)
            with patched(_jit_internal, "is_scripting", lambda _: lambda: True), \
                    patched(torch.jit, "is_scripting", lambda _: lambda: True):
                return original(fn, *args, **kwargs)
        return run

    with patched(torch._C.ScriptFunction, "__call__", call):
        yield


@contextlib.contextmanager
def script_object_method_results(check):
    """While the forward is traced, each method a script object's (torchbind's)
    fake runs gives its result to ``check(method_name, result)`` (which may raise)."""
    from torch._library.fake_class_registry import FakeScriptMethod

    def call(original):
        def run(method, *args, **kwargs):
            result = original(method, *args, **kwargs)
            check(method.method_name, result)
            return result
        return run

    with patched(FakeScriptMethod, "__call__", call):
        yield
