"""Symbolic sizes: a program's dynamic dimensions, example inputs that carry them, the guards a trace adds.

A trace on :func:`symbolic_examples` gives graphs for every size the
program's ranges allow; what the trace assumed beyond them (a guard its
ops added) is checked per call by :class:`ShapeGuards`.
"""
from __future__ import annotations

import sympy
import torch
from torch._dynamo.source import ConstantSource
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StrictMinMaxConstraint
from torch.utils._sympy.value_ranges import ValueRanges


def symbol_of(size) -> str | None:
    """The symbol's name where a size is one free symbol (``s0``), else None."""
    if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
        return str(size.node.expr)
    return None


def value_range(range_constraints: dict, name: str) -> tuple[int, int | None]:
    """A program's range for the symbol named ``name``: (lower, upper or None for no bound)."""
    for symbol, vr in range_constraints.items():
        if str(symbol) == name:
            upper = vr.upper
            return int(vr.lower), (int(upper) if upper.is_finite else None)
    return 2, None


def symbolic_examples(examples: list, dims: list[dict], ranges: dict) -> list:
    """Fake tensors like ``examples`` (real tensors, for hints, requires_grad
    and leafness) in a fresh shape environment, where dimension ``d`` of
    example ``i`` is the symbol ``dims[i][d]`` names (one symbol per name, its
    range ``ranges[name]``); the other dimensions are static (all of them,
    where ``dims`` names none). The examples with a symbolic dimension must
    be contiguous."""
    shape_env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=True)
    symbols = {}

    def size(name, hint):
        if name not in symbols:
            lower, upper = ranges[name]
            constraint = StrictMinMaxConstraint(warn_only=False, vr=ValueRanges(max(lower, 2), upper or sympy.oo))
            source = ConstantSource(f"predispatch_dim_{name}")
            symbol = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC,
                                             constraint_dim=constraint)
            symbols[name] = shape_env.create_symintnode(symbol, hint=hint, source=source)
        return symbols[name]

    fakes = []
    for t, names in zip(examples, dims):
        sizes = [size(names[d], n) if d in names else n for d, n in enumerate(t.shape)]
        fakes.append(_fake_like(mode, t, sizes, _contiguous_strides(sizes) if names else t.stride()))
    return fakes


def _contiguous_strides(sizes: list) -> list:
    strides, step = [], 1
    for n in reversed(sizes):
        strides.insert(0, step)
        step = step * n
    return strides


def _fake_like(mode: FakeTensorMode, t: torch.Tensor, sizes: list, strides) -> torch.Tensor:
    with mode:
        fake = torch.empty_strided(sizes, strides, dtype=t.dtype, device=t.device)
        fake.requires_grad_(t.requires_grad)
        if t.is_leaf:
            return fake
        with torch.enable_grad():
            return fake.clone()


class ShapeGuards:
    """What a trace on symbolic examples assumed of the sizes: the program's
    ranges and every guard its ops added, as one expression over the inputs.

    ``ShapeGuards(fakes)`` after the trace; raises where the trace made a
    symbolic size static (the graphs are then for one size only)."""

    def __init__(self, fakes: list):
        self.shape_env = fakes[0].fake_mode.shape_env
        self.code = self.shape_env.produce_guards_expression(fakes)

    def hold(self, tensors: list) -> bool:
        """Do the guards hold for these inputs (real tensors, as the examples)?"""
        return not self.code or bool(self.shape_env.evaluate_guards_expression(self.code, tensors))


def is_symbolic(val) -> bool:
    """Does a graph value (a fake tensor or SymInt) have a symbolic size?"""
    if isinstance(val, torch.SymInt):
        return True
    return isinstance(val, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in val.shape)


def size_bindings(placeholder_values: list, args: list) -> dict:
    """Each free symbol of the placeholders' values (a SymInt, a fake tensor's
    sizes) bound to what it is in ``args``, the real inputs of the graph."""
    bindings = {}
    for val, arg in zip(placeholder_values, args):
        if isinstance(val, torch.SymInt) and isinstance(val.node.expr, sympy.Symbol):
            bindings[val.node.expr] = int(arg)
        elif isinstance(val, torch.Tensor) and isinstance(arg, torch.Tensor):
            for size, n in zip(val.shape, arg.shape):
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    bindings[size.node.expr] = n
    return bindings


def concrete(size, bindings: dict) -> int:
    """A size (an int or SymInt) with its symbols bound."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    return int(size.node.expr.xreplace(bindings))


# a relation as (kind, what is compared with 0): a >= b and b <= a are both ("ge", a - b)
_RELATIONS = {sympy.GreaterThan: ("ge", 1), sympy.LessThan: ("ge", -1),
              sympy.StrictGreaterThan: ("gt", 1), sympy.StrictLessThan: ("gt", -1)}


def condition_form(val):
    """A symbolic condition (a SymBool: a run-time check's) in a form that is
    the same however torch wrote it (``u0 >= -1`` and ``0 <= u0 + 1`` alike);
    None where ``val`` is not symbolic, or no longer says what it checks (a
    branch's condition the trace decided reads ``True``)."""
    if not isinstance(val, torch.SymBool):
        return None
    return relation_form(val.node.expr)


def relation_form(expr):
    """:func:`condition_form` of a sympy condition: None where it has no free symbols."""
    if not expr.free_symbols:
        return None
    kind = _RELATIONS.get(type(expr))
    if kind is not None:
        name, sign = kind
        return name, sympy.expand(sign * (expr.lhs - expr.rhs))
    if isinstance(expr, (sympy.Eq, sympy.Ne)):
        difference = sympy.expand(expr.lhs - expr.rhs)
        return type(expr).__name__, frozenset((difference, -difference))
    return "expr", expr


def holds_within(expr, bounds: dict) -> bool:
    """Does the sympy condition ``expr`` hold for every value of its symbols
    within ``bounds`` (symbol -> (lower or None, upper or None))? By torch's
    value-range analysis: False where it cannot tell."""
    from torch.utils._sympy.value_ranges import bound_sympy

    ranges = {s: ValueRanges(-sympy.oo if lo is None else lo, sympy.oo if hi is None else hi)
              for s, (lo, hi) in bounds.items()}
    try:
        return bound_sympy(expr, ranges).lower is sympy.true
    except Exception:  # an expression the analysis does not take: not known to hold
        return False


def pinned_int(val) -> int | None:
    """The int a symbolic int is known to be (an unbacked value a check pinned:
    ``u0 == 6`` asserted), else None."""
    return val.node.maybe_as_int() if isinstance(val, torch.SymInt) else None


def may_be_nonempty(t: torch.Tensor) -> bool:
    """False only where ``t`` is known empty (a size not known, an unbacked
    one, counts as possibly non-empty: no guard is added)."""
    from torch.fx.experimental.symbolic_shapes import guard_or_true

    return guard_or_true(t.numel() > 0)


def symbols_learned(sizes) -> int:
    """How many of their symbols the shape env of ``sizes`` (symbolic ints,
    any of them) has learned an equal for (``s70 == s53``, ``s3 == 4``):
    each changes how sizes print; 0 where none is symbolic."""
    for v in sizes:
        if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            return len(v.node.shape_env.replacements)
    return 0
