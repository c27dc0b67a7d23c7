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

import operator

import torch
import torch.fx

from .. import _torch
from ..errors import ExportError
from ..ir.blocks import SWITCH, Block, post_order, read_blocks, where
from ..ir.regions import AUTOCAST, delete_unused_submodules
from ..ir.meta_keys import SWITCH_REGION


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


def replace_blocks_with_regions(gm: torch.fx.GraphModule, one_op: str | None = None) -> bool | None:
    """The pass: every region outlined into a higher-order op; no markers
    left. Returns the grad mode the forward leaves its caller in (None: the
    caller's own), which the program sets after each call. ``one_op``: what
    the graph is the body of, where it becomes one op, which cannot leave
    its caller in another mode (refused)."""
    graph = gm.graph
    tree = read_blocks(graph)
    if tree.grad_mode_after is not None and one_op is not None:
        raise ExportError(
            f"a grad-mode switch left in force at the end of {one_op} (grad mode "
            f"{'on' if tree.grad_mode_after else 'off'} after it returns) cannot be exported soundly "
            f"as one op; switch back before returning, or use a with block, at {where(tree.left_by)}")
    choose_regions(tree.top)
    for node in tree.redundant:
        graph.erase_node(node)
    blocks = list(post_order(tree.top))
    markers = {n for b in blocks for n in (b.enter, b.exit) if n.op != "output"}
    for block in blocks:
        if block.is_region:
            _outline(gm, block, markers)
    for node in reversed(graph.nodes):  # an autocast exit refers to its enter: erased first
        if node in markers:
            graph.erase_node(node)
    delete_unused_submodules(gm)
    gm.recompile()
    return tree.grad_mode_after


def _outline(gm: torch.fx.GraphModule, block: Block, markers: set) -> None:
    """The block's ops into its region; the markers of the blocks inside it
    (outlined already) stay, for the blocks that end or begin at them."""
    body = []
    node = block.enter.next
    while node is not block.exit:
        if node not in markers:
            body.append(node)
        node = node.next
    if body:
        call = outline_region(gm, body, block.kind.hop, block.args, block.name, block.enter.meta)
        if block.key == SWITCH:
            call.meta.setdefault("custom", {})[SWITCH_REGION] = True


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
