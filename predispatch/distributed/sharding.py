"""Sharded modules (DTensor, tensor parallel): each rank's program over its shards.

A module whose parameters are DTensors (``parallelize_module``) is exported
on every rank as that rank's program: a graph over local tensors in which
DTensor is lowered away while the forward is traced.

* Parameters and buffers that are DTensors enter the graph as their local
  shards, under the module's own names; their mesh and placements are
  recorded in the program (:class:`Layout`, read with :func:`sharded_layouts`).
* While the forward runs, they are DTensors again around the traced shards,
  and DTensor's code runs above the trace: an op on DTensors is the same op
  on their local tensors (kept as the user called it: ``linear`` stays
  ``linear``), its output placement what DTensor's own sharding rules give
  on fake tensors; ``from_local`` / ``redistribute`` / ``to_local`` /
  ``full_tensor`` are the boundaries where shards move, lowered by
  :mod:`predispatch.distributed.collectives` into one op (an exported autograd.Function)
  whose forward and backward subgraphs hold the explicit
  ``_c10d_functional`` collectives and their ``wait_tensor``.
* The backward each boundary needs (``from_local(x, Replicate())`` in front
  of a column-wise linear all-reduces its gradient) depends on how the
  gradient arrives, which only a backward shows: one forward and backward of
  the module on fake tensors before the trace (:func:`_boundary_gradients`)
  records the placement of the gradient at each boundary, in call order.

An input DTensor moves inside an op (DTensor's implicit redistribution: a
row-wise linear's Replicate bias made Partial) is such a boundary too.
``fully_shard`` (FSDP2) is lowered by :mod:`predispatch.distributed.fsdp`.

The parallel styles' hooks (``ColwiseParallel``'s input ``from_local``,
``PrepareModuleInput`` / ``PrepareModuleOutput``) are the module's own
code: they run inside the lowering, the exported module's own hooks too (the
lowering wraps its whole call, not only its forward). A module whose state
is not sharded but whose parallel styles make DTensors of its activations
is lowered as well.

What is not lowered is refused with an ExportError naming it: a value made
inside an op that DTensor moves, a placement or redistribution the rules do
not lower, a DTensor with no process group, a DTensor output.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os

import torch

from .. import _torch
from . import collectives, fsdp
from ..errors import ExportError, exception_location, user_location
from ..ir.program_meta import program_meta
from .._torch.patching import patched


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a sharded parameter or buffer is laid out, as :func:`sharded_layouts` gives it.

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor.parallel import RowwiseParallel, parallelize_module
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = parallelize_module(torch.nn.Sequential(torch.nn.Linear(16, 8)),
        ...                            init_device_mesh("cpu", (1,)), {"0": RowwiseParallel()})
        >>> ep = predispatch.export_predispatch(model, (torch.randn(2, 16),))
        >>> dist.destroy_process_group()
        >>> predispatch.sharded_layouts(ep)["0.weight"]
        Layout(mesh_shape=(1,), mesh_dim_names=None, mesh_ranks=[0], placements=('S(1)',), global_shape=(8, 16), global_stride=(16, 1))

    What a tool needs to rebuild the DTensor (``DTensor.from_local(local,
    mesh, placements, shape=global_shape, stride=global_stride)``) or the
    full tensor from the program's local shard."""

    mesh_shape: tuple
    mesh_dim_names: tuple | None
    mesh_ranks: list  # the mesh's global ranks, nested as the mesh
    placements: tuple  # text per mesh dimension: "R", "S(0)", "P(sum)"
    global_shape: tuple
    global_stride: tuple

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def sharded_layouts(ep_or_gm) -> dict:
    """Name -> :class:`Layout` of each sharded parameter or buffer of a program.

        >>> import torch.distributed as dist
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # on every rank
        >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
        >>> mlp = parallelize_module(mlp, init_device_mesh("cpu", (dist.get_world_size(),)),
        ...                          {"0": ColwiseParallel(), "2": RowwiseParallel()})
        >>> ep = predispatch.export_predispatch(mlp, (torch.randn(2, 8),))   # this rank's program
        >>> dist.destroy_process_group()
        >>> {name: layout.placements for name, layout in predispatch.sharded_layouts(ep).items()}
        {'0.weight': ('S(0)',), '0.bias': ('S(0)',), '2.weight': ('S(1)',), '2.bias': ('R',)}

    Empty for a module that was not sharded. Kept through
    ``torch.export.save`` / :func:`load`. design/sharding.md has how
    tensor parallel and FSDP2 modules are exported, and what is refused.
    """
    return {name: Layout(**{k: tuple(v) if isinstance(v, list) and k != "mesh_ranks" else v
                            for k, v in fields.items()})
            for name, fields in program_meta(ep_or_gm).get("sharding", {}).items()}


