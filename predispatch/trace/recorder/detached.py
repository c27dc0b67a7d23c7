"""Detached aliases updated in place: the base's value changes, its history does not.

Detached aliases updated in place. An in-place op on a ``detach()`` result
(or a view of one, ``t.data`` included) changes its base's values without
autograd seeing it: like a mutation under no_grad, the base keeps its old
history. In grad mode the alias itself gets the update's history, which
functionalization, replaying the alias from memory through the detach,
would drop: it becomes the alias's own history (:mod:`.leaves` reads it
through ``keep_history``), and each view of the alias regenerates its own
from it (:class:`ViewOfUpdate`)."""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.fx

from ... import _torch
from ...errors import ExportError, user_location
from ...ir import meta_keys, ops
from ...ir.records import Event, Kind, TraceRecord, write
from . import marks
from .leaves import call_reading_through, mark_own_read, read_through
from .state import TorchCall, TraceState
from .views import current_node

# in-place ops that change a tensor's layout, not its values
_METADATA_UPDATES = {"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_", "as_strided_"}


def updates_detached_alias(state: TraceState, call: TorchCall) -> bool:
    """An in-place op on (a view of) a detached alias, outside a no_grad span
    (whose watch notes the alias's base as any other tensor it uses)."""
    return state.watch is None and bool(call.args) and call.in_place and marks.DETACHED.of(call.args[0])


def mutate_detached_alias(state: TraceState, call: TorchCall):
    """In grad mode, an in-place op on a detached alias changes its base's
    values without autograd seeing it: like a mutation under no_grad. The
    alias itself gets the update's history (from its operands): the
    base's new value, viewed as the alias, keeps it, and later reads of
    the alias, which functionalization replays from memory through the
    detach, read ``keep_history(that, value)`` (see :func:`.leaves.read_through`)."""
    func, args, kwargs = call.func, call.args, call.kwargs
    alias, base = args[0], marks.base(args[0])
    detached = marks.detach_result(alias)
    _refuse_writing_a_view_left_behind(alias, detached)
    if marks.OWN_HISTORY.on(detached):
        if not torch.is_grad_enabled():
            return func(*args, **kwargs)  # new values; the history eager keeps is read as before
        return _update_own_history(state, call, alias, detached)
    if (torch.is_grad_enabled() and _torch.layout(detached) != _torch.layout(base)
            and getattr(func, "__name__", None) not in _METADATA_UPDATES
            and _takes_a_float_tensor(args[1:], kwargs)):
        # the base's new value is not the alias's: the update's history is traced on a copy
        return _update_own_history(state, call, alias, detached)
    old = current_node(state, base)
    run = functools.partial(func, *args, **kwargs)
    out = call_reading_through(state, call, run, read_written=True) if state.reads_through else run()
    new = current_node(state, base)
    # eager's autograd base of the alias is the detach result it is a view of:
    # the update gives it a history, from which every view of it regenerates its own
    # (not a new layout of the alias: the base's value is the one it had)
    if new is not old and (updated := _update_of(detached, base, old, new)) is not None:
        _give_own_history(state, detached, updated)
    if old is not None and new is not None and new is not old:
        state.record.note(write(Kind.DETACHED_ALIAS_WRITE, old, new, new, where=user_location()))
    return out


def _refuse_writing_a_view_left_behind(alias, detached) -> None:
    """A view of a tensor that a set_() then gave other memory stays on the
    old memory: eager's update writes that memory, which the trace follows
    through the tensor no more (functionalization refuses such a write where
    it sees one: :mod:`predispatch.trace.capture`'s "frozen storage")."""
    if alias is not detached and _torch.storage_of(alias) != _torch.storage_of(detached):
        raise ExportError(
            f"an in-place update at {user_location()} of a view of a tensor whose storage a set_() swapped "
            "after the view was taken (the view still shares the old storage) cannot be exported soundly: "
            "the trace cannot follow the old storage past the swap; take the view after the set_(), or copy "
            "instead of swapping")


def _update_own_history(state: TraceState, call: TorchCall, alias, detached):
    """In grad mode, an in-place op on (a view of) a detached alias that has
    a history of its own (an earlier update's, or the one ``set_`` kept):
    eager's update computes from that history, so the part it does not
    write keeps it. The op is traced on a copy of the alias's value that
    carries the history (``keep_history``; a plain copy for a first update
    of an alias of part of its base), through the same view; the
    copy's new value becomes the alias's history (``keep_history_if_no_grad``
    of the one before: code in the caller's mode keeps it under a no_grad
    caller), and its values are written to the alias's memory without it."""
    func, args, kwargs = call.func, call.args, call.kwargs
    copy, kept_read = _copy_with_own_history(state, detached)
    if getattr(func, "__name__", None) in _METADATA_UPDATES:  # a new layout, the same values
        if alias is detached:
            func(copy, *args[1:], **kwargs)
            marks.OWN_HISTORY.set(detached, _kept_under_a_no_grad_caller(copy, kept_read, current_node(state, copy)))
        return func(*args, **kwargs)
    target = copy if alias is detached else _same_view(copy, detached, alias)
    on_copy = dataclasses.replace(call, args=(target, *args[1:]))
    run = functools.partial(func, *on_copy.args, **kwargs)
    call_reading_through(state, on_copy, run) if state.reads_through else run()
    updated = _kept_under_a_no_grad_caller(copy, kept_read, current_node(state, copy))
    _write_values_only(state, alias, detached, copy)
    _give_own_history(state, detached, updated)
    return alias


