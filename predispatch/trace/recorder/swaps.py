"""Storage swaps, ``t.set_(source)``: traced onto an alias, the target's history kept.

Storage swaps: ``t.set_(source)``. ``t`` takes ``source``'s storage and
layout, keeping its own autograd identity and (set_ under no_grad) its
history: traced as ``t.set_(source.alias())``, so that ``t``'s new value is a
node of its own, and from then on ``t`` is to the recorder what a
``source.detach()`` is (:mod:`.detached`). An in-place update of memory a
set_() made shared changes values other tensors' saved histories read:
each is noted for the history stage to check (:func:`note_swap_updates`)."""
from __future__ import annotations

import torch
import torch.fx

from ... import _torch
from ...errors import ExportError, user_location
from ...ir import ops
from ...ir.records import LINKED_BY_SET, Event, Kind
from .. import eager_layout
from ..._torch.patching import patched
from . import marks
from .detached import ViewOfUpdate
from .leaves import mark_own_read
from .observing import is_unobserved, unobserved
from .state import TraceState
from .views import current_node


def set_calls_to_aliases(state: TraceState):
    """``t.set_(source)`` traced onto an alias of ``source`` (set_ bypasses
    torch-function modes, so the method itself is wrapped; a storage or no
    argument is left to functionalization, which refuses them)."""
    def aliasing(set_):
        def call(self, source=None, *args, **kwargs):
            out = _traced_set(state, set_, self, source, *args, **kwargs)
            if _torch.is_traced(self):  # (after the layout changes the trace made for it)
                eager_layout.set_to(self, source if isinstance(source, torch.Tensor) and not args else None)
            return out
        return call
    return patched(torch.Tensor, "set_", aliasing)


def _traced_set(state: TraceState, set_, t, source=None, *args, **kwargs):
    if source is None and not args and not kwargs and _torch.is_traced(t) and not is_unobserved():
        raise ExportError(f"set_() with no source at {user_location()} gives a tensor new empty memory, which "
                          "the program would hold as a constant of the trace; use torch.empty(0) (or a slice) instead")
    if not (_torch.is_traced(t) and _torch.is_traced(source)) or args or kwargs or is_unobserved():
        return set_(t, *(() if source is None else (source,)), *args, **kwargs)
    if _torch.storage_of(t) == _torch.storage_of(source):
        return _relaid(t, source)
    _note_linking_an_input_to_a_history(state, t, source)
    _refuse_swapping_an_input_written_with_grad(state, t)
    before = _torch.current_node(t)
    out = set_(t, _alias_in_grad_mode(source))
    _torch.sync_wrapper_layout(t)
    # the same memory as source, its own autograd identity: like a detach of it
    # (of the root of source's views: source may be a view of t)
    root = marks.base(source)
    marks.SOURCE.set(t, None if root is t else root)
    marks.DETACHED.set(t)
    marks.DETACH_RESULT.set(t)
    note_swapped(state, t, before)
    _note_views_left_behind(state, t)
    return out


def _note_views_left_behind(state: TraceState, t) -> None:
    """The grad-mode views of ``t`` made before ``t.set_()`` stay on the old
    memory, yet share ``t``'s version counter: eager regenerates each one's
    history from ``t``'s when ``t`` is next updated in grad mode, as it
    does a view of a detached alias (:func:`.detached._give_own_history`),
    whose values the update does not change either."""
    memory = _torch.storage_of(t)
    left = [v for v in state.grad_views.values()
            if v is not t and marks.counter_owner(v) is t and _torch.storage_of(v) != memory]
    if not left:
        return
    noted = {id(v) for v in state.detached_views}  # (by identity: a weak set's lookup would compare tensors)
    state.detached_views.update(v for v in left if id(v) not in noted)
    # the swap bumped the version eager's views share: each one's next read regenerates its history
    own, value = marks.own_history(t), current_node(state, t)
    if own is None or value is None:
        return
    for view in left:
        marks.OWN_HISTORY.set(view, ViewLeftBehind(state, own, value, t, view))
    state.reads_through = True


