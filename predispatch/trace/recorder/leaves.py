"""Tensors read through an op: leaves made in the forward, aliases with a history of their own.

Tensors read through an op. A tensor made to require grad in the forward
has no node of its own in a trace above autograd, and a tensor whose eager
history is another node than the one functionalization replays it from (a
detached alias updated in grad mode, a set_() target, a grad-mode view of
either) would lose it: the recorder marks such tensors, and the nodes each
later call makes read ``requires_grad(value)`` / ``keep_history(own, value)``
of them instead (:func:`call_reading_through`)."""
from __future__ import annotations

import torch
import torch.fx

from ... import _torch
from ...errors import ExportError, user_location
from ...ir import ops
from ...ir.records import Event, Kind
from . import marks
from .state import TorchCall, TraceState
from .views import current_node


def _requires_grad_set_to(call: TorchCall) -> bool | None:
    """The flag ``t.requires_grad_(flag)`` / ``t.requires_grad = flag`` sets;
    None for another call."""
    func, args, kwargs = call.func, call.args, call.kwargs
    if func is torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    if getattr(func, "__self__", None) is _torch.TENSOR_REQUIRES_GRAD and func.__name__ == "__set__":
        return bool(args[1])
    return None


def sets_requires_grad(state: TraceState, call: TorchCall) -> bool:
    """``t.requires_grad_()`` / ``t.requires_grad_(True)`` / ``t.requires_grad = True``."""
    return _requires_grad_set_to(call) is True


def drops_autograd(state: TraceState, call: TorchCall) -> bool:
    """``t.detach_()``, ``t.requires_grad_(False)``, ``t.requires_grad = False``."""
    return call.func is torch.Tensor.detach_ or _requires_grad_set_to(call) is False


def refuse_dropping_autograd_of_state(state: TraceState, call: TorchCall) -> None:
    """Of a parameter that requires grad or a floating input (a caller may
    pass one that requires grad), refused: eager changes the caller's tensor
    (its ``requires_grad``, its history), which a program cannot. Of a
    buffer (nothing changes) or a tensor the forward made, the call goes on."""
    t = call.args[0]
    key = state.graph_inputs.get(id(t), "")
    if (key.startswith("param:") and t.requires_grad) or (key.startswith("input:") and (
            t.is_floating_point() or t.is_complex())):
        what = "detach_()" if call.func is torch.Tensor.detach_ else "requires_grad set to False"
        raise ExportError(
            f"{what} on a parameter, buffer or input at {user_location()}: eager changes the caller's "
            "tensor, which a program cannot; do it before the call, or use a detached copy (t.detach())")


def retains_grad(state: TraceState, call: TorchCall) -> bool:
    """``t.retain_grad()`` of a tensor the trace holds."""
    return call.func is torch.Tensor.retain_grad and bool(call.args) and _torch.is_traced(call.args[0])


def skip_retain_grad(state: TraceState, call: TorchCall) -> None:
    """No op: eager keeps the tensor's ``.grad`` after a backward, which
    changes no output, input or parameter gradient (and a program's
    intermediate is no tensor the caller holds)."""
    return None


def require_grad(state: TraceState, call: TorchCall):
    """``t.requires_grad_()`` / ``t.requires_grad = True``: no node in a
    trace above autograd; the tensor is marked, and later calls read it
    through the op (:func:`call_reading_through`)."""
    t = call.args[0]
    required = t.requires_grad
    out = call.func(*call.args, **call.kwargs)
    if isinstance(t, _torch.FunctionalTensor):
        note_leaf(state, t, required)
    return out


def note_leaf(state: TraceState, t, required: bool = False) -> None:
    """``t`` was made to require grad (``required``: it did already)."""
    node = current_node(state, t)
    if node is None:
        return
    if node.op == "placeholder" or id(t) in state.graph_inputs:  # (also once updated in place)
        if required:
            return  # a parameter that requires grad: nothing changes
        raise ExportError(
            f"requires_grad set on a parameter, buffer or input at {user_location()}: eager "
            "changes the caller's tensor, which a program cannot; set it before the call")
    marks.LEAF.set(t)
    marks.DETACHED.clear(t)  # a leaf now: its grad-mode views have a history
    marks.NO_GRAD_VIEW.clear(t)
    state.reads_through = True


def read_through(state: TraceState, t, replayed_later: bool = False):
    """(op, nodes before ``t`` in its arguments) a read of ``t`` goes
    through, or None:

    * ``requires_grad`` for a tensor made to require grad;
    * ``keep_history(own, t)`` for a tensor whose history is the node
      ``own`` (a detached alias updated in grad mode: the update, see
      :func:`.detached.mutate_detached_alias`; a grad-mode view of a tensor
      read through an op: the view as made, from that read), once
      functionalization replayed it from memory, or will (an output)."""
    if marks.LEAF.of(t):
        return ops.REQUIRES_GRAD, ()
    own = marks.own_history(t)
    if own is not None and (replayed_later or current_node(state, t) is not own):
        return ops.KEEP_HISTORY, (own,)
    return None


