"""Stage 2, regions: grad-mode and autocast blocks become higher-order ops.

One pass serves both kinds, driven by the table ``REGION_KINDS``: it reads
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
from typing import Callable

import torch
import torch.fx

from . import _torch
from .errors import ExportError, node_location
from .trace_events import GRAD_BLOCK


@dataclasses.dataclass(frozen=True)
class RegionKind:
    """A kind of region: its higher-order op and how its submodule is named."""

    name: str
    hop: object
    label: Callable[[tuple], str]  # region arguments -> submodule name prefix


def _autocast_label(args) -> str:
    device, dtype, enabled, _cache = args
    if not enabled:
        return "autocast_off"
    return f"autocast_{str(dtype).replace('torch.', '')}" if dtype is not None else f"autocast_{device}"


GRAD = RegionKind("grad", _torch.wrap_with_set_grad_enabled,
                  lambda args: "enable_grad" if args[0] else "no_grad")
AUTOCAST = RegionKind("autocast", _torch.wrap_with_autocast, _autocast_label)
REGION_KINDS = (GRAD, AUTOCAST)


@dataclasses.dataclass(frozen=True)
class Marker:
    """A node that opens or closes a block. ``key`` pairs an exit with its enter."""

    kind: RegionKind
    phase: str  # "enter" | "exit" | "bare"
    key: object
    args: tuple
    constant: bool = False  # the mode is a constant in the source: set_grad_enabled(True)


def marker(node: torch.fx.Node) -> Marker | None:
    if node.op != "call_function":
        return None
    if node.target is _torch.SET_GRAD_ENABLED:
        phase, block, constant = node.meta.get(GRAD_BLOCK, ("bare", None, False))
        return Marker(GRAD, phase, ("grad", block), (bool(node.args[0]),), constant)
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


def _grad_mode(stack: list[Block]) -> bool:
    """The grad mode inside the innermost open grad block (the trace runs with grad on)."""
    return next((b.args[0] for b in reversed(stack) if b.kind is GRAD), True)


def read_blocks(graph: torch.fx.Graph) -> tuple[list[Block], list[torch.fx.Node]]:
    """The block tree from the markers, and the redundant markers to drop
    (``set_grad_enabled`` sets its mode in both __init__ and __enter__).

    ``torch.set_grad_enabled(b)`` called as a function has no exit: such a
    toggle opens a block that the next toggle back to the previous mode, at
    the same nesting, closes (``prev = torch.is_grad_enabled();
    torch.set_grad_enabled(False); ...; torch.set_grad_enabled(prev)``)."""
    top, stack, redundant = [], [], []
    markers = [(node, marker(node)) for node in graph.nodes]
    exits = {m.key for _, m in markers if m is not None and m.phase == "exit"}
    for node, m in markers:
        if m is None:
            if node.op not in ("placeholder", "output"):
                for open_block in stack:
                    open_block.empty = False
            continue
        if m.phase == "bare":
            raise ExportError(
                f"a bare torch._C._set_grad_enabled call, outside any grad-mode context "
                f"manager, cannot be exported soundly, at {_where(node)}")
        if m.phase == "enter" and m.kind is GRAD and m.key not in exits:  # a function-call toggle
            if m.constant:
                _refuse_caller_mode_set(node, m.args[0], stack)
            if m.args[0] == _grad_mode(stack):
                redundant.append(node)
            elif stack and stack[-1].key == "toggle":
                stack.pop().exit = node
            else:
                block = Block(m.kind, m.args, "toggle", node)
                (stack[-1].children if stack else top).append(block)
                stack.append(block)
            continue
        if m.phase == "enter":
            if stack and stack[-1].key == m.key:
                redundant.append(node)
                continue
            block = Block(m.kind, m.args, m.key, node)
            (stack[-1].children if stack else top).append(block)
            stack.append(block)
        elif not stack or stack[-1].key != m.key:
            raise ExportError(f"a {m.kind.name} block that is not properly nested ends at {_where(node)}")
        else:
            stack.pop().exit = node
    if stack:
        raise ExportError(
            f"a {stack[0].kind.name} mode change that the forward never restores (e.g. "
            f"torch.set_grad_enabled(False) called as a function, not as a block) cannot be "
            f"exported soundly, at {_where(stack[0].enter)}")
    return top, redundant


def _refuse_caller_mode_set(node: torch.fx.Node, mode: bool, stack: list[Block]) -> None:
    """A toggle by a constant, at the same mode as the caller's (a no-op while
    tracing, or the toggle back of the outermost toggle), sets the caller's
    mode, unknown until run time: ``torch.set_grad_enabled(True)`` turns it
    on for a caller under no_grad too (and eager leaves it on after the
    forward). Inside a grad block the mode is the block's: no refusal."""
    closing = bool(stack) and stack[-1].key == "toggle" and mode != _grad_mode(stack)
    outside = stack[:-1] if closing else stack
    if any(b.kind is GRAD for b in outside) or (mode != _grad_mode(stack) and not closing):
        return
    raise ExportError(
        f"torch.set_grad_enabled({mode}) called as a function sets grad mode {'on' if mode else 'off'} "
        f"whatever mode the caller had (eager leaves it so after the forward), which the program "
        f"cannot know: restore the mode read before (prev = torch.is_grad_enabled(); ...; "
        f"torch.set_grad_enabled(prev)) or use a with block, at {_where(node)}")


def _where(node: torch.fx.Node) -> str:
    return node_location(node.meta.get("stack_trace"))


def choose_regions(blocks: list[Block], enclosing: dict | None = None, counter=None) -> None:
    """A block is a region unless it is empty or the nearest enclosing region
    of its kind already sets the same state. Regions are named in source order."""
    enclosing = enclosing or {}
    counter = counter if counter is not None else [0]
    for b in blocks:
        b.is_region = not b.empty and enclosing.get(b.kind.name) != b.args
        if b.is_region:
            b.name = f"{b.kind.label(b.args)}_{counter[0]}"
            counter[0] += 1
        inner = {**enclosing, b.kind.name: b.args} if b.is_region else enclosing
        choose_regions(b.children, inner, counter)


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
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def _outline(gm: torch.fx.GraphModule, block: Block) -> None:
    graph = gm.graph
    body = []
    node = block.enter.next
    while node is not block.exit:  # inner blocks are done: no markers left here
        body.append(node)
        node = node.next
    if not body:
        return
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
    gm.add_submodule(block.name, _torch.lazy_graph_module(gm, sub, block.name))

    with graph.inserting_before(block.exit):
        submod = graph.get_attr(block.name)
        call = graph.call_function(block.kind.hop, (*block.args, submod, *inputs))
        call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
        for key in ("stack_trace", "nn_module_stack"):  # unflatten places nodes by module stack
            if key in block.enter.meta:
                submod.meta[key] = call.meta[key] = block.enter.meta[key]
        results = []
        for i, o in enumerate(outputs):
            item = graph.call_function(operator.getitem, (call, i))
            item.meta.update({k: v for k, v in o.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
            results.append(item)
    for o, item in zip(outputs, results):
        o.replace_all_uses_with(item, delete_user_cb=lambda user: user not in inside)
    for n in reversed(body):
        graph.erase_node(n)
