"""Keep eager's autograd history for tensors mutated under no_grad.

In eager mode a tensor that requires grad and is mutated in place under
``torch.no_grad()`` keeps its ``grad_fn``: later uses send their gradient
through what it was before the mutation. Functionalization turns the new
value into a fresh tensor computed under no_grad, which would silently drop
that gradient. After each grad-disabled span we therefore rebind such values
to ``predispatch.keep_history(old, new)``: the value of ``new``, the autograd
history of ``old`` (identity gradient to ``old``, none to ``new``).

Code outside every grad block runs in the caller's mode: an update there is
differentiable, or under a no_grad caller keeps the old history. Later reads
that can show a history get ``keep_history_if_no_grad(old, new)``: ``new``'s
history in grad mode, ``old``'s under no_grad.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from .. import _torch
from .saved_for_backward import saves_its_input, saves_its_result
from ..errors import ExportError, node_location
from ..ir.ops import KEEP_HISTORY, KEEP_HISTORY_IF_NO_GRAD, REQUIRES_GRAD
from .regions import grad_modes
from ..ir.meta_keys import (
    GRAD_BLOCK,
    GRAD_VIEW_REPLAY,
    INPUT_VIEW,
    OWN_HISTORY_READ,
    REGENERATED_VIEW,
    REPLAY_OF,
    SWAPPED_HISTORY,
    SWAPPED_VIEW,
    NO_GRAD_VIEW_REPLAY,
)

_DETACH = torch.ops.aten.detach.default
_NO_HISTORY = (_DETACH,)  # ops whose result never requires grad
_KEEPS = (KEEP_HISTORY, KEEP_HISTORY_IF_NO_GRAD)


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in vals)


def may_require_grad(gm: torch.fx.GraphModule, signature, params_requiring_grad: set[str],
                     modes: dict | None = None, leaves: bool = True, inputs: bool = True):
    """Nodes whose value may require grad at run time, over the flat graph.

    Parameters as in the module, floating user inputs always (the program may
    be called with inputs that require grad), buffers and constants never;
    a computed value if it is floating, grad mode is on and an input may;
    a tensor made to require grad in the forward does (unless not ``leaves``).
    Not ``inputs``: what surely requires grad (user inputs may not).
    Grad mode is the trace's (the caller's on), or with ``modes`` (see
    :func:`predispatch.passes.regions.grad_modes`) a no_grad caller's: on only
    inside blocks that set it; a kept history is one whatever the mode."""
    specs = {s.arg.name: s for s in signature.input_specs if hasattr(s.arg, "name")}
    grad_on, result = True, set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = specs.get(node.name)
            kind = spec.kind if spec is not None else None
            requires = (kind == InputKind.PARAMETER and spec.target in params_requiring_grad) or (
                inputs and kind == InputKind.USER_INPUT and _is_float(node))
        elif node.target is _torch.SET_GRAD_ENABLED:
            grad_on = bool(node.args[0])
            continue
        elif node.target is REQUIRES_GRAD:
            requires = leaves or node.args[0] in result
        elif node.target in _KEEPS and modes is not None:
            requires = node.args[0] in result
        elif node.op == "call_function":
            on = grad_on if modes is None else modes.get(node) is True
            requires = on and node.target not in _NO_HISTORY and _is_float(node) and any(
                i in result for i in node.all_input_nodes)
        else:
            requires = False
        if requires:
            result.add(node)
    return result


@dataclasses.dataclass(frozen=True)
class _Kept:
    """A kept history: ``old``'s on ``new``'s value, read by ``later``; what
    the recorder knew of the tensor (``eager_view``: made by a view op, None:
    not known; ``swapped``: a set_() target), and whether the keep is for an
    update in the caller's mode."""

    old: torch.fx.Node
    new: torch.fx.Node
    later: tuple
    eager_view: bool | None = None
    swapped: bool = False
    in_callers_mode: bool = False


