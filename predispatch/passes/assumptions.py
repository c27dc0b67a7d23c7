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
from . import check_forms
from ..ir.assumptions import Assumption, assumptions, is_run_time_message, run_time_message


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
            _as_traced(node.args[0])
            checked.update(own)
    return checked


def _as_traced(condition) -> None:
    """A check's arithmetic as running it records it again: an int literal
    beside a SymFloat is the float the symbolic op makes of it (``item > 0``
    of a float is ``gt(item, 0.0)``), so the program exported again is the
    same graph (G7)."""
    todo = [condition]
    while todo:
        node = todo.pop()
        if not isinstance(node, torch.fx.Node) or isinstance(node.meta.get("val"), torch.Tensor):
            continue
        if any(isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.SymFloat) for a in node.args):
            node.args = tuple(float(a) if type(a) is int else a for a in node.args)
        todo.extend(node.all_input_nodes)


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


def carried_assumptions(module: torch.nn.Module) -> list[Assumption]:
    """A program exported again (``ep.module()``): the branches its own checks
    assume, which the new program runs as they are (see
    :func:`predispatch._torch.kept_as_they_are`)."""
    return assumptions(module) if isinstance(module, torch.fx.GraphModule) else []


def drop_regenerated_checks(gm: torch.fx.GraphModule, bindings: dict) -> None:
    """A program exported again runs its own checks (ops of its graph); torch's
    runtime-assert pass writes its own beside them for the same values. The
    first export named every check reading a value a branch decided as ours
    (:func:`check_assumptions`), so each of torch's that reads a value one of
    ours reads is such a copy: dropped, with what only it read (G7)."""
    read, checks = dict(bindings), list(gm.graph.find_nodes(op="call_function", target=_torch.ASSERT_SCALAR))
    ours = [n for n in checks if _message(n) is not None and is_run_time_message(_message(n))]
    decided = frozenset().union(*(_symbols_read(n.args[0], read) for n in ours))
    for node in checks:
        if node not in ours and decided and _symbols_read(node.args[0], read) & decided:
            condition = node.args[0]
            gm.graph.erase_node(node)
            _erase_unused(gm.graph, condition)
    gm.recompile()


def drop_restated_checks(gm: torch.fx.GraphModule) -> None:
    """A check of a condition an earlier check of the graph already checks,
    written in another form, is dropped, with what only it read; so is one of
    torch's that the bounds earlier checks put on its values imply, or that
    holds whatever they are. A program exported again runs its checks as ops
    of its graph, and torch's runtime-assert pass may write one of them again
    beside it (``0 <= u0 + 1`` beside the program's ``u0 >= -1``, an index
    read from a tensor; ``ge(item, 6)`` again, where a check pinned ``item``;
    ``(u1 == 5) & (u0 >= 4)`` after ``u1``'s and ``u0``'s bounds): the program
    would grow a check per export (G7). A condition's form is read from its
    value and from the nodes computing it (check_forms). Of two, ours
    (naming a line) is kept."""
    kept, bounds = {}, {}  # in the graph's order: what an earlier check checks holds at a later one
    for node in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _torch.ASSERT_SCALAR]:
        if not isinstance(node.args[0], torch.fx.Node):
            continue
        expr = check_forms.written_expression(node.args[0])
        forms = {f for f in (_torch.condition_form(node.args[0].meta.get("val")), check_forms.written_form(expr))
                 if f is not None}
        first = next((kept[f] for f in forms if f in kept), None)
        if first is None and not _is_ours(node) and (
                True in forms or (expr is not None and _torch.holds_within(expr, bounds))):
            _erase_check(gm.graph, node)
        elif first is None:
            kept.update((f, node) for f in forms)
            if expr is not None:
                check_forms.bounds_checked(expr, bounds)
        else:
            if _is_ours(node) and not _is_ours(first):  # ours kept: the earlier one goes
                kept.update((f, node) for f, n in list(kept.items()) if n is first)
                kept.update((f, node) for f in forms)
                node, first = first, node
            _erase_check(gm.graph, node)
    gm.recompile()


def say_check_conditions(gm: torch.fx.GraphModule) -> None:
    """Each of torch's checks says its condition as the nodes computing it
    compute it (its value may read ``True`` in one export, where a check
    before pinned a value, and not in the same program exported again: G7),
    its symbols u0, u1, ... in the order the graph reads them."""
    _torch.checks_say_their_conditions(gm, (check_forms.written_expression, check_forms.symbols_read_at))


def _erase_check(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    condition = node.args[0]
    graph.erase_node(node)
    _erase_unused(graph, condition)


def write_pinned_values(gm: torch.fx.GraphModule) -> None:
    """An op reading a value its program's checks pin (``item`` where ``item ==
    6`` is checked) reads the constant instead, as tracing the program again
    writes it: there the check runs before the op, here the trace learned the
    value while tracing the op (G7). Sound: torch writes a value's checks
    where the value is made, before any op reads it."""
    if not gm.graph.find_nodes(op="call_function", target=_torch.ASSERT_SCALAR):
        return  # no check, no value pinned by one
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, _torch.OpOverload) \
                or node.target is _torch.ASSERT_SCALAR or not _makes_tensors(node.meta.get("val")):
            continue
        node.args, node.kwargs = torch.fx.node.map_arg((node.args, node.kwargs), _pinned_or_node)
    gm.recompile()


def _pinned_or_node(node: torch.fx.Node):
    value = _torch.pinned_int(node.meta.get("val"))
    return node if value is None else value


def _makes_tensors(val) -> bool:
    return isinstance(val, torch.Tensor) or (isinstance(val, (list, tuple)) and any(
        isinstance(v, torch.Tensor) for v in val))


def _is_ours(node: torch.fx.Node) -> bool:
    return _message(node) is not None and is_run_time_message(_message(node))


def _message(node: torch.fx.Node) -> str | None:
    return node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else None


def _erase_unused(graph: torch.fx.Graph, node) -> None:
    """``node`` and the symbolic arithmetic only it read, where nothing else reads them."""
    todo = [node]
    while todo:
        n = todo.pop()
        if isinstance(n, torch.fx.Node) and not n.users and n.op == "call_function" \
                and not isinstance(n.meta.get("val"), torch.Tensor):
            inputs = n.all_input_nodes
            graph.erase_node(n)
            todo.extend(inputs)