class ViewLeftBehind(ViewOfUpdate):
    """The history of a grad-mode view that ``t.set_()`` left on the old
    memory, as eager regenerates it at its next read: ``as_strided`` of
    ``t`` as read then (the history the swap kept, on the new memory's
    layout: a ``t_()`` before the swap counts), made where it is first read."""

    def __init__(self, state: TraceState, own: torch.fx.Node, value: torch.fx.Node, t, view):
        where = user_location()
        super().__init__(value, t, view, where, state.record)
        (_, _, t_offset), (_, _, offset) = _torch.layout(t), _torch.layout(view)
        if offset < t_offset:
            raise ExportError(
                f"set_() at {where} gives a tensor memory that starts after a view of it made before "
                "starts: eager regenerates the view's history over memory the tensor does not cover, "
                "which a program cannot reproduce; take the view after the set_(), or set_ a clone")
        self.state, self.own, self.swapped = state, own, t
        self.offset = offset - t_offset + value.meta["val"].storage_offset()
        # made to require grad in the forward: eager's is a leaf still, now of the new memory's shape
        self.leaf = bool(marks.LEAF.of(t))

    def node(self) -> torch.fx.Node:
        graph = self.update.graph
        with graph.inserting_after(_torch.last_node(graph)):
            read = graph.call_function(ops.KEEP_HISTORY, (self.own, self.update))
        read.meta["val"] = self.update.meta.get("val")
        mark_own_read(self.state, read, self.swapped)
        self.update = _leaf_of(read) if self.leaf else read
        return super().node()


def _note_linking_an_input_to_a_history(state: TraceState, t, source) -> None:
    """``t.set_(source)`` in grad mode, ``t`` a parameter, buffer or input:
    where ``source`` requires grad, eager links the caller's tensor to its
    history through set_'s node (no derivative), which no write-back
    reproduces (the history stage's refusal table decides)."""
    if not torch.is_grad_enabled() or id(t) not in state.graph_inputs:
        return
    if marks.LEAF.of(source):  # made to require grad in the forward: it does
        raise ExportError(LINKED_BY_SET.format(where=user_location()))
    own = marks.own_history(source)  # (a history of its own: the value's node has none)
    node = own if isinstance(own, torch.fx.Node) else current_node(state, source)
    if node is not None:
        state.record.note(Event(Kind.LINKED_BY_SET, node, where=user_location()))
        state.record.needed.append(node)


def _refuse_swapping_an_input_written_with_grad(state: TraceState, t) -> None:
    """``t.set_(source)``, ``t`` a parameter, buffer or input the forward
    wrote in grad mode from another floating tensor: eager's tensor keeps
    the history that write gave it on the new memory (under no_grad; in
    grad mode, through set_'s node), which the program, writing back the
    memory's value, cannot reproduce (the reverse order, see
    :func:`_refuse_grad_mode_writes_of_swapped_inputs`)."""
    if id(t) in state.graph_inputs and marks.WRITTEN_WITH_GRAD.of(t):
        raise ExportError(
            f"set_() at {user_location()} gives a parameter, buffer or input that the forward wrote in "
            "grad mode other memory: eager keeps the history that write gave the caller's tensor, "
            "which a program, writing it back as that memory's value, cannot reproduce; set_ a clone, "
            "or write a clone")


def _relaid(t, source):
    """``t.set_(source)`` to the memory ``t`` has (to itself, to its view): a
    new layout at most, as eager gives it; functionalization's set_ would
    freeze the storage its views share."""
    layout = _torch.layout(source)
    marks.SWAPPED_AT.set(t, user_location())
    if _torch.layout(t) == layout:
        return t
    with eager_layout.in_functional_terms():
        return t.as_strided_(*layout)


def _alias_in_grad_mode(source):
    """``source.alias()`` made with grad on, unseen: under no_grad it would be
    a view made under no_grad, whose replay after an update in grad mode the
    trace's own autograd refuses (eager's set_ makes no view at all)."""
    with unobserved(), _torch.torch_function_off():
        mode = torch.is_grad_enabled()
        _torch.SET_GRAD_ENABLED(True)
        try:
            return torch.ops.aten.alias.default(source)
        finally:
            _torch.SET_GRAD_ENABLED(mode)


def note_swapped(state: TraceState, t, before) -> None:
    """``t.set_(source)`` (``before``: ``t``'s node until then): eager's set_
    under no_grad keeps ``t``'s autograd history, so an update of ``t`` in
    grad mode computes from it (the part it does not write keeps it):
    reads of ``t`` go through ``keep_history(before, value)``, ``before``
    of its first swap. (Given another shape where eager's history would
    not take it as autograd checks it, the history stage decides.)"""
    marks.SWAPPED_AT.set(t, user_location())
    if state.watch is not None and id(t) in state.watch:
        before = state.watch[id(t)][1]  # updated under this no_grad span: eager keeps the history before
    sharers = state.swapped.setdefault(_torch.storage_of(t), [])
    sharers += [s for s in (t, marks.SOURCE.of(t)) if s is not None and all(s is not o for o in sharers)]
    if marks.SWAPPED.of(t):
        return
    marks.SWAPPED.set(t)
    if before is None or marks.OWN_HISTORY.on(t):
        return
    marks.OWN_HISTORY.set(t, before)
    # its reads: as the history stage keeps it (a no_grad update), shape checked (Kind.STORAGE_SWAP)
    marks.SWAP_HISTORY.set(t, (before, marks.made_by_a_view(t)))
    state.reads_through = True


