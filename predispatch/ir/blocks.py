"""Grad-mode and autocast blocks in a flat graph: their markers read into a tree, and the grad mode each node runs in.

The captured graph is flat: a block shows only as the markers that open and
close it (``_set_grad_enabled`` calls the recorder marked with their phase
and block, ``_enter_autocast`` / ``_exit_autocast``). :func:`read_blocks`
reads them into a :class:`BlockTree`, nesting as in the source, bare
switches included; :func:`grad_modes` tells each node's grad mode from it.
The regions stage outlines the tree; the history stage reads the modes.
"""
from __future__ import annotations

import collections
import dataclasses

import torch
import torch.fx

from .. import _torch
from ..errors import ExportError, node_location
from .regions import AUTOCAST, GRAD, RegionKind
from .meta_keys import DERIVED, GRAD_BLOCK, GRAD_MODE_READ, UNKNOWN


@dataclasses.dataclass(frozen=True)
class Marker:
    """A node that opens or closes a block. ``key`` pairs an exit with its enter."""

    kind: RegionKind
    phase: str  # "enter" | "exit" | "bare" (the C switch called directly)
    key: object
    args: tuple
    passed: object = None  # where a set_grad_enabled mode comes from (grad_mode_reads.passed_mode)


def marker(node: torch.fx.Node) -> Marker | None:
    if node.op != "call_function":
        return None
    if node.target is _torch.SET_GRAD_ENABLED:
        phase, block, passed = node.meta.get(GRAD_BLOCK, ("bare", None, None))
        return Marker(GRAD, phase, ("grad", block), (bool(node.args[0]),), passed)
    if node.target is _torch.ENTER_AUTOCAST:
        return Marker(AUTOCAST, "enter", node, tuple(node.args))
    if node.target is _torch.EXIT_AUTOCAST:
        return Marker(AUTOCAST, "exit", node.args[0], ())
    return None


SWITCH = "switch"  # the key of a block a bare switch opens (it has no exit of its own)


@dataclasses.dataclass(eq=False)
class Block:
    kind: RegionKind
    args: tuple
    key: object
    enter: torch.fx.Node
    exit: torch.fx.Node | None = None
    children: list["Block"] = dataclasses.field(default_factory=list)
    is_region: bool = True
    name: str = ""
    empty: bool = True  # no op between its markers: never a region


@dataclasses.dataclass(frozen=True)
class BlockTree:
    """The blocks of a graph (nesting as in the source), the markers that
    open or close none, and the grad mode the forward leaves its caller in
    (None: the caller's own)."""

    top: list[Block]
    redundant: list[torch.fx.Node]
    grad_mode_after: bool | None
    left_by: torch.fx.Node | None = None  # the switch that set it


def read_blocks(graph: torch.fx.Graph) -> BlockTree:
    """The block tree from the markers, and the redundant markers to drop
    (``set_grad_enabled`` sets its mode in both __init__ and __enter__).

    A bare switch (``torch.set_grad_enabled(b)`` called as a function, or
    the C function it calls, called directly) has no exit: it opens a block that
    runs to the next switch, to the end of the block around it, or to the
    end of the forward (see :meth:`_BlockReader.switch`)."""
    reader = _BlockReader()
    markers = [(node, marker(node)) for node in graph.nodes]
    exits = {m.key for _, m in markers if m is not None and m.phase == "exit"}
    for node, m in markers:
        if GRAD_MODE_READ in node.meta:
            reader.note_read(node)
        elif m is None:
            reader.note_op(node)
        elif m.phase == "bare" or (m.phase == "enter" and m.kind is GRAD and m.key not in exits):
            reader.switch(node, m)
        elif m.phase == "enter":
            reader.enter(node, m)
        else:
            reader.exit(node, m)
    return reader.end(graph.output_node())


