"""The regions stage: grad-mode and autocast blocks become higher-order ops.

One pass serves both kinds, driven by the table ``REGION_KINDS``
(:mod:`predispatch.ir.regions`): it reads
the block markers of the flat captured graph into a tree (nesting as in the
source), decides which blocks are regions (a top-level block always is; a
nested one only if it changes the state its enclosing region set), and
outlines each region, innermost first, into a named submodule called through
the kind's higher-order op:

    wrap_with_set_grad_enabled(False, self.no_grad_0, x)
    wrap_with_autocast('cpu', torch.bfloat16, True, False, self.autocast_bfloat16_1, x)

Mutations need no special care here: the graph is already functional, so a
value mutated in a region is simply one of the region's outputs.
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx

from .. import _torch
from ..errors import ExportError, node_location
from ..ir.regions import AUTOCAST, GRAD, RegionKind, delete_unused_submodules
from ..ir.meta_keys import DERIVED, GRAD_BLOCK, GRAD_MODE_READ, UNKNOWN


@dataclasses.dataclass(frozen=True)
class Marker:
    """A node that opens or closes a block. ``key`` pairs an exit with its enter."""

    kind: RegionKind
    phase: str  # "enter" | "exit" | "bare"
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


def read_blocks(graph: torch.fx.Graph) -> tuple[list[Block], list[torch.fx.Node]]:
    """The block tree from the markers, and the redundant markers to drop
    (``set_grad_enabled`` sets its mode in both __init__ and __enter__).

    ``torch.set_grad_enabled(b)`` called as a function has no exit: such a
    toggle opens a block (see :func:`_read_toggle` for what closes it)."""
    top, stack, redundant = [], [], []
    reads: dict = {}  # grad-mode read -> the mode fixed where it was read (None: the caller's)
    markers = [(node, marker(node)) for node in graph.nodes]
    exits = {m.key for _, m in markers if m is not None and m.phase == "exit"}
    for node, m in markers:
        if GRAD_MODE_READ in node.meta:  # the same code read in two contexts (recursion): unusable
            read, mode = node.meta[GRAD_MODE_READ], _fixed_grad_mode(stack)
            reads[read] = mode if reads.get(read, mode) == mode else _CONFLICT
            redundant.append(node)
            continue
        if m is None:
            if node.op not in ("placeholder", "output"):
                for open_block in stack:
                    open_block.empty = False
            continue
        if m.phase == "bare":
            raise ExportError(
                f"a bare {_torch.SET_GRAD_ENABLED_NAME} call, outside any grad-mode context "
                f"manager, cannot be exported soundly, at {_where(node)}")
        if m.phase == "enter" and m.kind is GRAD and m.key not in exits:  # a function-call toggle
            _read_toggle(node, m, stack, top, redundant, reads)
            continue
        if m.phase == "enter":
            if stack and stack[-1].key == m.key:
                redundant.append(node)
                continue
            if m.kind is GRAD and _passed(node, m, reads) == "caller":  # with set_grad_enabled(prev)
                _refuse_callers_mode(node)
            block = Block(m.kind, m.args, m.key, node)
            (stack[-1].children if stack else top).append(block)
            stack.append(block)
        elif not stack or stack[-1].key != m.key:
            raise ExportError(f"a {m.kind.name} block that is not properly nested ends at {_where(node)}")
        else:
            stack.pop().exit = node
    if stack:
        raise ExportError(
            f"a {stack[-1].kind.name} mode change that the forward never restores (e.g. "
            f"torch.set_grad_enabled(False) called as a function, not as a block) cannot be "
            f"exported soundly: the mode it leaves is the caller's, unknown until run time; "
            f"restore the mode read before (prev = torch.is_grad_enabled(); ...; "
            f"torch.set_grad_enabled(prev)) or use a with block, at {_where(stack[-1].enter)}")
    return top, redundant


def grad_modes(graph: torch.fx.Graph) -> dict[torch.fx.Node, bool | None]:
    """The grad mode each node runs in: the one its innermost enclosing grad
    block sets, or None outside every grad block (the caller's)."""
    blocks, _ = read_blocks(graph)
    opens = {b.enter: b.args[0] for b in _post_order(blocks) if b.kind is GRAD}
    closes = {b.exit for b in _post_order(blocks) if b.kind is GRAD}
    stack, modes = [], {}
    for node in graph.nodes:
        if node in closes:
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
            f"assigned from torch.is_grad_enabled() at the same nesting, at {_where(node)}")
    mode = reads[m.passed]
    return "caller" if mode is None else mode


def _refuse_callers_mode(node) -> None:
    raise ExportError(
        f"the caller's grad mode (read with torch.is_grad_enabled() outside every grad block) "
        f"set inside another grad block cannot be exported soundly: a region has one mode; "
        f"restore it at the nesting it was read, at {_where(node)}")


