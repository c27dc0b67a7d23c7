"""The op-by-op backend's graphs, a pointwise op writing into an operand nothing reads after it.

A functional graph gives every op's result new memory. Eager does not
always: its autograd sums the two gradients of a tied weight (a language
model's embedding and head) in place. New memory is not free on CPU: a
large tensor is mapped afresh, and each of its pages faults on first
write (a [30522, 256] float gradient: some 7,600 faults, more than the add
itself costs). So the graphs run op by op write a pointwise op's result
into an operand that is a fresh result nothing else uses, of the result's
own shape, dtype and strides (any strides for a gradient the backward
returns): the first operand, or the second of an op whose operands commute. The graphs shown
(``forward_graph``, ``backward_graph``) stay functional.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from ... import _torch

aten = torch.ops.aten


@functools.lru_cache(maxsize=None)
def in_place_twin(op) -> _torch.OpOverload | None:
    """The in-place variant of a deterministic pointwise aten op, taking the same arguments."""
    if not (isinstance(op, _torch.OpOverload) and op.namespace == "aten" and torch.Tag.pointwise in op.tags
            and torch.Tag.nondeterministic_seeded not in op.tags):
        return None
    name, _, overload = op.name().split("::")[1].partition(".")
    twin = getattr(getattr(aten, f"{name}_", None), overload or "default", None)
    if twin is None or [a.name for a in twin._schema.arguments] != [a.name for a in op._schema.arguments]:
        return None
    return twin


@functools.lru_cache(maxsize=None)
def _returns_its_first_operand(op) -> bool:
    """Is ``op`` an in-place op, writing its first operand and returning it (``add_``)?"""
    if not isinstance(op, _torch.OpOverload) or len(op._schema.returns) != 1 or not op._schema.arguments:
        return False
    written, returned = op._schema.arguments[0].alias_info, op._schema.returns[0].alias_info
    return (written is not None and written.is_write and returned is not None
            and returned.before_set == written.before_set)


def _fresh(node: torch.fx.Node) -> bool:
    """Is ``node``'s value memory of its own: an op's result that aliases
    none of its inputs, or an in-place op's, written into such a result
    that nothing else reads (a residual ``add_`` a ``relu`` follows)?"""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return _fresh(node.args[0])
    if _returns_its_first_operand(node.target):
        operand = node.args[0]
        return isinstance(operand, torch.fx.Node) and list(operand.users) == [node] and _fresh(operand)
    return _torch.returns_new_memory(node.target)


def layout_of(node) -> tuple | None:
    """(shape, strides, dtype, device) of a node's tensor value, None if it has none."""
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return None
    return tuple(map(str, val.shape)), tuple(map(str, val.stride())), val.dtype, val.device


# ops whose two tensor operands may trade places (IEEE addition and product are commutative)
COMMUTATIVE = frozenset({aten.add.Tensor, aten.mul.Tensor})


def _dies_here(operand, node: torch.fx.Node, any_layout: bool) -> bool:
    """Is ``operand`` memory of its own that nothing reads after ``node``, and
    laid out as ``node``'s result (or ``any_layout`` will do)?"""
    if not (isinstance(operand, torch.fx.Node) and _fresh(operand) and list(operand.users) == [node]):
        return False
    layout = layout_of(operand)
    if layout is None or layout[2:] != layout_of(node)[2:]:  # dtype, device
        return False
    return any_layout and layout[0] == layout_of(node)[0] or layout == layout_of(node)


def _only_a_gradient(node: torch.fx.Node, backward: bool) -> bool:
    """Is ``node``'s value only returned, by a backward graph? A gradient's
    strides are not read: autograd lays it out as its parameter is
    (AccumulateGrad's layout contract), a copy where they differ."""
    return backward and all(user.op == "output" for user in node.users)


def _operand_to_write_into(node: torch.fx.Node, backward: bool) -> int | None:
    """The position (0 or 1) of the operand ``node`` can write its result into, if any."""
    if node.op != "call_function" or in_place_twin(node.target) is None or not node.args:
        return None
    if layout_of(node) is None:
        return None
    any_layout = _only_a_gradient(node, backward)
    if _dies_here(node.args[0], node, any_layout):
        return 0
    if (node.target in COMMUTATIVE and not node.kwargs and len(node.args) == 2
            and _dies_here(node.args[1], node, any_layout)):
        return 1
    return None


def write_into_dead_operands(gm: torch.fx.GraphModule, backward: bool = False) -> torch.fx.GraphModule:
    """``gm`` (changed): each pointwise op one of whose operands dies there
    writes into it (the first; or the second, of an op whose operands
    commute). Laid out as the result, or in any layout where the result is
    only a gradient the ``backward`` graph returns."""
    for node in gm.graph.nodes:
        position = _operand_to_write_into(node, backward)
        if position is not None:
            node.target = in_place_twin(node.target)
            if position == 1:
                node.args = node.args[::-1]
    gm.recompile()
    return gm
