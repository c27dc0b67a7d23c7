"""Any other torch call: run as traced, with what it reads and makes noted.

Any other torch call: run as traced, with what it reads and makes noted.
Before it, the casts eager's autocast cache would hold are looked up
(:mod:`predispatch.trace.autocast_cache`); it runs marking the view replays
it causes (when it reads a view made under no_grad) and reading through
their ops the tensors :mod:`.leaves` names (a tensor requiring grad that the
trace does not hold is refused: :mod:`.unregistered`; what it makes from
constants alone is traced: :mod:`.constants`); after it, a custom op's alias is
refused, the cast cache followed, the views it made noted, and a tensor it
made to require grad (``requires_grad=True``) marked."""
from __future__ import annotations

import functools

import torch

from ... import _torch
from ...ir import ops
from . import leaves, views
from .constants import traced_if_fresh, untraced_tensors
from .custom_ops import alias_annotations_explained, refuse_hidden_alias
from .state import TorchCall, TraceState
from .unregistered import refuse_unregistered_grad_tensors

# predispatch's own reads through an op: not read through again
_OWN_READS = (ops.REQUIRES_GRAD, ops.KEEP_HISTORY)


def _reads_a_dtype(func) -> bool:
    """``t.dtype`` (a getter: each read gives another method-wrapper of the one descriptor)."""
    return getattr(func, "__self__", None) is torch.Tensor.dtype


def always(state: TraceState, call: TorchCall) -> bool:
    return True


def call_as_traced(state: TraceState, call: TorchCall):
    func, args, kwargs = call.func, call.args, call.kwargs
    if _reads_a_dtype(func) and _torch.any_autocast_enabled():
        state.record.reads_dtype_under_autocast = True  # (see predispatch.program.ambient)
    cast_reads = state.casts.reads(args, kwargs, functools.partial(views.current_node, state))
    mark = _torch.last_node(_torch.current_tracer().graph) if cast_reads else None
    with alias_annotations_explained(func):
        out = _run(state, call)
    untraced = untraced_tensors(args, kwargs)  # constants: empty for nearly every call
    if untraced:
        out = traced_if_fresh(func, untraced, out)
        refuse_unregistered_grad_tensors(func, untraced, out)
    refuse_hidden_alias(func, args, kwargs, out)
    state.casts.after(cast_reads, out, mark)
    views.note_views(state, func, args, out)
    if kwargs.get("requires_grad") and isinstance(out, _torch.FunctionalTensor):
        leaves.note_leaf(state, out)  # torch.ones(..., requires_grad=True)
    return out


def _run(state: TraceState, call: TorchCall):
    func, args, kwargs = call.func, call.args, call.kwargs
    run = functools.partial(func, *args, **kwargs)
    if state.watch is None and state.any_no_grad_view and views.reads_no_grad_view(args, kwargs):
        run = functools.partial(views.call_marking_view_replays, state, func, args, kwargs)
    if state.reads_through and func not in _OWN_READS:
        return leaves.call_reading_through(state, call, run)
    return run()
