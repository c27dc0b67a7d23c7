"""Make functionalized copies differentiable.

Functionalization turns ``dst.copy_(src)`` (and every index assignment
``t[i] = v``, which is ``t[i].copy_(v)``) into ``aten.copy(dst, src)``. In a
pre-dispatch graph that op runs above autograd, and aten::copy has no
derivative formula (only copy_ has one), so a backward through it fails.

``copy(dst, src)`` is written ``where(False, dst, src')`` with ``src'`` = src
cast to dst's dtype and device: the same values (src broadcast to dst's
shape, in a new tensor laid out as dst, which ``where`` takes from its first
tensor operand: a view replayed on the copy, ``t().view(...)``, needs dst's
strides) and, as eager's CopyBackwards gives, the gradient of ``src`` for
src and a zero gradient for dst.
"""
from __future__ import annotations

import torch
import torch.fx

aten = torch.ops.aten


def _copy_as_differentiable_ops(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    dst, src = node.args[0], node.args[1]
    want, have = dst.meta["val"], src.meta["val"]
    if have.dtype != want.dtype or have.device != want.device:
        src = graph.call_function(aten._to_copy.default, (src,),
                                  {"dtype": want.dtype, "device": want.device})
        src.meta["val"] = have.to(dtype=want.dtype, device=want.device)
    take_dst = graph.call_function(aten.scalar_tensor.default, (False,),
                                   {"dtype": torch.bool, "device": want.device})
    take_dst.meta["val"] = torch.zeros((), dtype=torch.bool, device="meta")
    value = graph.call_function(aten.where.self, (take_dst, dst, src))
    value.meta["val"] = node.meta["val"]
    for key in ("stack_trace", "nn_module_stack"):
        if key in node.meta:
            for new in (take_dst, value):
                new.meta[key] = node.meta[key]
    return value


def replace_copies(gm: torch.fx.GraphModule) -> int:
    """Rewrite every ``aten.copy.default`` node; returns how many."""
    graph, count = gm.graph, 0
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is aten.copy.default and not node.kwargs:
            with graph.inserting_before(node):
                node.replace_all_uses_with(_copy_as_differentiable_ops(graph, node))
            graph.erase_node(node)
            count += 1
    return count