def _kept_under_a_no_grad_caller(copy, kept_read, updated: torch.fx.Node) -> torch.fx.Node:
    """The alias's history after an update (``updated``, the copy's node): in
    code in the caller's mode, under a no_grad caller, eager keeps the one
    before (``kept_read``, which the history stage reads at its source: a new
    layout changes the tensor, not eager's autograd node). ``kept_read`` is
    None for a first update: nothing kept before."""
    if kept_read is None:
        return updated
    kept = _torch.current_node(ops.KEEP_HISTORY_IF_NO_GRAD(copy, copy))
    kept.args = (kept_read, updated)
    return kept


def _copy_with_own_history(state: TraceState, detached):
    """A copy of the alias's value carrying its own history, and the node
    reading that history (None for a first update: a plain copy)."""
    through = read_through(state, detached, replayed_later=True)
    if through is None:  # a first update: the alias has no history of its own yet
        return torch.clone(detached), None
    own, value = through[1][0], current_node(state, detached)
    copy = ops.KEEP_HISTORY(detached, detached)
    node = _torch.current_node(copy)
    node.args = (own, value)
    mark_own_read(state, node, detached)
    return copy, node


def _write_values_only(state: TraceState, alias, detached, copy) -> None:
    """The copy's new values written to the alias's memory, without its history."""
    base = marks.base(alias)
    old = current_node(state, base)
    copy_values_only(detached, copy.detach())
    if old is not None and (new := current_node(state, base)) is not None and new is not old:
        state.record.note(write(Kind.DETACHED_ALIAS_WRITE, old, new, new, where=user_location()))  # as above


def copy_values_only(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` while tracing, with no gradient for ``dst``'s old
    value (eager's copy_ gives it zeros): the memory's new values, and
    ``src``'s history for them (:data:`meta_keys.VALUES_ONLY`)."""
    mark = _torch.last_node(_torch.current_tracer().graph)
    dst.copy_(src)
    for node in _torch.nodes_after(mark):
        if node.target is torch.ops.aten.copy.default:
            node.meta[meta_keys.VALUES_ONLY] = True


def _give_own_history(state: TraceState, detached, updated: torch.fx.Node) -> None:
    """``updated`` is the alias's history now; reads go through it, and each
    grad-mode view of the alias regenerates its own from it."""
    marks.OWN_HISTORY.set(detached, updated)
    state.reads_through = True  # reads go through read_through from now on
    for view in list(state.detached_views):
        if view is not detached and marks.detach_result(view) is detached:
            marks.OWN_HISTORY.set(view, ViewOfUpdate(updated, detached, view, user_location(), state.record))


def _same_view(copy, detached, alias):
    """``alias`` (a view of ``detached``) seen in ``copy`` (laid out as ``detached``)."""
    (_, stride, offset), (size, view_stride, view_offset) = _torch.layout(detached), _torch.layout(alias)
    if tuple(copy.stride()) != stride:
        raise ExportError(
            f"an in-place update, in grad mode at {user_location()}, of a view of a detached "
            "alias that has a history of its own, laid out in a way its copy is not: cannot "
            "be exported soundly; update the alias itself, or a clone")
    return copy.as_strided(size, view_stride, view_offset - offset)


def _takes_a_float_tensor(args, kwargs) -> bool:
    """Can an in-place op's operands give the tensor it writes a history?"""
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in _torch.pytree.tree_leaves((args, kwargs)))


def _update_of(alias, base, old: torch.fx.Node, new: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding ``alias``'s value as the in-place update made it, before
    it reached ``base`` (``old`` -> ``new``): for an alias of all of the base,
    the base's new value (computed from the detached alias, so with the
    update's history only); for an alias of part of it, the value the base's
    update scatters in. None where the graph does not show it."""
    if _torch.layout(alias) == _torch.layout(base):  # (functionalization's: set_ updates only those)
        return new
    if (new is not None and new.op == "call_function" and str(new.target).split(".")[-2].endswith("_scatter")
            and new.args[0] is old and isinstance(new.args[1], torch.fx.Node)):
        val = new.args[1].meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) == _torch.layout(alias)[0]:
            return new.args[1]
    return None


@dataclasses.dataclass
class ViewOfUpdate(marks.PendingHistory):
    """The history of a view made of a detached alias before the alias was
    updated in grad mode: eager regenerates it from the alias's new one, as
    ``as_strided`` of the update (made where it is first read)."""

    update: torch.fx.Node
    size: tuple
    stride: tuple
    offset: int
    where: str

    def __init__(self, update, alias, view, where, record: TraceRecord):
        val = update.meta.get("val")
        (_, alias_stride, alias_offset), (size, stride, offset) = _torch.layout(alias), _torch.layout(view)
        if val is None or tuple(val.stride()) != alias_stride:
            raise ExportError(
                f"a view of a detached alias that is then updated in place with an operand that "
                f"requires grad, at {where}, when the update's value is laid out otherwise than "
                "the alias: cannot be exported soundly; take the view after the update")
        self.update, self.where, self.record = update, where, record
        self.size, self.stride, self.offset = size, stride, offset - alias_offset

    def node(self) -> torch.fx.Node:
        graph = self.update.graph
        with graph.inserting_after(_torch.last_node(graph)):
            node = graph.call_function(torch.ops.aten.as_strided.default,
                                       (self.update, list(self.size), list(self.stride), self.offset))
        node.meta["val"] = _torch.fake_as_strided(self.update.meta["val"], self.size, self.stride, self.offset)
        self.record.note(Event(Kind.OWN_HISTORY_READ, node))  # the update's own history: no kept one replaces it
        # in grad mode, read maybe under a no_grad caller; where: the change the view's history follows
        self.record.note(Event(Kind.REGENERATED_VIEW, node, where=self.where))
        return node