def _leaf_of(value: torch.fx.Node) -> torch.fx.Node:
    """``requires_grad(value)``, right after ``value``: a leaf of its value."""
    with value.graph.inserting_after(value):
        leaf = value.graph.call_function(ops.REQUIRES_GRAD, (value,))
    leaf.meta.update({k: v for k, v in value.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
    return leaf


def note_call_start(state: TraceState, outer_call) -> None:
    """At a torch call of the user's (``outer_call``: the call it is made
    inside, None for the user's own): where it starts in the graph, once a
    set_() made memory shared (see :func:`note_swap_updates`)."""
    if outer_call is None and state.swapped and (tracer := _torch.current_tracer()) is not None:
        state.call_start = _torch.last_node(tracer.graph)  # what the graph held before this call


def note_swap_updates(state: TraceState, func, tensors) -> None:
    """A write (not a layout change) to memory a set_() made shared: each
    other sharer's value before it and the ops that read it before the
    call (the history stage's refusal table checks it). A
    sharer with the writer's version counter (itself, its views) is
    eager's own check's business."""
    if torch.Tag.inplace_view in getattr(func, "tags", ()):
        return
    _refuse_grad_mode_writes_of_swapped_inputs(state, tensors)
    before = _nodes_up_to(state.call_start)
    # the update's own ops too, reading it as another operand than the one they write:
    # eager's in-place op saves that operand, then overwrites its memory
    own = _nodes_up_to(_torch.last_node(_torch.current_tracer().graph)) - before
    for storage in {_torch.storage_of(t) for t in tensors} & state.swapped.keys():
        for owner in state.swapped[storage]:
            if any(marks.counter_owner(owner) is marks.counter_owner(t) for t in tensors):
                continue
            if (node := current_node(state, owner)) is not None:
                readers = [(op, i) for op, i in _readers(node)
                           if op in before or (op in own and i not in (None, 0))]
                state.record.note(Event(Kind.SAVED_VALUE_UPDATE, node, where=user_location(), readers=tuple(readers)))


def _refuse_grad_mode_writes_of_swapped_inputs(state: TraceState, tensors) -> None:
    """A parameter, buffer or input that set_() gave other memory, then
    written in grad mode: eager gives the caller's tensor its own history
    (none where it had none) and the update's; the program writes it back
    as the memory's value, whose history is the memory's (another input's,
    or what the forward computed there). (AOTAutograd refuses an input
    set_() and otherwise mutated too.)"""
    if state.watch is not None or not torch.is_grad_enabled():
        return
    for t in tensors:
        if any(marks.SWAPPED.of(s) and id(s) in state.graph_inputs for s in (t, marks.base(t))):
            raise ExportError(
                f"an in-place update in grad mode at {user_location()} of a parameter, buffer or input "
                "that set_() gave other memory: eager gives the caller's tensor its own history and the "
                "update's, which a program, writing it back as that memory's value, cannot reproduce; "
                "set_ a clone, or update a clone")


def _readers(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int | None]]:
    """(op, the position of the argument it reads, None if not positional)
    of the ops other than views reading ``node``'s value (or a view of it,
    or it read through predispatch's ops: as a leaf, as a kept value)."""
    found = []
    for user in node.users:
        if user.op != "call_function":
            continue
        if getattr(user.target, "is_view", False) or user.target is ops.REQUIRES_GRAD or (
                user.target in (ops.KEEP_HISTORY, ops.KEEP_HISTORY_IF_NO_GRAD) and user.args[-1] is node):
            found += _readers(user)  # the same values on: read through
        elif user.target not in (ops.KEEP_HISTORY, ops.KEEP_HISTORY_IF_NO_GRAD):
            found.append((user, user.args.index(node) if node in user.args else None))
    return found


def _nodes_up_to(mark: torch.fx.Node | None) -> set:
    if mark is None:
        return set()
    found, node = set(), mark
    while node.op != "root":
        found.add(node)
        node = node.prev
    return found
