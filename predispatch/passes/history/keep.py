"""Writes out of autograd's sight: their old history kept where a later read can see it.

Each write event of the recorder (a no_grad write, a write through a
detached alias, a write in the caller's mode) replaced a value without
autograd seeing it, for eager: the tensor keeps its old history. Where the
old value may have one and a later use reads the new value, that use reads
``keep_history(old, new)`` instead, inserted where the write took effect (a
caller's-mode write: ``keep_history_if_no_grad``, the old history only
under a no_grad caller). How each kind of write is kept is one row of
:data:`KEEPERS`; each history kept is a :class:`Kept`, which the refusal
table checks once all are (:mod:`.refusals`).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.fx

from ...ir.ops import KEEP_HISTORY, KEEP_HISTORY_IF_NO_GRAD
from ...ir.records import Event, Kind
from .refusals import BEFORE_KEEPING, refuse
from ...ir.blocks import grad_modes
from .facts import Facts, Kept, chain, history_source, is_view, reach, same_dtype, users_after
from .views import REPLAYED_IN_GRAD_MODE


def insert_keep(facts: Facts, old: torch.fx.Node, new: torch.fx.Node, after: torch.fx.Node, kept: list,
                about: Event | None = None, target=KEEP_HISTORY, needed: bool = False) -> torch.fx.Node | None:
    """``target(old, new)`` (``keep_history``) right after ``after``; later
    uses of ``new`` read it. None if nothing reads ``new`` later (no node, no
    region output), unless ``needed`` (a later keep's history starts from
    it). ``kept`` gets a :class:`Kept` (``about``: the event it keeps a
    history for), checked once every history is kept. ``old``'s history is
    its source's (see :func:`.facts.history_source`)."""
    old = history_source(old)
    position = facts.position
    after_at = position.get(after, len(position))
    merge_replays(new, after_at, position)
    later = users_after(new, after_at, position)
    if not needed and not later:
        return None
    kept.append(Kept(about.kind if about is not None else Kind.CALLERS_MODE_WRITE, old, new, tuple(later),
                     getattr(about, "eager_view", None), getattr(about, "swapped", False),
                     target is KEEP_HISTORY_IF_NO_GRAD, getattr(about, "where", None)))
    node = _keep_node(target, old, new, after)
    for user in later:
        _read_kept(facts, user, new, node)
    return node


