"""The op-by-op backward graph, without AOTAutograd's detaches of saved tensors.

AOTAutograd detaches each activation it saves (``detach`` in the forward
graph, again in the backward graph before the op that reads it): in a
ResNet, a relu's output feeding its ``threshold_backward``. In a backward
graph that runs with autograd off (the compiled function's backward), a
``detach`` another op reads computes nothing: each is a tensor made and
dropped per step, where eager's engine reads the saved tensor itself. The
graph shown (``backward_graph``) keeps them.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def without_read_detaches(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (changed): each ``detach`` only ops read (not an output of the
    graph) replaced by the tensor it detaches."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and node.target is aten.detach.default and node.users
                and all(user.op == "call_function" for user in node.users)):
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.recompile()
    return gm
