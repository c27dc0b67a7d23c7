"""How ``ep.module()`` writes mutated parameters, buffers and inputs back: as eager mutated them.

Under no_grad when every mutation happened under no_grad (an EMA of a
parameter: torch's stock ``copy_`` would be refused for a leaf that requires
grad), and also without bumping the version counter when the mutation was
hidden from autograd (BatchNorm's running statistics, which its backward has
saved); relaid out or moved to other storage as eager left them. The modes
and layouts travel in the program's record (:mod:`predispatch.ir.program_meta`).
"""
from __future__ import annotations

import contextlib
import functools

import torch

from .. import _torch
from ..ir.program_meta import program_meta
from ..trace import input_aliasing
from ..trace.translations import mark_rebound
from ..trace.functional_trace import note_relaid_in, note_written_as_started
from ..trace.recorder import unobserved


def write_back_with_grad(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    if _torch.is_traced(target):  # the program is being exported again
        if not _torch.is_traced(value):  # a constant (a buffer rebound to one): written as it is
            value = _torch.to_functional(value)
        _torch.functional_write(target, value, hidden=False)
        return target
    if target.is_leaf and target.requires_grad:
        # eager can only have changed such a leaf without autograd (through
        # a detached alias), so its history stays as it is
        with torch.no_grad():
            return target.copy_(value)
    if value.requires_grad and not torch.is_grad_enabled():
        # updated in a block that turned grad on, or kept its history across an
        # update under the caller's no_grad: eager's tensor has that history
        with torch.enable_grad():
            return target.copy_(value)
    return target.copy_(value)


def write_back_under_no_grad(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return write_back_with_grad(target, value)


def write_back_hidden_from_autograd(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if _torch.is_traced(target):
            _torch.functional_write(target, value, hidden=True)
            return target
        if target.is_inference():
            return target.copy_(value)
        with _torch.preserve_version_counter(target):
            return target.copy_(value)


# "rebound": a buffer the forward rebound (``self.b = v``), which eager's module
# holds as the new tensor: written like a mutation in the caller's mode, with
# every op of the call reading the old tensor reading a snapshot of it
_WRITE_BACK = {"grad": write_back_with_grad, "no_grad": write_back_under_no_grad,
               "hidden": write_back_hidden_from_autograd, "rebound": write_back_with_grad}


def write_back_layout(target: torch.Tensor, value: torch.Tensor, source, layout: dict,
                      mode: str | None) -> torch.Tensor:
    """Leave ``target`` stored and laid out as eager left it (``t_()``,
    ``resize_()``, ``set_()``: ``layout`` is a
    :class:`predispatch.trace.functional_trace.LayoutChange`), holding ``value``:
    on its own storage restrided (grown if needed), its data written back as
    ``mode`` says; on the storage of ``source`` (another input, written back
    before); or on the storage the forward made, ``value``'s."""
    if layout.get("dtype") is not None:
        return _rebound(target, value, layout)
    if _torch.is_traced(target):
        note_relaid_in(target, layout.get("grad_mode"))
    if layout.get("as_started"):  # its memory as the call started, written through its views: then relaid
        _WRITE_BACK[mode or "grad"](target, value)
        if _torch.is_traced(target):
            return _relaid_as_started_in_trace(target, value, layout)
        mode = None
    if _torch.is_traced(target):  # the program is being exported again: the same change
        with unobserved(), torch.no_grad():
            return target.set_(value)
    size, stride, offset = layout["size"], layout["stride"], layout["offset"]
    if size is None:  # symbolic at export
        size, stride, offset = value.size(), value.stride(), 0
    if _relaid_with_history(target, layout, size, stride, offset):
        return _WRITE_BACK[mode](target, value) if mode is not None else target
    # eager changed the layout before anything the program saved for backward read the
    # tensor (a view of it passed as another input: f(y, y[1])): no version bump here
    with torch.no_grad(), _torch.preserve_version_counter(target):
        if layout["storage"] in ("other", "shared"):
            # its values too: the source, relaid itself, may no longer cover them all (nor
            # does the copy of the forward's memory a "value" source took)
            target.set_(source.untyped_storage(), source.storage_offset() + offset, size, stride)
            if mode is None and layout["storage"] != "shared":
                return target
            # values only: eager's tensor keeps its own history across set_ (under no_grad;
            # in grad mode linked to it through set_'s node), not the memory's (a history
            # the forward gave it, before or after, or set_ linked it to, is refused)
            return target.copy_(value)
        if layout["storage"] == "value":
            if (tuple(value.stride()), value.storage_offset()) != (tuple(stride), offset):
                value = _laid_out(value, size, stride, offset)
            return target.set_(value.untyped_storage(), value.storage_offset(), value.size(), value.stride())
        offset += target.storage_offset()
        _grow_storage(target, size, stride, offset)
        # set_, not as_strided_: as eager's set_ (and not its as_strided_), a leaf gets a gradient
        # accumulator of its new shape
        target.set_(target.untyped_storage(), offset, size, stride)
    return _WRITE_BACK[mode](target, value) if mode is not None else target


def _relaid_as_started_in_trace(target: torch.Tensor, value: torch.Tensor, layout: dict) -> torch.Tensor:
    """The program exported again: ``target``, written ``value`` (its memory
    as the call started), relaid on it as eager left it; the trace writes it
    back as ``value`` again (the same graph)."""
    note_written_as_started(target, value)
    with unobserved(), torch.no_grad():
        return target.set_(target.as_strided(layout["size"], layout["stride"],
                                             target.storage_offset() + layout["offset"]))


def _relaid_with_history(target: torch.Tensor, layout: dict, size, stride, offset: int) -> bool:
    """A tensor with a history relaid on its own memory where autograd saw
    it (``t_()`` in grad mode, or in the caller's mode: ``layout["grad_mode"]``
    is "grad" or "caller"): as eager's, its history goes through the change
    (``as_strided_``, in the caller's mode or with grad on), which autograd
    checks later gradients against. (A leaf takes the new shape as a leaf:
    set_, below.) False where it is not such a change, done nothing."""
    grad_mode = layout.get("grad_mode")
    if layout["storage"] != "own" or grad_mode not in ("grad", "caller") or target.is_leaf or not (
            target.requires_grad) or _torch.is_traced(target):
        return False
    offset += target.storage_offset()
    if _torch.storage_extent(size, stride, offset) * target.element_size() > target.untyped_storage().nbytes():
        return False  # grown (resize_): on memory of its own, as set_ gives it
    with torch.enable_grad() if grad_mode == "grad" else contextlib.nullcontext(), \
            _torch.preserve_version_counter(target):
        target.as_strided_(size, stride, offset)
    return True


def _rebound(target: torch.Tensor, value: torch.Tensor, layout: dict) -> torch.Tensor:
    """A buffer the forward rebound to a tensor of another dtype: ``target``
    takes ``value``'s dtype, memory and layout (``t.data = v`` keeps the
    buffer's identity, as the module holds it)."""
    if _torch.is_traced(target):  # the program is being exported again: the same rebinding
        mark_rebound(target, value)
        return target
    size, stride, offset = layout["size"], layout["stride"], layout["offset"]
    if size is not None and (tuple(value.stride()), value.storage_offset()) != (tuple(stride), offset):
        value = _laid_out(value, size, stride, offset)
    with torch.no_grad():
        target.data = value
    return target


def _laid_out(value: torch.Tensor, size, stride, offset: int) -> torch.Tensor:
    """``value`` on a storage of its own, laid out as eager's tensor was (a
    strided view into memory the forward made, ``x.set_(y[:, 1:3])``, which
    the program's value, a copy, is not)."""
    laid = value.new_empty(_torch.storage_extent(size, stride, offset)).as_strided(size, stride, offset)
    return laid.copy_(value)


def _grow_storage(t: torch.Tensor, size, stride, offset) -> None:
    """``resize_()`` may have needed more elements than ``t``'s storage has."""
    if 0 in tuple(size):
        return
    needed = _torch.storage_extent(size, stride, offset) * t.element_size()
    if needed > t.untyped_storage().nbytes():
        t.untyped_storage().resize_(needed)


for _write_back in (*_WRITE_BACK.values(), write_back_layout,  # dead-code elimination keeps them
                    input_aliasing.check_inputs_alias_as_exported, input_aliasing.check_inputs_repeated_as_exported,
                    mark_rebound):
    _torch.mark_side_effectful(_write_back)


def read_before_mutation(target: torch.Tensor) -> torch.Tensor:
    """What the op that mutates ``target`` (in grad mode) reads: a snapshot,
    so that the write-back cannot change a tensor that op saved for backward
    (eager's in-place op saves what it needs before mutating)."""
    if _torch.is_traced(target):
        return target
    if target.requires_grad and not torch.is_grad_enabled():
        with torch.enable_grad():  # a kept history (keep_history_if_no_grad) leads back to it
            return target.clone()
    return target.clone()


def copy_target_name(node: torch.fx.Node) -> str:
    """The name of the input, parameter or buffer ``node`` reads, as the record names it."""
    return node.target if node.op == "get_attr" else node.name


def _ancestors(node: torch.fx.Node) -> set[torch.fx.Node]:
    seen, todo = set(), [node]
    while todo:
        for i in todo.pop().all_input_nodes:
            if i not in seen:
                seen.add(i)
                todo.append(i)
    return seen


def _snapshot_reads(graph: torch.fx.Graph, target: torch.fx.Node, value: torch.fx.Node,
                    aliases: list[torch.fx.Node] = ()) -> None:
    """Readers of ``target`` that compute its new value read a snapshot, as
    do those of the inputs that are its ``aliases`` (the same tensor given
    twice: the write-back writes them too). Other readers (reads before the
    mutation, in eager order) see the real tensor, so the version check
    fails exactly where eager's would."""
    computing = _ancestors(value) | {value}
    for t in (target, *aliases):
        _read_through_snapshot(graph, t, [u for u in t.users if u in computing])


def _snapshot_all_reads(graph: torch.fx.Graph, write: torch.fx.Node) -> None:
    """A rebound buffer: eager never wrote the old tensor, so no read of it in
    the call may see the write-back (a version error in backward, or, after a
    swap of storage, another value); and a program exported again from
    ``ep.module()`` rebinds it too (:func:`predispatch.trace.translations.mark_rebound`)."""
    target = write.args[0]
    with graph.inserting_before(write):
        graph.call_function(mark_rebound, (target,))
    _read_through_snapshot(graph, target, [u for u in target.users if u.target is not mark_rebound
                                           and u is not write])


def _read_through_snapshot(graph: torch.fx.Graph, target: torch.fx.Node, readers: list) -> None:
    if not readers:
        return
    first = next(n for n in graph.nodes if n in readers)  # after every placeholder (unflatten)
    with graph.inserting_before(first):
        snapshot = graph.call_function(read_before_mutation, (target,))
    for key in ("nn_module_stack", "stack_trace"):  # placed with its reader's module (unflatten)
        if key in first.meta:
            snapshot.meta[key] = first.meta[key]
    if "val" in target.meta:  # passes read it (a quantizer's pattern matcher)
        snapshot.meta["val"] = target.meta["val"]
    for r in readers:
        r.replace_input_with(target, snapshot)


def fix_write_backs(gm: torch.fx.GraphModule | torch.fx.Graph, modes: dict[str, str],
                    target_name=copy_target_name, layouts: dict | None = None, input_views: dict | None = None) -> None:
    """Swap the ``copy_`` write-backs torch writes (``ep.module()``'s unlift,
    ``torch.export.unflatten``) for the mode's function; ``target_name``: the
    mutated state's name (as in the output specs) from the copy's target node.
    A target whose layout or storage changed is written back last (it may
    take the storage of another, written back before: the one that other
    has before its own layout changes). ``input_views``: the record's user
    inputs that share memory (``trace.input_aliasing``)."""
    graph = gm if isinstance(gm, torch.fx.Graph) else gm.graph
    layouts = layouts or {}
    aliases = _aliased_inputs(graph, input_views or {})
    if isinstance(gm, torch.fx.GraphModule):
        aliases.update(_state_read_under_two_names(gm))
    relaid = []
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is torch.ops.aten.copy_.default:
            name = target_name(node.args[0])
            mode = modes.get(name)
            if mode == "grad":
                _snapshot_reads(graph, *node.args, aliases.get(node.args[0], ()))
            elif mode == "rebound":
                _snapshot_all_reads(graph, node)
            if name in layouts:
                relaid.append((node, layouts[name], mode))
                continue
            if mode in _WRITE_BACK:
                node.target = _WRITE_BACK[mode]
    # a source's storage as the call left it: relaid itself, it may move to another one
    sources = {}
    for _, layout, _ in relaid:
        if layout["storage"] == "other" and layout["source"] not in sources:
            with graph.inserting_before(graph.output_node()):
                sources[layout["source"]] = graph.call_function(
                    torch.ops.aten.alias.default, (_state_node(graph, layout["source"], target_name),))
    written = {}  # a target's write-back: where a later target sharing its new storage finds it
    for node, layout, mode in relaid:
        source = sources.get(layout["source"]) if layout["storage"] == "other" else written.get(layout["source"])
        with graph.inserting_before(graph.output_node()):
            last = graph.call_function(write_back_layout, (*node.args, source, layout, mode))
        written[target_name(node.args[0])] = last
        last.meta.update(node.meta)
        node.replace_all_uses_with(last)
        graph.erase_node(node)


def _aliased_inputs(graph: torch.fx.Graph, views: dict) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Per user input sharing memory with others (by the record's positions
    among the graph's placeholders), the placeholders of those others."""
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    groups: dict[int, set[int]] = {}
    for i, view in views.items():
        groups.setdefault(view["of"], {view["of"]}).add(int(i))
    return {inputs[i]: [inputs[j] for j in sorted(group - {i})] for group in groups.values() for i in group}


def _state_read_under_two_names(gm: torch.fx.GraphModule) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Per read of a parameter or buffer the module holds under two names
    (``self.a = self.bn``), the reads of it under the others."""
    reads: dict[int, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            try:
                held = functools.reduce(getattr, node.target.split("."), gm)
            except AttributeError:
                continue
            reads.setdefault(id(held), []).append(node)
    return {n: [m for m in group if m is not n] for group in reads.values() if len(group) > 1 for n in group}


def _state_node(graph: torch.fx.Graph, name: str, target_name) -> torch.fx.Node:
    """The node reading input, parameter or buffer ``name`` (named as
    ``target_name`` names them), made if the graph has none."""
    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr") and target_name(node) == name:
            return node
    with graph.inserting_before(graph.output_node()):
        return graph.get_attr(name)


def fix_unflattened_write_backs(graph: torch.fx.Graph, signature) -> None:
    """torch.export.unflatten writes mutations back with ``copy_`` into the
    placeholders of the program's graph: the same swap, for our programs
    (a BatchNorm's running statistics, saved by its backward, are written
    back hidden from autograd)."""
    record = program_meta(graph)
    if not record:
        return
    state = {**signature.inputs_to_parameters, **signature.inputs_to_buffers}
    fix_write_backs(graph, record.get("write_back", {}), lambda node: state.get(node.name, node.name),
                    record.get("layouts", {}))


def mutated_user_inputs(signature) -> list[int]:
    """Positions, among the user inputs, of those the program mutates."""
    users = [getattr(s.arg, "name", None) for s in signature.input_specs if s.kind.name == "USER_INPUT"]
    return [users.index(s.target) for s in signature.output_specs if s.kind.name == "USER_INPUT_MUTATION"]


def check_input_aliasing(unlifted: torch.fx.GraphModule, views: dict, mutated: list[int], repeated: dict) -> None:
    """A program that mutates an input first checks that the call's inputs
    share memory as the example inputs did, where it matters (see
    :mod:`predispatch.trace.input_aliasing`); one whose example inputs gave
    a tensor twice, that the call does too."""
    if not (repeated or mutated):  # nothing to check (a module called without inputs among them)
        return
    graph = unlifted.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(inputs[-1]):
        if repeated:
            graph.call_function(input_aliasing.check_inputs_repeated_as_exported, (repeated, *inputs))
        if mutated:
            graph.call_function(input_aliasing.check_inputs_alias_as_exported, (views, mutated, *inputs))
    unlifted.recompile()


