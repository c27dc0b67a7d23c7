"""How a captured Function's results reach its caller: the inputs its forward updates, the inputs it returns.

The op is functional; what eager's Function does to its caller's tensors is
done around it, in the caller's graph, as eager's autograd does it:

* an input the forward updates in place, not marked dirty: eager's forward
  runs under no_grad, so the input takes the new value and keeps its
  history. The op returns the new value (a non-differentiable output after
  the Function's own, ``updates``), written to the input under no_grad;
* an input marked dirty (``ctx.mark_dirty``) and returned: the Function's
  output *is* the caller's tensor, which takes the Function's history. The
  op's output (differentiable) is written to the input in grad mode, and the
  caller gets the input itself (one also marked non-differentiable gets no
  history in eager: it is updated as one not marked dirty);
* an input returned as it is, or a view of one, not dirty: eager returns a
  view of it (``view_as`` for the input itself) with the Function's history.
  The caller gets that view of the input, whose value is the op's output
  (its history, the Function's) until the input's memory is next written,
  when it is replayed from the input as any view: what eager does where it
  does not refuse (it forbids using such a view in autograd once its base
  or the view itself was updated in place). So an update of the view
  reaches the input, and one of the input the view.

At run time the op's autograd.Function returns what the forward subgraph
returns (the input, or its view), so ``ep.module()``'s output is the alias
eager's is, with the Function's history.
"""
from __future__ import annotations

import dataclasses

import torch

from ... import _torch
from ..recorder.detached import copy_values_only
from .ctx import refused


@dataclasses.dataclass(frozen=True)
class ReturnedInput:
    """The Function's tensor output ``output`` is its input ``input`` (one of
    the op's; ``layout``: None) or a view of it, its (size, stride, offset
    from the input's) in the forward's trace; ``dirty``: marked dirty."""

    output: int
    input: int
    layout: tuple | None
    dirty: bool = False


def returned_input(out, k: int, tensors: list, dirty: tuple) -> ReturnedInput | None:
    """The tensor ``out``, the Function's ``k``-th tensor output, as a
    returned input (``tensors``: the forward's tensor inputs), or None."""
    for j, t in enumerate(tensors):
        if out is t:
            return ReturnedInput(k, j, None, any(out is d for d in dirty))
        if _torch.shares_storage(out, t):
            offset = out.storage_offset() - t.storage_offset()
            return ReturnedInput(k, j, (tuple(out.shape), tuple(out.stride()), offset))
    return None


def refuse_dirty_not_returned(dirty: tuple, tensors: list, outputs: list, name: str, where: str) -> None:
    """Eager refuses a tensor marked dirty that is not an input the forward returns."""
    for d in dirty:
        if not any(d is t for t in tensors):
            raise refused(name, where, "it marks dirty a tensor that is not one of its inputs")
        if not any(d is o for o in outputs):
            raise refused(name, where, "it marks dirty an input it does not return")


def reach_the_caller(tensors: list, results, n_outputs: int, updates: list, returned: list) -> list:
    """The Function's tensor outputs as the caller gets them, from the op's
    ``results`` on its inputs ``tensors``, the inputs the forward updates
    written (see the module docs)."""
    outputs = list(results[:n_outputs])
    if updates:
        with torch.no_grad():  # the forward's own mode: the inputs keep their history
            for j, value in zip(updates, results[n_outputs:]):
                tensors[j].copy_(value)
    for r in returned:
        if r.dirty:  # the caller's tensor, with the Function's history and none of its old value's
            copy_values_only(tensors[r.input], outputs[r.output])
            outputs[r.output] = tensors[r.input]
    for r in returned:
        if not r.dirty:
            outputs[r.output] = _view_with_value(tensors[r.input], r.layout, outputs[r.output])
    return outputs


def _view_with_value(x, layout: tuple | None, value):
    """A view of ``x`` (``view_as`` for None, else ``layout`` in its memory)
    holding ``value`` until ``x``'s memory is next written."""
    if layout is None:
        view = x.view_as(x)
    else:
        size, stride, offset = layout
        view = x.as_strided(size, stride, x.storage_offset() + offset)
    _torch.hold_value_until_written(view, value)
    return view
