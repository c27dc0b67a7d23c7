"""How a program's regions run: exception-safe, and cheap.

torch's ``wrap_with_set_grad_enabled`` restores grad mode without ``finally``
(an exception inside a region leaks its mode to the caller, against G7:
only a bare switch's region leaves its mode, as eager's switch does) and
both region ops build a dynamo-disabled wrapper per call. Installed when
predispatch is imported (:func:`install_region_runtime`), their calls run
the region's body in a :class:`GradBlock` or an autocast state set and
restored in ``finally``; under dynamo, torch's own calls run (dynamo knows
those). A program exported again is traced through its regions: the
recorder sees a GradBlock's enter and exit as a grad-mode block's (the seam
knows its code: :func:`predispatch._torch.register_grad_mode_block`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .. import _torch
from ..ir.bodies import call_body
from ..ir.meta_keys import SWITCH_REGION

_set_grad_enabled = _torch.SET_GRAD_ENABLED  # bound once: a region runs per call of the program


class GradBlock:
    """The cheapest exception-safe grad-mode block (a region runs in one)."""

    __slots__ = ("enable", "prev")

    def __init__(self, enable: bool):
        self.enable = enable

    def __enter__(self):
        self.prev = torch.is_grad_enabled()
        _set_grad_enabled(self.enable)

    def __exit__(self, *exc):
        _set_grad_enabled(self.prev)


def _exception_safe_call(self, enable_grad, wrapped_func, *args, **kwargs):
    if torch.compiler.is_dynamo_compiling():  # dynamo knows torch's own call, not this one
        torch_call = _torch.TORCH_REGION_CALLS[_torch.WrapWithSetGradEnabled]
        return torch_call(self, enable_grad, wrapped_func, *args, **kwargs)
    if _torch.torch_function_mode_enabled():  # being traced: the recorder reads GradBlock's frames
        with GradBlock(enable_grad):
            return wrapped_func(*args, **kwargs)
    prev = torch.is_grad_enabled()
    _set_grad_enabled(enable_grad)
    try:
        out = call_body(wrapped_func, args, kwargs)
    except BaseException:
        if not _opened_by_a_switch(wrapped_func):
            _set_grad_enabled(prev)
        raise
    _set_grad_enabled(prev)
    return out


def _opened_by_a_switch(submodule) -> bool:
    """A bare switch's region: eager restores no mode when an exception
    leaves it (a block's region restores it, as the block's ``__exit__``)."""
    return getattr(submodule, "meta", {}).get(SWITCH_REGION, False)


@functools.lru_cache(maxsize=64)
def _validated_autocast(device_type, dtype, enabled, cache_enabled):
    """What torch.autocast makes of these arguments (its checks may disable it)."""
    a = torch.autocast(device_type, dtype, enabled, cache_enabled)
    return a.device, a.fast_dtype, a._enabled, a._cache_enabled


def _autocast_call(self, device_type, dtype, enabled, cache_enabled, wrapped_func, *args, **kwargs):
    if torch.compiler.is_dynamo_compiling():
        return _torch.TORCH_REGION_CALLS[_torch.WrapWithAutocast](
            self, device_type, dtype, enabled, cache_enabled, wrapped_func, *args, **kwargs)
    if _torch.torch_function_mode_enabled():  # being traced: torch.autocast records itself
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
        return call_body(wrapped_func, args, kwargs)
    finally:
        if torch.autocast_decrement_nesting() == 0:
            torch.clear_autocast_cache()
        torch.set_autocast_enabled(device, prev[0])
        torch.set_autocast_dtype(device, prev[1])
        torch.set_autocast_cache_enabled(prev[2])


def install_region_runtime() -> None:
    """Run regions exception-safely and cheaply (torch's HOPs restore grad mode
    without `finally` and build a dynamo-disabled wrapper per call)."""
    _torch.WrapWithSetGradEnabled.__call__ = _exception_safe_call
    _torch.WrapWithAutocast.__call__ = _autocast_call


@contextlib.contextmanager
def torch_region_runtime():
    """torch's own region calls, for a while (the benchmark's reference)."""
    ours = {cls: cls.__call__ for cls in _torch.TORCH_REGION_CALLS}
    for cls, call in _torch.TORCH_REGION_CALLS.items():
        cls.__call__ = call
    try:
        yield
    finally:
        for cls, call in ours.items():
            cls.__call__ = call


_torch.register_grad_mode_block(GradBlock)