def _keep_node(target, old: torch.fx.Node, new: torch.fx.Node, after: torch.fx.Node) -> torch.fx.Node:
    """``target(old, new)`` right after ``after``, with ``new``'s value."""
    with after.graph.inserting_after(after):
        node = after.graph.create_node("call_function", target, (old, new), name="keep_history")
    node.meta.update({k: v for k, v in new.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
    return node


def _read_kept(facts: Facts, user: torch.fx.Node, new: torch.fx.Node, kept: torch.fx.Node) -> None:
    """``user`` of ``new`` reads ``kept`` instead: not a no_grad view's replay
    (eager's has no history), nor a read of an own history (its value is
    the update's), but for a set_() target's, whose history is ``new``'s, kept."""
    notes = facts.notes
    if user is kept or notes.has(user, Kind.NO_GRAD_VIEW):
        return
    if not notes.has(user, Kind.OWN_HISTORY_READ):
        user.replace_input_with(new, kept)
    elif user.args[0] is new and notes.has(user, Kind.STORAGE_SWAP):
        user.args = (history_source(kept), *user.args[1:])


def merge_replays(new: torch.fx.Node, after_at: int, position: dict) -> None:
    """Later replays of the view ``new`` is (functionalization replays a
    relaid tensor from its base at each read) read ``new`` itself, so they
    see the history kept for it."""
    if new.op != "call_function" or not is_view(new) or not new.args:
        return
    for twin in list(new.args[0].users):
        if (twin is not new and twin.target is new.target and twin.args == new.args
                and twin.kwargs == new.kwargs and position.get(twin, -1) > after_at):
            twin.replace_all_uses_with(new)


def replayed_bases(old: torch.fx.Node, new: torch.fx.Node, at: int, position: dict, live: set):
    """A value that is the same view of two bases, the new one computed from
    the old, and is not read after the position ``at`` by anything ``live``
    (functionalization keeps a tensor given a new layout in place,
    ``unsqueeze_``, as a view of its old value, replayed from the base at
    every read): the bases were replaced, and later reads replay from the
    new one. Returns (old, new) as far back as that holds."""
    while (old.op == new.op == "call_function" and old.target is new.target and is_view(old)
           and old.args[0] is not new.args[0] and old.args[1:] == new.args[1:] and old.kwargs == new.kwargs
           and not any(u in live for u in users_after(new, at, position))
           and old.args[0] in reach([new.args[0]], lambda n: n.all_input_nodes)):
        old, new = old.args[0], new.args[0]
    return old, new


class Keeper:
    """What keeping the writes' histories carries from one write to the
    next: the history each replaced value carries, the caller's-mode
    writes deferred, the histories kept and the nodes inserted."""

    def __init__(self, facts: Facts):
        self.facts = facts
        self.history_of: dict = {}  # a replaced value -> the node whose autograd history it carries
        # a caller's-mode write whose history no later read showed: its value -> (its old, where it took effect)
        self.deferred: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}
        self.nodes: list[torch.fx.Node] = []  # the keep_history nodes inserted
        self.kept: list[Kept] = []  # the histories kept, checked once all are
        self.done: set = set()  # (old, new, at) of the no_grad writes handled
        self.live = facts.live()
        self.moved: dict = {}  # id(a caller's-mode write) -> where it takes effect, moved before view replays
        # writes through a detached alias are hidden from autograd, also where grad mode is on
        self.hidden = {e.old: e.new for e in facts.notes.writes if e.kind is Kind.DETACHED_ALIAS_WRITE}

    def keep(self, event: Event) -> None:
        """Keep the history the write ``event`` replaced, where a later use can see it."""
        refuse(BEFORE_KEEPING, event, self.facts, self)
        event = self._to_keep(event)
        if event is None:
            return
        if event.old in self.deferred and event.kind is not Kind.CALLERS_MODE_WRITE:
            self._keep_deferred(event.old)
        old = self.history_of.get(event.old, event.old)  # written again later: chained to the first old
        KEEPERS[event.kind](self, event, old)

    def at(self, e: Event) -> torch.fx.Node:
        """Where the write ``e`` takes effect, as keeping it so far decided."""
        return self.moved.get(id(e), e.at)

    def _to_keep(self, e: Event) -> Event | None:
        """``e`` as its history is kept (a relaid view's: its bases'), or None
        where none is: one of its nodes is gone, a caller's-mode write was
        made through detached aliases alone, the same write was handled."""
        alive = self.facts.alive
        if not (alive(e.old) and alive(e.new) and alive(e.at)):
            return None
        if e.kind is Kind.CALLERS_MODE_WRITE:
            return None if _written_hidden(e.old, e.new, self.hidden) else e
        position = self.facts.position
        old, new = replayed_bases(e.old, e.new, position.get(e.at, len(position)), position, self.live)
        if old is not e.old:  # the bases' tensor: not known to be a view or not
            self.history_of.setdefault(e.new, self.history_of.get(e.old, e.old))  # the view's, for its next write
            e = dataclasses.replace(e, of=old, node=new, eager_view=None)
        if (e.old, e.new, e.at) in self.done:
            return None
        self.done.add((e.old, e.new, e.at))
        return e

    def _keep_deferred(self, value: torch.fx.Node) -> None:
        """A hidden or no_grad write of ``value``, a caller's-mode write's
        result, keeps the history the caller's mode gave it: the write's
        under grad mode, the first old one's under no_grad."""
        first, at = self.deferred.pop(value)
        node = insert_keep(self.facts, first, value, at, self.kept, target=KEEP_HISTORY_IF_NO_GRAD, needed=True)
        self.history_of[value] = node
        self._inserted(node, at)

    def keep_out_of_sight(self, e: Event, old: torch.fx.Node) -> None:
        """A no_grad write, or one through a detached alias: ``keep_history``
        where the old value may have a history. (A write through a detached
        alias, in grad mode, may give the new value a history eager's tensor
        does not get: kept, as none, also where the old value has none.)"""
        may_grad = self.facts.may_grad()
        hidden_history = e.kind is Kind.DETACHED_ALIAS_WRITE and e.new in may_grad
        if (old in may_grad or old in self.nodes or hidden_history) and same_dtype(old, e.new):
            self._note(e, old, insert_keep(self.facts, old, e.new, e.at, self.kept, about=e))

    def keep_in_callers_mode(self, e: Event, old: torch.fx.Node) -> None:
        """A write in grad mode outside every grad block: under a no_grad
        caller it keeps ``old``'s history (``keep_history_if_no_grad``),
        where a later read shows it; else deferred to the value's next write."""
        replay = self._first_view_replay_in_segment(e)  # inside the segment, a replay in an enable_grad block
        self.moved[id(e)] = _before_view_replays(self.facts, replay if replay is not None else e.at)
        e = dataclasses.replace(e, at=self.moved[id(e)])
        self._keep_for_grad_reads_between(e, old)
        if not self._callers_mode_write_needs_keep(e, old):
            return
        merge_replays(e.new, self.facts.position[e.at], self.facts.position)  # a relaid value: read through replays
        if not _read_later_where_history_shows(self.facts, old, e.new, e.at):
            bases = self._through_replayed_bases(e)
            if bases is None:
                self.history_of[e.new] = old  # a later write in the caller's mode chains to it
                self.deferred[e.new] = (old, e.at)
                return
            e, old = bases, self.history_of.get(bases.old, bases.old)
        self._note(e, old, insert_keep(self.facts, old, e.new, e.at, self.kept, about=e,
                                       target=KEEP_HISTORY_IF_NO_GRAD))

    def _through_replayed_bases(self, e: Event) -> Event | None:
        """A relaid tensor's write (``x.unsqueeze_(0)`` before it) whose new
        value nothing reads later, where its memory is: the write as its
        bases' (:func:`replayed_bases`), where a later read of the new base
        shows its history (a cover written back as its memory started);
        else None."""
        facts = self.facts
        old, new = replayed_bases(e.old, e.new, facts.position[e.at], facts.position, self.live)
        if old is e.old or not same_dtype(old, new) or not _read_later_where_history_shows(facts, old, new, e.at):
            return None
        return dataclasses.replace(e, of=old, node=new, eager_view=None)

    def _keep_for_grad_reads_between(self, e: Event, old: torch.fx.Node) -> None:
        """A segment of several writes of one tensor: a value between ``old``
        and ``e.new`` (an earlier write's) read in grad mode inside the
        segment (a view replayed in an enable_grad block) reads
        ``keep_history_if_no_grad(old, value)``: under a no_grad caller
        each write of the segment kept ``old``'s history, and eager's view
        regenerates its history from it."""
        facts = self.facts
        if not (old in facts.may_grad(caller_on=False) or old in self.nodes):
            return
        source = history_source(old)
        for value in _written_between(old, e.new, facts.position):
            position, modes = facts.position, facts.modes  # (again after each insertion)
            readers = [u for u in value.users
                       if modes.get(u) is True and position.get(u, len(position)) <= position[e.at]]
            if not readers or not same_dtype(old, value):
                continue
            at = _before_view_replays(facts, min(readers, key=position.get))
            if position[at] < position[value]:
                at = value
            if modes.get(at) is not None:  # (not in the caller's mode there: the write's history stands)
                continue
            node = _keep_node(KEEP_HISTORY_IF_NO_GRAD, source, value, at)
            for reader in readers:
                reader.replace_input_with(value, node)
            self.kept.append(Kept(e.kind, source, value, tuple(readers), e.eager_view, e.swapped, True))
            self._inserted(node, at)

    def _first_view_replay_in_segment(self, e: Event) -> torch.fx.Node | None:
        position = self.facts.position
        end = position[e.at]
        replays = [u for u in e.new.users
                   if self.facts.notes.has(u, *REPLAYED_IN_GRAD_MODE) and position.get(u, len(position)) <= end]
        return min(replays, key=position.get) if replays else None

    def _callers_mode_write_needs_keep(self, e: Event, old: torch.fx.Node) -> bool:
        """Not where ``e.new`` is a replay after the segment (it reads the
        kept base), nor inside a grad block (the write's history, as the
        graph has it), nor where ``old`` has no history under a no_grad caller."""
        facts = self.facts
        return (facts.position.get(e.new, -1) <= facts.position[e.at] and facts.modes.get(e.at) is None
                and (old in facts.may_grad(caller_on=False) or old in self.nodes) and same_dtype(old, e.new))

    def _note(self, e: Event, old: torch.fx.Node, node: torch.fx.Node | None) -> None:
        """``e.new`` carries ``node``'s history (None: no later use needed one: ``old``'s)."""
        self.history_of[e.new] = old if node is None else node
        if node is not None:
            self._inserted(node, e.at)

    def _inserted(self, node: torch.fx.Node, at: torch.fx.Node) -> None:
        self.nodes.append(node)
        self.facts.inserted(node, like=at)


# how each kind of write is kept
KEEPERS: dict[Kind, Callable[[Keeper, Event, torch.fx.Node], None]] = {
    Kind.NO_GRAD_WRITE: Keeper.keep_out_of_sight,
    Kind.DETACHED_ALIAS_WRITE: Keeper.keep_out_of_sight,
    Kind.CALLERS_MODE_WRITE: Keeper.keep_in_callers_mode,
}


def keep_written_histories(facts: Facts) -> list[Kept]:
    """Each write's history kept (see :class:`Keeper`); the histories kept."""
    keeper = Keeper(facts)
    for event in _in_order_of_effect(facts.notes.writes, keeper.hidden):
        keeper.keep(event)
    return keeper.kept


def _in_order_of_effect(writes: list[Event], hidden: dict) -> list[Event]:
    """The writes, a caller's-mode write whose segment ends in writes through
    detached aliases (``hidden``: old -> new) ending where its own value
    was made, before them: the recorder notes it at the segment's end, and
    its value is the one the hidden writes then replaced, which keeps the
    caller's-mode history under them."""
    made_from = {new: old for old, new in hidden.items()}
    ordered = list(writes)
    for e in writes:
        if e.kind is not Kind.CALLERS_MODE_WRITE:
            continue
        made, seen = e.new, set()
        while made in made_from and made_from[made] is not e.old and made not in seen:
            seen.add(made)
            made = made_from[made]
        if made is e.new:
            continue
        ordered.remove(e)
        first = next(i for i, w in enumerate(ordered) if w.kind is Kind.DETACHED_ALIAS_WRITE and w.old is made)
        ordered.insert(first, dataclasses.replace(e, node=made, at=made))
    return ordered


def _written_hidden(old: torch.fx.Node, new: torch.fx.Node, hidden: dict) -> bool:
    """Did writes through detached aliases alone (``hidden``: old -> new)
    turn ``old`` into ``new``?"""
    seen = set()
    while old in hidden and old not in seen:
        seen.add(old)
        old = hidden[old]
        if old is new:
            return True
    return False


def _written_between(old: torch.fx.Node, new: torch.fx.Node, position: dict) -> list[torch.fx.Node]:
    """The values a tensor took between ``old`` and ``new``, where each write
    computed the next from the one before (its first operand, as a
    functionalized in-place op or a view's scatter into its base does);
    none where the graph does not show that chain (the walk stops at
    ``old``'s position: it does not go back through the whole graph)."""
    between, node, start = [], new, position.get(old, -1)
    while node is not old:
        if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and node.args
                and isinstance(node.args[0], torch.fx.Node)) or position.get(node, start) <= start:
            return []
        node = node.args[0]
        if node is not old:
            between.append(node)
    return between


