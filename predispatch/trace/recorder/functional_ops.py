"""Each op functionalization sees: grad mode synced, the tensors it writes noted.

Each op functionalization sees (:func:`.observing.observing_ops`), before
it runs: a grad-mode change no torch-function mode saw is marked first, and
the tensors it writes are noted (for the span or segment they are written
in, and where a set_() made their memory shared)."""
from __future__ import annotations

from . import spans, swaps
from .grad_blocks import sync_grad_mode
from .state import TraceState


def before_functional_op(state: TraceState, func, written) -> None:
    """Before ``func`` runs (``written``: the tensors it writes)."""
    sync_grad_mode(state)
    if written:
        if state.swapped:
            swaps.note_swap_updates(state, func, written)
        spans.note_written(state, written)
