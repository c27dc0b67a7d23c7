"""Views and their replays: each view's lineage, replays marked with the mode it was made in.

Views and their replays. Functionalization replays a view of an updated
tensor from its base lazily, at the view's next use, in whatever grad mode
holds then; eager's view has the history of the mode it was made in. So
each view the recorder sees gets its lineage marked (:func:`note_views`),
and each replay is marked with what the history stage needs to know
(:func:`current_node`): made under no_grad, made in grad mode (and where),
a user input's view."""
from __future__ import annotations

import torch
import torch.fx

from ... import _torch
from ...errors import ExportError, user_location
from ...ir.records import Event, Kind
from . import marks
from .state import TorchCall, TraceState


def current_node(state: TraceState, t) -> torch.fx.Node | None:
    """``t``'s node, up to date. A view made in grad mode whose base was
    updated since is replayed from the base, maybe in the caller's mode:
    the replay is marked with where the view was made (a block may have
    set grad on there)."""
    made_after, made_as = marks.MADE_AFTER.of(t), marks.MADE_AS.of(t)
    no_grad_view, input_view = marks.NO_GRAD_VIEW.of(t), marks.INPUT_VIEW.of(t)
    if made_after is None and made_as is None and not (no_grad_view or input_view):
        return _torch.current_node(t)
    last = _torch.last_node(_torch.current_tracer().graph)
    node = _torch.current_node(t)
    if last.next.op == "root":
        return node
    if no_grad_view:  # replayed, maybe in grad mode: eager's view has no history
        mark_view_replays(state, last, Kind.NO_GRAD_VIEW)
    if input_view:  # replayed, maybe under a no_grad caller: eager's view has its history
        mark_view_replays(state, last, Kind.INPUT_VIEW)
    if made_after is not None:  # replayed: the history stage reads where it was made
        for replay in _torch.nodes_after(last):
            state.record.note(Event(Kind.GRAD_VIEW, replay, made_after))
        state.record.needed.append(made_after)
    if made_as is not None and node is not made_as and node not in state.replays_noted:
        state.replays_noted.add(node)  # (the first view it replays)
        state.record.note(Event(Kind.VIEW_REPLAY, node, made_as))
        state.record.needed.append(made_as)
    return node


def mark_view_replays(state: TraceState, last: torch.fx.Node, kind: Kind) -> None:
    """Note the view ops the graph got after ``last`` as replays of ``kind``."""
    for node in _torch.nodes_after(last):
        if getattr(node.target, "is_view", False):
            state.record.note(Event(kind, node))


def call_marking_view_replays(state: TraceState, func, args, kwargs):
    """In grad mode, functionalization may replay a view made under no_grad
    from its base, in grad mode, reading a value that keeps its history:
    the replay would require grad where eager's view does not. The no_grad
    views the call reads are replayed before it, their view ops marked;
    the view ops the call itself makes (an updated value's own replay, say)
    are not theirs, and stay unmarked."""
    replay_no_grad_views(state, _torch.pytree.tree_leaves((args, kwargs)))
    return func(*args, **kwargs)


def replay_no_grad_views(state: TraceState, tensors) -> None:
    """Replay, now, each of ``tensors`` that is a stale view made under
    no_grad, marking the view ops of its replay."""
    for t in tensors:
        if isinstance(t, _torch.FunctionalTensor) and marks.NO_GRAD_VIEW.of(t):
            last = _torch.last_node(_torch.current_tracer().graph)
            _torch.replay_if_stale(t)
            mark_view_replays(state, last, Kind.NO_GRAD_VIEW)


def reads_no_grad_view(args, kwargs) -> bool:
    return any(marks.NO_GRAD_VIEW.of(t) for t in _torch.pytree.tree_leaves((args, kwargs))
               if isinstance(t, _torch.FunctionalTensor))


def note_views(state: TraceState, func, args, out) -> None:
    """After a call: the views it returned are the span's, and each new one
    gets its lineage (what it is a view of, and how it was made)."""
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if func is torch.Tensor.detach_ and isinstance(source, _torch.FunctionalTensor):
        _note_detached_in_place(state, source)
        return
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, _torch.FunctionalTensor) and _torch.is_view(t):
            state.span_views.append(t)
            if source is not None and t is not source and not marks.SOURCE.on(t):
                _note_lineage(state, func, source, t)