class _BlockReader:
    """The markers read in graph order into a tree of blocks."""

    def __init__(self):
        self.top: list[Block] = []
        self.stack: list[Block] = []
        self.redundant: list[torch.fx.Node] = []
        self.reads: dict = {}  # grad-mode read -> the mode fixed where it was read (None: the caller's)

    def note_read(self, node) -> None:
        """The same code read in two contexts (recursion) is unusable."""
        read, mode = node.meta[GRAD_MODE_READ], _fixed_grad_mode(self.stack)
        self.reads[read] = mode if self.reads.get(read, mode) == mode else _CONFLICT
        self.redundant.append(node)

    def note_op(self, node) -> None:
        if node.op not in ("placeholder", "output"):
            for open_block in self.stack:
                open_block.empty = False

    def open(self, kind: RegionKind, args: tuple, key, node) -> None:
        block = Block(kind, args, key, node)
        (self.stack[-1].children if self.stack else self.top).append(block)
        self.stack.append(block)

    def enter(self, node, m: Marker) -> None:
        if self.stack and self.stack[-1].key == m.key:
            self.redundant.append(node)
            return
        if m.kind is GRAD and _passed(node, m, self.reads) == "caller":  # with set_grad_enabled(prev)
            _refuse_callers_mode(node)
        self.open(m.kind, m.args, m.key, node)

    def exit(self, node, m: Marker) -> None:
        """A block ends, and the switches made inside it with it; an autocast
        block's end leaves the grad mode switched inside it in force."""
        in_force = self.close_switches(node)
        if not self.stack or self.stack[-1].key != m.key:
            raise ExportError(f"a {m.kind.name} block that is not properly nested ends at {where(node)}")
        self.stack.pop().exit = node
        if m.kind is AUTOCAST and in_force != _fixed_grad_mode(self.stack):
            self.switch_to(node, in_force)

    def close_switches(self, node) -> bool | None:
        """End at ``node`` the switch blocks open inside the innermost other
        block; returns the grad mode in force before."""
        in_force = _fixed_grad_mode(self.stack)
        while self.stack and self.stack[-1].key == SWITCH:
            self.stack.pop().exit = node
        return in_force

    def switch(self, node, m: Marker) -> None:
        """A bare switch to a constant mode, to one read inside a block, or
        back to the caller's (read outside every block)."""
        passed = _passed(node, m, self.reads)
        mode = None if passed == "caller" else m.args[0] if passed is None else passed
        if mode == _fixed_grad_mode(self.stack):
            self.redundant.append(node)  # the mode already in force: no block
        else:
            self.switch_to(node, mode)

    def switch_to(self, node, mode: bool | None) -> None:
        """The switch block open at this level ends at ``node``; unless the
        mode is the one around it, another begins there. The caller's mode
        (None) cannot be set inside a block that set another."""
        if self.stack and self.stack[-1].key == SWITCH:
            self.stack.pop().exit = node
        around = _fixed_grad_mode(self.stack)
        if mode == around:
            return
        if mode is None:
            _refuse_callers_mode(node)
        self.open(GRAD, (mode,), SWITCH, node)

    def end(self, output: torch.fx.Node) -> BlockTree:
        """The switches still open run to the end of the forward; the mode
        they set is the one the caller is left in."""
        after = _fixed_grad_mode(self.stack)
        left_by = self.stack[-1].enter if self.stack else None
        self.close_switches(output)
        if self.stack:
            raise ExportError(f"a {self.stack[-1].kind.name} block that the forward never ends "
                              f"cannot be exported soundly, at {where(self.stack[-1].enter)}")
        return BlockTree(self.top, self.redundant, after, left_by)


def grad_modes(graph: torch.fx.Graph) -> dict[torch.fx.Node, bool | None]:
    """The grad mode each node runs in: the one its innermost enclosing grad
    block sets, or None outside every grad block (the caller's)."""
    blocks = read_blocks(graph).top
    opens = {b.enter: b.args[0] for b in post_order(blocks) if b.kind is GRAD}
    closes = collections.Counter(b.exit for b in post_order(blocks) if b.kind is GRAD)
    stack, modes = [], {}
    for node in graph.nodes:
        for _ in range(closes[node]):  # a block's end closes the switches inside it too
            stack.pop()
        modes[node] = stack[-1] if stack else None
        if node in opens:
            stack.append(opens[node])
    return modes


def _fixed_grad_mode(stack: list[Block]) -> bool | None:
    """The grad mode the innermost open grad block sets; None outside any
    (the caller's mode, unknown until run time)."""
    return next((b.args[0] for b in reversed(stack) if b.kind is GRAD), None)


_CONFLICT = object()


def _passed(node, m: Marker, reads: dict):
    """Where the mode a grad call passes comes from: None (a constant of the
    code, or the traced value when nothing read the mode), the mode fixed
    where it was read (True/False), or "caller" (read where it was the
    caller's). A mode computed from reads, or read where the trace cannot
    tell, is refused."""
    if m.passed is None or (m.passed == UNKNOWN and not reads):
        return None
    known = m.passed not in (DERIVED, UNKNOWN) and reads.get(m.passed, _CONFLICT) is not _CONFLICT
    if not known:
        raise ExportError(
            f"torch.set_grad_enabled(...) with a mode computed from torch.is_grad_enabled(), or "
            f"passed where its origin cannot be traced (an argument, an attribute, a copy), in a "
            f"forward that reads the grad mode, cannot be exported soundly: the mode may be the "
            f"caller's, unknown until run time; use a with block, or pass back the variable "
            f"assigned from torch.is_grad_enabled() at the same nesting, at {where(node)}")
    mode = reads[m.passed]
    return "caller" if mode is None else mode


def _refuse_callers_mode(node) -> None:
    raise ExportError(
        f"the caller's grad mode (read with torch.is_grad_enabled() outside every grad block) "
        f"set inside another grad block cannot be exported soundly: a region has one mode; "
        f"restore it at the nesting it was read, at {where(node)}")


def where(node: torch.fx.Node) -> str:
    return node_location(node.meta.get("stack_trace"))


def post_order(blocks):
    for b in blocks:
        yield from post_order(b.children)
        yield b
