"""Whole-graph passes through regions: inlined, run on the flat graph, outlined again.

Every region is inlined with a record of where each node came from, the
pass runs on the flat graph, then the regions are outlined again, with the
same names, kinds and modes.

    >>> prepared = through_regions(ep.module(), lambda gm: prepare_pt2e(gm, quantizer))

The pass sees the program as one graph (the true edges across region
boundaries, so a value crossing one gets one observer, not one per side)
and the result keeps every region. A node the pass adds goes into the
innermost region its inputs come from (an observer or a quantize/dequantize
pair stays with the value it observes; a node reading only state and
constants goes to the top level); a node the pass copies with its metadata
stays where the original was.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.fx

from ..passes.regions import outline_region
from ..ir.regions import inline_region, regions

PLACE = "predispatch_region"  # node.meta key: the path of region keys the node runs in


@dataclasses.dataclass(frozen=True)
class Placement:
    """A region taken apart: its higher-order op and mode arguments, its
    submodule's name, the path of region keys down to it (itself last), and
    where it was opened (the call's stack trace and module stack)."""

    hop: object
    args: tuple
    name: str
    path: tuple
    opened_at: dict


def inline_with_placements(gm: torch.fx.GraphModule) -> dict[int, Placement]:
    """Inline every region of ``gm`` (in place), each of its nodes recording
    in ``meta[PLACE]`` the regions it ran in. Returns the regions by key."""
    placements, path_of = {}, {id(gm): ()}
    for node in gm.graph.nodes:
        node.meta[PLACE] = ()
    for key, region in enumerate(regions(gm)):  # outer before inner
        path = path_of[id(region.owner)] + (key,)
        path_of[id(region.submodule)] = path
        opened_at = {k: region.node.meta[k] for k in ("stack_trace", "nn_module_stack") if k in region.node.meta}
        placements[key] = Placement(region.node.target, region.args, region.name, path, opened_at)
        for node in region.submodule.graph.nodes:
            if node.op not in ("placeholder", "output"):
                node.meta[PLACE] = path
    while top := [r for r in regions(gm) if r.depth == 0]:
        for region in top:
            inline_region(gm, region)
    gm.delete_all_unused_submodules()
    return placements


def place_new_nodes(graph: torch.fx.Graph) -> None:
    """A node without a placement goes into the innermost region its inputs
    come from: the deepest of their paths when each is a prefix of it,
    else the regions they share."""
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or PLACE in node.meta:
            continue
        paths = [i.meta.get(PLACE, ()) for i in node.all_input_nodes]
        deepest = max(paths, key=len, default=())
        if all(deepest[:len(p)] == p for p in paths):
            node.meta[PLACE] = deepest
        else:
            node.meta[PLACE] = _shared_prefix(paths)


def _shared_prefix(paths: list[tuple]) -> tuple:
    shared = paths[0]
    for p in paths[1:]:
        n = 0
        while n < min(len(shared), len(p)) and shared[n] == p[n]:
            n += 1
        shared = shared[:n]
    return shared


def outline_placed(gm: torch.fx.GraphModule, placements: dict[int, Placement]) -> None:
    """Outline the regions again, innermost first: a region's body is the
    nodes placed in it (its inner regions are calls by then)."""
    graph = gm.graph
    place_new_nodes(graph)
    for p in sorted(placements.values(), key=lambda p: -len(p.path)):
        body = [n for n in graph.nodes if n.meta.get(PLACE) == p.path]
        if not body:
            continue
        name = p.name if not hasattr(gm, p.name) else _fresh_name(gm, p.name)
        call = outline_region(gm, body, p.hop, p.args, name, p.opened_at, make_submodule=_submodule)
        for node in (call, call.args[len(p.args)], *call.users):
            node.meta[PLACE] = p.path[:-1]
        _in_dependency_order(graph, name)
    for node in graph.nodes:
        node.meta.pop(PLACE, None)
    gm.delete_all_unused_submodules()
    gm.recompile()


def _submodule(root: torch.nn.Module, graph: torch.fx.Graph, name: str) -> torch.fx.GraphModule:
    # not lazy: dynamo inlines the call of a generated module only (torch.compile of the result)
    return torch.fx.GraphModule(root, graph, name)


def _fresh_name(gm: torch.nn.Module, name: str) -> str:
    i = 1
    while hasattr(gm, f"{name}_{i}"):
        i += 1
    return f"{name}_{i}"


def _in_dependency_order(graph: torch.fx.Graph, region: str) -> None:
    """A region's call goes after its body's last node; a node placed outside
    that ran between its body nodes and reads one of its results moves after
    the call. Nodes keep their order otherwise. A node outside that both
    reads the region's results and feeds its body cannot be placed."""
    position = {n: i for i, n in enumerate(graph.nodes)}
    if all(position[i] < position[n] for n in graph.nodes for i in n.all_input_nodes):
        return
    order, state = [], {}

    def visit(node):
        stack = [(node, False)]
        while stack:
            n, ready = stack.pop()
            if ready:
                state[n] = "done"
                order.append(n)
            elif state.get(n) == "open":  # reached from its own inputs
                raise RuntimeError(
                    f"the pass made {n.name} read results of region {region} and feed its body: "
                    f"the region cannot be outlined again")
            elif n not in state:
                state[n] = "open"
                stack.append((n, True))
                stack.extend((i, False) for i in reversed(n.all_input_nodes) if state.get(i) != "done")

    for node in graph.nodes:
        visit(node)
    cursor = graph.output_node()
    for node in reversed(order[:-1]):  # the output stays last
        cursor.prepend(node)
        cursor = node


def through_regions(gm: torch.fx.GraphModule, run: Callable[[torch.fx.GraphModule], torch.fx.GraphModule]):
    """``run(gm)`` on ``gm`` with its regions inlined; the regions are put
    back into the module ``run`` returns (see the module's docs)."""
    placements = inline_with_placements(gm)
    result = run(gm)
    outline_placed(result, placements)
    return result