def placement_text(p) -> str:
    """A DTensor placement as text; one the lowering does not know raises Unsupported."""
    if type(p) is _torch.Replicate:
        return "R"
    if type(p) is _torch.Shard:
        return f"S({p.dim})"
    if type(p) is _torch.Partial:
        return f"P({p.reduce_op})"
    if type(p) is _torch.StridedShard:  # FSDP's over a TP shard of the same dimension: recorded only
        return f"SS({p.dim},{p.split_factor})"
    raise collectives.Unsupported(f"a {type(p).__name__} placement ({p}) (not lowered)")


def _grad_text(placement: str) -> str:
    """Where a value's gradient lives when it arrives as DTensor's backward
    sends it: a Partial value's as Replicate (DTensor's Redistribute.backward
    keeps it so)."""
    return "R" if collectives.kind(placement) == "P" else placement


def _mesh_dims(mesh) -> tuple:
    coordinate = mesh.get_coordinate()
    return tuple(collectives.MeshDim(_torch.mesh_group_name(mesh, d), mesh.size(d), coordinate[d])
                 for d in range(mesh.ndim))


def _layout(t) -> Layout:
    mesh = t.device_mesh
    return Layout(tuple(mesh.shape), tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None,
                  mesh.mesh.tolist(), tuple(placement_text(p) for p in t.placements),
                  tuple(t.shape), tuple(t.stride()))


def _normalized(placements, ndim: int) -> tuple:
    return tuple(_torch.Shard(p.dim % ndim) if type(p) is _torch.Shard and ndim else p for p in placements)


def sharded_state(module: torch.nn.Module) -> dict:
    """Name -> DTensor, for the module's parameters and buffers that are DTensors."""
    state = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    return {name: t for name, t in state.items() if isinstance(t, _torch.DTensor)}


_DTENSOR_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed", "tensor", "")


def _is_dtensor_hook(hook) -> bool:
    """A hook torch.distributed.tensor registered: a parallel style's
    (``PrepareModuleInput``, ...) or ``distribute_module``'s, which make
    DTensors of activations."""
    code = getattr(getattr(hook, "__func__", hook), "__code__", None)
    return code is not None and code.co_filename.startswith(_DTENSOR_DIR)


def _dtensor_hooks(module: torch.nn.Module):
    """The forward hooks torch.distributed.tensor registered in the module tree."""
    for sub in module.modules():
        pre, post = _torch.forward_hooks_of(sub)
        yield from filter(_is_dtensor_hook, pre + post)


def _styles_on(module: torch.nn.Module) -> list:
    """The class names of the parallel styles whose forward hooks sit on the
    module itself (such a hook, a lambda, holds its style in its closure)."""
    _pre, post = _torch.forward_hooks_of(module)
    styles = [inspect.getclosurevars(hook).nonlocals.get("self") for hook in filter(_is_dtensor_hook, post)]
    return [type(style).__name__ for style in styles if style is not None]


def refuse_unlowered(module: torch.nn.Module) -> None:
    """A DTensor without a process group, what the FSDP2 lowering does not
    express: ExportError."""
    fsdp.refuse_unlowered(module)
    if sharded_state(module) and not torch.distributed.is_initialized():
        name = next(iter(sharded_state(module)))
        raise ExportError(
            f"the module holds DTensor {name!r} but no process group is initialised: call "
            "torch.distributed.init_process_group on every rank before exporting a sharded module")


