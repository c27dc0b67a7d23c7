"""The history stage: every value a program reads has the autograd history eager's tensor has.

The model. In eager a tensor is a value and a history (its ``grad_fn``).
The functional graph computes the values; run under autograd, each node
also gets a history from the op that made it, in the grad mode it runs in.
The two agree except where eager changes a tensor's value out of
autograd's sight, or regenerates a history functionalization does not:

* a write under no_grad, through a detached alias, or in the caller's mode
  under a no_grad caller: eager's tensor keeps its old history, the graph's
  new value has none. Later reads get ``keep_history(old, new)`` (in the
  caller's mode ``keep_history_if_no_grad``): ``new``'s value, ``old``'s
  history (:mod:`.keep`);
* a view, replayed by functionalization wherever it is next read: eager's
  has the history of the mode it was made in, or regenerates it from its
  base (:mod:`.views`);
* the recorder's reads through an op (a leaf made in the forward, a
  detached alias's or a set_() target's own history) that end up carrying
  nothing (:mod:`.reads`);
* what no program can reproduce (a history kept for another shape than
  eager's gradient takes, a view regenerated through a new layout, a value
  saved for backward written through shared memory): refused, from one
  table (:mod:`.refusals`).

What the recorder saw is its list of typed events
(:class:`~predispatch.ir.records.Event`); what every decision reads is
gathered in :class:`~.facts.Facts`. The stage is :data:`STEPS`, in order.
A new kind of mutation takes a :class:`~predispatch.ir.records.Kind`, the
recorder's rule that notes it (trace/recorder/table.py), and here a row of
:data:`.keep.KEEPERS` where its old history must be kept, a row of
:data:`.refusals.REFUSALS` where no program can reproduce it.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from ...ir.records import Event, Kind, TraceRecord
from . import keep, reads, refusals, views
from .facts import Facts


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[Facts], None]


def _keep_written_histories(facts: Facts) -> None:
    """Each write's old history kept (refusing, before each, what its views
    cannot get), then each history kept checked, the recorder's reads of a
    set_() target's own history with them."""
    kept = keep.keep_written_histories(facts)
    for k in kept + reads.own_history_reads(facts):
        refusals.refuse(refusals.ONCE_KEPT, k, facts)
    facts.changed()


def _refuse_what_no_program_reproduces(facts: Facts) -> None:
    """Writes of values saved for backward, inputs linked to a history,
    views regenerated past their memory, covers written back as their
    memory started, views of inputs given another shape."""
    notes = facts.notes
    for event in notes.saved_value_updates:
        refusals.refuse(refusals.ONCE_DONE, event, facts)
    for event in notes.links_by_set:
        refusals.refuse(refusals.ONCE_DONE, event, facts)
    for node in notes.nodes(facts.graph, Kind.REGENERATED_VIEW):  # a view's history regenerated past its memory
        refusals.refuse(refusals.ONCE_DONE, notes.of(node, Kind.REGENERATED_VIEW), facts)
    as_started = [k for k, layout in facts.layouts.items() if layout.get("as_started")]
    placeholders = _user_input_placeholders(facts) if as_started else {}
    for key in as_started:
        kind, _, i = key.partition(":")
        if kind == "input" and (node := placeholders.get(int(i))) is not None:
            refusals.refuse(refusals.ONCE_DONE, Event(Kind.RELAYOUT, node, input=key), facts)
    relaid = _relaid_covers(facts)
    if relaid:  # the caller's views of them: as the trace made them, and as given (returned as they are)
        views = [notes.of(node, Kind.INPUT_VIEW) for node in notes.nodes(facts.graph, Kind.INPUT_VIEW)]
        given = [Event(Kind.INPUT_VIEW, node) for node, cover in relaid.items() if node is not cover]
        for event in views + given:
            refusals.refuse(refusals.ONCE_DONE, event, facts, relaid)


def _relaid_covers(facts: Facts) -> dict:
    """The placeholders of user inputs other inputs view that the forward
    gave another shape, or other memory (set_()), and of the inputs viewing
    them -> the cover's placeholder."""
    placeholders = _user_input_placeholders(facts) if facts.input_views else {}
    relaid = {}
    for j, view in facts.input_views.items():
        layout = facts.layouts.get(f"input:{view.of}", {})
        cover = placeholders.get(view.of)
        if cover is not None and _relaid(layout, cover.meta["val"]):
            relaid[cover] = cover
            if (node := placeholders.get(j)) is not None and node is not cover:
                relaid[node] = cover
    return relaid


def _user_input_placeholders(facts: Facts) -> dict[int, torch.fx.Node]:
    """User input position -> its placeholder (where the graph still has one)."""
    by_name = {n.name: n for n in facts.graph.nodes if n.op == "placeholder"}
    return {i: by_name[name] for i, name in enumerate(facts.signature.user_inputs) if name in by_name}


def _relaid(layout: dict, val) -> bool:
    """Does ``layout`` (a LayoutChange's) give the tensor ``val`` was another
    shape, or other memory where it lies otherwise than it did (a view of it
    then regenerates its history through another layout)?"""
    if layout.get("size") is None:
        return False
    if tuple(layout["size"]) != tuple(val.shape):
        return True
    return layout.get("storage", "own") != "own" and (tuple(layout["stride"]), layout["offset"]) != (
        tuple(val.stride()), val.storage_offset())


STEPS = (
    Step("relaid inputs' history as eager gives it", keep.note_relayout_modes),
    Step("views made with grad on replayed in grad mode", views.replay_in_grad_mode),
    Step("writes' old histories kept", _keep_written_histories),
    Step("caller's-mode keeps read at their history's source", keep.read_kept_histories_at_their_source),
    Step("views made in the caller's mode keep their history", views.keep_callers_mode_view_histories),
    Step("views made under no_grad replayed without a history", views.detach_no_grad_view_replays),
    Step("own histories with nothing to carry dropped", reads.drop_historyless_own_reads),
    Step("what no program reproduces refused", _refuse_what_no_program_reproduces),
    Step("leaves no output shows dropped", reads.drop_unseen_leaves),
)


def keep_histories(gm: torch.fx.GraphModule, signature, record: TraceRecord, module: torch.nn.Module) -> None:
    """The stage on ``gm``, the graph the capture stage made with ``signature``
    and ``record``, of ``module`` (whose parameters say which require grad)."""
    facts = Facts.of(gm, signature, record, module)
    for step in STEPS:
        step.run(facts)
