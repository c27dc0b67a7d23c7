"""predispatch's record in a program: where it lives in the graph, reading and writing it.

The record (write-back modes, layouts, input views, the autocast policy,
module order, sharding layouts) is a dict on one node's ``meta["custom"]``,
which torch.export serializes and run_decompositions keeps.
"""
from __future__ import annotations

import operator

import torch
from torch.export import ExportedProgram

META_KEY = "predispatch"


def program_meta(ep_or_gm) -> dict:
    """predispatch's record in a program, graph module or graph (write-back
    modes, autocast policy, module order)."""
    gm = ep_or_gm.graph_module if isinstance(ep_or_gm, ExportedProgram) else ep_or_gm
    graph = gm if isinstance(gm, torch.fx.Graph) else gm.graph
    for node in graph.nodes:
        if META_KEY in node.meta.get("custom", {}):
            return node.meta["custom"][META_KEY]
    return {}


def set_program_meta(gm: torch.fx.GraphModule, meta: dict) -> None:
    """Kept on the first node computing a tensor: torch.export serializes the
    ``meta["custom"]`` of op nodes, not that of the graph module or its output
    node, and run_decompositions keeps it on tensor ops (not on the ``sym_size``
    nodes of dynamic shapes, which it makes anew)."""
    holder = next((n for n in gm.graph.nodes if n.op == "call_function" and n.target is not operator.getitem
                   and _computes_a_tensor(n)), None)
    holder = holder or next((n for n in gm.graph.nodes if n.op == "call_function"), gm.graph.output_node())
    holder.meta.setdefault("custom", {})[META_KEY] = meta


def _computes_a_tensor(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val))
