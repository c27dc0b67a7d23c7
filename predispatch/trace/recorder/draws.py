"""Host random draws passed to a torch call: read, so refused where they change the program.

Host random draws (:mod:`predispatch.trace.host_random`): a draw of
Python's or numpy's generator passed to torch is read there, so each torch
call's arguments are looked at while a draw is pending."""
from __future__ import annotations

from .state import TorchCall, TraceState


def is_pending(state: TraceState, call: TorchCall) -> bool:
    return state.draws is not None and state.draws.pending


def note_passed(state: TraceState, call: TorchCall) -> None:
    state.draws.note_torch_call(call.args, call.kwargs)
