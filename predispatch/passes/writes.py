"""Make functionalized writes differentiable.

Functionalization turns an in-place write into a functional op that makes
the written tensor's new value. Two of those are wrong to differentiate in
a pre-dispatch graph, which runs above autograd:

* ``dst.copy_(src)`` (and every index assignment ``t[i] = v``, which is
  ``t[i].copy_(v)``) becomes ``aten.copy(dst, src)``, which has no
  derivative formula (only copy_ has one): a backward through it fails.
  It is written ``where(False, dst, src')`` with ``src'`` = src cast to dst's
  dtype and device: the same values (src broadcast to dst's shape, in a new
  tensor laid out as dst, which ``where`` takes from its first tensor
  operand: a view replayed on the copy, ``t().view(...)``, needs dst's
  strides) and, as eager's CopyBackwards gives, the gradient of ``src`` for
  src and a zero gradient for dst (none, for the recorder's own write of a
  detached alias's values to the memory it shares: ``VALUES_ONLY``).
* a write through an ``as_strided`` view becomes ``aten.as_strided_scatter``,
  whose derivative for ``self`` is wrong in torch 2.13 (it passes the
  gradient of the written part, not of the rest: gradcheck fails). It is
  written ``where(mask, as_strided_scatter(zeros, src), self)``, the mask
  the written part: torch's gradient for ``src`` is right, ``where`` gives
  ``self`` the rest. (A scatter into zeros has no gradient to get wrong: a
  re-export leaves the rewrite as it is.) torch's gradient for ``src``
  takes ``self`` contiguous: a permutation of a contiguous tensor (an input
  given transposed) is scattered into zeros permuted to be contiguous, then
  permuted back.

One pass, a rule per op (:data:`_REWRITES`).
"""
from __future__ import annotations

import torch
import torch.fx

from .. import _torch
from ..ir.meta_keys import VALUES_ONLY
from ..trace.inplace_rules import memory_order

aten = torch.ops.aten


def _node(graph, target, args, kwargs, val):
    node = graph.call_function(target, args, kwargs)
    node.meta["val"] = val
    return node


# ops whose new tensor no gradient can reach (its values are not its inputs')
FACTORIES = frozenset({aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
                       aten.full_like.default, aten.empty.memory_format, aten.empty_strided.default,
                       aten.zeros.default, aten.ones.default, aten.full.default})


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape, a.stride(), a.dtype, a.device) == (b.shape, b.stride(), b.dtype, b.device)


def _is_the_value(src: torch.fx.Node, dst: torch.fx.Node, copy: torch.fx.Node) -> bool:
    """Can ``src`` stand for the copy of it into ``dst``? Where ``dst`` is a
    factory's (no gradient for it) and ``src`` memory of its own (an op's
    result aliasing none of its inputs), laid out as ``dst``, read by the
    copy only (else two values the program holds apart would be one tensor)."""
    return (dst.target in FACTORIES and src.op == "call_function" and _torch.returns_new_memory(src.target)
            and list(src.users) == [copy] and _same_layout(src.meta["val"], dst.meta["val"]))