def _refuse_reshaped_history(kept: _Kept, modes, output_kinds: list[str] | None = None,
                             write_backs: dict | None = None) -> None:
    """A tensor given another shape under no_grad (``set_``, ``resize_``,
    ``t_()``) keeps its history, of the old shape. Autograd checks a gradient
    of the new shape against that history (reducing it, or raising), for
    eager's and the program's alike. Not so where the history is a leaf's
    (eager's ``.grad`` takes the new shape) or a view's (eager regenerates it
    from the base through the new layout, also when a set_() moved it to
    other memory of the same shape, at another offset): refused there, where a gradient can
    reach it (for a leaf, also through its views made before, which eager
    regenerates through the new layout), unless nothing is lost (size-1
    dimensions in front: ``unsqueeze_(0)``). Not a view: a tensor that no view op made, which
    view ops hold because it was relaid in place (its history is that of
    what they view). A leaf updated in the caller's mode is one under a
    no_grad caller only: eager refuses the update of a leaf that requires
    grad. A leaf's value written back as a mutation (``write_backs``: output
    position -> the placeholder it writes) is the caller's tensor, whose
    history is its own."""
    old, new, later = kept.old, kept.new, kept.later
    history = _kept_history_of(old)
    va, vb = history.meta.get("val"), new.meta.get("val")
    origin, in_callers_mode = _history_origin(old, through_views=kept.eager_view is False)
    leaf = origin.op == "placeholder"
    view = not leaf and _torch.returns_a_view(origin)
    reshaped = not _same_elements_broadcast(tuple(va.shape), tuple(vb.shape))
    moved = kept.swapped and (tuple(va.shape), va.stride(), va.storage_offset()) != (
        tuple(vb.shape), vb.stride(), vb.storage_offset())
    # the program reduces a gradient to the new shape, then to the history's, which must broadcast
    # to it; eager's reaches the history as its reader made it, unreduced where the reader broadcast
    # the tensor (elsewhere both raise)
    unreducible = not _broadcasts(tuple(va.shape), tuple(vb.shape)) and any(
        _broadcasts(tuple(va.shape), shape) and shape != tuple(vb.shape) for shape in map(_shape, later))
    if not unreducible and (not (leaf or view) or not (reshaped or (view and moved))):
        return  # eager's history reduces the gradient as the program's does
    modes = modes if modes is not None else grad_modes(old.graph)
    if leaf and (in_callers_mode or kept.in_callers_mode):
        modes = _under_a_no_grad_caller(modes)
    outputs = old.graph.output_node().args[0]
    kinds = output_kinds if output_kinds is not None and len(output_kinds) == len(outputs) else None
    # a leaf's history, and one the new shape cannot reach, show through what the user gets only
    # (a write-back returns the caller's tensor)
    shown = None if not (leaf or unreducible) or kinds is None else {
        o for o, k in zip(outputs, kinds) if k == "USER_OUTPUT"}
    if shown and write_backs:  # returned as written back: the program returns the caller's tensor
        shown -= {outputs[i] for i, name in write_backs.items() if name == origin.name}
    # a leaf's views made before, read after: eager regenerates them through the new layout
    views = [u for u in origin.users if leaf and reshaped and getattr(u.target, "is_view", False)]
    if _differentiated([u for u in (*later, *views) if u.op != "output"], modes, shown) or any(
            u.op == "output" and _outputs_as_shown(new, u, old, shown) for u in later):
        change = f"another shape {tuple(vb.shape)}" if reshaped else "other memory"
        eager = ("gives the parameter or input a .grad of the new shape" if leaf else
                 "gives the view history it keeps gradients through the new layout" if view else
                 "passes that history the gradients its readers make, not reduced to the new shape")
        raise ExportError(
            f"a tensor ({history.name}, {tuple(va.shape)}) is given {change} under "
            f"no_grad (set_, resize_, t_(), ...) and keeps its history, at "
            f"{_location(new, *later)}: eager then {eager}, "
            "which a program cannot reproduce; change the shape of a copy instead")


def _refuse_views_made_before_a_relayout(old: torch.fx.Node, new: torch.fx.Node, position: dict, modes,
                                         swapped: bool, updated_at: int | None, shown: set | None,
                                         input_views: set) -> None:
    """Views of a tensor given another layout under no_grad (``old`` ->
    ``new``): a set_() to memory of another layout (``swapped``), or
    ``t_()``, ``transpose_``, ``as_strided_``, ... that does more than add or
    drop size-1 dimensions. The tensor keeps its history, of the old layout;
    eager regenerates a view's history from it through the new layout when
    the tensor's version moves after the view was made: by the change itself
    for the views made before it, by a later update (ending at the position
    ``updated_at``, None: none) for those made after, which functionalization
    replays after it. A program cannot reproduce that: refused where a
    gradient reaches such a view from what the user gets (``shown``: the
    user outputs, None: any output; a write-back returns the caller's
    tensor, whose history is its own). The caller's views among the inputs
    (``input_views``: their values) are :func:`refuse_views_of_reshaped_inputs`'s."""
    va, vb = old.meta.get("val"), new.meta.get("val")
    if not (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)) or (
            _layout(va) == _layout(vb) if swapped else _layout_beyond_size_one(va) == _layout_beyond_size_one(vb)):
        return
    modes = modes if modes is not None else grad_modes(old.graph)
    at = position.get(new, len(position))
    before = [u for u in old.users if getattr(u.target, "is_view", False) and u not in input_views
              and position.get(u, len(position)) < at]
    after = [] if swapped or updated_at is None else [
        u for u in new.users if getattr(u.target, "is_view", False) and at < position.get(u, -1) < updated_at]
    readers = [*before, *_replays_of(_views_closure(before), old.graph),
               *[n for n in _replays_of(_views_closure(after), old.graph) if position.get(n, -1) > (updated_at or 0)]]
    if not (readers and _differentiated(readers, modes, shown)):
        return
    change = ("a set_() gave the tensor memory of another layout" if swapped else
              "the tensor was given another layout under no_grad (t_(), transpose_, as_strided_, ...)")
    made = "made before" if swapped else "made before or after (then updated)"
    raise ExportError(
        f"a view of a tensor ({old.name}) {made} {change}, at {_location(new, *readers)}, "
        "is differentiated: eager regenerates the view's "
        "history through the new layout, which a program cannot reproduce; take the view after "
        "the change, or change a clone")


def _input_view_values(graph: torch.fx.Graph, replacements) -> set:
    """The values the caller's views among the inputs (``f(x, x[0])``) take,
    as updates replace them."""
    values = {n for n in graph.nodes if INPUT_VIEW in n.meta}
    for r in replacements:
        if r.old in values:
            values.add(r.new)
    return values


def _user_outputs(graph: torch.fx.Graph, output_kinds: list[str] | None) -> set | None:
    """The outputs the user gets (None where the kinds are not known)."""
    outputs = graph.output_node().args[0]
    if output_kinds is None or len(output_kinds) != len(outputs):
        return None
    return {o for o, k in zip(outputs, output_kinds) if k == "USER_OUTPUT"}


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.storage_offset()