def _note_detached_in_place(state: TraceState, t: torch.Tensor) -> None:
    """``t.detach_()`` (a tensor the forward made): ``t`` is a detach result
    of its old value, an autograd base of its own, which functionalization
    holds as a view of that value: an update in grad mode gives it the
    update's history, as a ``detach()`` result's (:mod:`.detached`)."""
    if any(v is not t and marks.base(v) is t for v in state.grad_views.values()):
        raise ExportError(
            f"detach_() at {user_location()} of a tensor with views made before: eager regenerates their "
            "history from the tensor's next update, and a write through one gives the tensor a history, "
            "which the program does not follow; use t = t.detach(), or take the views after")
    marks.DETACHED.set(t)
    marks.DETACH_RESULT.set(t)
    marks.NO_GRAD_VIEW.clear(t)
    marks.OWN_HISTORY.set(t, _torch.materialized_node(t))  # none: its value, detached
    if torch.is_grad_enabled():
        state.detached_views.add(t)


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _note_lineage(state: TraceState, func, source: torch.Tensor, t: torch.Tensor) -> None:
    """``t``, a new view of ``source`` made by ``func``: detached (a detach, a
    view of a floating tensor as integers, which autograd does not track,
    or a view of one), made under no_grad, or a view with eager autograd history."""
    is_detach = func is torch.Tensor.detach or (_differentiable(source) and not _differentiable(t))
    marks.SOURCE.set(t, source)
    marks.EAGER_VIEW.set(t, not is_detach)
    detached = is_detach or marks.DETACHED.of(source)
    no_grad = not torch.is_grad_enabled() or marks.NO_GRAD_VIEW.of(source)
    if detached:
        marks.DETACHED.set(t)
        if is_detach:
            marks.DETACH_RESULT.set(t)
            if state.reading_data and func is torch.Tensor.detach:
                marks.DATA_ALIAS.set(t)
        if not no_grad:
            state.detached_views.add(t)
    if no_grad:
        marks.NO_GRAD_VIEW.set(t)
        state.any_no_grad_view = True
    if not (detached or no_grad):  # a view with eager autograd history
        state.grad_views[id(t)] = t
        marks.MADE_AS.set(t, _torch.materialized_node(t))
        if state.after_a_grad_marker:
            marks.MADE_AFTER.set(t, _torch.last_node(_torch.current_tracer().graph))
    if not no_grad and not is_detach and (marks.LEAF.of(source) or marks.OWN_HISTORY.on(source)):
        # its history is that of the view as made now, from the source's read
        marks.OWN_HISTORY.set(t, _torch.materialized_node(t))


def note_relayout(state: TraceState, t) -> None:
    """``t`` was given another layout in place: where it is a parameter,
    buffer or input, its value then, whose grad mode says what history
    eager gave the caller's tensor (the history stage reads it)."""
    key = state.graph_inputs.get(id(t))
    if key is not None and (node := current_node(state, t)) is not None:
        state.record.note(Event(Kind.RELAYOUT, node, input=key))
        state.record.needed.append(node)


def note_input_views(state: TraceState, inputs) -> None:
    """The user inputs traced as views of another (the caller made them): like
    views made in grad mode, each has its history whatever the mode it is
    read in, also where a no_grad span replays it (a write to its base)."""
    state.grad_views.update({id(t): t for t in inputs if isinstance(t, _torch.FunctionalTensor) and marks.INPUT_VIEW.of(t)})


def is_after_a_grad_marker(state: TraceState, call: TorchCall) -> bool:
    return state.after_a_grad_marker


def bring_call_up_to_date(state: TraceState, call: TorchCall) -> None:
    """After a grad-mode marker, the tensors a call reads are brought up to
    date before it runs: a stale view is replayed here, marked as it was made
    (a view made before a grad block, read inside it), not unmarked inside the call."""
    for t in _torch.pytree.tree_leaves((call.args, call.kwargs)):
        current_node(state, t)


def sync_no_grad_view_outputs(state: TraceState, out) -> None:
    """Outputs are brought up to date after the forward; replay those that
    are views made under no_grad now, marked."""
    replay_no_grad_views(state, _torch.pytree.tree_leaves(out))


def sync_grad_view_outputs(state: TraceState, out) -> None:
    """Output views are brought up to date after the forward; replay those
    made in grad mode now, marked."""
    for t in _torch.pytree.tree_leaves(out):
        current_node(state, t)