@contextlib.contextmanager
def lowered(module: torch.nn.Module, args: tuple, kwargs: dict | None):
    """While the module is exported: its DTensor parameters and buffers are
    their local shards, and its forward lowers DTensor (see the module
    docstring). Yields name -> :class:`Layout` (empty for a module that is
    not sharded, whose export is untouched; one whose state is not sharded
    but whose parallel styles make DTensors of its activations is lowered
    too)."""
    refuse_unlowered(module)
    sharded = sharded_state(module)
    if not sharded and not any(_dtensor_hooks(module)):
        yield {}
        return
    try:
        layouts = {name: _layout(t) for name, t in sharded.items()}
    except collectives.Unsupported as e:
        raise ExportError(f"sharded parameter or buffer: {e}") from None
    gradients = _boundary_gradients(module, args, kwargs or {})
    # FSDP's hooks run around the module's forward: replaced for the whole export
    with _local_state(module, sharded), _lowering_call(module, sharded, gradients), \
            fsdp.hooks_replaced(module, _all_gathered):
        yield layouts


def _owner(module: torch.nn.Module, name: str):
    path, _, leaf = name.rpartition(".")
    return module.get_submodule(path), leaf


@contextlib.contextmanager
def _local_state(module, sharded: dict):
    """Each DTensor parameter or buffer swapped for its local shard (a
    parameter stays a parameter, with its requires_grad); restored on exit."""
    saved, locals_ = [], {}  # a tied DTensor (one tensor, two names) gets one local parameter
    try:
        for name, t in sharded.items():
            owner, leaf = _owner(module, name)
            table = _torch.state_table(owner, leaf)
            saved.append((table, leaf, table[leaf]))
            if id(t) not in locals_:
                locals_[id(t)] = (torch.nn.Parameter(_torch.local_tensor(t), requires_grad=t.requires_grad)
                                  if isinstance(t, torch.nn.Parameter) else _torch.local_tensor(t))
            table[leaf] = locals_[id(t)]
        yield
    finally:
        for table, leaf, value in reversed(saved):
            table[leaf] = value


def _lowering_call(module, sharded: dict, gradients: list):
    """Each call of the module while traced — its forward and the forward
    hooks on it, such as a parallel style applied to the module itself
    (``PrepareModuleInput`` / ``PrepareModuleOutput``) — sees its sharded
    state as DTensors around the traced shards and runs DTensor above the
    trace (a context manager: restored on exit)."""
    by_fsdp = fsdp.managed_names(module)  # FSDP's hooks all-gather them from the local shard
    specs = {name: _torch.dtensor_spec(t) for name, t in sharded.items() if name not in by_fsdp}

    def wrap(call):
        @functools.wraps(call)
        def lowering_call(*args, **kwargs):
            boundaries = iter(gradients)
            with _as_dtensors(module, specs), _boundaries_lowered(boundaries), _LocalOps():
                out = call(*args, **kwargs)
            missed = next(boundaries, None)
            if missed is not None:
                raise ExportError(
                    f"the module's fake eager run met DTensor.{missed.call} (to {missed.placements}) "
                    "where its trace met none: the forward moves DTensors differently from run to run; "
                    "cannot be exported soundly")
            for leaf in _torch.pytree.tree_leaves(out):
                if isinstance(leaf, _torch.DTensor):
                    styles = "".join(f", through its {name}" for name in _styles_on(module))
                    raise ExportError(
                        f"the sharded module's forward ({user_location()}{styles}) returns a DTensor: "
                        "a rank's program returns local tensors; return out.to_local() or "
                        "out.full_tensor() (or a parallel style with use_local_output=True)")
            return out
        return lowering_call

    return _torch.module_call_wrapped(module, wrap)


@contextlib.contextmanager
def _as_dtensors(module, specs: dict):
    """The traced shards of the sharded state, wrapped as DTensors for the
    forward's code (restored to the traced shards on exit)."""
    saved = []
    try:
        for name, spec in specs.items():
            owner, leaf = _owner(module, name)
            table = _torch.state_table(owner, leaf)
            local = table[leaf]
            saved.append((table, leaf, local))
            table[leaf] = _torch.make_dtensor(local, spec, requires_grad=local.requires_grad)
        yield
    finally:
        for table, leaf, value in reversed(saved):
            table[leaf] = value