def _before_view_replays(facts: Facts, node: torch.fx.Node) -> torch.fx.Node:
    """A caller's-mode segment whose value is replayed into views in an
    enable_grad block (:func:`.views.replay_in_grad_mode`: views made in grad
    mode, the caller's views among the inputs, ...) ends, for its keep, in
    the caller's mode before them: the replays read the kept value."""
    while node.op != "root" and (facts.notes.has(node, *REPLAYED_IN_GRAD_MODE) or node in facts.replay_blocks):
        node = node.prev
    return node


def _read_later_where_history_shows(facts: Facts, old, new, after) -> bool:
    """Under a no_grad caller, does a use of ``new`` after ``after`` see its
    history: a use inside a grad block (enable_grad, or a no_grad block that
    writes it again), or an output, unless ``old`` is a graph input and
    ``new`` its written-back value only (the write-back returns the tensor
    itself, whose history is its own; one computed in the graph is not; so
    for a caller's input seen as a view of another)?"""
    output = facts.graph.output_node()
    callers = old.op == "placeholder" or facts.notes.has(old, Kind.INPUT_VIEW)
    for user in users_after(new, facts.position[after], facts.position):
        if user is output:
            if not callers or _is_user_output_only(facts, new):
                return True
        elif facts.modes.get(user) is not None:
            return True
    return False


