"""Eager autocast's cast cache, made data flow.

Inside an enabled autocast block, eager casts a float32 leaf that requires
grad (a parameter, an input that is a leaf) to the lower precision once and
caches the cast until the outermost autocast block exits; the cache does not
see in-place updates. A parameter updated in place inside the block after
its first cast is still read as its old cast by later lower-precision ops
(``w.mul_(-1)`` between two ``linear``s: the second sees the old ``w``).

The trace runs with the cache off, so the graph would read the new value.
:class:`CastCache` notes, per outermost block, the value each parameter,
buffer or input had when an op first cast it; a later op that casts it
again after it was updated reads ``predispatch.autocast_cached(source,
first, current)`` instead, which at run time is ``first`` where eager's
autocast would have cached ``source`` (the cache enabled, ``source`` a
float32 leaf that requires grad: a frozen parameter or an input that does
not require grad is never cached) and ``current`` otherwise.
"""
from __future__ import annotations

import torch

from .._torch import pytree
from .. import _torch
from ..ir import ops


class CastCache:
    """What eager's cast cache holds, followed while the forward is traced."""

    def __init__(self, sources: dict[int, torch.fx.Node]):
        self.sources = sources  # id of a parameter/buffer/input FunctionalTensor -> its placeholder
        self.first: dict[int, torch.fx.Node] = {}  # id -> its value's node at its first cast

    def reads(self, args, kwargs, current_node) -> list[tuple[torch.Tensor, torch.fx.Node]]:
        """(tensor, its node now) of the call's float32 sources, inside autocast."""
        if _torch.autocast_nesting() == 0:
            self.first.clear()  # the outermost block exited: eager cleared the cache
            return []
        return [(t, node) for t in pytree.tree_leaves((args, kwargs))
                if isinstance(t, _torch.FunctionalTensor) and id(t) in self.sources
                and t.dtype == torch.float32 and (node := current_node(t)) is not None]

    def after(self, reads, out, mark: torch.fx.Node) -> None:
        """The call read ``reads`` and made the nodes after ``mark``: if it cast
        them to autocast's lower precision, the first cast is noted, and a
        later one of an updated value reads the first instead."""
        if not reads or not _casts_down(reads[0][0].device.type, out):
            return
        stale = {}
        for t, node in reads:
            first = self.first.setdefault(id(t), node)
            if first is not node:
                stale[node] = (self.sources[id(t)], first)
        if stale:
            _redirect(mark, stale)


def _casts_down(device: str, out) -> bool:
    """Did autocast cast the call's float32 inputs down (its result has the
    lower precision)?"""
    if not torch.is_autocast_enabled(device):
        return False
    low = torch.get_autocast_dtype(device)
    return any(isinstance(o, torch.Tensor) and o.dtype == low for o in pytree.tree_leaves(out))


def _redirect(mark: torch.fx.Node, stale: dict) -> None:
    """Nodes after ``mark`` reading a stale value read autocast_cached instead."""
    graph = mark.graph
    cached = {}
    for node in list(_torch.nodes_after(mark)):
        for value in [i for i in node.all_input_nodes if i in stale]:
            if value not in cached:
                source, first = stale[value]
                with graph.inserting_before(node):
                    cached[value] = graph.call_function(ops.AUTOCAST_CACHED, (source, first, value))
                cached[value].meta.update({k: v for k, v in node.meta.items()
                                           if k in ("stack_trace", "nn_module_stack")})
                cached[value].meta["val"] = value.meta.get("val")
            node.replace_input_with(value, cached[value])
