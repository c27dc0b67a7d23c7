"""View replays given the history eager's view has.

Functionalization replays a view of a written tensor from its base, lazily,
wherever it is next read, in whatever grad mode holds there; eager's view
has the history of the mode it was made in, or regenerates it from its
base. The recorder notes each replay with how eager's view was made; here:

* a view made in grad mode, or a caller's view among the inputs, or a view
  eager regenerates (any mode), replayed in the caller's mode: the replay
  runs in an enable_grad block (:func:`replay_in_grad_mode`);
* a view made in the caller's mode, replayed inside a grad block after
  writes autograd did not see: the replay keeps the view's history as made
  (:func:`keep_callers_mode_view_histories`);
* a view made under no_grad, replayed in grad mode: it reads its base
  detached (:func:`detach_no_grad_view_replays`).
"""
from __future__ import annotations

import torch
import torch.fx

from ... import _torch
from ...ir.meta_keys import GRAD_BLOCK
from ...ir.ops import KEEP_HISTORY
from ...ir.records import Kind
from .facts import NO_HISTORY, Facts, chain, is_view

# eager's view has its history in any mode: the caller's views among its inputs (and the
# synthetic base they are seen through), the regenerated
_ANY_MODE = (Kind.INPUT_VIEW, Kind.SYNTHETIC_BASE, Kind.REGENERATED_VIEW)
# the replays :func:`replay_in_grad_mode` may place in an enable_grad block
REPLAYED_IN_GRAD_MODE = (Kind.GRAD_VIEW, *_ANY_MODE)


def replay_in_grad_mode(facts: Facts) -> None:
    """Replays of views made with grad on (the caller's views among its
    inputs too, and the views whose history eager regenerates), read in the
    caller's mode, run in an enable_grad block placed around them. Under a
    no_grad caller eager's view keeps its history (its base's, even when the
    base was written under no_grad); a replay under no_grad has none."""
    notes = facts.notes
    replays = notes.nodes(facts.graph, *REPLAYED_IN_GRAD_MODE)
    if not replays:
        return
    modes = facts.modes
    in_callers_mode = [n for n in replays if modes.get(n) is None and (
        notes.has(n, *_ANY_MODE) or modes.get(notes.of(n, Kind.GRAD_VIEW).of) is True)]
    for i, run in enumerate(_runs(in_callers_mode)):
        _enable_grad_around(facts, run, i)
    facts.changed()


def _enable_grad_around(facts: Facts, run: list, i: int) -> None:
    graph = facts.graph
    with graph.inserting_before(run[0]):
        enter = graph.call_function(_torch.SET_GRAD_ENABLED, (True,))
    with graph.inserting_after(run[-1]):
        exit = graph.call_function(_torch.SET_GRAD_ENABLED, (True,))
    enter.meta[GRAD_BLOCK] = ("enter", ("view replay", i), None)
    exit.meta[GRAD_BLOCK] = ("exit", ("view replay", i), None)
    for key in ("stack_trace", "nn_module_stack"):
        if key in run[0].meta:
            enter.meta[key] = run[0].meta[key]
    facts.replay_blocks.update((enter, exit))


def _runs(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """``nodes`` (in graph order) as runs of consecutive graph nodes."""
    runs = []
    for node in nodes:
        if runs and runs[-1][-1].next is node:
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def keep_callers_mode_view_histories(facts: Facts) -> None:
    """A view made in the caller's grad mode, replayed inside a grad block
    (its base's memory was written since): where no write changed the base's
    history (each was out of autograd's sight, the base's value a kept
    history), eager's view keeps the history it was made with, none under a
    no_grad caller, and the replay reads ``keep_history(view as made,
    replay)``. (After a write autograd saw, eager regenerates the view's
    history from its base's, as the replay does, or under a no_grad caller
    raises.)"""
    graph, notes = facts.graph, facts.notes
    inserted = False
    for replay in notes.nodes(graph, Kind.VIEW_REPLAY):
        made = notes.of(replay, Kind.VIEW_REPLAY).of
        if not (facts.alive(made) and facts.modes.get(replay) is True):
            continue
        made, replay = _callers_mode_part(made, replay, facts.modes)
        if made is None or made is replay or not is_view(made) or not (
                _same_meta(made, replay) and _history_root(made) is _history_root(replay)):
            continue
        with graph.inserting_after(replay):
            kept = graph.call_function(KEEP_HISTORY, (made, replay))
        kept.meta.update({k: v for k, v in replay.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
        replay.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)
        inserted = True
    if inserted:
        facts.changed()


def _callers_mode_part(made: torch.fx.Node, replay: torch.fx.Node, modes: dict):
    """The outermost view of the chain ``made`` (a view of a view ...) made in
    the caller's mode, and its replay in ``replay``'s chain; (None, None) if
    none was. A view made of a replay that keeps its history as made (an
    earlier replay's keep) was made of that view as made."""
    made_views = [n for n in chain(made, lambda n: is_view(n) or n.target is KEEP_HISTORY)
                  if n.target is not KEEP_HISTORY]
    for m, r in zip(made_views, chain(replay, is_view)):
        if modes.get(m) is None:
            return m, r
        if not (m.op == r.op == "call_function" and m.target is r.target and m.args and is_view(m)
                and m.args[1:] == r.args[1:] and isinstance(m.args[0], torch.fx.Node)
                and isinstance(r.args[0], torch.fx.Node)):
            return None, None
    return None, None


def _history_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose history ``node``'s is, through views and kept histories."""
    return chain(node, lambda n: n.target is KEEP_HISTORY or is_view(n))[-1]


def _same_meta(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype)


def detach_no_grad_view_replays(facts: Facts) -> None:
    """A view made under no_grad, and every view of it, has no history in
    eager. Functionalization may replay one from its base in grad mode (when
    it is read, or returned); the replay reads the base's value, which may
    have a history: it reads ``detach(base)``."""
    graph, notes = facts.graph, facts.notes
    replays = notes.nodes(graph, Kind.NO_GRAD_VIEW)
    may_grad = facts.may_grad() if replays else set()
    detached = {}
    for node in replays:
        for base in node.all_input_nodes:
            if notes.has(base, Kind.NO_GRAD_VIEW) or base not in may_grad:
                continue
            if base not in detached:
                with graph.inserting_before(node):
                    detached[base] = graph.call_function(NO_HISTORY[0], (base,))
                detached[base].meta.update(
                    {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
                detached[base].meta["val"] = base.meta.get("val")
            node.replace_input_with(base, detached[base])
    if detached:
        facts.changed()