def _read_toggle(node, m: Marker, stack: list[Block], top: list[Block], redundant: list,
                 reads: dict) -> None:
    """A function-call toggle: it restores, changes nothing, or opens a block.

    Passing back the caller's mode (read outside every grad block) closes the
    toggle opened where the mode was the caller's, or changes nothing where
    it still is; elsewhere it is refused. Any other mode (a constant, or one
    read inside a block) closes the open toggle when it is the mode of the
    block around that toggle, changes nothing inside a block that already
    sets it, and otherwise opens a block, even to the mode the trace runs in:
    outside every block ``torch.set_grad_enabled(True)`` sets the caller's
    mode, which may be off (never restored, that is refused)."""
    toggle = stack[-1] if stack and stack[-1].key == "toggle" else None
    around = _fixed_grad_mode(stack[:-1]) if toggle is not None else None
    fixed = _fixed_grad_mode(stack)
    if _passed(node, m, reads) == "caller":
        if toggle is not None and around is None:
            stack.pop().exit = node
        elif fixed is None:
            redundant.append(node)  # it still is the caller's
        else:
            _refuse_callers_mode(node)
    elif toggle is not None and around is not None and m.args[0] == around:
        stack.pop().exit = node
    elif fixed is not None and m.args[0] == fixed:
        redundant.append(node)
    else:
        block = Block(m.kind, m.args, "toggle", node)
        (stack[-1].children if stack else top).append(block)
        stack.append(block)


def _where(node: torch.fx.Node) -> str:
    return node_location(node.meta.get("stack_trace"))


def choose_regions(blocks: list[Block], enclosing: dict | None = None, counter=None) -> None:
    """A block is a region unless it is empty or the nearest enclosing region
    of its kind already sets the same state. Regions are named in source order."""
    enclosing = enclosing or {}
    counter = counter if counter is not None else [0]
    for b in blocks:
        b.is_region = not b.empty and not _sets_again(b, enclosing.get(b.kind.name))
        if b.is_region:
            b.name = f"{b.kind.label(b.args)}_{counter[0]}"
            counter[0] += 1
        inner = {**enclosing, b.kind.name: b.args} if b.is_region else enclosing
        choose_regions(b.children, inner, counter)


def _sets_again(b: Block, enclosing_args: tuple | None) -> bool:
    """Does ``b`` set the state its enclosing region of its kind sets? An
    autocast without a dtype takes the one current there: the enclosing one's."""
    if enclosing_args is None:
        return False
    args = b.args
    if b.kind is AUTOCAST and args[1] is None and args[0] == enclosing_args[0]:
        args = (args[0], enclosing_args[1], *args[2:])
    return args == enclosing_args


def _post_order(blocks):
    for b in blocks:
        yield from _post_order(b.children)
        yield b


def replace_blocks_with_regions(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The pass: every region outlined into a higher-order op; no markers left."""
    graph = gm.graph
    blocks, redundant = read_blocks(graph)
    choose_regions(blocks)
    for node in redundant:
        graph.erase_node(node)
    for block in _post_order(blocks):
        if block.is_region:
            _outline(gm, block)
        graph.erase_node(block.exit)  # the exit refers to the enter: erase it first
        graph.erase_node(block.enter)
    delete_unused_submodules(gm)
    gm.recompile()
    return gm


def _outline(gm: torch.fx.GraphModule, block: Block) -> None:
    body = []
    node = block.enter.next
    while node is not block.exit:  # inner blocks are done: no markers left here
        body.append(node)
        node = node.next
    if body:
        outline_region(gm, body, block.kind.hop, block.args, block.name, block.enter.meta)


def outline_region(gm: torch.fx.GraphModule, body: list[torch.fx.Node], hop, args: tuple, name: str,
                   meta: dict, make_submodule=_torch.lazy_graph_module) -> torch.fx.Node:
    """Move ``body`` (nodes of ``gm``'s graph, in graph order) into a submodule
    ``name`` called as ``hop(*args, submodule, *inputs)`` right after the
    body's last node; later uses read the call's outputs. ``meta``: where the
    block was opened (its stack trace and module stack), which the call and
    its submodule carry, and its results the module stack:
    ``torch.export.unflatten`` places nodes by module stack, and a pattern
    matcher must not take a result for the op inside that computed it (a
    ``getitem`` with a Linear's module stack is no linear, whatever
    torchao's ``get_source_partitions`` thought). Returns the call."""
    graph = gm.graph
    inside = set(body)
    inputs = list(dict.fromkeys(i for n in body for i in n.all_input_nodes if i not in inside))
    outputs = [n for n in body if any(u not in inside for u in n.users)]

    sub = torch.fx.Graph()
    env = {}
    for i in inputs:
        env[i] = sub.placeholder(i.name)
        env[i].meta.update({k: v for k, v in i.meta.items() if k == "val"})
    for n in body:
        env[n] = sub.node_copy(n, lambda x: env[x])
    sub.output(tuple(env[o] for o in outputs))
    gm.add_submodule(name, make_submodule(gm, sub, name))

    opened_at = {k: meta[k] for k in ("stack_trace", "nn_module_stack") if k in meta}
    with graph.inserting_before(body[-1].next):
        submod = graph.get_attr(name)
        call = graph.call_function(hop, (*args, submod, *inputs))
        submod.meta.update(opened_at)
        call.meta.update(opened_at)
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        results = []
        for i, o in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta.update({k: v for k, v in o.meta.items() if k in ("val", "stack_trace")})
            if "nn_module_stack" in opened_at:
                item.meta["nn_module_stack"] = opened_at["nn_module_stack"]
            results.append(item)
    for o, item in zip(outputs, results):
        o.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for n in reversed(body):
        graph.erase_node(n)
    return call
