"""Views of a value whose layout is picked at run time, written as reshapes.

A composite the program keeps (``OpPolicy``) runs as torch's composite, whose
kernel, picked at run time, lays its output out: the CPU's
``scaled_dot_product_attention`` takes its fused kernel where no input
requires grad (a (B, H, L, E) output laid out as (B, L, H, E)), its math
kernel where the mask does (contiguous). The trace, above autograd, sees the
fused one. A reshape it decomposed into a view of such an output, or of a
view, element-wise result or cast of it (``o.transpose(1, 2).flatten(2)``),
fails at run time on the other layout, in ``ep.module()`` and in
``compile_training``'s trace alike: it becomes a reshape, a view where the
layout allows and a copy where not, as eager's is (the graph is
functional: a copy changes no value). A kept composite's output counts as
picked at run time where the trace saw it laid out otherwise than
contiguous: the kernels a composite falls back to (a math kernel) give
contiguous outputs, a fused kernel's layout is its own.
"""
from __future__ import annotations

import operator

import torch

from .. import _torch

_VIEW = torch.ops.aten.view.default
_RESHAPE = torch.ops.aten.reshape.default


def views_of_run_time_layouts_as_reshapes(gm: torch.fx.GraphModule) -> None:
    views = gm.graph.find_nodes(op="call_function", target=_VIEW)
    if not views:
        return
    laid_out = _RunTimeLayouts()
    for view in views:
        if laid_out.at_run_time(view.args[0]):
            view.target = _RESHAPE
            view.args = (view.args[0], _inferred_size(view), *view.args[2:])
    gm.recompile()


def _inferred_size(view: torch.fx.Node):
    """The view's size with its -1 written out where the trace knows it as a number: the reshape
    a re-export traces decomposes into a view of the inferred size (G7), and turns back into
    this reshape."""
    size, val = view.args[1], view.meta.get("val")
    if not isinstance(val, torch.Tensor) or -1 not in size:
        return size
    inferred = val.shape[list(size).index(-1)]
    return [inferred if s == -1 else s for s in size] if isinstance(inferred, int) else size


class _RunTimeLayouts:
    """Which values of one graph are laid out as a composite's run-time kernel picks, asked once each."""

    def __init__(self):
        self.known: dict = {}  # node -> bool

    def at_run_time(self, node) -> bool:
        """Is ``node`` laid out by a composite's output whose layout its run-time kernel picks: up
        through views, element-wise ops and casts?"""
        todo = [node]
        while todo:  # depth first, each node's inputs answered before it
            n = todo[-1]
            if not isinstance(n, torch.fx.Node) or n in self.known:
                todo.pop()
                continue
            if n.op != "call_function" or not _follows_its_inputs(n):
                self.known[n] = n.op == "call_function" and self._picked_at_run_time(n)
                todo.pop()
                continue
            unknown = [i for i in n.all_input_nodes if i not in self.known]
            if unknown:
                todo.extend(unknown)
                continue
            self.known[n] = any(self.known[i] for i in n.all_input_nodes)
            todo.pop()
        return isinstance(node, torch.fx.Node) and self.known[node]

    @staticmethod
    def _picked_at_run_time(node: torch.fx.Node) -> bool:
        """A kept composite's output the trace saw laid out otherwise than contiguous."""
        if not (isinstance(node.target, _torch.OpOverload) and _torch.has_composite_implicit_kernel(node.target)):
            return False
        return any(isinstance(v, torch.Tensor) and not _torch.laid_out_contiguous(v)
                   for v in _torch.pytree.tree_leaves(node.meta.get("val")))


def _follows_its_inputs(node: torch.fx.Node) -> bool:
    """Is the node's output laid out as its inputs are: a view, an element-wise op, a cast or copy
    (keeping the memory format)?"""
    target = node.target
    if target is operator.getitem:
        return True
    if not isinstance(target, _torch.OpOverload):
        return False
    if target in _COPIES:
        return node.kwargs.get("memory_format") in (None, torch.preserve_format)
    return not _torch.returns_new_memory(target) or torch.Tag.pointwise in target.tags


_COPIES = {torch.ops.aten._to_copy.default, torch.ops.aten.clone.default}
