"""The form of a run-time check's condition, read from the nodes that compute it.

A program exported again runs its checks as ops of its graph, and torch's
runtime-assert pass may write them again beside (G7). Their conditions'
values cannot always tell the two apart: once a check pinned a value
(``u0 == 6``), every condition on it reads ``True``. What the nodes compute
can: ``ge(item, 6)`` is one condition however often it is written, and
``eq(sym_size, sym_size)`` none at all. Each node that is no symbolic
arithmetic (``item``, ``sym_size``) is a symbol of its own.
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


def written_form(condition: torch.fx.Node):
    """The condition's form (as :func:`predispatch._torch.condition_form` gives
    it) from what its nodes compute; ``True`` where it holds whatever its
    symbols are; None where it cannot be read."""
    try:
        expr = _expression(condition, {})
    except (TypeError, ValueError, AttributeError):
        return None
    if expr is sympy.true:
        return True
    return _torch.relation_form(expr) if isinstance(expr, sympy.Basic) else None


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


def _symbol(node: torch.fx.Node):
    val = node.meta.get("val")
    if isinstance(val, torch.SymBool):
        return sympy.Symbol(node.name)
    if isinstance(val, torch.SymInt):
        return sympy.Symbol(node.name, integer=True)
    if isinstance(val, torch.SymFloat):
        return sympy.Symbol(node.name, real=True)
    raise TypeError(f"not a symbolic value: {node.name}")
