"""Constructs a trace cannot capture soundly, refused while the forward runs.

Each is a context manager that wraps what the construct calls, for the
duration of the traced forward, and raises ``ExportError`` naming the
construct and the user's line.
"""
from __future__ import annotations

import contextlib

import torch
import torch.utils._pytree as pytree

from . import _torch
from .errors import ExportError, user_location
from .patching import patched


@contextlib.contextmanager
def refusing_custom_backwards():
    """``torch.autograd.Function.apply`` runs the forward below torch-function
    modes with autograd off, and installs the custom backward on the result:
    the graph gets the forward's ops, and the program would differentiate
    them rather than run the custom backward (a straight-through estimator
    would get round()'s zero gradient). Refuse when that backward could run:
    in grad mode, on a tensor that requires grad or may at run time (a
    floating-point one: the caller decides whether inputs require grad).
    Calls on the tensors below the functional layer are torch's own (the
    autograd kernel of a custom op with a registered backward): not ours to judge.

    torch.utils.checkpoint's reentrant Function is the exception: its backward
    recomputes the forward (with the same random state) and differentiates
    it, which is what the graph does anyway; its function is traced inline,
    in grad mode (when to recompute is the compiler's choice in a graph)."""
    def refusing(apply):
        def call(cls, *args, **kwargs):
            if cls is _torch.REENTRANT_CHECKPOINT:
                run_function, _preserve_rng_state, *inputs = args
                return run_function(*inputs)
            if torch.is_grad_enabled() and any(
                    _torch.is_traced(t) and (t.is_floating_point() or t.is_complex()
                                             or _torch.requires_grad_in_trace(t))
                    for t in pytree.tree_leaves((args, kwargs))):
                raise ExportError(
                    f"torch.autograd.Function {cls.__qualname__} at {user_location()} cannot be "
                    "exported soundly: its custom backward is not part of a graph, and the "
                    "program would differentiate its forward's ops instead; write it as "
                    "differentiable ops, or as a torch.library.custom_op with register_autograd "
                    "(kept as one op)")
            return apply(cls, *args, **kwargs)
        return call

    with patched(torch.autograd.Function, "apply", refusing):
        yield
