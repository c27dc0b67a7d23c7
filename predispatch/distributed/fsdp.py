"""FSDP2 (``fully_shard``) in a rank's program: its all-gather and reduce-scatter.

Eager FSDP2 all-gathers a module's parameters in a forward pre-hook (its
own copy-in ops over flat storage, resized in place), frees them in a post
hook, all-gathers them again before the module's backward and
reduce-scatters their gradients, averaged over the ranks, after it. What the
program computes is the same, said as data flow: while the forward is
traced, the hooks FSDP registered on each ``fully_shard``-ed module are
swapped for two of ours (restored on exit):

* before the module's forward, each parameter it manages (a DTensor
  ``Shard(0)``, whose local shard the program takes as the parameter) is
  the all-gathered tensor, one op (:class:`predispatch.distributed.collectives.Redistribute`)
  whose forward is ``all_gather_into_tensor`` + ``wait_tensor`` and whose
  backward is ``reduce_scatter_tensor`` + ``wait_tensor`` divided by the
  number of ranks (FSDP's gradient averaging);
* after it, the parameter is the shard again.

With ``reshard_after_forward`` on or off the program is the same: when to
free and all-gather again is the memory plan of whoever runs the graph
(autograd keeps what the backward needs). What FSDP2 does that this does
not express is refused, naming the module: a mixed-precision or offload
policy, a gradient divide factor, parameters shared between modules, HSDP,
uneven shards. With tensor parallelism (FSDP on one dimension of a 2-D mesh,
TP on the other) the all-gathered parameter is the TP DTensor FSDP would
give the module, around the gathered TP shard.
"""
from __future__ import annotations

import contextlib

import torch

from .. import _torch
from ..errors import ExportError
from .._torch.patching import patches_suspended


def fsdp_modules(module: torch.nn.Module) -> list:
    """(path, module, its FSDP parameter groups) of each ``fully_shard``-ed submodule."""
    return [(path, sub, _torch.fsdp_param_groups(sub)) for path, sub in module.named_modules()
            if isinstance(sub, _torch.FSDPModule)]


def _refused(path: str, sub, why: str) -> ExportError:
    forward = type(sub).forward
    code = getattr(forward, "__code__", None)
    where = f"{code.co_filename}:{code.co_firstlineno}" if code else "unknown location"
    named = f"submodule {path!r}" if path else "the module"
    return ExportError(f"fully_shard (FSDP2) on {named} ({type(sub).__name__}, forward at {where}): "
                       f"{why} is not supported")


def refuse_unlowered(module: torch.nn.Module) -> None:
    """What the lowering does not express, refused with the module's name."""
    for path, sub, groups in fsdp_modules(module):
        for group in groups:
            why = _group_refusal(group)
            for fsdp_param in _torch.fsdp_params(group):
                why = why or _param_refusal(fsdp_param)
            if why is not None:
                raise _refused(path, sub, why)


def _group_refusal(group) -> str | None:
    """What a parameter group does beyond sharding its parameters evenly, or None."""
    default_mp = _torch.MixedPrecisionPolicy()
    policy = next((p for p in _torch.fsdp_mixed_precision_policies(group) if p != default_mp), None)
    if policy is not None:
        return f"a mixed-precision policy ({policy})"
    offload = _torch.fsdp_offload_policy(group)
    if not isinstance(offload, _torch.OffloadPolicy) or type(offload) is not _torch.OffloadPolicy:
        return f"an offload policy ({type(offload).__name__})"
    if _torch.fsdp_gradient_divide_factor(group) is not None:
        return "a gradient divide factor"
    return None


def _param_refusal(fsdp_param) -> str | None:
    """How a managed parameter is placed otherwise than the lowering expresses, or None."""
    _owner, name, sharing = _torch.fsdp_param_place(fsdp_param)
    mesh, mesh_kind, dim = _torch.fsdp_param_mesh(fsdp_param)
    if sharing:
        return f"parameter {name!r} shared between modules"
    if mesh_kind != "FSDPMeshInfo" or mesh.ndim != 1:
        return f"{mesh_kind} on a {mesh.ndim}-D data-parallel mesh (HSDP, DDP)"
    size = _torch.fsdp_param_unsharded_size(fsdp_param)[dim]
    if size % mesh.size():
        return f"parameter {name!r} of {size} along dimension {dim} over {mesh.size()} ranks (uneven shards)"
    return None


def _managed(groups) -> list:
    """(module, parameter name, FSDP's record of it) of each parameter FSDP's groups manage."""
    return [(*_torch.fsdp_param_place(p)[:2], p) for group in groups for p in _torch.fsdp_params(group)]


def managed_names(module: torch.nn.Module) -> set:
    """Qualified names of the parameters ``fully_shard`` manages in ``module``."""
    ids = {id(getattr(owner, name)) for _path, _sub, groups in fsdp_modules(module)
           for owner, name, _param in _managed(groups)}
    return {name for name, p in module.named_parameters(remove_duplicate=False) if id(p) in ids}


def gathered_along(fsdp_param) -> tuple:
    """(the data-parallel mesh, the dimension FSDP shards) of a managed parameter."""
    mesh, _kind, dim = _torch.fsdp_param_mesh(fsdp_param)
    return mesh, dim


def tensor_parallel_spec(fsdp_param):
    """The DTensor spec of the all-gathered parameter (FSDP x TP: the TP
    DTensor's), or None (a plain tensor)."""
    return _torch.fsdp_param_tensor_parallel_spec(fsdp_param)


@contextlib.contextmanager
def hooks_replaced(module: torch.nn.Module, unsharded):
    """FSDP's forward hooks on each ``fully_shard``-ed submodule swapped for
    ours: before its forward, each parameter it manages is
    ``unsharded(param, FSDP's record of it)``; after, the
    parameter it was. Restored on exit."""
    saved = []
    try:
        for _path, sub, groups in fsdp_modules(module):
            managed = _managed(groups)
            shards: list = []

            def pre(_module, args, kwargs, managed=managed, shards=shards):
                shards[:] = [getattr(owner, name) for owner, name, _ in managed]
                for (owner, name, record), shard in zip(managed, shards):
                    _torch.state_table(owner, name)[name] = unsharded(shard, record)
                return args, kwargs

            def post(_module, _args, output, managed=managed, shards=shards):
                for (owner, name, _), shard in zip(managed, shards):
                    _torch.state_table(owner, name)[name] = shard
                return output

            for (hooks, key), ours in zip(_torch.fsdp_forward_hooks(sub), (pre, post)):
                saved.append((hooks, key, hooks[key]))
                hooks[key] = ours
        yield
    finally:
        for hooks, key, hook in reversed(saved):
            hooks[key] = hook


def unsharded_in_eager(shard, fsdp_param):
    """The all-gathered parameter, by DTensor itself (for the fake eager run
    that finds the gradients' placements: not one of the boundaries it counts)."""
    spec = tensor_parallel_spec(fsdp_param)
    with patches_suspended():
        if spec is None:
            return shard.full_tensor()
        gathered = shard.redistribute(shard.device_mesh, [_torch.Replicate(), *spec.placements])
        return _torch.DTensor.from_local(gathered.to_local(), spec.mesh, spec.placements,
                                         shape=spec.shape, stride=spec.stride)
