"""FunctionalTensor and its mode: wrapping, unwrapping, and what a wrapper's storage went through."""
from __future__ import annotations

import contextlib
import functools
import sys
import threading

import torch
import torch.fx
from torch._functorch._aot_autograd.functional_utils import (
    are_all_mutations_hidden_from_autograd,
    are_all_mutations_under_no_grad_or_inference_mode,
    has_data_mutation,
)
from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
from torch.fx.experimental import proxy_tensor
from torch.fx.experimental.proxy_tensor import _AttrProxy, get_proxy_mode, get_proxy_slot

from .patching import patched


def current_node(t: torch.Tensor) -> torch.fx.Node | None:
    """The graph node holding the current value of a traced FunctionalTensor
    (a stale view is brought up to date first, in the current grad mode)."""
    if not isinstance(t, FunctionalTensor):
        return None
    torch._sync(t)
    return materialized_node(t)


def replay_if_stale(t: FunctionalTensor) -> None:
    """Functionalization's sync: a view whose base was updated since is
    replayed from it now (in the current grad mode), as at its next use."""
    torch._sync(t)


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


def same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do two plain (or fake) tensors share memory?"""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(a.untyped_storage()) == StorageWeakRef(b.untyped_storage())


def memory_of(t: torch.Tensor):
    """A handle comparing equal for plain (or fake) tensors sharing memory;
    None for a tensor without storage of its own (a subclass, sparse)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    try:
        return StorageWeakRef(t.untyped_storage())
    except (NotImplementedError, RuntimeError):
        return None


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


preserve_version_counter = torch.autograd._unsafe_preserve_version_counter


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


def hold_value_until_written(view: FunctionalTensor, value: FunctionalTensor) -> None:
    """``view`` reads ``value`` (its node) until its memory is next written,
    when functionalization replays it from its base as any view: no write
    (its base is untouched), no node."""
    torch._sync(view)  # a view of an updated base starts out of date: brought up to date first
    torch._sync(value)
    torch._functionalize_replace(view.elem, torch._from_functional_tensor(value.elem))


def apply_pending_updates(t: FunctionalTensor) -> None:
    """Bring ``t`` up to date with the writes made through its aliases
    (functionalization applies them lazily, at the next read)."""
    torch._sync(t)


def functionalizing() -> bool:
    """Is a call seen now one functionalization will see (not one its own
    kernels make below it, on the tensors it unwrapped)?"""
    from torch.utils._python_dispatch import _detect_infra_mode

    return _detect_infra_mode(torch._C._TorchDispatchModeKey.FUNCTIONAL) is not None


def functional_mode() -> FunctionalTensorMode:
    return FunctionalTensorMode(pre_dispatch=True, export=True, _allow_token_discovery=True)


def to_functional(t):
    return FunctionalTensor.to_functional(t) if isinstance(t, torch.Tensor) else t


@contextlib.contextmanager
def symbolic_work_recorded_when_read():
    """While tracing, a SymInt operation inside an op's functionalization
    becomes a graph node when a node reads its result, not when it runs
    (make_fx's thunks, which torch turns off around the module's own code).
    Functionalizing an in-place op runs its meta kernel first, for the
    errors only the in-place op has, and a decomposition checks sizes: with
    symbolic sizes, hundreds of SymInt operations per program that no node
    reads, each recorded (a node, a dispatch-mode switch) and then dropped as
    dead code. torch.export's graph functionalizes nothing."""
    with patched(FunctionalTensorMode, "__torch_dispatch__", _thunked_dispatch), \
            patched(proxy_tensor, "handle_sym_dispatch", _sym_dispatch_unstacked):
        yield


def _sym_dispatch_unstacked(original):
    """make_fx's ``handle_sym_dispatch``, which traces a SymInt operation with
    the proxy mode taken off the mode stack (its own SymInt work is not to be
    traced again) through torch's stack bookkeeping: some 25 Python calls an
    operation, 259 in a 4-block ResNet's export with a dynamic batch (the
    functionalization kernels'). SymNode asks ``get_proxy_mode()`` whether to
    trace, which reads the pre-dispatch proxy mode's slot, and the operation
    runs no tensor op: the slot emptied for it does the same."""
    def handle_sym_dispatch(func, args, kwargs):
        stack = torch._ops.mode_stack_state_for_pre_dispatch()
        mode = stack.get(0)  # the pre-dispatch proxy mode (torch._ops._get_dispatch_mode_pre_dispatch)
        if mode is None:
            return original(func, args, kwargs)
        stack.set(0, None)
        try:
            return mode.__sym_dispatch__(func, [], args, kwargs)
        finally:
            stack.set(0, mode)
    return handle_sym_dispatch


