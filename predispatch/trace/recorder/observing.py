"""Seeing each op where functionalization sees it (in-place updates inside library calls too).

Seeing each op where functionalization sees it: ``observing_ops(observer)``
tells ``observer`` of every op on FunctionalTensors, in-place updates inside
library calls included (``F.relu(x, inplace=True)``), and traces the ops
functionalization gets wrong as :mod:`predispatch.trace.inplace_rules` says;
inside :func:`unobserved`, ops are not the forward's own and go straight to
functionalization."""
from __future__ import annotations

import contextlib

import torch

from ... import _torch
from ...errors import ExportError, user_location
from .. import inplace_rules
from ..._torch.patching import patched

_UNOBSERVED: list[bool] = []  # inside unobserved(): ops go straight to functionalization


@contextlib.contextmanager
def unobserved():
    """Ops traced meanwhile are not the forward's own (a write-back of
    ``ep.module()`` exported again): no rule, no recorder sees them."""
    _UNOBSERVED.append(True)
    try:
        yield
    finally:
        _UNOBSERVED.pop()


def is_unobserved() -> bool:
    return bool(_UNOBSERVED)


def observing_ops(observer):
    """``observer(op, tensors it writes)`` before each op on FunctionalTensors,
    seen where functionalization sees it. A subclass of the mode would not
    do: higher-order ops look their functionalization rule up by the mode's
    exact type."""
    def observed(dispatch):
        def call(mode, func, types, args=(), kwargs=None, rules=True):
            kwargs = kwargs or {}
            if _UNOBSERVED:
                return dispatch(mode, func, types, args, kwargs)
            if (rules and args and isinstance(args[0], _torch.FunctionalTensor)  # not a kernel's inner call
                    and (rewrite := inplace_rules.traced_as(func, torch.is_grad_enabled(), args[0])) is not None):
                # the rewrite's own ops are observed; the op it rewrites is not rewritten again
                return rewrite(lambda f, a, k: call(mode, f, types, a, k, rules=f is not func),
                               func, args, kwargs)
            written = _written_tensors(func, args, kwargs)
            if len(written) > 1:
                _refuse_writes_into_one_memory(func, written)
            observer(func, written)
            return dispatch(mode, func, types, args, kwargs)
        return call
    return patched(_torch.FunctionalTensorMode, "__torch_dispatch__", observed)


def _written_tensors(func, args, kwargs) -> list:
    """The FunctionalTensors ``func`` writes (by its schema)."""
    return [t for i, name in _torch.written_arguments(func)
            for t in ((args[i] if i < len(args) else kwargs.get(name)),)
            if isinstance(t, _torch.FunctionalTensor)]


def _refuse_writes_into_one_memory(func, written: list) -> None:
    """An op writing two of its arguments that overlap in memory (the same
    tensor passed twice): eager's values are what its kernel wrote last,
    the program writes each result back in turn."""
    for i, a in enumerate(written):
        for b in written[i + 1:]:
            if a is b or (_torch.shares_storage(a, b) and _overlap(a, b)):
                raise ExportError(
                    f"{func} at {user_location()} writes two of its arguments that share memory (one "
                    "tensor passed twice, or views overlapping): eager's values are what its kernel writes "
                    "last, which a program, writing each result back, cannot reproduce; pass clones")


def _overlap(a, b) -> bool:
    (size_a, stride_a, start_a), (size_b, stride_b, start_b) = _torch.layout(a), _torch.layout(b)
    end_a, end_b = _torch.storage_extent(size_a, stride_a, start_a), _torch.storage_extent(size_b, stride_b, start_b)
    return start_a < end_b and start_b < end_a