def _is_user_output_only(facts: Facts, new: torch.fx.Node) -> bool:
    kinds = facts.output_kinds()
    if kinds is None:
        return True
    return {k.name for o, k in zip(facts.outputs, kinds) if o is new} == {"USER_OUTPUT"}


_MODE_NAMES = {True: "grad", False: "no_grad", None: "caller"}


def note_relayout_modes(facts: Facts) -> None:
    """A parameter, buffer or input given another layout in place: in eager
    its history goes through the change where autograd saw it (in grad mode,
    in the caller's mode under a caller with grad on), and stays the one it
    had elsewhere. The grad mode of its last change, for its write-back
    (:func:`predispatch.program.write_backs.write_back_layout`)."""
    for e in facts.notes.relayouts:
        if e.input in facts.layouts and facts.alive(e.node):
            facts.layouts[e.input]["grad_mode"] = _MODE_NAMES[facts.modes.get(e.node)]


def read_kept_histories_at_their_source(facts: Facts) -> None:
    """Each ``keep_history_if_no_grad(old, new)`` outside grad blocks reads,
    for ``old``, the history it keeps when it runs under no_grad: through
    the keeps before it that keep their old one then too. A value kept
    between is no autograd node of eager's, and a gradient would be
    checked against its shape, which a relayout since (``t_()`` in the
    caller's mode) changed; eager checks it against the history's own
    (:func:`.facts.history_source`, the same rule for ``keep_history``)."""
    modes = grad_modes(facts.graph)  # (the pass has inserted nodes since facts.modes)
    for node in list(facts.graph.nodes):
        if node.target is KEEP_HISTORY_IF_NO_GRAD and modes.get(node) is not True:
            keeps_old_too = _keeps_old_whenever(modes.get(node), modes)
            node.args = (chain(node.args[0], keeps_old_too)[-1], *node.args[1:])


def _keeps_old_whenever(mode: bool | None, modes: dict) -> Callable[[torch.fx.Node], bool]:
    """Does a keep take its old history whenever one running in ``mode`` (None:
    the caller's, False: no_grad) takes its own?"""
    def keeps(n: torch.fx.Node) -> bool:
        if n.target is KEEP_HISTORY:
            return True
        return n.target is KEEP_HISTORY_IF_NO_GRAD and modes.get(n) in ((None, False) if mode is None else (False,))
    return keeps
