"""The facts the history stage decides from, gathered in one place.

Facts first, decisions after, as AOTAutograd collects its
``ViewAndMutationMeta`` once and then decides from it. :class:`Facts` holds,
for the flat captured graph, what every decision of the stage reads:

* the recorder's :class:`~predispatch.ir.records.Event` records, indexed by
  node (:class:`Notes`);
* each node's grad mode: on, off, or the caller's (None), as the blocks set it;
* which nodes may require grad under a caller with grad on, and under one
  with grad off (:meth:`Facts.may_grad`);
* where a node's history comes from (:func:`chain`, the one walker back to
  an origin) and what a gradient can reach (:func:`reach`, the one walker
  over the graph);
* which outputs the user gets, and which write an input back.

The stage's passes change the graph; each change is said to the facts
(:meth:`Facts.inserted`, :meth:`Facts.changed`), which forget what it
invalidates and compute it again when asked.
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Callable, Iterable, Iterator

import torch
import torch.fx
from torch.export.graph_signature import InputKind, OutputKind

from ... import _torch
from ...ir.blocks import grad_modes
from ...ir.meta_keys import VALUES_ONLY
from ...ir.ops import KEEP_HISTORY, KEEP_HISTORY_IF_NO_GRAD, REQUIRES_GRAD
from ...ir.records import WRITES, Event, Kind, TraceRecord

KEEPS = (KEEP_HISTORY, KEEP_HISTORY_IF_NO_GRAD)
NO_HISTORY = (torch.ops.aten.detach.default,)  # ops whose result never requires grad


# ---------------------------------------------------------------- the walkers


def walk(starts: Iterable[torch.fx.Node], step: Callable[[torch.fx.Node], Iterable]) -> Iterator[torch.fx.Node]:
    """Each node reached from ``starts`` by ``step`` (a node -> the next
    ones), once, as it is reached: the one graph walker of the stage."""
    seen, todo = set(), list(starts)
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            yield node
            todo.extend(step(node))


def reach(starts: Iterable[torch.fx.Node], step: Callable[[torch.fx.Node], Iterable]) -> set:
    return set(walk(starts, step))


def chain(node: torch.fx.Node, through: Callable[[torch.fx.Node], bool]) -> list[torch.fx.Node]:
    """``node``, and the first argument of each node ``through`` passes, back
    to the first it does not: where a history comes from (through kept
    histories, through views). The one walker back to an origin."""
    found = [node]
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node) and through(node):
        node = node.args[0]
        found.append(node)
    return found


def is_view(node: torch.fx.Node) -> bool:
    return getattr(node.target, "is_view", False)


def is_keep(node: torch.fx.Node) -> bool:
    return node.target in KEEPS


def users_after(node: torch.fx.Node, at: int, position: dict) -> list:
    """``node``'s users after the position ``at`` (a node not placed: after)."""
    return [u for u in node.users if position.get(u, at + 1) > at]


# ---------------------------------------------------------------- the recorder's events by node


class Notes:
    """The recorder's events, by node: what it saw of a node's value."""

    def __init__(self, events: list[Event]):
        self.writes = [e for e in events if e.kind in WRITES]
        self.saved_value_updates = [e for e in events if e.kind is Kind.SAVED_VALUE_UPDATE]
        self.relayouts = [e for e in events if e.kind is Kind.RELAYOUT]
        self.links_by_set = [e for e in events if e.kind is Kind.LINKED_BY_SET]
        self._by_node: dict[torch.fx.Node, dict[Kind, Event]] = collections.defaultdict(dict)
        for e in events:
            if e.kind not in WRITES:
                self._by_node[e.node][e.kind] = e  # the last noted wins, as a mark set again would

    def of(self, node: torch.fx.Node, kind: Kind) -> Event | None:
        return self._by_node[node].get(kind) if node in self._by_node else None

    def has(self, node: torch.fx.Node, *kinds: Kind) -> bool:
        return node in self._by_node and any(k in self._by_node[node] for k in kinds)

    def nodes(self, graph: torch.fx.Graph, *kinds: Kind) -> list[torch.fx.Node]:
        """The nodes of ``graph`` noted with one of ``kinds``, in graph order."""
        return [n for n in graph.nodes if self.has(n, *kinds)]


