"""What changed between two grad-mode markers: the values replaced out of autograd's sight.

What changed between two grad-mode markers. A no_grad span replaces the
values it updates without autograd seeing it: eager keeps their old
history, functionalization does not, so the recorder notes each tensor the
span uses at its first use (``watch``) and, where the span ends, hands the
keep-history pass each (old, new) pair. In grad mode, a segment between two
markers runs, outside every grad block, in the caller's mode, which may be
no_grad: the values it writes are noted before their first write
(``written``) and handed on at the next marker, or at the forward's end."""
from __future__ import annotations

import dataclasses

import torch
import torch.fx

from ... import _torch
from ...ir.records import Kind, write
from . import marks
from .state import TorchCall, TraceState
from .observing import is_unobserved
from .views import current_node


def in_no_grad_span(state: TraceState, call: TorchCall) -> bool:
    return state.watch is not None


def note_call_tensors(state: TraceState, call: TorchCall) -> None:
    """Under no_grad: the first value of each tensor the call uses."""
    note_tensors(state, call.args, call.kwargs)


def note_tensors(state: TraceState, args, kwargs) -> None:
    for arg in _torch.pytree.tree_leaves((args, kwargs)):
        if not isinstance(arg, _torch.FunctionalTensor):
            continue
        for t in (arg, marks.base(arg)):  # a view made before the span changes its base
            if id(t) not in state.watch and (node := current_node(state, t)) is not None:
                state.watch[id(t)] = (t, node)


def note_written(state: TraceState, tensors) -> None:
    """Before an op writes ``tensors`` in grad mode: their values (and their
    bases') before the first write since the last grad-mode marker."""
    if state.written is None:  # under no_grad: the span's watch sees it
        if state.watch is not None:  # unless torch-function modes are off (see sync_grad_mode)
            note_tensors(state, tensors, {})
        return
    # the call's tensors too: a view made inside it (x[0] = v) leads to none
    called = [a for a in _torch.pytree.tree_leaves(state.call or ()) if isinstance(a, _torch.FunctionalTensor)]
    for written in [*tensors, *called]:
        for t in (written, marks.base(written)):
            if id(t) not in state.written and (node := current_node(state, t)) is not None:
                state.written[id(t)] = (t, node)
    _note_inputs_written_from_a_tensor(state, tensors, called)


def _note_inputs_written_from_a_tensor(state: TraceState, tensors, called: list) -> None:
    """The parameters, buffers and inputs a grad-mode write reaches (through
    a view: ``x[0] = v`` calls its view's copy_), where another floating
    tensor of the call may give them a history (see swaps: set_() to other
    memory after such a write is refused)."""
    inputs = [c for t in (*tensors, *called) for c in (t, marks.base(t)) if id(c) in state.graph_inputs]
    if not inputs:
        return
    memory = {_torch.storage_of(t) for t in tensors}
    written = {id(marks.detach_result(t)) for t in tensors}
    if any(_another_tensor(a, memory, written) and (a.is_floating_point() or a.is_complex()) for a in called):
        for t in inputs:
            if _torch.storage_of(t) in memory:
                marks.WRITTEN_WITH_GRAD.set(t)


def _another_tensor(a, memory: set, written: set) -> bool:
    """Is ``a`` another tensor than the written ones to autograd: of other
    memory, or a detach of theirs (their memory, an autograd identity of its
    own: ``y.copy_(y.detach().requires_grad_())``)?"""
    if _torch.storage_of(a) not in memory:
        return True
    root = marks.detach_result(a)
    return bool(marks.DETACH_RESULT.of(root)) and id(root) not in written


@dataclasses.dataclass(frozen=True)
class Settled:
    """A value no code can write any more, written in grad mode inside a layer
    stamped from a template (:mod:`predispatch.trace.layer_reuse`): its final
    node, as the template's tensor was laid out (made by a view op, swapped)."""

    node: torch.fx.Node
    made_by_a_view: bool
    swapped: bool


def note_settled(state: TraceState, written: list) -> None:
    """``(value, its node before its first write)``: what a stamped layer wrote
    in grad mode, as its template's trace noted it (values are :class:`Settled`
    or the layer's own output tensors)."""
    for value, old in written:
        state.written.setdefault(id(value), (value, old))


