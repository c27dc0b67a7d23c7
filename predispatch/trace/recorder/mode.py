"""The recorder: a torch-function mode inside the traced forward, walking the table.

The recorder: a torch-function mode pushed inside the traced forward that
hands each torch call, with the state of one forward, down the table of
:mod:`.table`, and follows eager's layouts around it
(:mod:`predispatch.trace.eager_layout`)."""
from __future__ import annotations

import torch

from ... import _torch
from .. import eager_layout
from . import swaps, table
from .state import TorchCall, TraceState


class Recorder(_torch.TorchFunctionMode):
    def __init__(self, state: TraceState):
        super().__init__()
        self.state = state

    def __torch_function__(self, func, types, args=(), kwargs=None):
        state = self.state
        outer_call, state.call = state.call, (args, kwargs)
        swaps.note_call_start(state, outer_call)
        try:
            eager_layout.refuse_storage_offsets_unlike_eager(func, args, kwargs or {})
            out = table.handle(state, TorchCall(func, args, kwargs or {}, self))
            eager_layout.follow(func, args, kwargs or {}, out)
            return out
        finally:
            state.call = outer_call

    def reuse_mark(self):
        """What a layer traced once and stamped later (:mod:`predispatch.trace.layer_reuse`)
        must leave as it found it; None where the recorder's state allows no
        reuse now (under no_grad, after a leaf, inside a hidden block, with a
        host random draw pending)."""
        state = self.state
        if (state.watch is not None or state.reads_through or state.hidden_blocks or not torch.is_grad_enabled()
                or (state.draws is not None and state.draws.pending)):
            return None
        r = state.record
        return (len(r.replacements), len(r.needed), len(state.block_ids), state.bare_switches,
                len(state.written or ()),
                state.after_a_grad_marker, state.any_no_grad_view, state.grad_mode)
