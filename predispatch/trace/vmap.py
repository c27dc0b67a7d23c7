"""``torch.vmap`` in the forward: a batched forward computation, traced as the plain ops it runs.

A vmap that batches a forward computation is ordinary data flow: the same
ops on tensors with one more dimension. On the PreDispatch key the trace
sits above functorch's batching (it would record ops on BatchedTensors,
which functionalization cannot see through), so while a vmapped function
runs the trace's modes move below the batching
(:func:`predispatch._torch.pre_dispatch_modes_below_batching`) and record
what the batching rules call: plain ops on whole tensors, below autograd
(composites inside the function are decomposed, as vmap's own rules do).

What such a graph cannot hold is refused, naming the line: an in-place
update, inside the vmapped function, of memory made outside it (a captured
tensor, a parameter, a buffer, an input): the trace would see it once,
batched, where the recorder's account of mutations (their grad mode,
their history) never saw it. Autograd inside (``torch.func.grad``,
``torch.autograd.grad``, a hook) stays refused by
:mod:`predispatch.trace.refusals`. An ``autograd.Function`` called inside
on tensors a gradient can flow through is refused too: below the batching
its op would be recorded below autograd, without its own backward. On
others (integer indices: transformers' masks index through torch's
``ModIndex``) it has no backward to lose and is traced inline, as anywhere.
"""
from __future__ import annotations

import contextlib

import torch

from .. import _torch
from ..errors import ExportError, user_location
from .._torch.patching import patched

_INSIDE: list[bool] = []  # one entry per vmapped call running under the trace


def inside_vmap() -> bool:
    """Is a vmapped function running under the trace?"""
    return bool(_INSIDE)


@contextlib.contextmanager
def tracing_vmap_as_plain_ops():
    """Every vmap call made while tracing runs with the trace below its batching."""
    def batching_below(vmap_impl):
        def call(*args, **kwargs):
            if _INSIDE or not _torch.pre_dispatch_tracing():
                return vmap_impl(*args, **kwargs)  # a vmap inside a vmap: already below
            made: set = set()
            _INSIDE.append(True)
            try:
                with _torch.pre_dispatch_modes_below_batching(
                        lambda func, a, k, out: _note_op(made, func, a, k, out)):
                    return vmap_impl(*args, **kwargs)
            finally:
                _INSIDE.pop()
        return call

    module, name = _torch.vmap_entry()
    with patched(module, name, batching_below):
        yield


def _note_op(made: set, func, args, kwargs, out) -> None:
    """Refuse a write to memory made outside the vmapped function; note
    the memory each op makes (a view makes none)."""
    for i, arg_name in _torch.written_arguments(func):
        target = args[i] if i < len(args) else kwargs.get(arg_name)
        if isinstance(target, torch.Tensor) and _storage(target) not in made:
            raise ExportError(
                f"an in-place update ({func}) inside a vmapped function at {user_location()} of "
                "a tensor made outside it (a captured tensor, a parameter, a buffer, an input) "
                "cannot be exported soundly: the trace sees the batched update once, outside "
                "its account of mutations; update a copy inside the function and return it")
    if getattr(func, "is_view", False) or _torch.written_arguments(func):
        return
    for t in _torch.pytree.tree_leaves(out):
        if isinstance(t, torch.Tensor):
            made.add(_storage(t))


def _storage(t: torch.Tensor):
    return _torch.storage_of(t) or id(t)