def end_grad_mode_segment(state: TraceState) -> None:
    """At a grad-mode marker in grad mode, or at the forward's end: the
    values written since the last marker were replaced."""
    written, state.written = state.written, {}
    pairs = {}
    for t, old in (written or {}).values():
        if isinstance(t, Settled):
            new, view, swapped = t.node, t.made_by_a_view, t.swapped
        else:
            new, view, swapped = current_node(state, t), marks.made_by_a_view(t), marks.SWAPPED.of(t)
        if new is not None and new is not old:
            pairs[new] = (old, view, swapped)
    if pairs:
        exit = _torch.last_node(_torch.current_tracer().graph)
        for new, (old, view, swapped) in pairs.items():
            state.record.note(write(Kind.CALLERS_MODE_WRITE, old, new, exit, eager_view=view, swapped=swapped))


def end_no_grad_span(state: TraceState) -> None:
    """At the forward's end under no_grad (a bare switch left grad mode off):
    the values the span replaced, as a marker ending it would hand them on,
    taking effect at the graph's last node."""
    _materialize_span_views(state)
    replaced = _replaced_in_span(state)
    if replaced:
        exit = _lasting_last_node(_torch.current_tracer().graph)
        for old, new, view, swapped, where in replaced:
            state.record.note(write(Kind.NO_GRAD_WRITE, old, new, exit, eager_view=view, swapped=swapped,
                                    where=where))


def _lasting_last_node(graph: torch.fx.Graph) -> torch.fx.Node:
    """The graph's last node that stays: not functionalization's set_() on the
    trace's own constants, nor such a constant (both dropped after the trace)."""
    node = _torch.last_node(graph)
    while node.op == "get_attr" or getattr(node.target, "overloadpacket", None) is torch.ops.aten.set_:
        node = node.prev
    return node


def before_marker(state: TraceState, was_enabled: bool, enabling: bool) -> list:
    """At a grad-mode marker, before it sets the mode (``enabling`` or not) on
    the one the trace had (``was_enabled``): the segment or span it ends.
    Returns (old, new, made by a view op, set_() target, where set_()) of
    the values a no_grad span ending in grad mode replaced."""
    # at every marker, not only where the trace's mode changes: a block may fix
    # the mode the caller's code (where a stale view is replayed) does not
    _materialize_span_views(state)
    if was_enabled:
        end_grad_mode_segment(state)
    if was_enabled and not enabling:
        _note_views_at_entry(state)
    return _replaced_in_span(state) if not was_enabled and enabling else []


def after_marker(state: TraceState, was_enabled: bool, enabling: bool) -> None:
    """The marker set the mode: a no_grad span starts, or ends, or a grad-mode segment starts."""
    if was_enabled and not torch.is_grad_enabled():
        state.watch = {}
    elif not was_enabled and enabling:
        state.watch = None
    state.written = {} if torch.is_grad_enabled() else None


def _materialize_span_views(state: TraceState) -> None:
    """Functionalization regenerates a view of a mutated tensor lazily, at
    its next use, which may be in another grad mode (a view taken under
    no_grad must not become differentiable). Bring views up to date in
    the mode they were made in."""
    for t in state.span_views:
        current_node(state, t)
    state.span_views = []


def _note_views_at_entry(state: TraceState) -> None:
    """Views made in grad mode have history in eager. If one is replayed
    inside the span (its base was mutated there) and used after it, the
    replay must keep that history: note each one's grad-mode value now. (Not
    in a program's own write-back, exported again: the program it came from
    had no such span.)"""
    state.views_at_entry = {}
    if is_unobserved():
        return
    for view in list(state.grad_views.values()):
        if (node := current_node(state, view)) is not None:
            state.views_at_entry[id(view)] = (view, node)


def _replaced_in_span(state: TraceState) -> list:
    """(old, new, made by a view op, set_() target, where the module's code
    set_() it last) of the values the span replaced: tensors it used (noted
    at first use) and grad-mode views replayed inside it."""
    pairs = {}
    for t, old in (state.watch or {}).values():
        new = current_node(state, t)
        if new is not None and new is not old:
            swapped = marks.SWAPPED.of(t)
            if swapped and isinstance(own := marks.OWN_HISTORY.of(t), torch.fx.Node):
                old = own  # a set_() target's history is its own, whatever its memory held
            pairs[new] = (old, marks.made_by_a_view(t), swapped, marks.user_swap_location(t))
    for view, old in state.views_at_entry.values():
        new = _torch.materialized_node(view)  # replayed inside the span, or not at all
        if new is not None and new is not old:  # the grad-mode value, even if first used after a mutation
            pairs[new] = (old, True, marks.SWAPPED.of(view), marks.user_swap_location(view))
    state.views_at_entry = {}
    return [(old, new, *facts) for new, (old, *facts) in pairs.items()]
