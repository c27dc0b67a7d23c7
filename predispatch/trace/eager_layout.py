"""Eager's layouts of the inputs a forward relays, kept on meta shadows.

An input given another layout or storage (``t_()``, ``resize_()``,
``set_()``) is written back as eager left it: its size, strides and storage
offset, counted from where its storage's owner starts. Functionalization's
inner tensors do not keep that: an update replaces a storage's base by a
fresh tensor (offset 0, its own strides), and views are replayed from it,
so an input that starts at offset 4 (``f(y[1:3])``) reads as one at 0.

So each input gets a shadow: a meta tensor laid out as the input, sharing a
meta storage with the inputs that share memory. The recorder runs each view
op and each layout change of a shadowed tensor on the shadows too (on meta:
eager's own layout rules, no data), and ``set_()`` sets the shadow to the
source's. A tensor without a shadow (memory the forward made) has none: its
layout is functionalization's, in a storage of its own.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from .. import _torch
from . import input_aliasing
from ..errors import ExportError, user_location

_SHADOW = "_predispatch_eager_layout"
# in-place ops that change a tensor's layout, not its values (set_: see set_to)
_LAYOUT_CHANGES = frozenset({"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_",
                             "as_strided_", "resize_", "resize_as_"})


@dataclasses.dataclass(frozen=True)
class Start:
    """The inputs' shadows as the forward got them: which storage each used
    (None: not shadowed) and where it started in it."""

    storages: list
    offsets: list


def shadow_inputs(inputs: list, shifts: dict | None = None) -> Start:
    """Give each traced input with concrete sizes a shadow; inputs sharing
    functional storage share one meta storage. ``shifts``: input position ->
    how far into eager's storage functionalization's starts (inputs seen
    through a synthetic base, which holds the memory from their first element)."""
    with _unseen():
        return _shadow_inputs(inputs, shifts or {})


def _shadow_inputs(inputs: list, shifts: dict) -> Start:
    storages, offsets, meta = [], [], {}
    for i, t in enumerate(inputs):
        layout = _concrete_layout(t) if isinstance(t, _torch.FunctionalTensor) else None
        if layout is None:
            storages.append(None)
            offsets.append(None)
            continue
        size, stride, offset = layout
        offset += shifts.get(i, 0)
        key = _torch.storage_of(t)
        if key not in meta:
            meta[key] = torch.empty(0, dtype=torch.uint8, device="meta").untyped_storage()
        needed = _torch.storage_extent(size, stride, offset) * t.element_size()
        if meta[key].nbytes() < needed:
            meta[key].resize_(needed)
        shadow = torch.empty(0, dtype=t.dtype, device="meta").set_(meta[key], offset, size, stride)
        setattr(t, _SHADOW, shadow)
        storages.append(input_aliasing.storage(shadow))
        offsets.append(offset)
    return Start(storages, offsets)


def of(t: torch.Tensor) -> tuple[tuple, tuple, int, object] | None:
    """Eager's (size, strides, storage offset, storage) of ``t``, if shadowed
    (and the shadow saw every change: its size is functionalization's)."""
    shadow = getattr(t, _SHADOW, None)
    if shadow is None or tuple(shadow.size()) != _torch.layout(t)[0]:
        return None
    return tuple(shadow.size()), tuple(shadow.stride()), shadow.storage_offset(), input_aliasing.storage(shadow)


def follow(func, args, kwargs, out) -> None:
    """After the module's call ``func(*args, **kwargs) -> out``: a view of a
    shadowed tensor gets the shadow's view, a layout change in place changes
    the shadow (a view op's first argument is the tensor it views)."""
    if not args or _IN_FUNCTIONAL_TERMS or getattr(args[0], _SHADOW, None) is None:
        return
    name = getattr(func, "__name__", None)
    if out is args[0] and name not in _LAYOUT_CHANGES:
        return  # a data update, or the tensor itself (x.float() of a float)
    source = _torch.storage_of(args[0])
    outs = [o for o in _torch.pytree.tree_leaves(out) if isinstance(o, _torch.FunctionalTensor)]
    if out is not args[0] and not any(_torch.storage_of(o) == source for o in outs):
        return  # new memory: no view
    try:
        shadow_out = _on_shadows(func, args, kwargs)
    except Exception:  # noqa: BLE001 (no eager layout known: functionalization's stands)
        for o in outs:
            _drop(o)
        return
    if out is args[0]:
        return  # the shadow changed in place
    for o, s in zip(outs, [s for s in _torch.pytree.tree_leaves(shadow_out) if isinstance(s, torch.Tensor)]):
        if _torch.storage_of(o) == source and s.device.type == "meta":
            setattr(o, _SHADOW, s)
        else:
            _drop(o)


def refuse_storage_offsets_unlike_eager(func, args, kwargs) -> None:
    """Before the module's call: an explicit storage offset (``as_strided``)
    counts from the start of eager's storage; functionalization counts from
    its own base, which an update replaces (an input at offset 4 then starts
    at 0): refused where the two differ."""
    name = getattr(func, "__name__", None)
    if name not in ("as_strided", "as_strided_") or not args or _IN_FUNCTIONAL_TERMS or (
            getattr(args[0], _SHADOW, None) is None):
        return
    offset = args[3] if len(args) > 3 else kwargs.get("storage_offset")
    if offset is None:
        return
    if getattr(args[0], _SHADOW).storage_offset() != _torch.layout(args[0])[2]:
        raise ExportError(
            f"{name}() with a storage offset at {user_location()}: the tensor's storage starts "
            "where the trace cannot count from as eager does (an input that is a view into a larger "
            "storage, updated before); pass a tensor that starts its own storage (a clone), or use "
            "view ops")


@contextlib.contextmanager
def in_functional_terms():
    """Layout calls made by predispatch in functionalization's own terms:
    not the module's (their offsets count from functionalization's base)."""
    global _IN_FUNCTIONAL_TERMS
    before, _IN_FUNCTIONAL_TERMS = _IN_FUNCTIONAL_TERMS, True
    try:
        yield
    finally:
        _IN_FUNCTIONAL_TERMS = before


_IN_FUNCTIONAL_TERMS = False


def set_to(t: torch.Tensor, source: torch.Tensor | None) -> None:
    """``t.set_(source)``: ``t`` takes ``source``'s storage and layout (None:
    memory that is no tensor's)."""
    shadow = getattr(source, _SHADOW, None)
    if shadow is None:
        _drop(t)
        return
    mine = getattr(t, _SHADOW, None)
    with _unseen():
        if mine is None or mine.dtype != shadow.dtype:
            mine = torch.empty(0, dtype=shadow.dtype, device="meta")
            setattr(t, _SHADOW, mine)
        mine.set_(shadow)


def _drop(t) -> None:
    if hasattr(t, _SHADOW):
        delattr(t, _SHADOW)


def _on_shadows(func, args, kwargs):
    """``func`` run on the shadows (a tensor without one: a meta tensor laid out as it)."""
    def shadow(a):
        if not isinstance(a, torch.Tensor):
            return a
        s = getattr(a, _SHADOW, None)
        if s is not None:
            return s
        layout = _concrete_layout(a)
        if layout is None:
            raise ValueError("symbolic layout")
        return torch.empty_strided(layout[0], layout[1], dtype=a.dtype, device="meta")

    with _unseen():
        args, kwargs = _torch.pytree.tree_map(shadow, (args, kwargs))
        return func(*args, **kwargs)


@contextlib.contextmanager
def _unseen():
    """Meta work no mode traces (the shadows are not the program's)."""
    with _torch.outer_trace_suspended(None), torch.no_grad():
        yield


def _concrete_layout(t) -> tuple[tuple, tuple, int] | None:
    """``t``'s (wrapper's) size, strides and storage offset, None where symbolic."""
    with _torch.torch_function_disabled():
        layout = (tuple(t.size()), tuple(t.stride()), t.storage_offset())
    if not all(isinstance(v, int) for v in (*layout[0], *layout[1], layout[2])):
        return None
    return layout


def relays_in_place(func, args, out) -> bool:
    """Did ``func(*args) -> out`` change its first argument's layout in place
    (``t_()``, ``transpose_``, ``unsqueeze_``, ``as_strided_``, ``resize_``, ...)?"""
    return bool(args) and out is args[0] and getattr(func, "__name__", None) in _LAYOUT_CHANGES
