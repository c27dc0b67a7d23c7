"""The joint graph, an argument a backward op does not read given as ``None``.

In train mode a batch norm's backward reads the batch's statistics the
forward saved (``save_mean``, ``save_invstd``), not the running ones; its
schema still takes them. AOTAutograd saves whatever the backward graph
takes, so the forward made a copy of each running statistic before its
update (a ``clone``: the update writes in place) only for the backward to
ignore it: two small tensors per batch norm, each step. Eager's node saves
them too, but as the buffers themselves. Given ``None`` (what a batch norm
without running statistics passes), nothing is saved or cloned.

One rule per op: (the op, the position of the flag that says the arguments
are unread, the positions of those arguments).
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten

# op -> (position of a bool argument, the positions not read where it is True)
UNREAD_WHEN = {
    aten.native_batch_norm_backward.default: (7, (3, 4)),  # train: running_mean, running_var
}


def unread_arguments_as_none(graph: torch.fx.Graph) -> None:
    """``graph`` (changed): each argument its op does not read, by the rule
    table, is ``None``; what computed it only for that goes."""
    for node in graph.nodes:
        rule = UNREAD_WHEN.get(node.target) if node.op == "call_function" else None
        if rule is None or len(node.args) <= max(rule[1]) or node.args[rule[0]] is not True:
            continue
        unread = [node.args[position] for position in rule[1]]
        node.args = tuple(None if i in rule[1] else a for i, a in enumerate(node.args))
        for value in unread:
            _erase_if_dead(graph, value)


def _erase_if_dead(graph: torch.fx.Graph, node) -> None:
    """``node`` and what computed only it, where nothing reads them and they
    neither write nor draw."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function" and not node.users
            and not node.is_impure() and torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ())):
        return
    inputs = node.all_input_nodes
    graph.erase_node(node)
    for value in inputs:
        _erase_if_dead(graph, value)
