"""``t.data`` and ``t.data = v``: a detached alias, a storage swap.

``t.data``: a detached alias for which the tracer records no node (the
graph would keep the history). Torch-function modes see the ``data``
attribute's ``__get__`` / ``__set__``: a read is traced as ``t.detach()``,
whose node and alias handling are the same; ``t.data = value`` as
``t.set_(value)`` under no_grad (:mod:`.swaps`)."""
from __future__ import annotations

import dataclasses

import torch

from ... import _torch
from ...errors import ExportError, user_location
from . import marks
from .state import TorchCall, TraceState


def assigns_data(state: TraceState, call: TorchCall) -> bool:
    return getattr(call.func, "__self__", None) is _torch.TENSOR_DATA and call.func.__name__ == "__set__"


def reads_data(state: TraceState, call: TorchCall) -> bool:
    return getattr(call.func, "__self__", None) is _torch.TENSOR_DATA


def as_detach(state: TraceState, call: TorchCall):
    """``t.data`` read: the call handled on is ``t.detach()``, its result
    marked a data alias (see :func:`note_state_write`) while it is answered."""
    state.reading_data = True

    def done():
        state.reading_data = False

    return dataclasses.replace(call, func=torch.Tensor.detach, args=call.args[:1]), done


def writes_state(state: TraceState, call: TorchCall) -> bool:
    """An in-place op on (a view of, an alias of) a parameter, buffer or input."""
    return call.in_place and bool(call.args) and isinstance(call.args[0], torch.Tensor) and (
        id(marks.base(call.args[0])) in state.graph_inputs)


def note_state_write(state: TraceState, call: TorchCall) -> None:
    """Which way the tensor is written: through ``.data`` only (eager's alias
    has a version counter of its own: autograd never sees the write, nor
    does a value saved for backward), or otherwise too."""
    key = state.graph_inputs[id(marks.base(call.args[0]))]
    through_data = marks.DATA_ALIAS.of(marks.detach_result(call.args[0]))
    (state.record.written_through_data if through_data else state.record.written_otherwise).add(key)


def assign_data(state: TraceState, call: TorchCall) -> None:
    """``t.data = value`` gives ``t`` ``value``'s memory and layout, keeping
    ``t``'s autograd identity and history: ``t.set_(value)`` under no_grad,
    which is traced as such (of another dtype or device: refused)."""
    t, value = call.args
    if not _swappable(t, value):
        raise ExportError(
            f"assigning Tensor.data at {user_location()} a tensor of another dtype or device "
            "cannot be exported soundly: the tensor changes type under autograd, which a "
            "functional graph cannot express; convert a copy instead")
    with call.recorder, torch.no_grad():  # the recorder is off inside its own handler
        t.set_(value)


def _swappable(t, value) -> bool:
    return isinstance(value, torch.Tensor) and (t.dtype, t.device) == (value.dtype, value.device)