# ---------------------------------------------------------------- the facts


@dataclasses.dataclass
class Facts:
    """What the stage knows of ``gm``'s flat graph; computed on first use,
    forgotten where a pass changes the graph."""

    gm: torch.fx.GraphModule
    signature: object  # the capture's GraphSignature (input and output specs)
    notes: Notes
    params_requiring_grad: frozenset
    input_views: dict  # user inputs (flat position) traced as views of another
    layouts: dict  # the record's layouts of inputs relaid or given another storage
    # the grad-mode markers the stage inserted around view replays (.views.replay_in_grad_mode)
    replay_blocks: set = dataclasses.field(default_factory=set)
    _position: dict | None = None
    _modes: dict | None = None
    _may_grad: dict = dataclasses.field(default_factory=dict)  # analyses by their key, while the graph holds

    @classmethod
    def of(cls, gm: torch.fx.GraphModule, signature, record: TraceRecord, module: torch.nn.Module) -> "Facts":
        requiring = frozenset(name for name, p in module.named_parameters(remove_duplicate=False)
                              if p.requires_grad)
        return cls(gm, signature, Notes(record.events), requiring, record.input_views, record.layouts)

    @property
    def graph(self) -> torch.fx.Graph:
        return self.gm.graph

    # -- changes

    def changed(self) -> None:
        """The graph changed: every fact is computed again when asked."""
        self._position, self._modes, self._may_grad = None, None, {}

    def inserted(self, node: torch.fx.Node, like: torch.fx.Node) -> None:
        """``node`` was inserted after ``like``, in its grad mode: positions
        and analyses are computed again, modes kept (the new node's: ``like``'s)."""
        modes = self.modes
        modes[node] = modes.get(like)
        self._position, self._may_grad = None, {}

    # -- where each node is, and its grad mode

    @property
    def position(self) -> dict:
        if self._position is None:
            self._position = {n: i for i, n in enumerate(self.graph.nodes)}
        return self._position

    @property
    def modes(self) -> dict:
        """Each node's grad mode: the one its innermost enclosing grad block
        sets, None outside every block (the caller's)."""
        if self._modes is None:
            self._modes = grad_modes(self.graph)
        return self._modes

    def under_a_no_grad_caller(self) -> dict:
        """The modes as a no_grad caller runs them: grad on inside the blocks that set it only."""
        return {n: m is True for n, m in self.modes.items()}

    # -- what may require grad

    def may_grad(self, caller_on: bool = True, leaves: bool = True, inputs: bool = True,
                 no_grad_views: bool = True) -> set:
        """The nodes whose value may require grad at run time, the caller's
        grad mode on or off (see :func:`_may_require_grad`)."""
        key = (caller_on, leaves, inputs, no_grad_views)
        if key not in self._may_grad:
            self._may_grad[key] = _may_require_grad(self, caller_on, leaves, inputs, no_grad_views)
        return self._may_grad[key]

    def differentiable(self) -> set:
        """The nodes a gradient from an output can reach (see :func:`differentiable_ancestors`)."""
        if "differentiable" not in self._may_grad:
            self._may_grad["differentiable"] = differentiable_ancestors(self)
        return self._may_grad["differentiable"]

    # -- the outputs

    @property
    def outputs(self) -> list:
        return list(self.graph.output_node().args[0])

    def output_kinds(self) -> list[OutputKind] | None:
        """Each output's kind, in order (None where they do not match the graph's)."""
        kinds = [s.kind for s in self.signature.output_specs]
        return kinds if len(kinds) == len(self.outputs) else None

    def user_outputs(self) -> set | None:
        """The outputs the user gets (None where the kinds are not known)."""
        kinds = self.output_kinds()
        return None if kinds is None else {o for o, k in zip(self.outputs, kinds) if k == OutputKind.USER_OUTPUT}

    def write_backs(self) -> dict[int, str]:
        """Output position -> the name of the placeholder it writes back."""
        sig = self.signature
        placeholder = {s.target: s.arg.name for s in sig.input_specs if s.target is not None}
        placeholder.update({s.arg.name: s.arg.name for s in sig.input_specs if hasattr(s.arg, "name")})
        return {i: placeholder[s.target] for i, s in enumerate(sig.output_specs)
                if s.kind.name.endswith("_MUTATION") and s.target in placeholder}

    def input_view_values(self) -> set:
        """The values the caller's views among the inputs (``f(x, x[0])``)
        take, as writes replace them."""
        values = set(self.notes.nodes(self.graph, Kind.INPUT_VIEW))
        for e in self.notes.writes:
            if e.old in values:
                values.add(e.new)
        return values

    def live(self) -> set:
        """The nodes the output depends on."""
        return reach([self.graph.output_node()], lambda n: n.all_input_nodes)

    def alive(self, node: torch.fx.Node) -> bool:
        return node.graph is self.graph and not getattr(node, "_erased", False)


