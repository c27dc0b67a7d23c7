"""The assumptions stage: each data-dependent branch the example took, checked at run time naming its line.

Exported with ``data_dependent="specialize"``, the trace decided each Python
branch on a tensor's value by the example's value (a guard the shape
environment deferred), and torch.export's runtime-assert pass wrote a check
of it into the graph: ``aten._assert_scalar`` on the recomputed condition,
its message naming a node. Here every check of a value such a branch read
says instead which source line assumed what. A branch is checked only by a
check of its own condition as decided (or of a bound that implies it),
never by one that merely reads the same value: two branches on one
``item()``, one check, would leave the other unchecked. A branch torch's
pass left without such a check (it checks a bound on one value as the
value's range, not always the bound) gets one written here; one that
cannot be written is refused, never left unchecked. (The seam puts a float
value's bounds in its range before the pass, which then checks them.)
"""
from __future__ import annotations

import torch

from .. import _torch
from ..errors import ExportError, innermost_user_frame
from ..ir.assumptions import Assumption, run_time_message


def check_assumptions(gm: torch.fx.GraphModule, guards: list, bindings: dict) -> list[Assumption]:
    """Name each run-time check of ``gm`` that reads a value one of
    ``guards`` (the seam's SpecializedGuard records) decided; the assumptions
    they check, in the order the trace made them (each checked by a check
    of its own condition, or refused). ``bindings``: node -> the unbacked
    symbols it binds, as the trace made them."""
    bound = set().union(*bindings.values())
    made = []  # (assumption, the guard deciding it), once each
    for guard in guards:
        if not guard.symbols <= bound:  # made by a trace made again: its values are not this graph's
            continue
        assumption = _assumption(guard)
        if all(a != assumption for a, _ in made):
            made.append((assumption, guard))
    checked = _name_checks(gm, made, bindings)
    for assumption, guard in made:
        binders = [n for n, symbols in bindings.items() if symbols & guard.symbols]
        if assumption not in checked and not _torch.write_check(gm, guard, binders, run_time_message([assumption])):
            raise ExportError(
                f"internal: the data-dependent branch at {assumption.describe()} has no run-time "
                "check in the program")
    gm.recompile()
    return [a for a, _ in made]


def _assumption(guard) -> Assumption:
    frame = innermost_user_frame(guard.frames)
    where, code = ("unknown location", "") if frame is None else (
        f"{frame.filename}:{frame.lineno} in {frame.name}", frame.line or "")
    return Assumption(where, code, guard.condition, guard.value)


def _name_checks(gm: torch.fx.GraphModule, made: list, bindings: dict) -> set:
    """Each ``_assert_scalar`` reading a value of ``made`` says which
    assumptions: those whose own condition it checks, else all it reads a
    value of (a bound of that value's range); the assumptions whose own
    condition some check checks. Reading a value is not checking a branch
    on it: two branches on one ``item()``, one check."""
    checked, read = set(), dict(bindings)
    for node in gm.graph.find_nodes(op="call_function", target=_torch.ASSERT_SCALAR):
        symbols = _symbols_read(node.args[0], read)
        own = [a for a, guard in made if _torch.checks_guard(node, guard)]
        about = own or [a for a, guard in made if guard.symbols & symbols]
        if about:
            node.args = (node.args[0], run_time_message(about), *node.args[2:])
            checked.update(own)
    return checked


def _symbols_read(node, read: dict) -> frozenset:
    """The unbacked symbols a symbolic value is computed from: those bound by
    the nodes it reads (``item``, ``nonzero``: ``read`` starts with them),
    through symbolic arithmetic."""
    if not isinstance(node, torch.fx.Node):
        return frozenset()
    if node not in read:
        if isinstance(node.meta.get("val"), torch.Tensor):
            read[node] = frozenset()
        else:
            read[node] = frozenset().union(*(_symbols_read(n, read) for n in node.all_input_nodes))
    return read[node]
