"""The op-by-op forward graph, a buffer's update written where the buffer lies.

AOTAutograd keeps an update of an input that nothing differentiates (a
batch norm's running statistics, its step count) in the forward graph as
a ``copy_`` at its end. The functional trace computes the new value into
memory of its own first, from a clone of the old one: a batch norm's
update is ``clone``, ``_native_batch_norm_legit_functional``, ``copy``,
``copy_`` for each statistic, where eager's kernel writes the statistics
in place. Where the new value is the result of an op reading a clone of
the input, laid out as the input, and nothing else reads the input, the op
runs as its in-place twin on the input (``add_`` for ``add``; for a
``*_functional`` op, the op its name comes from, whose schema writes those
arguments), and the ``copy_`` goes. A clone something else reads (saved
for the backward) stays: it is made before the write. The graph shown
(``forward_graph``) stays functional.
"""
from __future__ import annotations

import functools
import operator

import torch
import torch.fx

from ... import _torch
from .in_place import in_place_twin, layout_of

aten = torch.ops.aten
FUNCTIONAL = "_functional"


@functools.lru_cache(maxsize=None)
def mutating_twin(op) -> tuple[_torch.OpOverload, tuple[int, ...]] | None:
    """For a ``name_functional`` aten op, the op ``name`` and the positions of
    the arguments it writes, whose new values the functional op returns
    after that op's own results, in order (functionalization's contract)."""
    if not (isinstance(op, _torch.OpOverload) and op.namespace == "aten"):
        return None
    name, _, overload = op.name().split("::")[1].partition(".")
    if not name.endswith(FUNCTIONAL):
        return None
    twin = getattr(getattr(aten, name[:-len(FUNCTIONAL)], None), overload or "default", None)
    if twin is None or [a.name for a in twin._schema.arguments] != [a.name for a in op._schema.arguments]:
        return None
    written = tuple(i for i, a in enumerate(twin._schema.arguments) if a.alias_info is not None and a.alias_info.is_write)
    if not written or len(op._schema.returns) != len(twin._schema.returns) + len(written):
        return None
    return twin, written


def _is(node, target) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "call_function" and node.target is target


def _final_copies(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, torch.fx.Node]:
    """Each input updated by a ``copy_`` the graph ends with, and that copy_;
    a write-back's functional ``copy`` (the value laid out as the input) in
    between folded into it (``copy_`` lays the value out so too)."""
    copies = {}
    for node in gm.graph.nodes:
        if _is(node, aten.copy_.default) and node.args[0].op == "placeholder" and not node.users:
            target, value = node.args[:2]
            if _is(value, aten.copy.default) and value.args[0] is target and len(value.users) == 1:
                node.args = (target, value.args[1])
                gm.graph.erase_node(value)
            copies[target] = node
    return copies


def _clone_of(node, target: torch.fx.Node) -> bool:
    return _is(node, aten.clone.default) and node.args[0] is target and not node.kwargs


def _read_only_through(target: torch.fx.Node, copy: torch.fx.Node, writer: torch.fx.Node, order: dict) -> bool:
    """Does nothing read the input ``target`` but its final ``copy`` and
    clones of it made before ``writer`` (which is to write it in place)?"""
    return all(user is copy or _clone_of(user, target) and order[user] < order[writer] for user in target.users)


def _written_in_place(copy: torch.fx.Node, copies: dict, order: dict) -> bool:
    """Rewrite the op computing ``copy``'s value as its in-place twin on the
    input, if it reads a clone of the input there and nothing else reads the
    input; True if done (``copy`` then goes)."""
    target, value = copy.args[:2]
    if layout_of(value) is None or layout_of(value) != layout_of(target):
        return False
    if _is(value, operator.getitem):
        return _functional_written_in_place(value.args[0], copies, order)
    twin = in_place_twin(value.target) if value.op == "call_function" else None
    if (twin is None or not value.args or not _clone_of(value.args[0], target) or len(value.users) != 1
            or not _read_only_through(target, copy, value, order)):
        return False
    clone = value.args[0]
    value.target, value.args = twin, (target, *value.args[1:])
    copy.graph.erase_node(copies.pop(target))
    if not clone.users:
        copy.graph.erase_node(clone)
    return True


def _functional_written_in_place(call: torch.fx.Node, copies: dict, order: dict) -> bool:
    """A ``*_functional`` op each of whose written arguments is a clone of an
    input its new value (and nothing else) is copied into: its mutating
    twin, writing those inputs."""
    found = mutating_twin(call.target) if call.op == "call_function" else None
    if found is None:
        return False
    twin, written = found
    first_new = len(twin._schema.returns)
    outputs = {user.args[1]: user for user in call.users if _is(user, operator.getitem)}
    finals = []
    for k, position in enumerate(written):
        clone, new = call.args[position], outputs.get(first_new + k)
        target = clone.args[0] if _is(clone, aten.clone.default) and not clone.kwargs else None
        copy = copies.get(target)
        if (copy is None or new is None or copy.args[1] is not new or list(new.users) != [copy]
                or layout_of(new) != layout_of(target) or not _read_only_through(target, copy, call, order)):
            return False
        finals.append((position, clone, new, copy))
    args = list(call.args)
    for position, clone, new, copy in finals:
        args[position] = clone.args[0]
        call.graph.erase_node(copies.pop(clone.args[0]))
        call.graph.erase_node(new)
    call.target, call.args = twin, tuple(args)
    if isinstance(call.meta.get("val"), (tuple, list)):
        call.meta["val"] = call.meta["val"][:first_new]
    for _, clone, _, _ in finals:
        if not clone.users:
            call.graph.erase_node(clone)
    return True


def buffers_updated_in_place(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (changed): each input update the forward graph ends with
    written by the op computing it, where the input lies, where it can be."""
    copies = _final_copies(gm)
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    for target in list(copies):
        if target in copies:  # not gone with another input's (a functional op writes two)
            _written_in_place(copies[target], copies, order)
    gm.recompile()
    return gm
