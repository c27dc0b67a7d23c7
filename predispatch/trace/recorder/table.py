"""The recorder's table of contents: the rules every torch call it sees walks, in order.

The recorder's table of contents: every torch call the recorder sees is
walked down :data:`RULES`, in order. A rule whose ``matches(state, call)``
holds runs its ``handle(state, call)``, which either answers the call
(``ANSWERS``: its result is the call's), notes something and lets the call
go on down the table (``NOTES``), hands the rest of the table another
call (``REWRITES``: ``t.data`` goes on as ``t.detach()``), or does that and
runs something after the rest has answered it (``WRAPS``: a draw from a
generator made in the forward, under that generator's state). The last rule
answers every call that gets that far."""
from __future__ import annotations

import dataclasses
from typing import Callable

from . import data, detached, draws, foreach, generators, grad_blocks, leaves, renorm, spans, traced_call, views
from .state import TorchCall, TraceState

ANSWERS, NOTES, REWRITES, WRAPS = "answers", "notes", "rewrites", "wraps"


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str  # the event it handles, as the user's code makes it
    matches: Callable[[TraceState, TorchCall], bool]
    handle: Callable[[TraceState, TorchCall], object]
    then: str  # ANSWERS, NOTES, REWRITES or WRAPS


RULES = (
    # a grad-mode change no torch-function mode saw is marked before any other call
    Rule("hidden grad block", grad_blocks.is_not_a_marker, grad_blocks.sync_before_call, NOTES),
    Rule("t.data = value", data.assigns_data, data.assign_data, ANSWERS),
    Rule("t.data", data.reads_data, data.as_detach, WRAPS),
    Rule("in-place write of a parameter, buffer or input", data.writes_state, data.note_state_write, NOTES),
    Rule("torch._foreach_*_() of one memory twice", foreach.writes_one_memory_twice, foreach.refuse, NOTES),
    Rule("t.detach_() / t.requires_grad_(False)", leaves.drops_autograd, leaves.refuse_dropping_autograd_of_state,
         NOTES),
    Rule("t.requires_grad_()", leaves.sets_requires_grad, leaves.require_grad, ANSWERS),
    Rule("t.retain_grad()", leaves.retains_grad, leaves.skip_retain_grad, ANSWERS),
    Rule("host random draw passed", draws.is_pending, draws.note_passed, NOTES),
    Rule("draw from a generator made in the forward", generators.draws_from_forward_generator,
         generators.draw_under_its_state, WRAPS),
    Rule("grad-mode marker", grad_blocks.is_marker, grad_blocks.on_marker, ANSWERS),
    Rule("F.embedding(max_norm=)", renorm.is_renorming_lookup, renorm.lookup_renorming_visibly, ANSWERS),
    Rule("use in a no_grad span", spans.in_no_grad_span, spans.note_call_tensors, NOTES),
    Rule("detached alias updated", detached.updates_detached_alias, detached.mutate_detached_alias, ANSWERS),
    Rule("read after a grad marker", views.is_after_a_grad_marker, views.bring_call_up_to_date, NOTES),
    Rule("any other call", traced_call.always, traced_call.call_as_traced, ANSWERS),
)


def handle(state: TraceState, call: TorchCall):
    """``call`` walked down the table: what the first answering rule returns."""
    afters = []  # what the wrapping rules run once the call is answered, innermost last
    try:
        for rule in RULES:
            if not rule.matches(state, call):
                continue
            result = rule.handle(state, call)
            if rule.then == ANSWERS:
                return result
            if rule.then == REWRITES:
                call = result
            if rule.then == WRAPS:
                call, after = result
                afters.append(after)
    finally:
        for after in reversed(afters):
            after()
    raise AssertionError("the recorder's last rule answers every call")
