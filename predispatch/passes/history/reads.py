"""The recorder's reads through an op, once histories are kept: own histories and leaves.

The recorder reads some tensors through an op of ours (see
:mod:`predispatch.trace.recorder.leaves`): ``keep_history(own, value)`` for
a tensor whose history is its own (a detached alias written in grad mode, a
set_() target), ``requires_grad(value)`` for a tensor made to require grad
in the forward. Once every write's history is kept, some have nothing to
carry and go; a set_() target's reads are histories kept like the stage's
own (:func:`own_history_reads`), checked as they are.
"""
from __future__ import annotations

import torch
import torch.fx

from ...ir.ops import KEEP_HISTORY, REQUIRES_GRAD
from ...ir.records import Kind
from .facts import NO_HISTORY, Facts, Kept, reach


def own_history_reads(facts: Facts) -> list[Kept]:
    """The recorder's reads of a set_() target's own history (kept across
    later writes of its memory), where it may require grad."""
    reads = [n for n in facts.notes.nodes(facts.graph, Kind.STORAGE_SWAP) if n.target is KEEP_HISTORY]
    may_grad = facts.may_grad() if reads else set()
    return [Kept(Kind.STORAGE_SWAP, n.args[0], n.args[1], tuple(n.users),
                 eager_view=facts.notes.of(n, Kind.STORAGE_SWAP).eager_view, swapped=True)
            for n in reads if n.args[0] in may_grad]


def drop_historyless_own_reads(facts: Facts) -> None:
    """A detached alias's read of its own history (see the recorder's
    ``mutate_detached_alias``) where that history cannot require grad (the
    update's operands did not): the read is the value itself, or, where the
    value may require grad through another tensor sharing its memory (a
    set_() to a parameter), the value detached; asked again after a detach
    (a later read's own history may have lost its history with it)."""
    detached = bool(facts.notes.nodes(facts.graph, Kind.OWN_HISTORY_READ))
    while detached:
        detached = _drop_historyless_own_reads_once(facts, facts.may_grad())
        facts.changed()


def _drop_historyless_own_reads_once(facts: Facts, may_grad: set) -> bool:
    graph, detached = facts.graph, False
    for node in [n for n in facts.notes.nodes(graph, Kind.OWN_HISTORY_READ) if n.target is KEEP_HISTORY]:
        if node.args[0] in may_grad:
            continue
        value = node.args[1]
        if value in may_grad:
            with graph.inserting_before(node):
                value = graph.call_function(NO_HISTORY[0], (value,))
            value.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace")})
            detached = True
        node.replace_all_uses_with(value)
        graph.erase_node(node)
    return detached


def drop_unseen_leaves(facts: Facts) -> None:
    """Reads of one value as a leaf become one read. A tensor made to require
    grad whose history no output can show (every value it reaches has a
    history anyway, like T5's position bias under gradient checkpointing; a
    view made under no_grad requires grad but has none) is
    read as itself: its own gradient is never seen, and a leaf changes a
    kernel's choice (sdpa given a mask that requires grad), so the layout the
    trace assumed. A leaf goes where it is unseen under a caller with grad
    on and under one with grad off. Runs after the kept histories are in the
    graph: a value written without autograd seeing it is read through its
    keep, which carries the old value's history, not the leaf's."""
    first = {}  # a value read as a leaf twice is one leaf, as in eager
    for leaf in [n for n in facts.graph.nodes if n.target is REQUIRES_GRAD]:
        key = (leaf.target, leaf.args[0])
        if key in first:  # (left for dead-code elimination: the trace's record names it)
            leaf.replace_all_uses_with(first[key])
        else:
            first[key] = leaf
    if not first:
        return
    facts.changed()
    outputs = set(facts.graph.output_node().all_input_nodes)
    analyses = [(facts.may_grad(on), facts.may_grad(on, leaves=False, inputs=False, no_grad_views=False))
                for on in (True, False)]
    for leaf in first.values():
        if not any(_shown_by_an_output(leaf, outputs, *analysis) for analysis in analyses):
            leaf.replace_all_uses_with(leaf.args[0])
    facts.gm.recompile()


def _shown_by_an_output(leaf: torch.fx.Node, outputs: set, requiring: set, requiring_without_leaves: set) -> bool:
    """Does an output have a history that comes from the leaf alone?"""
    def step(node):
        return [u for u in node.users if u in requiring and u not in requiring_without_leaves]
    return bool(reach([leaf], step) & outputs)