def _may_require_grad(facts: Facts, caller_on: bool, leaves: bool, inputs: bool, no_grad_views: bool) -> set:
    """Nodes whose value may require grad at run time, over the flat graph.

    Parameters as in the module, floating user inputs always (the program may
    be called with inputs that require grad), buffers and constants never;
    a computed value if it is floating, grad mode is on and an input may;
    a tensor made to require grad in the forward does (unless not ``leaves``).
    Not ``inputs``: what surely requires grad (user inputs may not). Not
    ``no_grad_views``: what has a history, which a view made under no_grad of
    a tensor that requires grad has not (it requires grad all the same). The
    caller's grad mode on: the trace's modes, as its markers set them; off:
    grad on only inside the blocks that set it, and a kept history is one
    whatever the mode."""
    specs = {s.arg.name: s for s in facts.signature.input_specs if hasattr(s.arg, "name")}
    modes = None if caller_on else facts.modes
    grad_on, result = True, set()
    for node in facts.graph.nodes:
        if node.target is _torch.SET_GRAD_ENABLED:
            grad_on = bool(node.args[0])
            continue
        if _requires(node, specs, facts.params_requiring_grad, result, grad_on, modes, leaves, inputs,
                     no_grad_views):
            result.add(node)
    return result


def _requires(node, specs, requiring, result, grad_on, modes, leaves, inputs, no_grad_views) -> bool:
    """May ``node`` require grad, given what may before it?"""
    if node.op == "placeholder":
        spec = specs.get(node.name)
        kind = spec.kind if spec is not None else None
        return (kind == InputKind.PARAMETER and spec.target in requiring) or (
            inputs and kind == InputKind.USER_INPUT and is_float(node))
    if node.target is REQUIRES_GRAD:
        return leaves or node.args[0] in result
    if node.target in KEEPS and modes is not None:
        return node.args[0] in result
    if node.target is KEEP_HISTORY:  # the old value's history, in any mode (not the new value's)
        return node.args[0] in result
    if node.op == "call_function":
        on = grad_on if modes is None else modes.get(node) is True
        if no_grad_views and not on and is_view(node) and node.target not in NO_HISTORY and node.args[0] in result:
            return True  # a view made under no_grad of a tensor that requires grad requires grad too
        return on and node.target not in NO_HISTORY and is_float(node) and any(
            i in result for i in history_inputs(node))
    return False