def _all_gathered(local, fsdp_param):
    """A ``fully_shard``-ed parameter (its traced local shard) before its
    module's forward: all-gathered over the data-parallel mesh, its gradient
    reduce-scattered and averaged over those ranks, as FSDP's; with tensor
    parallelism, the TP DTensor around the gathered TP shard."""
    mesh, dim = fsdp.gathered_along(fsdp_param)
    gathered = _moved(local, mesh, (f"S({dim})",), ("R",), ("P(avg)",), "fully_shard's all-gather")
    spec = fsdp.tensor_parallel_spec(fsdp_param)
    return gathered if spec is None else _torch.make_dtensor(gathered, spec, gathered.requires_grad)


def _plan(src: tuple, dst: tuple, dims: tuple) -> tuple:
    return tuple((s, d, dim) for s, d, dim in zip(src, dst, dims))


def _moved(local, mesh, src: tuple, dst: tuple, grad_at_dst: tuple, what: str):
    """``local`` moved from ``src`` to ``dst`` placements (text), its gradient
    moved back from ``grad_at_dst`` (where it arrives) to where ``src``'s
    gradient lives; ``local`` itself when neither moves."""
    dims = _mesh_dims(mesh)
    forward_plan = _plan(src, dst, dims)
    backward_plan = _plan(grad_at_dst, tuple(_grad_text(p) for p in src), dims)
    try:
        collectives.check(forward_plan, tuple(local.shape))
        collectives.check(backward_plan)  # on the gradient, whose shape the forward's output has
    except collectives.Unsupported as e:
        raise ExportError(f"{what} at {user_location()}: {e}") from None
    if src == dst and all(s == d for s, d, _ in backward_plan):
        return local
    if src == dst and not (torch.is_grad_enabled() and _may_require_grad(local)):
        return local  # no gradient will come back through it
    return collectives.Redistribute.apply(local, forward_plan, backward_plan)


def _may_require_grad(t: torch.Tensor) -> bool:
    """As the autograd.Function capture decides: a traced floating tensor may
    require grad at run time (the caller decides)."""
    return t.is_floating_point() or t.is_complex() or _torch.requires_grad_in_trace(t)


@contextlib.contextmanager
def _boundaries_lowered(boundaries):
    """``DTensor.from_local`` / ``redistribute`` / ``to_local`` /
    ``full_tensor`` lowered; the k-th boundary takes its gradient's placement
    from ``boundaries``."""
    DTensor = _torch.DTensor
    from_local = functools.partial(_lowered_from_local, boundaries)
    redistribute = functools.partial(_lowered_redistribute, boundaries)
    with patched(DTensor, "from_local", lambda _original: from_local), \
            patched(DTensor, "redistribute", lambda _original: redistribute), \
            patched(DTensor, "to_local", lambda _original: _lowered_to_local), \
            patched(DTensor, "full_tensor", lambda _original: _lowered_full_tensor):
        yield


def _next_gradient(boundaries, call: str, dst: tuple) -> tuple:
    """Where the gradient arrives (placements, as text) at this boundary,
    ``DTensor.<call>`` to ``dst``: as the module's fake eager run met it at
    this point (``boundaries``, in call order), which must be the same call."""
    seen = next(boundaries, None)
    if seen is None or (seen.call, seen.placements) != (call, dst):
        raise ExportError(
            f"{_by_style('DTensor.' + call)} at {user_location()} (to {', '.join(dst)}) is not the call "
            f"the module's fake eager run met at this point ({seen and f'{seen.call} to {seen.placements}'}): "
            "the forward moves DTensors differently from run to run; cannot be exported soundly")
    return seen.gradient if seen.gradient is not None else tuple(_grad_text(p) for p in dst)


