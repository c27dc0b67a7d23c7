"""The functional stage: G1's safety net, no in-place op left in any graph.

Functionalization turns mutations of parameters, buffers, inputs and
intermediates into data flow; an in-place op left in the graph mutates
something else (a plain tensor attribute, lifted as a constant), which a
functional program cannot express.
"""
from __future__ import annotations

import torch

from ..errors import ExportError, node_location
from ..ir.regions import mutable_op_nodes


def refuse_remaining_mutations(gm: torch.fx.GraphModule) -> None:
    for node in mutable_op_nodes(gm):
        raise ExportError(
            f"an in-place update ({node.target}) at {node_location(node.meta.get('stack_trace'))} "
            "of a tensor that is neither a parameter, a buffer nor an input (a plain tensor "
            "attribute, a global, a closure's tensor) cannot be exported soundly; register "
            "it with register_buffer or pass it as an input")