def _layout_beyond_size_one(t: torch.Tensor) -> tuple:
    """Where each element lies, size-1 dimensions aside (``unsqueeze_(0)``
    moves none)."""
    kept = [(n, s) for n, s in zip(t.shape, t.stride()) if n != 1]
    return tuple(kept), t.storage_offset()


def _views_closure(views: list) -> set:
    """``views`` and every view of them."""
    found, todo = set(), list(views)
    while todo:
        node = todo.pop()
        if node not in found:
            found.add(node)
            todo.extend(u for u in node.users if getattr(u.target, "is_view", False))
    return found


def _replays_of(views: set, graph: torch.fx.Graph) -> list:
    """The replays functionalization made of ``views`` (their base updated
    since), those of views made under no_grad aside (they read a detach)."""
    return [n for n in graph.nodes if n.meta.get(REPLAY_OF) in views
            and not n.meta.get(NO_GRAD_VIEW_REPLAY)] if views else []


def _under_a_no_grad_caller(modes: dict) -> dict:
    """``modes`` (see :func:`grad_modes`) as a no_grad caller runs them: grad
    on inside the blocks that set it only."""
    return {n: m is True for n, m in modes.items()}


def _kept_history_of(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose history (and its shape, which autograd checks a
    gradient against) ``node``'s is, through kept histories: a value kept
    twice (a hidden write after a set_()) has its first history's shape."""
    while node.op == "call_function" and node.target in _KEEPS and node.args:
        node = node.args[0]
    return node


def _history_origin(node: torch.fx.Node, through_views: bool) -> tuple[torch.fx.Node, bool]:
    """The node whose history ``node``'s is, through kept histories (and
    view ops, ``through_views``: a tensor relaid in place, not an eager
    view), and whether a caller's-mode update was on the way."""
    in_callers_mode = False
    while node.op == "call_function" and node.args and (
            node.target in _KEEPS or (through_views and getattr(node.target, "is_view", False))):
        in_callers_mode |= node.target is KEEP_HISTORY_IF_NO_GRAD
        node = node.args[0]
    return node, in_callers_mode


def _differentiable_ancestors(graph: torch.fx.Graph, output_kinds: list[str]) -> set:
    """The nodes a gradient from an output can reach (a parameter's new
    value is written back without one): not through a no_grad span's
    inputs, nor to a kept history's new value."""
    modes = grad_modes(graph)
    outputs = graph.output_node().args[0]
    kinds = output_kinds if len(output_kinds) == len(outputs) else ["USER_OUTPUT"] * len(outputs)
    todo = [o for o, k in zip(outputs, kinds) if isinstance(o, torch.fx.Node) and k != "PARAMETER_MUTATION"]
    seen = set()
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        if modes.get(node) is False and node.target not in _KEEPS:
            continue
        todo.extend([node.args[0]] if node.target is KEEP_HISTORY else node.all_input_nodes)
    return seen


def _outputs_as_shown(new: torch.fx.Node, output: torch.fx.Node, old: torch.fx.Node, shown: set | None) -> bool:
    """Is ``new`` (or its kept value) an output a gradient can come from? Any
    output, where ``shown`` is None, unless an input's old value is returned
    as it is (the caller's tensor)."""
    if shown is None or old.op == "placeholder":
        return old.op != "placeholder"
    return any(o in shown and (o is new or (o.target in _KEEPS and o.args[1] is new))
               for o in output.args[0] if isinstance(o, torch.fx.Node))


def _location(*nodes: torch.fx.Node) -> str:
    """The source line of the first of ``nodes`` that has one (a node the
    trace made itself, a set_'s alias, has none)."""
    for node in nodes:
        if node.meta.get("stack_trace"):
            return node_location(node.meta["stack_trace"])
    return node_location(None)


def _differentiated(readers: list, modes, shown: set | None = None) -> bool:
    """Does a path from ``readers`` reach the output outside no_grad spans
    (``modes``: see :func:`grad_modes`; None: any mode), as one of ``shown``
    (None: any output value)? A kept history passes a gradient in any mode,
    to its old value only; a detach none."""
    seen, todo = set(), list(readers)
    while todo:
        node = todo.pop()
        if node in seen or node.target in _NO_HISTORY or (
                modes is not None and modes.get(node) is False and node.target not in _KEEPS):
            continue
        seen.add(node)
        if node.op == "output" or (shown is not None and node in shown):
            return True
        todo.extend(u for u in node.users if (u.target is not KEEP_HISTORY or u.args[0] is node)
                    and (shown is None or u.op != "output"))
    return False


def _shape(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _broadcasts(old: tuple, new: tuple | None) -> bool:
    """Does ``old`` broadcast to ``new`` (can autograd reduce a gradient of
    ``new``'s shape to it)?"""
    return new is not None and len(old) <= len(new) and all(
        o == n or o == 1 for o, n in zip(reversed(old), reversed(new)))


def _same_elements_broadcast(old: tuple, new: tuple) -> bool:
    """``old`` broadcasts to ``new`` and holds as many elements."""
    return math.prod(old) == math.prod(new) and _broadcasts(old, new)


def _insert_keep_history(graph, old, new, after, position, reshapes: list, target=None,
                         needed=False, about=None) -> torch.fx.Node | None:
    """``keep_history(old, new)`` right after ``after``; later uses of ``new``
    read it. None if nothing reads ``new`` later (no node, no region output),
    unless ``needed`` (a later keep's history starts from it). ``reshapes``
    gets a :class:`_Kept` (``about``: the :class:`Replacement` it keeps a
    history for), checked once every history is kept."""
    after_at = position.get(after, len(position))
    _merge_replays(new, after_at, position)
    if not needed and not any(position.get(u, after_at + 1) > after_at for u in new.users):
        return None
    reshapes.append(_Kept(old, new, tuple(u for u in new.users if position.get(u, after_at + 1) > after_at),
                          getattr(about, "eager_view", None), getattr(about, "swapped", False),
                          target is KEEP_HISTORY_IF_NO_GRAD))
    with graph.inserting_after(after):
        kept = graph.create_node("call_function", target or KEEP_HISTORY, (old, new), name="keep_history")
    kept.meta.update({k: v for k, v in new.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
    for user in list(new.users):
        if user is kept or position.get(user, after_at + 1) <= after_at or user.meta.get(NO_GRAD_VIEW_REPLAY):
            continue
        if not user.meta.get(OWN_HISTORY_READ):
            user.replace_input_with(new, kept)
        elif user.args[0] is new and user.meta.get(SWAPPED_HISTORY):
            user.args = (kept, *user.args[1:])  # a set_() target's history is new's, kept
    return kept


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


def _merge_replays(new: torch.fx.Node, after_at: int, position: dict) -> None:
    """Later replays of the view ``new`` is (functionalization replays a
    relaid tensor from its base at each read) read ``new`` itself, so they
    see the history kept for it."""
    if new.op != "call_function" or not getattr(new.target, "is_view", False) or not new.args:
        return
    for twin in list(new.args[0].users):
        if (twin is not new and twin.target is new.target and twin.args == new.args
                and twin.kwargs == new.kwargs and position.get(twin, -1) > after_at):
            twin.replace_all_uses_with(new)


def _replayed_bases(old: torch.fx.Node, new: torch.fx.Node, exit, position, live) -> tuple[torch.fx.Node, torch.fx.Node]:
    """A value that is the same view of two bases, the new one computed from
    the old, and is not read after ``exit`` by anything ``live``
    (functionalization keeps a tensor given a new layout in place,
    ``unsqueeze_``, as a view of its old value, replayed from the base at
    every read): the bases were replaced, and later reads replay from the
    new one."""
    at = position.get(exit, len(position))
    while (old.op == new.op == "call_function" and old.target is new.target
           and getattr(old.target, "is_view", False) and old.args[0] is not new.args[0]
           and old.args[1:] == new.args[1:] and old.kwargs == new.kwargs
           and not any(position.get(u, at + 1) > at and u in live for u in new.users)
           and _depends_on(new.args[0], old.args[0])):
        old, new = old.args[0], new.args[0]
    return old, new


def _depends_on(node: torch.fx.Node, ancestor: torch.fx.Node) -> bool:
    """Is ``node`` computed from ``ancestor`` (the base's new value from its
    old one; not another tensor's, as after a ``set_()``)?"""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is ancestor:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _live_nodes(graph: torch.fx.Graph) -> set:
    """The nodes the output depends on."""
    live, todo = set(), [graph.output_node()]
    while todo:
        node = todo.pop()
        if node not in live:
            live.add(node)
            todo.extend(node.all_input_nodes)
    return live


def _alive(node: torch.fx.Node, graph: torch.fx.Graph) -> bool:
    return node.graph is graph and not getattr(node, "_erased", False)


def _same_dtype(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """A tensor keeps its dtype through in-place ops; its shape may change (a
    ``t_()`` / ``unsqueeze_()`` under no_grad), and eager's kept history then
    gets the new shape's gradient, which autograd reduces to the old shape as
    it does for eager's (or refuses, as for eager's)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype


def insert_kept_histories(gm: torch.fx.GraphModule, replacements, analyze, output_kinds: list[str] | None = None,
                          write_backs: dict | None = None) -> list[torch.fx.Node]:
    """Insert keep_history after each span that replaced a value that may
    require grad; later uses read it. ``analyze(modes)`` gives the nodes that
    may require grad (see :func:`may_require_grad`); it is asked again after
    each insertion (a value computed from a kept one may now require grad).
    Replacements made in grad mode outside every grad block get
    keep_history_if_no_grad (``output_kinds``: the output specs' kinds, in
    order: a write-back needs none). Returns the inserted nodes."""
    graph = gm.graph
    modes = _modes_after_replaying_views(graph, replacements)
    if not replacements:  # nothing replaced: no analysis unless a pass below needs one
        _refuse_and_tidy(graph, [], lambda: analyze(None), modes, analyze, output_kinds, write_backs)
        return []
    keeper = _HistoryKeeper(graph, replacements, analyze, modes, output_kinds)
    for r in replacements:
        keeper.keep(r)
    final_modes = keeper.modes if keeper.modes is not None else grad_modes(graph)
    _refuse_and_tidy(graph, keeper.reshapes, lambda: keeper.may_grad, final_modes, analyze, output_kinds,
                     write_backs)
    return keeper.kept


def _modes_after_replaying_views(graph: torch.fx.Graph, replacements) -> dict | None:
    """Views made with grad on (the caller's views among its inputs too, and
    the views whose history eager regenerates), read in the caller's mode,
    replayed in grad mode; then the grad modes
    (see :func:`grad_modes`) where a replay or an update made in grad mode
    needs them (None: none does)."""
    any_mode = (INPUT_VIEW, REGENERATED_VIEW)  # eager's has its history in any mode
    replays = [n for n in graph.nodes if GRAD_VIEW_REPLAY in n.meta or any(k in n.meta for k in any_mode)]
    modes = grad_modes(graph) if replays or any(r.in_grad_mode for r in replacements) else None
    if replays:
        replay_in_grad_mode(graph, [n for n in replays if modes.get(n) is None and (
            any(k in n.meta for k in any_mode) or modes.get(n.meta.get(GRAD_VIEW_REPLAY)) is True)])
        modes = grad_modes(graph)
    return modes


def _refuse_and_tidy(graph: torch.fx.Graph, kept: list[_Kept], may_grad, modes, analyze, output_kinds,
                     write_backs) -> None:
    """Once every history is kept: the ``kept`` ones and the recorder's own
    reads (``may_grad()``: the nodes that may require grad) refused where
    eager's differs (a gradient reaches a history kept later too); then the
    views' histories in the caller's mode, the no_grad view replays and the
    own reads without a history put right."""
    for kept_history in kept + _own_history_reads(graph, may_grad):
        _refuse_reshaped_history(kept_history, modes, output_kinds, write_backs)
    keep_callers_mode_view_histories(graph)
    detach_no_grad_view_replays(graph, lambda: analyze(None))
    drop_historyless_own_reads(graph, lambda: analyze(None))


class _HistoryKeeper:
    """What :func:`insert_kept_histories` carries from one replacement to the
    next: the positions of the nodes, the analyses (redone after each
    insertion), the history each replaced value carries, the caller's-mode
    updates deferred, the histories kept."""

    def __init__(self, graph: torch.fx.Graph, replacements, analyze, modes: dict | None, output_kinds):
        self.graph, self.analyze, self.modes, self.output_kinds = graph, analyze, modes, output_kinds
        self.replacements = replacements
        self.input_views = _input_view_values(graph, replacements)
        self.may_grad = analyze(None)
        self.may_grad_off = analyze(modes) if modes is not None else set()  # under a no_grad caller
        self.position = _positions(graph)
        self.history_of = {}  # a replaced value -> the node whose autograd history it carries
        # a caller's-mode update whose history no later read showed: (its old, its segment's end)
        self.deferred: dict[torch.fx.Node, tuple[torch.fx.Node, torch.fx.Node]] = {}
        self.kept: list[torch.fx.Node] = []  # the keep_history nodes inserted
        self.reshapes: list[_Kept] = []  # the histories kept, checked once all are
        self.done: set = set()  # (old, new, exit) of the no_grad replacements handled
        self.live = _live_nodes(graph)
        # writes through a detached alias are hidden from autograd, also where grad mode is on
        self.hidden = {r.old: r.new for r in replacements if r.detached_alias_at is not None}

    def keep(self, r) -> None:
        """Keep the history the :class:`Replacement` ``r`` replaced, where a later use can see it."""
        self._check_views_made_before_a_relayout(r)
        r = self._to_keep(r)
        if r is None:
            return
        if r.old in self.deferred and not r.in_grad_mode:
            self._keep_deferred(r.old)
        old = self.history_of.get(r.old, r.old)  # mutated again later: chain to the first old
        if r.in_grad_mode:
            self._keep_in_callers_mode(r, old)
        elif self._no_grad_update_needs_keep(r, old):
            self._note(r, old, _insert_keep_history(self.graph, old, r.new, r.exit, self.position, self.reshapes,
                                                    about=r))

    def _check_views_made_before_a_relayout(self, r) -> None:
        """A tensor's views made before a no_grad change of its layout, where its history may require grad
        (a leaf given another shape: its views are the kept history's check, which says more)."""
        if not r.in_grad_mode and _alive(r.old, self.graph) and r.old in self.may_grad and not (
                not r.swapped and _history_origin(r.old, True)[0].op == "placeholder" and _alive(r.new, self.graph)
                and _shape(r.old) != _shape(r.new)):
            # (its new value may be read by none)
            updates = [self.position.get(u.exit, -1) for u in self.replacements if u.old is r.new]
            _refuse_views_made_before_a_relayout(r.old, r.new, self.position, self.modes, r.swapped,
                                                 min(updates) if updates else None,
                                                 _user_outputs(self.graph, self.output_kinds), self.input_views)

    def _to_keep(self, r):
        """``r`` as its history is kept (a relaid view's: its bases'), or None
        where none is: one of its nodes is gone, a grad-mode update was
        written through detached aliases alone, the same update was handled."""
        if not (_alive(r.old, self.graph) and _alive(r.new, self.graph) and _alive(r.exit, self.graph)):
            return None
        if r.in_grad_mode:
            return None if _written_hidden(r.old, r.new, self.hidden) else r
        old, new = _replayed_bases(r.old, r.new, r.exit, self.position, self.live)
        if old is not r.old:  # the bases' tensor: not known to be a view or not
            self.history_of.setdefault(r.new, self.history_of.get(r.old, r.old))  # the view's, for its next update
            r = dataclasses.replace(r, old=old, new=new, eager_view=None)
        if (r.old, r.new, r.exit) in self.done:
            return None
        self.done.add((r.old, r.new, r.exit))
        return r

    def _keep_deferred(self, value: torch.fx.Node) -> None:
        """A hidden or no_grad update of ``value``, a caller's-mode update's
        result, keeps the history the caller's mode gave it: the update's
        under grad mode, the first old one's under no_grad."""
        first, exit = self.deferred.pop(value)
        node = _insert_keep_history(self.graph, first, value, exit, self.position, self.reshapes,
                                    KEEP_HISTORY_IF_NO_GRAD, needed=True)
        self.history_of[value] = node
        self._inserted(node, exit)

    def _no_grad_update_needs_keep(self, r, old: torch.fx.Node) -> bool:
        # (a write through a detached alias, in grad mode, may give the new value a history
        # eager's tensor does not get: kept, as none, also where the old value has none)
        hidden_history = r.detached_alias_at is not None and r.new in self.may_grad
        return (old in self.may_grad or old in self.kept or hidden_history) and _same_dtype(old, r.new)

    def _keep_in_callers_mode(self, r, old: torch.fx.Node) -> None:
        """An update made in grad mode outside every grad block: under a
        no_grad caller it keeps ``old``'s history (keep_history_if_no_grad),
        where a later read shows it; else deferred to the value's next update."""
        replay = self._first_view_replay_in_segment(r)  # inside the segment, a replay in an enable_grad block
        r.exit = _before_view_replays(replay if replay is not None else r.exit)
        if not self._callers_mode_update_needs_keep(r, old):
            return
        _merge_replays(r.new, self.position[r.exit], self.position)  # a relaid value is read through its replays
        if not _read_later_where_history_shows(old, r.new, r.exit, self.position, self.modes, self.graph,
                                               self.output_kinds):
            self.history_of[r.new] = old  # a later update in the caller's mode chains to it
            self.deferred[r.new] = (old, r.exit)
            return
        self._note(r, old, _insert_keep_history(self.graph, old, r.new, r.exit, self.position, self.reshapes,
                                                KEEP_HISTORY_IF_NO_GRAD, about=r))

    def _first_view_replay_in_segment(self, r) -> torch.fx.Node | None:
        end = self.position[r.exit]
        replays = [u for u in r.new.users
                   if GRAD_VIEW_REPLAY in u.meta and self.position.get(u, len(self.position)) <= end]
        return min(replays, key=self.position.get) if replays else None

    def _callers_mode_update_needs_keep(self, r, old: torch.fx.Node) -> bool:
        """Not where ``r.new`` is a replay after the segment (it reads the
        kept base), nor inside a grad block (the update's history, as the
        graph has it), nor where ``old`` has no history under a no_grad caller."""
        return (self.position.get(r.new, -1) <= self.position[r.exit] and self.modes.get(r.exit) is None
                and (old in self.may_grad_off or old in self.kept) and _same_dtype(old, r.new))

    def _note(self, r, old: torch.fx.Node, node: torch.fx.Node | None) -> None:
        """``r.new`` carries ``node``'s history (None: no later use needed one: ``old``'s)."""
        self.history_of[r.new] = old if node is None else node
        if node is not None:
            self._inserted(node, r.exit)

    def _inserted(self, node: torch.fx.Node, exit: torch.fx.Node) -> None:
        """``node`` was inserted after ``exit``: positions and analyses redone."""
        self.kept.append(node)
        self.position = _positions(self.graph)
        if self.modes is not None:
            self.modes[node] = self.modes.get(exit)
            self.may_grad_off = self.analyze(self.modes)
        self.may_grad = self.analyze(None)


def _positions(graph: torch.fx.Graph) -> dict:
    return {n: i for i, n in enumerate(graph.nodes)}


def _own_history_reads(graph: torch.fx.Graph, analyze) -> list[_Kept]:
    """The recorder's reads of a set_() target's own history (kept across
    later writes of its memory): histories kept as the stage's own are, and
    checked as they are. (``analyze()``: the nodes that may require grad,
    asked where there is a read.)"""
    reads = [n for n in graph.nodes if n.target is KEEP_HISTORY and n.meta.get(SWAPPED_HISTORY)]
    may_grad = analyze() if reads else set()
    return [_Kept(n.args[0], n.args[1], tuple(n.users), eager_view=n.meta[SWAPPED_HISTORY] == SWAPPED_VIEW,
                  swapped=True) for n in reads if n.args[0] in may_grad]


def drop_historyless_own_reads(graph: torch.fx.Graph, analyze) -> None:
    """A detached alias's read of its own history (see the recorder's
    ``_mutate_detached_alias``) where that history cannot require grad (the
    update's operands did not): the read is the value itself, or, where the
    value may require grad through another tensor sharing its memory (a
    set_() to a parameter), the value detached. (``analyze()``: the nodes
    that may require grad, asked again after a detach: a later read's own
    history may have lost its history with it.)"""
    detached = any(n.meta.get(OWN_HISTORY_READ) for n in graph.nodes)
    while detached:
        detached = _drop_historyless_own_reads_once(graph, analyze())


def _drop_historyless_own_reads_once(graph: torch.fx.Graph, may_grad: set) -> bool:
    detached = False
    for node in [n for n in graph.nodes if n.meta.get(OWN_HISTORY_READ) and n.target is KEEP_HISTORY]:
        if node.args[0] not in may_grad:
            value = node.args[1]
            if value in may_grad:
                with graph.inserting_before(node):
                    value = graph.call_function(torch.ops.aten.detach.default, (value,))
                value.meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace")})
                detached = True
            node.replace_all_uses_with(value)
            graph.erase_node(node)
    return detached


def _before_view_replays(node: torch.fx.Node) -> torch.fx.Node:
    """A caller's-mode segment whose value is replayed into views in an
    enable_grad block (:func:`replay_in_grad_mode`) ends, for its keep, in the
    caller's mode before them: the replays read the kept value."""
    while node.op != "root" and (GRAD_VIEW_REPLAY in node.meta or (
            node.target is _torch.SET_GRAD_ENABLED
            and isinstance((node.meta.get(GRAD_BLOCK) or (None, None))[1], tuple))):
        node = node.prev
    return node


def replay_in_grad_mode(graph: torch.fx.Graph, nodes: list[torch.fx.Node]) -> None:
    """Replays of output views made inside a block that set grad on, placed
    after the forward in the caller's mode, and the views the caller passed
    as inputs (seen through the input they view): an enable_grad block
    around them. Under a no_grad caller eager's view keeps its history (its
    base's, even when the base was updated under no_grad); a replay under
    no_grad has none."""
    for i, run in enumerate(_runs(nodes)):
        with graph.inserting_before(run[0]):
            enter = graph.call_function(_torch.SET_GRAD_ENABLED, (True,))
        with graph.inserting_after(run[-1]):
            exit = graph.call_function(_torch.SET_GRAD_ENABLED, (True,))
        enter.meta[GRAD_BLOCK] = ("enter", ("view replay", i), None)
        exit.meta[GRAD_BLOCK] = ("exit", ("view replay", i), None)
        for key in ("stack_trace", "nn_module_stack"):
            if key in run[0].meta:
                enter.meta[key] = run[0].meta[key]


def _runs(nodes: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """``nodes`` (in graph order) as runs of consecutive graph nodes."""
    runs = []
    for node in nodes:
        if runs and runs[-1][-1].next is node:
            runs[-1].append(node)
        else:
            runs.append([node])
    return runs


def keep_callers_mode_view_histories(graph: torch.fx.Graph) -> None:
    """A view made in the caller's grad mode, replayed inside a grad block
    (its base's memory was written since): where no write changed the base's
    history (each was out of autograd's sight, the base's value a kept
    history), eager's view keeps the history it was made with, none under a
    no_grad caller, and the replay reads ``keep_history(view as made,
    replay)``. (After a write autograd saw, eager regenerates the view's
    history from its base's, as the replay does, or under a no_grad caller
    raises.)"""
    replays = [n for n in graph.nodes if REPLAY_OF in n.meta]
    modes = grad_modes(graph) if replays else {}
    for replay in replays:
        made = replay.meta[REPLAY_OF]
        if not (_alive(made, graph) and modes.get(replay) is True):
            continue
        made, replay = _callers_mode_part(made, replay, modes)
        if made is None or made is replay or not getattr(made.target, "is_view", False) or not (
                _same_meta(made, replay) and _history_root(made) is _history_root(replay)):
            continue
        with graph.inserting_after(replay):
            kept = graph.call_function(KEEP_HISTORY, (made, replay))
        kept.meta.update({k: v for k, v in replay.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
        replay.replace_all_uses_with(kept, delete_user_cb=lambda user: user is not kept)


def _callers_mode_part(made: torch.fx.Node, replay: torch.fx.Node, modes: dict):
    """The outermost view of the chain ``made`` (a view of a view ...) made in
    the caller's mode, and its replay in ``replay``'s chain; (None, None) if
    none was."""
    while True:
        if modes.get(made) is None:
            return made, replay
        if not (made.op == replay.op == "call_function" and made.target is replay.target and made.args
                and getattr(made.target, "is_view", False) and made.args[1:] == replay.args[1:]
                and isinstance(made.args[0], torch.fx.Node) and isinstance(replay.args[0], torch.fx.Node)):
            return None, None
        made, replay = made.args[0], replay.args[0]


def refuse_views_of_reshaped_inputs(graph: torch.fx.Graph, reshaped: set, under_no_grad: set) -> None:
    """A user input viewed by another input (``f(y, y[1])``) and given another
    shape (placeholders ``reshaped``): eager's view regenerates its history
    through the input's new layout, for a gradient of the input's new shape,
    which the program's cannot; refused where a gradient can reach it. (Given
    it in the caller's mode only, not in a no_grad span (``under_no_grad``):
    under a no_grad caller only, eager refusing the in-place change of a leaf
    that requires grad in grad mode.)"""
    if not reshaped:
        return
    modes = grad_modes(graph)
    no_grad_caller = _under_a_no_grad_caller(modes)
    for node in graph.nodes:
        root = _history_root(node) if INPUT_VIEW in node.meta else None
        if root in reshaped and _differentiated(list(node.users), None if root in under_no_grad else no_grad_caller):
            raise ExportError(
                f"a user input viewed by another input of the call (f(x, x[0])) is given another "
                f"shape, and the view is differentiated at {_location(*node.users, node)}: eager "
                "regenerates the view's history through the new layout, which a program cannot "
                "reproduce; pass distinct tensors, or change the shape of a copy")


def _history_root(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose history ``node``'s is, through views and kept histories."""
    while node.op == "call_function" and node.args and (
            node.target is KEEP_HISTORY or getattr(node.target, "is_view", False)):
        node = node.args[0]
    return node


def _same_meta(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.shape == vb.shape and va.dtype == vb.dtype)


def detach_no_grad_view_replays(graph: torch.fx.Graph, analyze) -> None:
    """A view made under no_grad, and every view of it, has no history in
    eager. Functionalization may replay one from its base in grad mode (when
    it is read, or returned); the replay reads the base's value, which may
    have a history: it reads ``detach(base)``. (``analyze()``: the nodes
    that may require grad, asked where there is a replay.)"""
    detached = {}
    replays = [node for node in graph.nodes if node.meta.get(NO_GRAD_VIEW_REPLAY)]
    may_grad = analyze() if replays else set()
    for node in replays:
        for base in node.all_input_nodes:
            if base.meta.get(NO_GRAD_VIEW_REPLAY) or base not in may_grad:
                continue
            if base not in detached:
                with graph.inserting_before(node):
                    detached[base] = graph.call_function(_DETACH, (base,))
                detached[base].meta.update(
                    {k: v for k, v in node.meta.items() if k in ("stack_trace", "nn_module_stack")})
                detached[base].meta["val"] = base.meta.get("val")
            node.replace_input_with(base, detached[base])


def _read_later_where_history_shows(old, new, after, position, modes, graph, output_kinds) -> bool:
    """Under a no_grad caller, does a use of ``new`` after ``after`` see its
    history: a use inside a grad block (enable_grad, or a no_grad block that
    updates it again), or an output, unless ``old`` is a graph input and
    ``new`` its written-back value only (the write-back returns the tensor
    itself, whose history is its own; one computed in the graph is not)?"""
    at = position[after]
    output = graph.output_node()
    for user in new.users:
        if position.get(user, at + 1) <= at:
            continue
        if user is output:
            if old.op != "placeholder" or _is_user_output_only(new, output.args[0], output_kinds):
                return True
        elif modes.get(user) is not None:
            return True
    return False


def _is_user_output_only(new, outputs, kinds) -> bool:
    if kinds is None or len(kinds) != len(outputs):
        return True
    as_kinds = {k for o, k in zip(outputs, kinds) if o is new}
    return as_kinds == {"USER_OUTPUT"}


def drop_unseen_leaves(gm: torch.fx.GraphModule, analyze) -> None:
    """Reads of one value as a leaf become one read. A tensor made to require
    grad whose history no output can show (every value it reaches requires
    grad anyway, like T5's position bias under gradient checkpointing) is
    read as itself: its own gradient is never seen, and a leaf changes a
    kernel's choice (sdpa given a mask that requires grad), so the layout the
    trace assumed. ``analyze()`` (asked where there is a leaf): (what may
    require grad, what does without the leaves) for a caller's grad mode on
    and for it off; a leaf unseen in both goes. Runs after the kept
    histories are in the graph: a value updated without autograd seeing it
    is read through its keep, which carries the old value's history, not
    the leaf's."""
    first = {}  # a value read as a leaf twice is one leaf, as in eager
    for leaf in [n for n in gm.graph.nodes if n.target is REQUIRES_GRAD]:
        key = (leaf.target, leaf.args[0])
        if key in first:  # (left for dead-code elimination: the trace's record names it)
            leaf.replace_all_uses_with(first[key])
        else:
            first[key] = leaf
    if not first:
        return
    analyses = analyze()
    outputs = set(gm.graph.output_node().all_input_nodes)
    for leaf in first.values():
        if not any(_shown_by_an_output(leaf, outputs, *analysis) for analysis in analyses):
            leaf.replace_all_uses_with(leaf.args[0])
    gm.recompile()


def _shown_by_an_output(leaf, outputs: set, requiring: set, requiring_without_leaves: set) -> bool:
    reached, todo = {leaf}, [leaf]
    while todo:  # the values whose history comes from the leaf alone
        node = todo.pop()
        for user in node.users:
            if user not in reached and user in requiring and user not in requiring_without_leaves:
                reached.add(user)
                todo.append(user)
    return bool(reached & outputs)


def refuse_updates_of_saved_values(updates: list, analyze, graph: torch.fx.Graph,
                                   output_kinds: list[str]) -> None:
    """``updates``: (value, [(op, argument position)] reading it by then, where) of
    in-place updates, through a ``set_()`` target, of the memory it shares
    with another tensor. set_ does not share autograd's version counter, so
    where an op differentiated saved that value for its backward (the op
    that made it, ``relu``; one that read it, ``mul``: per torch's
    derivative formulas), eager's backward silently uses the updated memory,
    which a functional program cannot reproduce. (Differentiated: a gradient
    can reach it from an output other than a parameter's new value.
    ``analyze()``: the nodes that may require grad.)"""
    if not updates:
        return
    may_grad = analyze()
    differentiated = _differentiable_ancestors(graph, output_kinds)
    for value, readers, where in updates:
        # the op that made the value saved it only if it was differentiated; one reading it saves it
        # for another operand's gradient too (mul(value, w): w's), whether or not the value requires grad
        made_saving = (value.op == "call_function" and saves_its_result(value.target)
                       and value in may_grad and value in differentiated)
        read_saving = any(op in may_grad and op in differentiated and saves_its_input(op.target, position)
                          for op, position in readers)
        if made_saving or read_saving:
            raise ExportError(
                f"an in-place update at {where} writes memory that set_() made shared with a tensor "
                "an op differentiated already saved for its backward: set_ does not share autograd's version "
                "counter, so eager's backward silently reads the updated values where it saved the "
                "old ones, which a program cannot reproduce; set_ to a clone, or update a clone")