def _copy_as_differentiable_ops(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    dst, src = node.args[0], node.args[1]
    want, have = dst.meta["val"], src.meta["val"]
    if have.dtype != want.dtype or have.device != want.device:
        src = _node(graph, aten._to_copy.default, (src,), {"dtype": want.dtype, "device": want.device},
                    have.to(dtype=want.dtype, device=want.device))
    if _is_the_value(src, dst, node):
        return src
    if node.meta.get(VALUES_ONLY):  # the recorder's write of values: dst's history is not the memory's
        dst = _node(graph, aten.detach.default, (dst,), {}, want)
    take_dst = _node(graph, aten.scalar_tensor.default, (False,), {"dtype": torch.bool, "device": want.device},
                     torch.zeros((), dtype=torch.bool, device="meta"))
    return _node(graph, aten.where.self, (take_dst, dst, src), {}, node.meta["val"])


def _as_strided_scatter_as_differentiable_ops(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    self, src, *layout = node.args
    mine, theirs = self.meta["val"], src.meta["val"]
    nothing = _node(graph, aten.zeros_like.default, (self,), {"dtype": torch.bool},
                    torch.empty_like(mine, dtype=torch.bool))
    everything = _node(graph, aten.ones_like.default, (src,), {"dtype": torch.bool},
                       torch.empty_like(theirs, dtype=torch.bool))
    written = _node(graph, aten.as_strided_scatter.default, (nothing, everything, *layout), node.kwargs,
                    torch.empty_like(mine, dtype=torch.bool))
    zeros = _node(graph, aten.zeros_like.default, (self,), {}, torch.empty_like(mine))
    order = _contiguous_order(mine)
    if order is None:
        placed = _node(graph, aten.as_strided_scatter.default, (zeros, src, *layout), node.kwargs,
                       node.meta["val"])
    else:  # torch's gradient for src is right for a contiguous tensor only: scattered into one, laid back
        zeros = _node(graph, aten.permute.default, (zeros, order), {}, zeros.meta["val"].permute(order))
        scattered = _node(graph, aten.as_strided_scatter.default, (zeros, src, *layout), node.kwargs,
                          torch.empty_like(zeros.meta["val"]))
        back = [order.index(d) for d in range(len(order))]
        placed = _node(graph, aten.permute.default, (scattered, back), {}, scattered.meta["val"].permute(back))
    return _node(graph, aten.where.self, (written, placed, self), {}, node.meta["val"])


def _contiguous_order(t: torch.Tensor) -> list[int] | None:
    """The order of ``t``'s dims that lays it out contiguously, where ``t`` is
    a permutation of a contiguous tensor (``y.t()``) and not contiguous
    itself (pytorch/pytorch#90992: as_strided_scatter takes ``self``
    contiguous, and its gradient for ``src`` reads positions as if it were);
    None otherwise (contiguous, symbolic, or not dense)."""
    order = memory_order(t)
    return order if order is not None and t.permute(order).is_contiguous() else None


_REWRITES = {
    aten.copy.default: _copy_as_differentiable_ops,
    aten.as_strided_scatter.default: _as_strided_scatter_as_differentiable_ops,
}


def replace_writes(gm: torch.fx.GraphModule) -> int:
    """Rewrite every node :data:`_REWRITES` names; returns how many."""
    graph, count, impure = gm.graph, 0, _torch.impure_by_op()
    for node in list(graph.nodes):
        rewrite = _REWRITES.get(node.target) if node.op == "call_function" else None
        if rewrite is None or (node.target is aten.copy.default and node.kwargs) or (
                node.target is aten.as_strided_scatter.default and not _may_carry_a_gradient(node.args[0])):
            continue
        mark = node.prev
        with graph.inserting_before(node):
            value = rewrite(graph, node)
        for new in _nodes_between(mark, node):
            for key in ("stack_trace", "nn_module_stack"):
                if key in node.meta:
                    new.meta[key] = node.meta[key]
        node.replace_all_uses_with(value)
        operands = node.all_input_nodes
        graph.erase_node(node)
        _erase_if_dead(graph, operands, impure)
        count += 1
    return count


def _erase_if_dead(graph: torch.fx.Graph, nodes: list, impure) -> None:
    """Nodes a rewrite left unread go, and what only they read (a factory
    ``copy_`` wrote over): a program exported again has none of them."""
    for node in nodes:
        if node.op == "call_function" and not node.users and not impure(node):
            operands = node.all_input_nodes
            graph.erase_node(node)
            _erase_if_dead(graph, operands, impure)


def _may_carry_a_gradient(node: torch.fx.Node) -> bool:
    """Not a factory's zeros (permuted or not) or a mask (the rewrite's own
    scatters: a re-export leaves them as they are)."""
    val = node.meta.get("val")
    if node.target is aten.permute.default:
        node = node.args[0]
    return isinstance(val, torch.Tensor) and val.is_floating_point() and node.target is not aten.zeros_like.default


def _nodes_between(first, last):
    node = first.next
    while node is not last:
        yield node
        node = node.next