def call_reading_through(state: TraceState, call: TorchCall, run, read_written: bool = False):
    """``run()``, a call reading tensors :func:`read_through` names: the nodes
    it makes read the op of them instead (a leaf's history, an alias's own),
    as eager's call would differentiate through them. The tensors
    themselves are untouched, so what aliases what is as in eager (a view
    of one reads it through the op; its later replays from the base do
    not); the tensor an in-place op writes is written as itself (and,
    ``read_written``, read through its op: a detached alias updated in
    grad mode again computes from its own history)."""
    written = call.args[0] if call.args and call.in_place and not read_written else None
    reading = {node: (through, t) for t in _torch.pytree.tree_leaves((call.args, call.kwargs))
               if isinstance(t, _torch.FunctionalTensor) and t is not written
               and (through := read_through(state, t)) is not None
               and (node := current_node(state, t)) is not None}
    if not reading:
        return run()
    mark = _torch.last_node(_torch.current_tracer().graph)
    out = run()
    reads = {}
    for node in list(_torch.nodes_after(mark)):
        for value in [i for i in node.all_input_nodes if i in reading]:
            if value not in reads:
                reads[value] = _read_node(state, mark, value, node, *reading[value])
            node.replace_input_with(value, reads[value])
    return out


def _read_node(state: TraceState, mark: torch.fx.Node, value: torch.fx.Node, reader: torch.fx.Node, through, t) -> torch.fx.Node:
    """``op(*leading, value)`` (``through``), right after ``mark``, stamped as
    the first node that reads it (``reader``); a leaf set_() to other memory
    reads it through its own history first (:func:`_own_before_swap`)."""
    op, leading = through
    graph = mark.graph
    own = _own_before_swap(t, value) if op is ops.REQUIRES_GRAD else None
    if own is not None:
        mark = _read_node(state, mark, value, reader, (ops.KEEP_HISTORY, (own,)), t)
        value = mark
    with graph.inserting_after(mark):
        read = graph.call_function(op, (*leading, value))
    if op is ops.KEEP_HISTORY:
        mark_own_read(state, read, t)
    read.meta.update({k: v for k, v in reader.meta.items() if k in ("stack_trace", "nn_module_stack")})
    read.meta["val"] = value.meta.get("val")
    return read


def _own_before_swap(t, value: torch.fx.Node) -> torch.fx.Node | None:
    """The node of ``t``'s own history where ``t``, made to require grad, was
    given other memory by set_() (its value is that memory's, with the
    memory's history: a parameter's, say); eager's ``t`` is still itself, a
    leaf of its own. None otherwise."""
    if not marks.SWAPPED.of(t):
        return None
    own = marks.own_history(t)
    return own if isinstance(own, torch.fx.Node) and own is not value else None


def read_leaf_outputs(state: TraceState, out):
    """Outputs are read through their op too (functionalization replays
    an output view from memory once the forward returns)."""
    if not state.reads_through:
        return out

    def read(t):
        through = read_through(state, t, replayed_later=True)
        if through is None:
            return t
        op, leading = through
        own = _own_before_swap(t, _torch.current_node(t)) if op is ops.REQUIRES_GRAD else None
        if own is not None:  # a leaf set_() to other memory: its own history first, then the leaf
            kept = ops.KEEP_HISTORY(t, t)
            node = _torch.current_node(kept)
            node.args = (own, node.args[1])
            mark_own_read(state, node, t)
            return op(kept)
        out = op(*(t for _ in leading), t)  # its leading arguments are nodes: set below
        node = _torch.current_node(out)
        node.args = (*leading, *node.args[len(leading):])
        if op is ops.KEEP_HISTORY:
            mark_own_read(state, node, t)
        return out
    return _torch.pytree.tree_map_only(_torch.FunctionalTensor, read, out)


def mark_own_read(state: TraceState, node: torch.fx.Node, t: torch.Tensor) -> None:
    """``node``, ``keep_history(own, value)``, reads ``t``'s own history; a
    set_() target's kept from before the swap is noted as such."""
    state.record.note(Event(Kind.OWN_HISTORY_READ, node))
    swap = marks.SWAP_HISTORY.of(t)
    if swap is not None and swap[0] is node.args[0]:  # (not an own history given it later)
        state.record.note(Event(Kind.STORAGE_SWAP, node, swap[0], eager_view=swap[1]))
