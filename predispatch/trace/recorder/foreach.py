"""An in-place foreach op given one memory twice: refused.

Eager's ``torch._foreach_mul_([b, b], 2.0)`` writes ``b`` once per entry, each
write reading the last; the functional op computes every entry from the
values before the call, and the write-backs of one memory keep one of them.
"""
from __future__ import annotations

import torch

from ...errors import ExportError, user_location
from ..input_aliasing import share_elements
from .state import TorchCall, TraceState


def writes_one_memory_twice(state: TraceState, call: TorchCall) -> bool:
    name = getattr(call.func, "__name__", "")
    if not (name.startswith("_foreach_") and name.endswith("_")) or not call.args:
        return False
    tensors = [t for t in call.args[0] if isinstance(t, torch.Tensor)] if isinstance(
        call.args[0], (list, tuple)) else []
    return any(a is b or _shared(a, b) for i, a in enumerate(tensors) for b in tensors[:i])


def _shared(a: torch.Tensor, b: torch.Tensor) -> bool:
    try:
        return share_elements(a, b)
    except (RuntimeError, NotImplementedError):  # no storage to compare: taken as shared
        return True


def refuse(state: TraceState, call: TorchCall) -> None:
    raise ExportError(
        f"torch.{call.func.__name__} at {user_location()} is given one tensor (or memory) twice: eager writes "
        "it once per entry, each write reading the last, which the program's functional op cannot; give it "
        "distinct tensors, or write the loop")
