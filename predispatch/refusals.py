"""Constructs a trace cannot capture soundly, refused while the forward runs.

Each is a context manager that wraps what the construct calls, for the
duration of the traced forward, and raises ``ExportError`` naming the
construct and the user's line.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.utils._pytree as pytree

from . import _torch
from .errors import ExportError, user_location


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
    autograd kernel of a custom op with a registered backward): not ours to judge."""
    function = torch.autograd.Function
    original = function.__dict__["apply"]  # the classmethod

    def apply(cls, *args, **kwargs):
        if torch.is_grad_enabled() and any(
                _torch.is_traced(t) and (t.is_floating_point() or t.is_complex()
                                         or _torch.requires_grad_in_trace(t))
                for t in pytree.tree_leaves((args, kwargs))):
            fix = ("call torch.utils.checkpoint with use_reentrant=False"
                   if cls is _torch.REENTRANT_CHECKPOINT else
                   "write it as differentiable ops, or as a torch.library.custom_op with "
                   "register_autograd (kept as one op)")
            raise ExportError(
                f"torch.autograd.Function {cls.__qualname__} at {user_location()} cannot be "
                "exported soundly: its custom backward is not part of a graph, and the program "
                f"would differentiate its forward's ops instead; {fix}")
        return original.__func__(cls, *args, **kwargs)

    function.apply = classmethod(apply)
    try:
        yield
    finally:
        function.apply = original


def _host_generators() -> dict:
    """Python's and numpy's global random generators: name -> (module, instance)."""
    import random

    generators = {"Python's random": (random, random._inst)}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        generators["numpy.random"] = (numpy.random, numpy.random.mtrand._rand)
    return generators


def _generator_state(instance):
    if hasattr(instance, "getstate"):  # Python's
        return instance.getstate()
    state = instance.get_state(legacy=False)  # numpy's: a dict holding an array
    return state["state"]["key"].tobytes(), state["state"]["pos"], state["has_gauss"], state["gauss"]


@contextlib.contextmanager
def refusing_host_randomness():
    """Random numbers drawn with Python's or numpy's generator are constants
    to the tracer: the program would reuse this trace's draws on every call
    where eager draws anew (transformers' SpecAugment masks, numpy layer
    drop). torch's RNG is recorded as ops; these are refused. The module
    functions (``np.random.rand``, ``random.random``, ...) are wrapped to
    name the line; a changed generator state catches any other path."""
    generators = _host_generators()
    before = {name: _generator_state(inst) for name, (_, inst) in generators.items()}
    first_call: dict[str, str] = {}
    wrapped = []

    def wrap(name, module, attr, fn):
        def call(*args, **kwargs):
            first_call.setdefault(name, user_location())
            return fn(*args, **kwargs)
        setattr(module, attr, call)
        wrapped.append((module, attr, fn))

    for name, (module, inst) in generators.items():
        for attr in dir(module):
            fn = getattr(module, attr, None)
            if callable(fn) and getattr(fn, "__self__", None) is inst and not attr.startswith("_"):
                wrap(name, module, attr, fn)
    try:
        yield
    finally:
        for module, attr, fn in wrapped:
            setattr(module, attr, fn)
    for name, (_, inst) in generators.items():
        if _generator_state(inst) != before[name]:
            raise ExportError(
                f"random numbers drawn with {name} at {first_call.get(name, 'an unknown line')} "
                "cannot be exported soundly: the tracer sees them as constants, so the program "
                "would reuse this export's draws on every call where eager draws anew. Draw "
                "them with torch's generator (torch.rand, torch.randint, ...), which the graph "
                "records, or turn the feature off for export")
