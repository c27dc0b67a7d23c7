"""The recorder: a torch-function mode inside the traced forward, walking the table.

The recorder: a torch-function mode pushed inside the traced forward that
hands each torch call, with the state of one forward, down the table of
:mod:`.table`, and follows eager's layouts around it
(:mod:`predispatch.trace.eager_layout`)."""
from __future__ import annotations

import torch

from ... import _torch
from .. import eager_layout
from . import marks, spans, swaps, table, views
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
            if eager_layout.relays_in_place(func, args, out):
                views.note_relayout(state, args[0])
            return out
        finally:
            state.call = outer_call

    def reuse_mark(self):
        """What a layer traced once and stamped later (:mod:`predispatch.trace.layer_reuse`)
        must leave as it found it; None where the recorder's state allows no
        reuse now (under no_grad, after a leaf, inside a hidden block, with a
        host random draw pending); a layer that draws from a generator made
        in the forward changes its state, which a stamp would not."""
        state = self.state
        if (state.watch is not None or state.reads_through or state.hidden_blocks or not torch.is_grad_enabled()
                or (state.draws is not None and state.draws.pending)):
            return None
        r = state.record
        return (r.writes(), len(r.needed), len(state.block_ids), state.bare_switches,
                state.after_a_grad_marker, state.any_no_grad_view, state.grad_mode, state.generators.draws)

    def views_made(self) -> int:
        """How many views the recorder has seen made since the last grad-mode marker."""
        return len(self.state.span_views)

    def views_made_since(self, count: int) -> list:
        """The views made since :meth:`views_made` said ``count``."""
        return self.state.span_views[count:]

    def written_so_far(self) -> set:
        """The tensors noted as written in grad mode since the last marker (ids)."""
        return set(self.state.written or ())

    def written_since(self, before: set) -> list:
        """(tensor, its node before its first write, its node now, made by a view op,
        given another's storage) of those noted since ``before``."""
        state = self.state
        return [(t, old, views.current_node(state, t), marks.made_by_a_view(t), marks.SWAPPED.of(t))
                for key, (t, old) in (state.written or {}).items() if key not in before]

    def note_stamped_writes(self, written: list) -> None:
        """What a stamped layer wrote in grad mode (see :func:`.spans.note_settled`)."""
        spans.note_settled(self.state, written)