def history_inputs(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The inputs whose history ``node``'s value carries: all, but for the
    recorder's write of a detached alias's values to its memory, whose
    destination's history is not the memory's (``VALUES_ONLY``: only the
    values written carry theirs, as the writes stage makes it)."""
    if node.meta.get(VALUES_ONLY):
        return [a for a in node.args[1:2] if isinstance(a, torch.fx.Node)]
    return node.all_input_nodes


def is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex()) for v in vals)


def shape(node: torch.fx.Node) -> tuple | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def same_dtype(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    """A tensor keeps its dtype through in-place ops; its shape may change (a
    ``t_()`` / ``unsqueeze_()`` under no_grad), and eager's kept history then
    gets the new shape's gradient, which autograd reduces to the old shape as
    it does for eager's (or refuses, as for eager's)."""
    va, vb = a.meta.get("val"), b.meta.get("val")
    return isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dtype == vb.dtype


def differentiated(readers: list, modes: dict | None, shown: set | None = None) -> bool:
    """Does a path from ``readers`` reach the output outside no_grad spans
    (``modes``: see :meth:`Facts.modes`; None: any mode), as one of ``shown``
    (None: any output value)? A kept history passes a gradient in any mode,
    to its old value only; a detach none."""
    def passes(n):
        return n.target not in NO_HISTORY and not (modes is not None and modes.get(n) is False and not is_keep(n))

    def step(n):  # (returning a value a grad-mode op made is no op of a mode)
        return [u for u in n.users if (passes(u) or u.op == "output")
                and (u.target is not KEEP_HISTORY or u.args[0] is n) and (shown is None or u.op != "output")]
    return any(n.op == "output" or (shown is not None and n in shown)
               for n in walk([r for r in readers if passes(r)], step))


def differentiable_ancestors(facts: Facts) -> set:
    """The nodes a gradient from an output can reach (a parameter's new
    value is written back without one): not through a no_grad span's
    inputs, nor to a kept history's new value."""
    modes, kinds = facts.modes, facts.output_kinds() or [OutputKind.USER_OUTPUT] * len(facts.outputs)
    starts = [o for o, k in zip(facts.outputs, kinds)
              if isinstance(o, torch.fx.Node) and k != OutputKind.PARAMETER_MUTATION]

    def step(n):
        if modes.get(n) is False and not is_keep(n):
            return []
        return [n.args[0]] if n.target is KEEP_HISTORY else history_inputs(n)
    return reach(starts, step)


@dataclasses.dataclass(frozen=True)
class Kept:
    """A history kept: ``old``'s on ``new``'s value, read by ``later``. ``kind``:
    the event it keeps it for; what the recorder knew of the tensor
    (``eager_view``: made by a view op, None: not known; ``swapped``: a set_()
    target); whether it is kept for an update in the caller's mode; the
    event's source line, where the recorder noted it."""

    kind: Kind
    old: torch.fx.Node
    new: torch.fx.Node
    later: tuple
    eager_view: bool | None = None
    swapped: bool = False
    in_callers_mode: bool = False
    where: str | None = None


def history_source(node: torch.fx.Node) -> torch.fx.Node:
    """The value whose history a kept history is: through ``keep_history``
    nodes to the first value that is not one. A value kept between is no
    history of its own, and autograd would check a gradient against its
    shape, which eager's tensor may no longer have (relaid under no_grad, then
    given other memory: eager checks against the history's own shape)."""
    return chain(node, lambda n: n.target is KEEP_HISTORY)[-1]


def history_origin(node: torch.fx.Node, through_views: bool) -> tuple[torch.fx.Node, bool]:
    """The node whose history ``node``'s is, through kept histories (and view
    ops, ``through_views``: a tensor relaid in place, not an eager view), and
    whether a caller's-mode write was on the way."""
    found = chain(node, lambda n: n.target in KEEPS
                  or (through_views and is_view(n)))
    return found[-1], any(n.target is KEEP_HISTORY_IF_NO_GRAD for n in found[:-1])
