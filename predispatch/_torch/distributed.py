"""DTensor and FSDP2 internals, imported on first use (a module that never imported them holds none)."""
from __future__ import annotations

import contextlib
import functools
import sys

import torch


def distributed_in_use() -> bool:
    """Has anything imported DTensor or FSDP2 (so a module may hold them)?"""
    return "torch.distributed.tensor" in sys.modules or "torch.distributed.fsdp" in sys.modules


@functools.cache
def _distributed_names() -> dict:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import _StridedShard

    return {"DTensor": DTensor, "DTensorSpec": DTensorSpec, "TensorMeta": TensorMeta,
            "Replicate": Replicate, "Shard": Shard, "Partial": Partial, "FSDPModule": FSDPModule,
            "MixedPrecisionPolicy": MixedPrecisionPolicy, "OffloadPolicy": OffloadPolicy,
            "StridedShard": _StridedShard}


def __getattr__(name: str):
    names = _distributed_names()
    if name in names:
        return names[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def mesh_group_name(mesh, dim: int) -> str:
    """The name of the process group of a device mesh's dimension (what
    ``_c10d_functional`` collectives take)."""
    return mesh.get_group(dim).group_name


def current_mesh():
    """The device mesh DTensor.from_local uses when none is given."""
    from torch.distributed.device_mesh import _mesh_resources

    return _mesh_resources.get_current_mesh()


def global_tensor_info(local: torch.Tensor, mesh, placements) -> tuple:
    """(global shape, global stride) of a local shard, as DTensor.from_local computes them."""
    from torch.distributed.tensor._utils import compute_global_tensor_info

    shape, stride = compute_global_tensor_info(local, mesh, placements)
    return tuple(shape), tuple(stride)


def dtensor_dispatch_module():
    """The module whose ``redistribute_local_tensor`` DTensor's op dispatch
    calls to move an input inside an op (an implicit redistribution)."""
    import torch.distributed.tensor._dispatch as dispatch

    return dispatch


def make_dtensor(local: torch.Tensor, spec, requires_grad: bool):
    """A DTensor around ``local`` made without its ``__init__``, which (while
    exporting) would record its construction in the graph: here it is a
    carrier of placements that no node sees."""
    from torch.distributed.tensor import DTensor

    return DTensor.__new__(DTensor, local, spec, requires_grad=requires_grad)


def local_tensor(dtensor) -> torch.Tensor:
    """A DTensor's local shard, without the autograd.Function ``to_local`` is."""
    return dtensor._local_tensor


def dtensor_spec(dtensor):
    return dtensor._spec


def state_table(owner: torch.nn.Module, name: str) -> dict:
    """The dict of ``owner`` (its parameters' or its buffers') that holds ``name``."""
    return owner._parameters if name in owner._parameters else owner._buffers


def forward_hooks_of(module: torch.nn.Module) -> tuple[list, list]:
    """(forward pre-hooks, forward hooks) registered on ``module`` itself."""
    return list(module._forward_pre_hooks.values()), list(module._forward_hooks.values())


@contextlib.contextmanager
def module_call_wrapped(module: torch.nn.Module, wrap):
    """Until exit, ``module(...)`` — its hooks, then its forward — runs
    ``wrap(call)(...)``, ``call`` being what it ran before: nn.Module's
    ``__call__`` looks ``_call_impl`` up on the instance."""
    call = module._call_impl
    had_own = "_call_impl" in module.__dict__
    module._call_impl = wrap(call)
    try:
        yield
    finally:
        if had_own:
            module._call_impl = call
        else:
            del module._call_impl


def fsdp_param_groups(module: torch.nn.Module) -> list:
    return module._get_fsdp_state()._fsdp_param_groups


def fsdp_forward_hooks(module: torch.nn.Module) -> list:
    """(hook dict, key) of the forward pre-hook and the forward hook
    ``fully_shard`` registered on ``module``."""
    state = module._get_fsdp_state()
    return [(module._forward_pre_hooks, state._pre_forward_hook_handle.id),
            (module._forward_hooks, state._post_forward_hook_handle.id)]


def fsdp_param_place(fsdp_param) -> tuple:
    """(module, parameter name, modules sharing it) of a parameter FSDP manages."""
    info = fsdp_param._module_info
    return info.module, info.param_name, info.shared_modules


def fsdp_param_unsharded_size(fsdp_param) -> torch.Size:
    """The size FSDP all-gathers back (with TP: the TP shard's)."""
    return fsdp_param._orig_size


def fsdp_param_tensor_parallel_spec(fsdp_param):
    """The DTensor spec of the all-gathered parameter (FSDP x TP), or None."""
    return fsdp_param._unsharded_dtensor_spec


def fsdp_params(group) -> list:
    """The parameters an FSDP2 parameter group manages (FSDP's record of each)."""
    return group.fsdp_params


def fsdp_mixed_precision_policies(group) -> list:
    """The mixed-precision policies FSDP2 applies to a group's parameters: the
    group's one (torch 2.13, 2.14) or each parameter's own, resolved (2.15)."""
    if hasattr(group, "mp_policy"):
        return [group.mp_policy]
    return [p.mp_policy for p in group.fsdp_params]


def fsdp_offload_policy(group):
    return group.offload_policy


def fsdp_gradient_divide_factor(group):
    return group.gradient_divide_factor


def fsdp_param_mesh(fsdp_param) -> tuple:
    """(the data-parallel mesh, the kind of mesh info: "FSDPMeshInfo" for plain
    FSDP, another for HSDP/DDP, the dimension FSDP shards) of a managed parameter."""
    return fsdp_param.mesh_info.mesh, type(fsdp_param.mesh_info).__name__, fsdp_param.fsdp_placement.dim
