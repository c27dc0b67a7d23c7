"""A DTensor redistribution as the rank's local ops: explicit collectives.

A placement is written as text (``"R"``, ``"S(0)"``, ``"P(sum)"``), a mesh
dimension as :class:`MeshDim` (the process group's name, its size, this
rank's coordinate): plain values, fixed at export time, so that a plan can
live on an autograd.Function's ctx and be traced into a graph.

:data:`_RULES` maps (from, to) placement kinds to the local ops that move a
shard: every collective is a ``torch.ops._c10d_functional`` op followed by
its ``wait_tensor``. Every rule returns a new tensor (never its input nor a
view of it), as an exported autograd.Function's forward must.

:class:`Redistribute` is the redistribution with DTensor's backward: the
gradient redistributed from the placement it arrives in back to where the
value came from (a Partial source takes its gradient Replicate, as DTensor's
``Redistribute.backward`` does). Traced by predispatch's autograd.Function
capture, it becomes one op whose forward and backward subgraphs hold the
collectives.
"""
from __future__ import annotations

import re
from typing import NamedTuple

import torch

_c10d = torch.ops._c10d_functional


class MeshDim(NamedTuple):
    """One dimension of a device mesh, as this rank sees it (a named tuple of
    plain values: fixed at export time, an autograd.Function's ctx may keep it)."""

    group: str  # the process group's name, what _c10d_functional ops take
    size: int
    rank: int  # this rank's coordinate along the dimension


class Unsupported(Exception):
    """A redistribution these rules cannot lower (the caller names the construct)."""


_PLACEMENT = re.compile(r"^(R|S\((-?\d+)\)|P\((\w+)\))$")


def kind(placement: str) -> str:
    return placement[0]


def shard_dim(placement: str, ndim: int) -> int:
    d = int(_PLACEMENT.match(placement).group(2))
    return d % ndim if ndim else d


def _identity(x, src, dst, dim):
    return x.clone()


def _reduce_op(placement: str) -> str:
    op = _PLACEMENT.match(placement).group(3)
    if op not in _REDUCE_OPS:
        raise Unsupported(f"a {placement} value reduced (only 'sum' and 'avg' are lowered)")
    return op


_REDUCE_OPS = ("sum", "avg")


def _averaged(x, op: str, dim: MeshDim):
    """A sum over the ranks, made the mean for 'avg' (gloo reduces no 'avg')."""
    return x / dim.size if op == "avg" else x


def _all_reduce(x, src, dst, dim):
    op = _reduce_op(src)
    return _averaged(_c10d.wait_tensor(_c10d.all_reduce(x, "sum", dim.group)), op, dim)


def _all_gather(x, src, dst, dim):
    d = shard_dim(src, x.dim())
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x.contiguous(), dim.size, dim.group))
    return gathered if d == 0 else torch.cat(torch.chunk(gathered, dim.size, 0), d)


def _local_chunk(x, src, dst, dim):
    d = shard_dim(dst, x.dim())
    _check_even(x, d, dim, dst)
    return torch.chunk(x, dim.size, d)[dim.rank].clone()


def _reduce_scatter(x, src, dst, dim):
    op = _reduce_op(src)
    d = shard_dim(dst, x.dim())
    _check_even(x, d, dim, dst)
    rows = x if d == 0 else torch.cat(torch.chunk(x, dim.size, d), 0)
    scattered = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(rows.contiguous(), "sum", dim.size, dim.group))
    return _averaged(scattered, op, dim)


def _partition(x, src, dst, dim):
    if _PLACEMENT.match(dst).group(3) != "sum":
        raise Unsupported(f"a Replicate value made {dst}")
    return x / dim.size  # DTensor's Replicate -> Partial(sum): each rank holds v / n


def _check_even(x, d, dim, placement):
    if x.shape[d] % dim.size:
        raise Unsupported(f"{placement} of a dimension of size {x.shape[d]} over {dim.size} ranks "
                          "(uneven shards are not lowered)")


# (from kind, to kind) -> the local ops; "S"->"S" of another dim (all-to-all) is not lowered
_RULES = {
    ("R", "R"): _identity, ("P", "P"): _identity,
    ("P", "R"): _all_reduce,
    ("S", "R"): _all_gather,
    ("R", "S"): _local_chunk,
    ("P", "S"): _reduce_scatter,
    ("R", "P"): _partition,
}


def redistribute(x: torch.Tensor, plan: tuple) -> torch.Tensor:
    """``x`` moved by ``plan``: one (from, to, MeshDim) per mesh dimension,
    applied in order."""
    if all(src == dst for src, dst, _ in plan):
        return x.clone()
    for src, dst, dim in plan:
        if src == dst:
            continue
        rule = _RULES.get((kind(src), kind(dst)))
        if rule is None:
            raise Unsupported(f"a redistribution {src} -> {dst} (not lowered)")
        x = rule(x, src, dst, dim)
    return x


def check(plan: tuple, shape: tuple | None = None) -> None:
    """Raise :class:`Unsupported` now, rather than while tracing, for a plan
    the rules cannot lower (on a local value of ``shape``, when given)."""
    if sum(src != dst for src, dst, _ in plan) > 1:  # the order of the moves matters then
        raise Unsupported("a redistribution over more than one mesh dimension at once "
                          f"({', '.join(s for s, _, _ in plan)} -> {', '.join(d for _, d, _ in plan)}; "
                          "not lowered)")
    for src, dst, dim in plan:
        if src != dst and (kind(src), kind(dst)) not in _RULES:
            raise Unsupported(f"a redistribution {src} -> {dst} (not lowered)")
        if shape is not None and src != dst and kind(dst) == "S" and kind(src) != "S":
            d = shard_dim(dst, len(shape))
            if shape[d] % dim.size:
                raise Unsupported(f"{dst} of a dimension of size {shape[d]} over {dim.size} ranks "
                                  "(uneven shards are not lowered)")
        for p in (src, dst):
            if kind(p) == "P" and _PLACEMENT.match(p).group(3) not in _REDUCE_OPS:
                raise Unsupported(f"a {p} placement (only Partial 'sum' and 'avg' are lowered)")


class Redistribute(torch.autograd.Function):
    """``forward_plan`` applied to ``x``; its gradient moved by ``backward_plan``."""

    @staticmethod
    def forward(ctx, x, forward_plan, backward_plan):
        ctx.backward_plan = backward_plan
        return redistribute(x, forward_plan)

    @staticmethod
    def backward(ctx, grad):
        return redistribute(grad, ctx.backward_plan), None, None
