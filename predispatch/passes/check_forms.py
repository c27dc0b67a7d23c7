"""The form of a run-time check's condition, read from the nodes that compute it.

A program exported again runs its checks as ops of its graph, and torch's
runtime-assert pass may write them again beside (G7). Their conditions'
values cannot always tell the two apart: once a check pinned a value
(``u0 == 6``), every condition on it reads ``True``. What the nodes compute
can: ``ge(item, 6)`` is one condition however often it is written, and
``eq(sym_size, sym_size)`` none at all. Each node that is no symbolic
arithmetic (``item``) is a symbol of its own; two reads of one tensor's
size (``sym_size(slice, 0)``) are one.
"""
from __future__ import annotations

import operator

import sympy
import torch

from .. import _torch

_RELATIONS = {operator.ge: sympy.Ge, operator.gt: sympy.Gt, operator.le: sympy.Le, operator.lt: sympy.Lt,
              operator.eq: sympy.Eq, operator.ne: sympy.Ne}
_ARITHMETIC = {operator.add: operator.add, operator.sub: operator.sub, operator.mul: operator.mul,
               operator.neg: operator.neg, operator.and_: sympy.And, operator.or_: sympy.Or,
               torch.sym_not: sympy.Not}


def written_expression(condition: torch.fx.Node):
    """What the condition's nodes compute, a sympy expression over a symbol per
    node that is no symbolic arithmetic; None where it cannot be read."""
    try:
        expr = _expression(condition, {})
    except (TypeError, ValueError, AttributeError):
        return None
    return expr if isinstance(expr, sympy.Basic) else None


def symbols_read_at(graph: torch.fx.Graph) -> dict:
    """Each symbol :func:`written_expression` names -> the position of the
    first node in ``graph`` it stands for (the graph's order)."""
    at = {}
    for i, node in enumerate(graph.nodes):
        if isinstance(node.meta.get("val"), (torch.SymInt, torch.SymBool, torch.SymFloat)):
            at.setdefault(_symbol(node), i)
    return at


def written_form(expr):
    """A written condition's form (as :func:`predispatch._torch.condition_form`
    gives it); ``True`` where it holds whatever its symbols are; None where
    there is none."""
    if expr is None:
        return None
    return True if expr is sympy.true else _torch.relation_form(expr)


def bounds_checked(expr, bounds: dict) -> None:
    """``bounds`` (symbol -> (lower or None, upper or None)) narrowed by what a
    check of ``expr`` bounds: one symbol against a number (``ge(item, 6)``,
    ``eq(item, 6)``), or a conjunction of such."""
    for part in (expr.args if isinstance(expr, sympy.And) else (expr,)):
        symbol, number, relation = _symbol_against_number(part)
        strict = relation in (sympy.Gt, sympy.Lt)
        if symbol is None or (strict and not symbol.is_integer):  # a real's strict bound: no closed range
            continue
        low, high, step = *bounds.get(symbol, (None, None)), (1 if strict else 0)
        if relation in (sympy.Ge, sympy.Gt, sympy.Eq):
            low = max(x for x in (low, number + step) if x is not None)
        if relation in (sympy.Le, sympy.Lt, sympy.Eq):
            high = min(x for x in (high, number - step) if x is not None)
        bounds[symbol] = (low, high)


_MIRRORED = {sympy.Ge: sympy.Le, sympy.Gt: sympy.Lt, sympy.Le: sympy.Ge, sympy.Lt: sympy.Gt, sympy.Eq: sympy.Eq}


def _symbol_against_number(relation) -> tuple:
    if type(relation) not in _MIRRORED:
        return None, None, None
    lhs, rhs, kind = relation.lhs, relation.rhs, type(relation)
    if isinstance(rhs, sympy.Symbol) and rhs.is_number is False and lhs.is_number:
        lhs, rhs, kind = rhs, lhs, _MIRRORED[kind]
    if isinstance(lhs, sympy.Symbol) and rhs.is_number and rhs.is_finite:
        return lhs, rhs, kind
    return None, None, None


def _expression(x, memo: dict):
    if not isinstance(x, torch.fx.Node):
        if isinstance(x, bool):
            return sympy.true if x else sympy.false
        if isinstance(x, (int, float)):
            return sympy.sympify(x)
        raise TypeError(f"not a symbolic operand: {type(x).__name__}")
    if x not in memo:
        memo[x] = _computed(x, memo)
    return memo[x]


def _computed(node: torch.fx.Node, memo: dict):
    args = [_expression(a, memo) for a in node.args] if node.op == "call_function" and not node.kwargs \
        and (node.target in _RELATIONS or node.target in _ARITHMETIC or node.target is torch.sym_ite) else None
    if args is None:
        return _symbol(node)
    if node.target in _RELATIONS:
        return _RELATIONS[node.target](*args)
    if node.target is torch.sym_ite:
        condition, then, otherwise = args
        return sympy.Piecewise((then, condition), (otherwise, True))
    return _ARITHMETIC[node.target](*args)


# a tensor's metadata, read by a node of its own: two reads of one tensor's are one value
_METADATA_READS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                   torch.ops.aten.sym_storage_offset.default, torch.ops.aten.sym_numel.default}


def _symbol(node: torch.fx.Node):
    val = node.meta.get("val")
    if node.target in _METADATA_READS and isinstance(val, torch.SymInt):
        read = ",".join(a.name if isinstance(a, torch.fx.Node) else repr(a) for a in node.args)
        return sympy.Symbol(f"{node.target}({read})", integer=True)
    if isinstance(val, torch.SymBool):
        return sympy.Symbol(f"node_{node.name}")
    if isinstance(val, torch.SymInt):
        return sympy.Symbol(f"node_{node.name}", integer=True)
    if isinstance(val, torch.SymFloat):
        return sympy.Symbol(f"node_{node.name}", real=True)
    raise TypeError(f"not a symbolic value: {node.name}")