def _lowered_from_local(boundaries, local_tensor, device_mesh=None, placements=None, *, run_check=False,
                        shape=None, stride=None, grad_placements=None):
    """``DTensor.from_local``: the traced local tensor, its gradient moved
    back from where it arrives (``grad_placements`` where given), wrapped."""
    if run_check:
        raise ExportError(f"DTensor.from_local(..., run_check=True) at {user_location()}: "
                          "its check broadcasts in place; pass run_check=False")
    mesh = device_mesh or _torch.current_mesh()
    placements = _normalized(placements or [_torch.Replicate()] * mesh.ndim, local_tensor.dim())
    if shape is None or stride is None:
        shape, stride = _torch.global_tensor_info(local_tensor, mesh, placements)
    src = tuple(placement_text(p) for p in placements)
    seen = _next_gradient(boundaries, "from_local", src)
    grad = tuple(placement_text(p) for p in grad_placements) if grad_placements else seen
    local = _moved(local_tensor, mesh, src, src, grad, _by_style("DTensor.from_local"))
    meta = _torch.TensorMeta(torch.Size(shape), tuple(stride), local_tensor.dtype)
    return _torch.make_dtensor(local, _torch.DTensorSpec(mesh, placements, tensor_meta=meta), local.requires_grad)


def _lowered_redistribute(boundaries, self, device_mesh=None, placements=None, *, async_op=False,
                          forward_dtype=None, backward_dtype=None):
    """``DTensor.redistribute``: the local shard moved by explicit
    collectives, its gradient moved back from where it arrives."""
    if forward_dtype is not None or backward_dtype is not None:
        raise ExportError(f"DTensor.redistribute(forward_dtype/backward_dtype) at "
                          f"{user_location()} is not supported")
    mesh = device_mesh or self.device_mesh
    placements = _normalized(placements or [_torch.Replicate()] * mesh.ndim, self.dim())
    src = tuple(placement_text(p) for p in self.placements)
    dst = tuple(placement_text(p) for p in placements)
    local = _moved(_torch.local_tensor(self), mesh, src, dst, _next_gradient(boundaries, "redistribute", dst),
                   _by_style("DTensor.redistribute"))
    spec = _torch.DTensorSpec(mesh, placements, tensor_meta=_torch.dtensor_spec(self).tensor_meta)
    return _torch.make_dtensor(local, spec, local.requires_grad)


def _lowered_to_local(self, *, grad_placements=None):
    """``DTensor.to_local``: the traced local shard."""
    return _torch.local_tensor(self)


def _lowered_full_tensor(self, *, grad_placements=None):
    """``DTensor.full_tensor``: replicated (a lowered redistribute), then the local shard."""
    replicated = self.redistribute(self.device_mesh, [_torch.Replicate()] * self.device_mesh.ndim)
    return _torch.local_tensor(replicated)


_STYLE_FILE = os.path.join(_DTENSOR_DIR, "parallel", "style.py")


def _by_style(call: str) -> str:
    """``call`` named by the parallel style whose hook makes it
    (``"PrepareModuleInput's DTensor.redistribute"``), when one does: the
    user's line is then the call of the module the style is applied to."""
    frame = inspect.currentframe()
    while frame is not None:
        style = frame.f_locals.get("self") if frame.f_code.co_filename == _STYLE_FILE else None
        if style is not None:
            return f"{type(style).__name__}'s {call}"
        frame = frame.f_back
    return call


