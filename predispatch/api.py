"""``export_predispatch``: the public entry, its options checked, the pipeline run."""
from __future__ import annotations

import contextlib

import torch

from . import _torch
from .pipeline import ModuleExport, run
from .policies.autocast_policy import AutocastPolicy
from .policies.op_policy import OpPolicy
from .program.program import PredispatchProgram

# what export_predispatch may do with a branch on a tensor's value: refuse it, or take the example's
DATA_DEPENDENT = ("refuse", "specialize")


def export_predispatch(module, args, kwargs=None, *, dynamic_shapes=None, op_policy=None,
                       backward_pass_autocast="same_as_forward",
                       on_backward_autocast_mismatch="error",
                       data_dependent="refuse") -> PredispatchProgram:
    """Export ``module`` to a functionalized pre-dispatch ``ExportedProgram``.

        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             x.mul_(2)
        ...         return x * x
        >>> ep = export_predispatch(M(), (torch.ones(2),))
        >>> print(ep.graph_module.code)   # wrap_with_set_grad_enabled(False, self.no_grad_0, x)

    ``data_dependent`` says what to do with Python control flow on a
    tensor's value (``if mask.all():``, ``x.item() > 0``, a loop over
    ``nonzero()``): ``"refuse"`` (the default) raises ``ExportError`` naming
    the line; ``"specialize"`` takes the branch the example's data takes (the
    trace carries the example's real values, as ``torch.export.draft_export``
    does), records each such assumption (its source line, the condition,
    its value) in the program, where the printed program shows it and
    ``torch.export.save``/``load`` keep it, and checks it on every call:
    ``ep.module()`` raises a ``RuntimeError`` naming the line when a call's
    data would take another branch, never a wrong result. (Inside an
    autograd.Function's forward or backward, traced apart on inputs with no
    value, such a branch stays refused.)

    See ../shared/CONTRACT.md for guarantees G1-G7; the stages it runs are
    :data:`predispatch.pipeline.STAGES`.
    """
    autocast = AutocastPolicy.validated(backward_pass_autocast, on_backward_autocast_mismatch)
    op_policy = OpPolicy.default() if op_policy is None else op_policy
    if data_dependent not in DATA_DEPENDENT:
        raise ValueError(f"data_dependent must be one of {', '.join(map(repr, DATA_DEPENDENT))}, "
                         f"got {data_dependent!r}")
    if not isinstance(op_policy, OpPolicy):
        raise ValueError(f"op_policy must be a predispatch.OpPolicy, got {type(op_policy).__name__}")
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"export_predispatch takes a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple of example inputs, got {type(args).__name__}")
    with _torch.lazy_codegen(), _sharding_lowered(module, args, kwargs) as layouts:
        return run(ModuleExport(module, args, kwargs, dynamic_shapes, op_policy, autocast, layouts,
                                data_dependent))


def _sharding_lowered(module, args, kwargs):
    """A sharded module's DTensors lowered to local shards (see
    :mod:`predispatch.distributed.sharding`); nothing where torch.distributed's
    DTensor was never imported (importing it costs a second)."""
    if not _torch.distributed_in_use():
        return contextlib.nullcontext({})
    from .distributed import sharding

    return sharding.lowered(module, args, kwargs)
