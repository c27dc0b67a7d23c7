"""What no program can reproduce of eager's history: refused, from one table.

Each row of :data:`REFUSALS` is a refusal: its name, the event kinds it
concerns, when the stage checks it (before a write's history is kept, once
all are, once the stage is done), ``applies(subject, facts, context)``,
which returns the facts its message names where the program's history
would differ from eager's in a way no program can reproduce (None where it
does not), and the message. The subject is an
:class:`~predispatch.ir.records.Event` or a :class:`~.facts.Kept` history;
both have a ``kind``. A refusal of a new kind is one more row.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.fx
from torch.export.graph_signature import OutputKind

from ... import _torch
from ...errors import ExportError, node_location
from ...ir.ops import KEEP_HISTORY
from ...ir.records import LINKED_BY_SET, WRITES, Kind
from .facts import Facts, chain, differentiated, history_origin, is_keep, is_view
from .facts import reach, shape
from .saved_for_backward import saves_its_input, saves_its_result

BEFORE_KEEPING, ONCE_KEPT, ONCE_DONE = "before keeping", "once kept", "once done"


@dataclasses.dataclass(frozen=True)
class Refusal:
    name: str
    kinds: frozenset
    when: str
    applies: Callable  # (subject, facts, context) -> the message's fields, or None
    message: str  # formatted with them


def refuse(when: str, subject, facts: Facts, context=None) -> None:
    """Raise the first refusal of ``when`` that applies to ``subject``."""
    for row in REFUSALS:
        if row.when == when and subject.kind in row.kinds:
            found = row.applies(subject, facts, context)
            if found is not None:
                raise ExportError(row.message.format(**found))


def location(*nodes: torch.fx.Node) -> str:
    """The source line of the first of ``nodes`` that has one (a node the
    trace made itself, a set_'s alias, has none)."""
    for node in nodes:
        if node.meta.get("stack_trace"):
            return node_location(node.meta["stack_trace"])
    return node_location(None)


# ---------------------------------------------------------------- views of a tensor relaid under no_grad


def views_made_before_a_relayout(e, facts: Facts, keeper) -> dict | None:
    """Views of a tensor given another layout under no_grad (``e.old`` ->
    ``e.new``): a set_() to memory of another layout (``swapped``), or
    ``t_()``, ``transpose_``, ``as_strided_``, ... that does more than add or
    drop size-1 dimensions. The tensor keeps its history, of the old layout;
    eager regenerates a view's history from it through the new layout when
    the tensor's version moves after the view was made: by the change itself
    for the views made before it, by a later write for those made after,
    which functionalization replays after it. A program cannot reproduce
    that: refused where a gradient reaches such a view from what the user
    gets (a write-back returns the caller's tensor, whose history is its
    own). The caller's views among the inputs are
    :func:`views_of_a_reshaped_input`'s; a leaf given another shape is the
    kept history's check, which says more."""
    old, new = e.old, e.new
    if not (facts.alive(old) and old in facts.may_grad()) or (
            not e.swapped and history_origin(old, True)[0].op == "placeholder" and facts.alive(new)
            and shape(old) != shape(new)):
        return None
    va, vb = old.meta.get("val"), new.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or (
            _layout(va) == _layout(vb) if e.swapped else _layout_beyond_size_one(va) == _layout_beyond_size_one(vb)):
        return None
    readers = _relaid_views_read(e, facts, keeper)
    if not (readers and differentiated(readers, facts.modes, facts.user_outputs())):
        return None
    return {"old": old.name, "where": location(new, *readers),
            "made": "made before" if e.swapped else "made before or after (then updated)",
            "change": ("a set_() gave the tensor memory of another layout" if e.swapped else
                       "the tensor was given another layout under no_grad (t_(), transpose_, as_strided_, ...)")}


def _relaid_views_read(e, facts: Facts, keeper) -> list:
    """The views of ``e.old`` made before the change, and (not for a set_())
    those of ``e.new`` made after it and read after a later write (the
    first, ending where ``updated_at`` is), with their replays."""
    old, new, position = e.old, e.new, facts.position
    updates = [position.get(keeper.at(u), -1) for u in facts.notes.writes if u.old is new]
    updated_at = min(updates) if updates else None
    at = position.get(new, len(position))
    input_views = facts.input_view_values()
    before = [u for u in old.users if is_view(u) and u not in input_views and position.get(u, len(position)) < at]
    after = [] if e.swapped or updated_at is None else [
        u for u in new.users if is_view(u) and at < position.get(u, -1) < updated_at]
    replays_after = [n for n in _replays_of(facts, after) if position.get(n, -1) > (updated_at or 0)]
    return [*before, *_replays_of(facts, before), *replays_after]


def _replays_of(facts: Facts, views: list) -> list:
    """The replays functionalization made of ``views`` and every view of
    them (their base written since), those of views made under no_grad aside
    (they read a detach)."""
    if not views:
        return []
    closure = reach(views, lambda n: [u for u in n.users if is_view(u)])
    notes = facts.notes
    return [n for n in notes.nodes(facts.graph, Kind.VIEW_REPLAY)
            if notes.of(n, Kind.VIEW_REPLAY).of in closure and not notes.has(n, Kind.NO_GRAD_VIEW)]


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()


def _layout_beyond_size_one(t: torch.Tensor) -> tuple:
    """Where each element lies, size-1 dimensions aside (``unsqueeze_(0)`` moves none)."""
    kept = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    return tuple(kept), t.storage_offset()


# ---------------------------------------------------------------- a history kept for another shape


def history_of_another_shape(kept, facts: Facts, context=None) -> dict | None:
    """A tensor given another shape under no_grad (``set_``, ``resize_``,
    ``t_()``) keeps its history, of the old shape. Autograd checks a gradient
    of the new shape against that history (reducing it, or raising), for
    eager's and the program's alike. Not so where the history is a leaf's
    (eager's ``.grad`` takes the new shape) or a view's (eager regenerates it
    from the base through the new layout, also when a set_() moved it to
    other memory of the same shape, at another offset): refused there, where
    a gradient can reach it (for a leaf, also through its views made before,
    which eager regenerates through the new layout), unless nothing is lost
    (size-1 dimensions in front: ``unsqueeze_(0)``). Not a view: a tensor that
    no view op made, which view ops hold because it was relaid in place (its
    history is that of what they view). Each history the kept value may
    carry at run time is checked (:func:`_possible_histories`)."""
    for history in _possible_histories(kept.old):
        found = _kept_for_another_shape(kept, history, facts)
        if found is not None:
            return found
    return None


def _possible_histories(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The values whose history ``node`` may carry at run time: through kept
    histories to the first value that is none; ``keep_history_if_no_grad``
    passes its old value's under a no_grad caller, its new value's else."""
    if not is_keep(node):
        return [node]
    found = _possible_histories(node.args[0])
    if node.target is not KEEP_HISTORY:
        found += [h for h in _possible_histories(node.args[1]) if h not in found]
    return found


def _kept_for_another_shape(kept, history: torch.fx.Node, facts: Facts) -> dict | None:
    """:func:`history_of_another_shape` for one history ``kept`` may carry."""
    va, vb = history.meta.get("val"), kept.new.meta.get("val")
    origin, in_callers_mode = history_origin(kept.old, through_views=kept.eager_view is False)
    leaf = origin.op == "placeholder"
    view = not leaf and (_torch.returns_a_view(_first_value(origin, facts))
                         or any(_made_as_a_view(n, facts) for n in (kept.old, history)))
    reshaped = not _same_elements_broadcast(tuple(va.shape), tuple(vb.shape))
    moved = kept.swapped and _layout(va) != _layout(vb)
    # the program reduces a gradient to the new shape, then to the history's, which must broadcast
    # to it; eager's reaches the history as its reader made it, unreduced where the reader broadcast
    # the tensor (elsewhere both raise)
    unreducible = not _broadcasts(tuple(va.shape), tuple(vb.shape)) and any(
        _broadcasts(tuple(va.shape), s) and s != tuple(vb.shape) for s in map(shape, kept.later))
    if not unreducible and (not (leaf or view) or not (reshaped or (view and moved))):
        return None  # eager's history reduces the gradient as the program's does
    in_callers_mode = kept.in_callers_mode or (leaf and in_callers_mode)
    if in_callers_mode and history not in facts.may_grad(caller_on=False, no_grad_views=False):
        return None  # kept under a no_grad caller only, where it has none (a view made there has none)
    if not _kept_history_shown(kept, facts, origin, in_callers_mode, leaf or unreducible, leaf and reshaped):
        return None
    return {"history": history.name, "shape": tuple(va.shape), "where": kept.where or location(kept.new, *kept.later),
            "change": f"another shape {tuple(vb.shape)}" if reshaped else "other memory",
            "eager": ("gives the parameter or input a .grad of the new shape" if leaf else
                      "gives the view history it keeps gradients through the new layout" if view else
                      "passes that history the gradients its readers make, not reduced to the new shape")}


def _first_value(node: torch.fx.Node, facts: Facts) -> torch.fx.Node:
    """The value the tensor holding ``node`` started as, back through the
    writes the recorder noted (in place, eager's tensor stays the one it
    was: a view, where its first value was one, such as ``linear`` of a
    vector on some releases)."""
    written_from = {e.new: e.old for e in facts.notes.writes}
    seen = set()
    while node in written_from and node not in seen:
        seen.add(node)
        node = written_from[node]
    return node


def _made_as_a_view(node: torch.fx.Node, facts: Facts) -> bool:
    """Did the forward make the tensor holding ``node`` as a view? Eager's
    tensor is the one the history is kept on, also where that history comes
    through a relayout's view of a later value (``unsqueeze_`` then
    ``copy_``); an input is the caller's, whatever the trace holds it as."""
    first = _first_value(node, facts)
    return first.op == "call_function" and _torch.returns_a_view(first)


def _kept_history_shown(kept, facts: Facts, origin, in_callers_mode: bool, user_outputs_only: bool,
                        views_too: bool) -> bool:
    """Can a gradient reach the kept history from an output? A tensor
    relaid in the caller's mode keeps a history under a no_grad caller
    only (in grad mode, eager's relayout is an op of the history, as the
    program's; and it refuses a leaf's that requires grad), so only a grad
    span of the forward can reach it; a leaf's history, and one the
    new shape cannot reach, show through what the user gets only, and a
    leaf's value written back as a mutation is the caller's tensor, whose
    history is its own. A leaf's views made before, read after: eager
    regenerates them through the new layout."""
    modes = facts.under_a_no_grad_caller() if in_callers_mode else facts.modes
    outputs, kinds = facts.outputs, facts.output_kinds()
    shown = None if not user_outputs_only or kinds is None else facts.user_outputs()
    if shown:  # returned as written back: the program returns the caller's tensor
        shown -= {outputs[i] for i, name in facts.write_backs().items() if name == origin.name}
    views = [u for u in origin.users if views_too and is_view(u)]
    return differentiated([u for u in (*kept.later, *views) if u.op != "output"], modes, shown) or any(
        u.op == "output" and _outputs_as_shown(kept.new, u, kept.old, shown, _set_on_other_memory(facts))
        for u in kept.later)


def _outputs_as_shown(new: torch.fx.Node, output: torch.fx.Node, old: torch.fx.Node, shown: set | None,
                      historyless: set) -> bool:
    """Is ``new`` (or its kept value) an output a gradient can come from? Any
    output, where ``shown`` is None, unless an input's old value is returned
    as it is (the caller's tensor), or each output it is only writes back a
    caller's tensor that keeps its own history (at a position of
    ``historyless``); else one of ``shown`` (the user's outputs but the
    input's write-back)."""
    outputs = [(i, o) for i, o in enumerate(output.args[0]) if isinstance(o, torch.fx.Node)]
    if shown is None:
        at = [i for i, o in outputs if o is new or (is_keep(o) and o.args[1] is new)]
        return old.op != "placeholder" and (not at or any(i not in historyless for i in at))
    return any(o in shown and (o is new or (is_keep(o) and o.args[1] is new)) for _, o in outputs)


def _set_on_other_memory(facts: Facts) -> set:
    """The output positions writing back a user input the forward set_() on
    other memory: the program sets the caller's tensor on it, and writes its
    values, under no_grad (program/write_backs.py), so the tensor keeps its
    own history, as eager's (one the forward gives it in grad mode besides is
    refused)."""
    user_inputs = {name: i for i, name in enumerate(facts.signature.user_inputs)}
    found = set()
    for position, name in facts.write_backs().items():
        layout = facts.layouts.get(f"input:{user_inputs.get(name)}", {})
        if layout.get("storage") in ("other", "shared", "value") and not layout.get("as_started") \
                and layout.get("dtype") is None:
            found.add(position)
    return found


def _broadcasts(old: tuple, new: tuple | None) -> bool:
    """Does ``old`` broadcast to ``new`` (can autograd reduce a gradient of
    ``new``'s shape to it)?"""
    return new is not None and len(old) <= len(new) and all(
        o == n or o == 1 for o, n in zip(reversed(old), reversed(new)))


def _same_elements_broadcast(old: tuple, new: tuple) -> bool:
    """``old`` broadcasts to ``new`` and holds as many elements."""
    return math.prod(old) == math.prod(new) and _broadcasts(old, new)


# ---------------------------------------------------------------- after the stage


def update_of_a_saved_value(e, facts: Facts, context=None) -> dict | None:
    """An in-place update, through a ``set_()`` target, of the memory ``e.node``
    shares with another tensor. set_ does not share autograd's version counter,
    so where an op differentiated saved that value for its backward (the op
    that made it, ``relu``; one that read it, ``mul``: per torch's derivative
    formulas), eager's backward silently uses the updated memory. (Differentiated:
    a gradient can reach it from an output other than a parameter's new value.)"""
    may_grad, differentiable = facts.may_grad(), facts.differentiable()
    value = e.node
    # the op that made the value saved it only if it was differentiated; one reading it saves it
    # for another operand's gradient too (mul(value, w): w's), whether or not the value requires grad
    made_saving = (value.op == "call_function" and saves_its_result(value.target)
                   and value in may_grad and value in differentiable)
    read_saving = any(op in may_grad and op in differentiable and saves_its_input(op.target, position)
                      for op, position in e.readers)
    return {"where": e.where} if made_saving or read_saving else None


def views_of_a_reshaped_input(e, facts: Facts, reshaped: dict) -> dict | None:
    """A user input viewed by another input (``f(y, y[1])``) and given another
    shape or other memory: eager's view regenerates its history through the
    input's new layout, which the program's cannot. (``reshaped``: such
    inputs' placeholders, and those of
    the inputs viewing them, -> the cover's.) Given another shape in the
    caller's mode only, not in a no_grad span: under a no_grad caller only,
    eager refusing the in-place change of a leaf that requires grad in grad
    mode."""
    node = e.node
    root = chain(node, lambda n: n.target is KEEP_HISTORY or is_view(n))[-1]
    if not facts.alive(node) or root not in reshaped:
        return None
    written_under_no_grad = {w.old for w in facts.notes.writes if w.kind is not Kind.CALLERS_MODE_WRITE}
    modes = None if reshaped[root] in written_under_no_grad else facts.under_a_no_grad_caller()
    if not differentiated(list(node.users), modes):
        return None
    return {"where": location(*node.users, node)}


# ---------------------------------------------------------------- a cover written back as its memory started


def written_with_history_after_relaid(e, facts: Facts, context=None) -> dict | None:
    """A user input other inputs of the call view (a cover), relaid out of
    autograd's sight (under no_grad, by set_() to its own memory) and
    written back as its memory started, then relaid (``as_started``), with
    a value that may require grad: eager's history of a write made after
    the relayout takes the new layout, the program's write-back gives it
    the old one. (Relaid in grad mode, the write-back relays it with its
    history, as eager.)"""
    layout = facts.layouts.get(e.input, {})
    if not layout.get("as_started") or layout.get("grad_mode") in ("grad", "caller"):
        return None
    written = [facts.outputs[i] for i, name in facts.write_backs().items() if name == e.node.name]
    may_grad = facts.may_grad()
    if not any(v in may_grad for v in written):
        return None
    return {"where": location(*written)}


def regenerated_past_its_memory(e, facts: Facts, context=None) -> dict | None:
    """A view's history regenerated (``as_strided`` of its base's update, as
    eager regenerates it) over memory that ends before the view ends (the
    base ``set_()`` to smaller memory since), where it may require grad."""
    node = e.node
    if node.target is not torch.ops.aten.as_strided.default or not facts.alive(node) or node not in facts.may_grad():
        return None
    val = node.args[0].meta.get("val")
    if val is None:
        return None
    end = _torch.storage_extent(node.args[1], node.args[2], node.args[3] if len(node.args) > 3 else 0)
    held = _torch.storage_extent(tuple(val.size()), tuple(val.stride()), 0)  # the update as held: its own copy
    if not (isinstance(end, int) and isinstance(held, int) and end > held):
        return None
    return {"where": e.where or location(node)}


def linked_to_a_history(e, facts: Facts, context=None) -> dict | None:
    """A parameter, buffer or input ``set_()`` in grad mode to a value that
    requires grad whatever the caller passes (a parameter, a leaf made in
    the forward, what the forward computed from them)."""
    if e.node not in facts.may_grad(inputs=False):
        return None
    return {"where": e.where}


REFUSALS = (
    Refusal("views made before a relayout", frozenset({Kind.NO_GRAD_WRITE, Kind.DETACHED_ALIAS_WRITE}),
            BEFORE_KEEPING, views_made_before_a_relayout,
            "a view of a tensor ({old}) {made} {change}, at {where}, is differentiated: eager regenerates "
            "the view's history through the new layout, which a program cannot reproduce; take the view "
            "after the change, or change a clone"),
    Refusal("a history kept for another shape", frozenset({*WRITES, Kind.STORAGE_SWAP}), ONCE_KEPT,
            history_of_another_shape,
            "a tensor ({history}, {shape}) is given {change} under no_grad (set_, resize_, t_(), ...) and "
            "keeps its history, at {where}: eager then {eager}, which a program cannot reproduce; change "
            "the shape of a copy instead"),
    Refusal("an update of a value saved for backward", frozenset({Kind.SAVED_VALUE_UPDATE}), ONCE_DONE,
            update_of_a_saved_value,
            "an in-place update at {where} writes memory that set_() made shared with a tensor an op "
            "differentiated already saved for its backward: set_ does not share autograd's version counter, "
            "so eager's backward silently reads the updated values where it saved the old ones, which a "
            "program cannot reproduce; set_ to a clone, or update a clone"),
    Refusal("a view of an input given another shape", frozenset({Kind.INPUT_VIEW}), ONCE_DONE,
            views_of_a_reshaped_input,
            "a user input viewed by another input of the call (f(x, x[0])) is given another shape or other "
            "memory (set_()), and the view is differentiated at {where}: eager regenerates the view's history "
            "through the new layout, which a program cannot reproduce; pass distinct tensors, or change a copy"),
    Refusal("a cover relaid out of autograd's sight, written with a history",
            frozenset({Kind.RELAYOUT}), ONCE_DONE, written_with_history_after_relaid,
            "a user input other inputs of the call view (f(x, x, x[0])) is given another layout out of "
            "autograd's sight (set_() or t_() under no_grad) and written at {where} with a value that may "
            "require grad: eager's history takes the layout the tensor had at the write, which the program, "
            "writing its memory back as it started, cannot reproduce; pass distinct tensors, or write a copy"),
    Refusal("a view regenerated past its memory", frozenset({Kind.REGENERATED_VIEW}), ONCE_DONE,
            regenerated_past_its_memory,
            "set_() at {where} gives a tensor memory that ends before a view of it made before ends, and "
            "the view is read where it may require grad: eager regenerates the view's history over memory "
            "the tensor does not cover, which a program cannot reproduce; take the view after the set_(), "
            "or set_ a clone"),
    Refusal("an input linked to a history by set_()", frozenset({Kind.LINKED_BY_SET}), ONCE_DONE,
            linked_to_a_history,
            LINKED_BY_SET),
)
