"""Regions in a graph: the kinds of region the IR has, walking them, inlining one.

A region is a higher-order-op call of a submodule: ``wrap_with_set_grad_enabled``
(kind "grad") or ``wrap_with_autocast`` (kind "autocast"), one row each of
:data:`REGION_KINDS`, nested as in the source. For passes and pattern
matchers that must see inside regions rather than silently skip them::

    >>> for r in regions(ep):
    ...     print(r.depth, r.name, r.kind, r.args)
    0 no_grad_0 grad (False,)
    1 autocast_bfloat16_1 autocast ('cpu', torch.bfloat16, True, True)
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Callable, Iterator

import torch
import torch.fx
from torch.export import ExportedProgram

from .. import _torch
from .autograd_function_op import AUTOGRAD_FUNCTION
from .control_flow_op import control_flow_kind, subgraph_inputs


@dataclasses.dataclass(frozen=True)
class RegionKind:
    """A kind of region: its higher-order op and how its submodule is named."""

    name: str
    hop: object
    label: Callable[[tuple], str]  # region arguments -> submodule name prefix


def _autocast_label(args) -> str:
    device, dtype, enabled, _cache = args
    if not enabled:
        return "autocast_off"
    return f"autocast_{str(dtype).replace('torch.', '')}" if dtype is not None else f"autocast_{device}"


GRAD = RegionKind("grad", _torch.wrap_with_set_grad_enabled,
                  lambda args: "enable_grad" if args[0] else "no_grad")
AUTOCAST = RegionKind("autocast", _torch.wrap_with_autocast, _autocast_label)
REGION_KINDS = (GRAD, AUTOCAST)
# a higher-order op -> the kind of region it calls (an autograd Function's op: walked into, no region)
_KIND = {**{kind.hop: kind.name for kind in REGION_KINDS}, AUTOGRAD_FUNCTION: "autograd_function"}
# where each op's submodule and its inputs are among its arguments (after the
# mode arguments of a region; an autograd Function's backward comes between)
_SUBMODULE = {"grad": 1, "autocast": 4, "autograd_function": 0}
_INPUTS = {"grad": 2, "autocast": 5, "autograd_function": 2}


@dataclasses.dataclass(frozen=True)
class Region:
    """One region, as :func:`regions` yields it.

        >>> class Nested(torch.nn.Module):
        ...     def forward(self, x):
        ...         with torch.autocast("cpu", torch.bfloat16):
        ...             y = x @ x
        ...             with torch.no_grad():
        ...                 z = y * 2
        ...         return y + z
        >>> ep = predispatch.export_predispatch(Nested(), (torch.ones(2, 2),))
        >>> outer, inner = predispatch.regions(ep)
        >>> inner.kind, inner.args, inner.depth, inner.name, inner.owner is outer.submodule
        ('grad', (False,), 1, 'no_grad_1', True)
        >>> inner.node.target is torch.ops.higher_order.wrap_with_set_grad_enabled
        True

    Its kind ("grad" or "autocast"), its mode arguments, the submodule it
    runs, the higher-order-op node calling it, the graph module that node
    lives in, and how deep it is nested (0 = top level). (Inlining also
    takes an autograd Function's op as one, of kind "autograd_function",
    whose submodule is its forward.)"""

    kind: str
    args: tuple
    submodule: torch.fx.GraphModule
    node: torch.fx.Node
    owner: torch.fx.GraphModule
    depth: int

    @property
    def name(self) -> str:
        return self.node.args[_SUBMODULE[self.kind]].target

    @property
    def inputs(self) -> tuple:
        return tuple(self.node.args[_INPUTS[self.kind]:])


def graph_modules(gm: torch.fx.GraphModule) -> list[torch.fx.GraphModule]:
    """The graph module and every graph module below it (region submodules)."""
    return [m for m in gm.modules() if isinstance(m, torch.fx.GraphModule)]


def mutable_op_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes, in ``gm`` or inside its regions, that call a mutable op (G1 has none)."""
    return [n for m in graph_modules(gm) for n in m.graph.nodes
            if n.op == "call_function" and getattr(n.target, "_schema", None) is not None
            and n.target._schema.is_mutable]


def _graph_module(ep_or_gm) -> torch.fx.GraphModule:
    return ep_or_gm.graph_module if isinstance(ep_or_gm, ExportedProgram) else ep_or_gm