def _thunked_dispatch(dispatch):
    """Replacement of ``FunctionalTensorMode.__torch_dispatch__`` (:func:`symbolic_work_recorded_when_read`)."""
    @functools.wraps(dispatch)
    def run(mode, func, types, args=(), kwargs=None):
        proxy = get_proxy_mode()
        if proxy is None or proxy.tracer.enable_thunkify:
            return dispatch(mode, func, types, args, kwargs)
        proxy.tracer.enable_thunkify = True
        try:
            return dispatch(mode, func, types, args, kwargs)
        finally:
            proxy.tracer.enable_thunkify = False
    return run


# A FunctionalTensor wraps each tensor the trace makes. Its wrapper computes a
# storage size for itself from the sizes and strides, some ten SymInt
# operations when they are symbolic: sympy work, each recorded in the graph by
# make_fx (a node and a dispatch-mode switch) and dropped as dead code at the
# end, for a storage nothing reads. torch.export's graph wraps nothing. While
# predispatch traces, a wrapper of a tensor with a symbolic layout takes the
# wrapped tensor's storage size instead: the same storage, known already.
_wrapping = threading.local()  # .nbytes: the storage size for the wrapper being made


# torch 2.15's FunctionalTensor.__new__ gives its wrapper the wrapped storage's size itself
_SIZED_BY_TORCH = "storage_size" in FunctionalTensor.__new__.__code__.co_varnames


@contextlib.contextmanager
def wrappers_sized_by_wrapped_storage():
    """While tracing, a FunctionalTensor of a tensor with a symbolic layout takes
    the wrapped tensor's storage size (known already: the same storage) instead
    of computing one from its sizes and strides, which make_fx would record as
    dead graph nodes. Where torch does so itself (2.15), nothing is patched."""
    if _SIZED_BY_TORCH:
        yield
        return
    with patched(FunctionalTensor, "__new__", _sized_new), \
            patched(torch.Tensor, "_make_wrapper_subclass", _make_with_known_size):
        yield


def _sized_new(new):
    """Replacement of ``FunctionalTensor.__new__`` (with :func:`_make_with_known_size`)."""
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


def _make_with_known_size(make):
    """Replacement of ``torch.Tensor._make_wrapper_subclass``: a FunctionalTensor
    made in :func:`_sized_new` gets its storage size."""
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


def storage_shared(t: FunctionalTensor) -> bool:
    """Does another traced tensor hold ``t``'s (functional) storage (a view
    of it, its base; ``t``'s own Python handle aside)? Functionalization's
    own check before it lets a resize_ replace a storage."""
    storage = t.elem.untyped_storage()
    return torch._C._storage_Use_Count(storage._cdata) > 2  # t's wrapper and this handle


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


def _async_collective_remap_texts() -> tuple:
    """How torch's collective remapping says it cannot remap an async collective:
    its inline text (2.13, 2.14), or the first clause of the module constant
    (``_ASYNC_OP_REMAP_ERROR``, 2.15), read where it exists."""
    texts = ["Can't remap async version of inplace op to functional collective"]
    collectives = sys.modules.get("torch.distributed._functional_collectives")
    message = getattr(collectives, "_ASYNC_OP_REMAP_ERROR", None) if collectives is not None else None
    if isinstance(message, str):
        texts.append(message.split(" to functional collectives")[0])
    return tuple(texts)


def functionalization_error_kind(error: BaseException) -> str | None:
    """Which of torch's functionalization (and collective-remapping) refusals
    ``error`` is, by the text torch gives it: "non-functional mutation",
    "async collective", "frozen storage", "no_grad view", or None."""
    text = str(error)
    kinds = (("non-functional mutation", ("mutating a non-functional tensor",)),
             ("async collective", _async_collective_remap_texts()),
             ("frozen storage", ("cannot mutate tensors with frozen storage",)),
             ("no_grad view", ("A view was created in no_grad mode and its base or another view of its base "
                               "has been modified",)))
    return next((kind for kind, texts in kinds if any(t in text for t in texts)), None)
