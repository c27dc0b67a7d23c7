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
        >>> ep = predispatch.export_predispatch(M(), (torch.ones(2),))
        >>> [r.name for r in predispatch.regions(ep)]      # the no_grad block, as a region
        ['no_grad_0']
        >>> [spec.kind.name for spec in ep.graph_signature.output_specs]
        ['USER_INPUT_MUTATION', 'USER_OUTPUT']
        >>> x = torch.ones(2)
        >>> ep.module()(x), x        # the output, and the input updated as eager updates it
        (tensor([4., 4.]), tensor([2., 2.]))

    The result (a :class:`PredispatchProgram`) is functional, traced above
    autograd and autocast, each grad-mode or autocast block a region; its
    ``module()`` gives eager's outputs, gradients and states.

    Args:
        module: the ``torch.nn.Module`` to export (train or eval mode).
        args: a tuple of example inputs (pytrees allowed).
        kwargs: a dict of example keyword inputs.
        dynamic_shapes: as for ``torch.export.export``.
        op_policy: which CompositeImplicitAutograd ops are kept whole
            (:class:`OpPolicy`; ``None`` is ``OpPolicy.default()``).
        backward_pass_autocast: the autocast state :func:`compile_training`
            traces the backward under: ``"same_as_forward"``, ``"off"`` or a
            list of ``torch.amp.autocast`` kwargs dicts.
        on_backward_autocast_mismatch: what a backward run under another
            autocast state does, where that changes its result: ``"error"``,
            ``"warn"`` or ``"do_nothing"``.
        data_dependent: Python control flow on a tensor's value (``if
            mask.all():``): ``"refuse"`` raises ``ExportError`` naming the
            line; ``"specialize"`` takes the example's branch, records the
            assumption (line, condition, value) in the program and checks it
            at every call (``ep.module()`` raises naming the line).

    Raises:
        ExportError: a construct no functional program can reproduce (the
            message names it and the source line).
        ValueError: a bad option value.

    The stages it runs are :data:`predispatch.pipeline.STAGES`.
    """
    autocast = AutocastPolicy.validated(backward_pass_autocast, on_backward_autocast_mismatch)
    op_policy = OpPolicy.default() if op_policy is None else op_policy
    _check_arguments(module, args, op_policy, data_dependent)
    with _torch.lazy_codegen(), _sharding_lowered(module, args, kwargs) as layouts:
        return run(ModuleExport(module, args, kwargs, dynamic_shapes, op_policy, autocast, layouts,
                                data_dependent))


def _check_arguments(module, args, op_policy, data_dependent) -> None:
    """A ValueError for an option or argument export_predispatch does not take."""
    if data_dependent not in DATA_DEPENDENT:
        raise ValueError(f"data_dependent must be one of {', '.join(map(repr, DATA_DEPENDENT))}, "
                         f"got {data_dependent!r}")
    if not isinstance(op_policy, OpPolicy):
        raise ValueError(f"op_policy must be a predispatch.OpPolicy, got {type(op_policy).__name__}")
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"export_predispatch takes a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple of example inputs, got {type(args).__name__}")


def _sharding_lowered(module, args, kwargs):
    """A sharded module's DTensors lowered to local shards (see
    :mod:`predispatch.distributed.sharding`); nothing where torch.distributed's
    DTensor was never imported (importing it costs a second)."""
    if not _torch.distributed_in_use():
        return contextlib.nullcontext({})
    from .distributed import sharding

    return sharding.lowered(module, args, kwargs)
