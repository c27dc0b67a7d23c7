"""Structural checks of an exported program: G1 (functional) and G3 (regions), in every graph.

Regions' and autograd Functions' subgraphs are checked too."""
from __future__ import annotations

import torch
import torch.fx

from .. import _torch
from ..ir.autograd_function_op import AUTOGRAD_FUNCTION
from ..ir.regions import graph_modules, mutable_op_nodes

_REGION_HOPS = (_torch.wrap_with_set_grad_enabled, _torch.wrap_with_autocast)
_SIDE_EFFECTS = (_torch.SET_GRAD_ENABLED, _torch.ENTER_AUTOCAST, _torch.EXIT_AUTOCAST)


all_graph_modules = graph_modules  # the graph module and every graph module below it


def functional_violations(ep_or_gm) -> list[str]:
    """G1: nodes that call a mutable op or change grad/autocast mode."""
    gm = getattr(ep_or_gm, "graph_module", ep_or_gm)
    bad = [f"{node.name}: {node.target.__name__}" for m in all_graph_modules(gm)
           for node in m.graph.nodes if node.op == "call_function" and node.target in _SIDE_EFFECTS]
    return bad + [f"{node.name}: mutable op {node.target}" for node in mutable_op_nodes(gm)]


def region_violations(ep_or_gm) -> list[str]:
    """G3: region submodules named for what they are, holding graph modules."""
    gm = getattr(ep_or_gm, "graph_module", ep_or_gm)
    bad = []
    for m in all_graph_modules(gm):
        for node in m.graph.nodes:
            if node.op == "call_function" and node.target in _REGION_HOPS:
                sub = next(a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr")
                if sub.target.startswith("submod"):
                    bad.append(f"{node.name}: region submodule named {sub.target}")
                if not isinstance(getattr(m, sub.target), torch.fx.GraphModule):
                    bad.append(f"{node.name}: region body is not a graph module")
            if node.op == "call_function" and node.target is AUTOGRAD_FUNCTION:
                for sub in node.args[:2]:  # its forward and backward (G1 holds inside them too)
                    if not (isinstance(sub, torch.fx.Node) and sub.op == "get_attr"
                            and isinstance(getattr(m, sub.target, None), torch.fx.GraphModule)):
                        bad.append(f"{node.name}: an autograd Function's subgraph is not a graph module")
    return bad


def assert_invariants(ep_or_gm) -> None:
    problems = functional_violations(ep_or_gm) + region_violations(ep_or_gm)
    if problems:
        raise AssertionError("exported graph breaks G1/G3:\n  " + "\n  ".join(problems))