def regions(ep_or_gm) -> Iterator[Region]:
    """Every region of a program or graph module, outer before inner, in graph order.

        >>> class Nested(torch.nn.Module):
        ...     def forward(self, x):
        ...         with torch.autocast("cpu", torch.bfloat16):
        ...             y = x @ x
        ...             with torch.no_grad():
        ...                 z = y * 2
        ...         return y + z
        >>> ep = predispatch.export_predispatch(Nested(), (torch.ones(2, 2),))
        >>> for r in predispatch.regions(ep):
        ...     print(r.depth, r.name, r.kind, r.args)
        0 autocast_bfloat16_0 autocast ('cpu', torch.bfloat16, True, True)
        1 no_grad_1 grad (False,)

    For passes and pattern matchers that must see inside regions rather
    than silently skip them. Also yields the regions inside an autograd
    Function's forward and backward, and inside the branches and bodies of
    control-flow operators (``torch.cond``...), at the depth of the op.
    """
    yield from _walk(_graph_module(ep_or_gm), 0)


def _walk(gm: torch.fx.GraphModule, depth: int) -> Iterator[Region]:
    for node in gm.graph.nodes:
        kind = _KIND.get(node.target) if node.op == "call_function" else None
        if kind == "autograd_function":  # no region: the regions in its forward and backward are
            for sub in node.args[:2]:
                yield from _walk(getattr(gm, sub.target), depth)
        elif node.op == "call_function" and control_flow_kind(node.target) is not None:
            for sub, _passed in subgraph_inputs(node):  # the same: the regions in its branches
                yield from _walk(getattr(gm, sub.target), depth)
        elif kind is not None:
            position = _SUBMODULE[kind]
            sub = getattr(gm, node.args[position].target)
            yield Region(kind, tuple(node.args[:position]), sub, node, gm, depth)
            yield from _walk(sub, depth + 1)


def function_calls(gm: torch.fx.GraphModule) -> list[Region]:
    """``gm``'s own autograd Function ops, as regions whose body is the forward."""
    return [Region("autograd_function", (), getattr(gm, node.args[0].target), node, gm, 0)
            for node in gm.graph.nodes
            if node.op == "call_function" and node.target is AUTOGRAD_FUNCTION]


def inline_region(owner: torch.fx.GraphModule, region: Region) -> None:
    """Replace one region's call by its body (its own regions stay regions)."""
    graph, call = owner.graph, region.node
    env = dict(zip([n for n in region.submodule.graph.nodes if n.op == "placeholder"], region.inputs))
    with graph.inserting_before(call):
        for node in region.submodule.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                results = node.args[0]
                break
            env[node] = graph.node_copy(node, lambda n: env[n])
            if node.op in ("get_attr", "call_module"):  # a nested region's submodule, an observer
                env[node].target = _moved_up(owner, region.submodule, node.target)
    for user in list(call.users):
        if user.target is operator.getitem:
            user.replace_all_uses_with(env[results[user.args[1]]])
            graph.erase_node(user)
    submodules = [a for a in call.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    graph.erase_node(call)
    for submodule in submodules:  # the region's body (a Function's backward too) is gone from the owner
        if not submodule.users:
            graph.erase_node(submodule)
            if not any(n.op == "get_attr" and n.target == submodule.target for n in graph.nodes):
                owner.delete_submodule(submodule.target)


def _moved_up(owner: torch.fx.GraphModule, submodule: torch.fx.GraphModule, target: str) -> str:
    """What ``target`` names in ``submodule``, set on ``owner`` under the
    same name where that is free or names it already; returns its name there."""
    value = operator.attrgetter(target)(submodule)
    base = candidate = target.replace(".", "_")
    i = 0
    while hasattr(owner, candidate) and getattr(owner, candidate) is not value:
        i += 1
        candidate = f"{base}_{i}"
    setattr(owner, candidate, value)
    return candidate


def delete_unused_submodules(gm: torch.fx.GraphModule) -> None:
    """``gm.delete_all_unused_submodules()``, keeping what a used submodule
    holds: torch's keeps only the module a get_attr node names, and would
    delete the regions inside an autograd Function's subgraphs."""
    used = set()
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "call_module"):
            parts = node.target.split(".")
            used.update(".".join(parts[:i + 1]) for i in range(len(parts)))
            try:
                held = gm.get_submodule(node.target)
            except AttributeError:  # a parameter, buffer or constant
                continue
            used.update(f"{node.target}.{name}" for name, _ in held.named_modules() if name)
    for name in [name for name, _ in gm.named_modules() if name and name not in used]:
        gm.delete_submodule(name)