class _LocalOps(_torch.TorchFunctionMode):
    """A torch function called on DTensors: the same function on their local
    tensors (in the trace), its outputs DTensors of the placements DTensor's
    own rules give on fake tensors. An input DTensor moves inside the op (an
    implicit redistribution: a Replicate bias made Partial for a row-wise
    linear) is moved first, as a boundary. What is not a tensor (a size, a
    dtype) is DTensor's answer: the global one."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = _torch.pytree.tree_flatten((args, kwargs))
        if not any(isinstance(a, _torch.DTensor) for a in flat):
            return func(*args, **kwargs)
        fake_out, same_as, moves = _placements_of(func, flat, spec)
        if not any(isinstance(o, torch.Tensor) for o in _torch.pytree.tree_leaves(fake_out)):
            return fake_out  # metadata: DTensor's global answer
        local = []
        for i, a in enumerate(flat):
            if i in moves:
                src, dst = moves[i]
                local.append(_moved(_torch.local_tensor(a), a.device_mesh, src, dst,
                                    tuple(_grad_text(p) for p in dst), f"{_name(func)} on DTensors"))
            else:
                local.append(_torch.local_tensor(a) if isinstance(a, _torch.DTensor) else a)
        local_args, local_kwargs = _torch.pytree.tree_unflatten(local, spec)
        out = func(*local_args, **local_kwargs)
        return _wrapped(func, out, fake_out, flat, same_as)


def _placements_of(func, flat: list, spec):
    """``func`` run by DTensor on fake tensors of the arguments' metadata,
    with the trace suspended: its output (DTensors of the output placements,
    or DTensor's non-tensor answer); for each output, the argument it is (an
    in-place op's), by position; argument position -> (from, to) placements
    (text) of each input DTensor moves inside the op."""
    local = next(_torch.local_tensor(a) for a in flat if isinstance(a, _torch.DTensor))
    moves: dict = {}
    with _torch.outer_trace_suspended(_torch.fake_mode_of(local)):
        fakes = [_fake_like(a) for a in flat]
        fake_args, fake_kwargs = _torch.pytree.tree_unflatten(fakes, spec)
        try:
            with _implicit_redistributions_seen(func, fakes, moves), torch.no_grad():
                out = func(*fake_args, **fake_kwargs)
        except (ExportError, *_torch.data_dependence_errors()):
            raise
        except Exception as e:
            raise ExportError(f"{_name(func)} on DTensors at {user_location()} could not be "
                              f"lowered to local tensors: {_first_line(e)}") from e
    same_as = [next((i for i, f in enumerate(fakes) if o is f), None) for o in _torch.pytree.tree_leaves(out)]
    return out, same_as, moves


def _fake_like(a):
    if isinstance(a, _torch.DTensor):
        t = _torch.local_tensor(a)
        local = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
        return _torch.make_dtensor(local, _torch.dtensor_spec(a), requires_grad=False)
    if isinstance(a, torch.Tensor):
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.device)
    return a


def _wrapped(func, out, fake_out, flat: list, same_as: list):
    """The local outputs as DTensors of the fake run's placements; an
    in-place op's output is its DTensor argument."""
    out_flat, out_spec = _torch.pytree.tree_flatten(out)
    fakes = _torch.pytree.tree_leaves(fake_out)
    if len(out_flat) != len(fakes):
        raise ExportError(f"{_name(func)} on DTensors at {user_location()}: its local and DTensor "
                          "outputs differ in structure")
    wrapped = []
    for o, f, arg in zip(out_flat, fakes, same_as):
        if arg is not None:
            wrapped.append(flat[arg])
        elif isinstance(f, _torch.DTensor):
            if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(_torch.local_tensor(f).shape):
                got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
                raise ExportError(
                    f"{_name(func)} on DTensors at {user_location()}: called on the local shards it "
                    f"gives {got}, where DTensor's shard is {tuple(_torch.local_tensor(f).shape)} (an op "
                    "whose arguments name global sizes); not lowered")
            wrapped.append(_torch.make_dtensor(o, _torch.dtensor_spec(f), requires_grad=o.requires_grad))
        else:
            wrapped.append(o)
    return _torch.pytree.tree_unflatten(wrapped, out_spec)


@contextlib.contextmanager
def _implicit_redistributions_seen(func, fakes: list, moves: dict):
    """DTensor moving an input inside an op (its dispatch's implicit
    redistribution), recorded by the argument's position. One of a value
    that is no argument (made inside the op) is refused."""
    def seen(original):
        def call(local_tensor, current_spec, target_spec, **kwargs):
            at = next((i for i, f in enumerate(fakes) if isinstance(f, _torch.DTensor)
                       and _torch.local_tensor(f) is local_tensor), None)
            src = tuple(placement_text(p) for p in current_spec.placements)
            dst = tuple(placement_text(p) for p in target_spec.placements)
            if at is None or at in moves:
                raise ExportError(
                    f"{_name(func)} on DTensors at {user_location()} moves a value made inside the "
                    f"op ({', '.join(src)} -> {', '.join(dst)}), which is not lowered: "
                    "redistribute its inputs explicitly (DTensor.redistribute) before the op")
            moves[at] = (src, dst)
            return original(local_tensor, current_spec, target_spec, **kwargs)
        return call

    with patched(_torch.dtensor_dispatch_module(), "redistribute_local_tensor", seen):
        yield


@dataclasses.dataclass(frozen=True)
class Boundary:
    """A ``from_local`` / ``redistribute`` call as the fake eager run saw it:
    the placements it made (text), and those of the gradient that reached
    it (None: none did)."""

    call: str
    placements: tuple
    gradient: tuple | None


def _boundary_gradients(module, args: tuple, kwargs: dict) -> list:
    """The module's forward and backward on fake tensors, eagerly, with
    DTensor as it is: a :class:`Boundary` for each ``from_local`` /
    ``redistribute`` call, in order."""
    seen: list = []
    forward_running = True

    def hooked(make):
        def wrap(original):
            def call(*a, **k):
                out = original(*a, **k)
                if not forward_running:  # DTensor's backward redistributes gradients too
                    return out
                slot = len(seen)
                seen.append(Boundary(make, tuple(placement_text(p) for p in out.placements), None))
                if out.requires_grad:
                    out.register_hook(lambda g: seen.__setitem__(slot, dataclasses.replace(
                        seen[slot], gradient=tuple(placement_text(p) for p in g.placements))))
                return out
            return call
        return wrap

    fake_mode = _torch.FakeTensorMode(allow_non_fake_inputs=True)
    state = {**dict(module.named_parameters(remove_duplicate=False)),
             **dict(module.named_buffers(remove_duplicate=False))}
    try:
        with fake_mode, fsdp.hooks_replaced(module, fsdp.unsharded_in_eager), \
                patched(_torch.DTensor, "from_local", hooked("from_local")), \
                patched(_torch.DTensor, "redistribute", hooked("redistribute")), torch.enable_grad():
            fake_state = {name: _fake_leaf(fake_mode, t) for name, t in state.items()}
            # floating inputs require grad: gradients reach every boundary they may at run time
            fake_args, fake_kwargs = _torch.pytree.tree_map_only(
                torch.Tensor, lambda t: _fake_leaf(fake_mode, t, t.is_floating_point()), (args, kwargs))
            out = torch.func.functional_call(module, fake_state, fake_args, fake_kwargs)
            forward_running = False
            outs = [o for o in _torch.pytree.tree_leaves(out) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        _refuse_moved_gradients(fake_state)
    except ExportError:
        raise
    except collectives.Unsupported as e:
        raise ExportError(f"sharded module: {e}") from None
    except Exception as e:
        raise ExportError(f"the sharded module's forward and backward on fake tensors (to find "
                          f"how gradients reach its DTensor boundaries) failed at "
                          f"{exception_location(e)}: {_first_line(e)}") from e
    return seen


def _refuse_moved_gradients(state: dict) -> None:
    """A sharded parameter whose gradient DTensor places otherwise (a Shard
    weight with a Replicate gradient): eager's ``.grad`` is another shard
    than the one the rank's program computes. A Replicate parameter's
    Partial gradient (a sequence-parallel norm's) is this rank's share in
    both: the same local tensor."""
    for name, t in state.items():
        grad = t.grad if isinstance(t, _torch.DTensor) else None
        if isinstance(grad, _torch.DTensor) and not all(
                g == p or (type(p) is _torch.Replicate and type(g) is _torch.Partial)
                for p, g in zip(t.placements, grad.placements)):
            raise ExportError(
                f"sharded parameter {name!r} is placed {tuple(map(str, t.placements))} but DTensor's "
                f"backward gives its gradient placed {tuple(map(str, grad.placements))}: the rank's "
                "program would compute another shard of it than eager's .grad holds; not lowered")


def _fake_leaf(fake_mode, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    fake = fake_mode.from_tensor(t)
    if (t.requires_grad or requires_grad) and not fake.requires_grad:
        fake.requires_grad_(True)
    return fake


def _name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
