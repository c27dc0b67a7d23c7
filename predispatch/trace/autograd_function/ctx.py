"""The ``ctx`` a traced Function's forward and backward get, and what may cross between them.

A ctx attribute reaches the traced backward as it is when it is fixed at
export time (a number, a string, a dtype, a function: baked into the
backward as a constant), as a saved tensor when it is a tensor, or as the
shape of a saved one-element tensor when it is a size of a dynamic
dimension (the backward's trace reads it from its inputs). Anything else
(a module, a list, an object) is state the backward would read when it
runs: refused, as are the globals and closure variables of that kind the
backward's own code reads.
"""
from __future__ import annotations

import dataclasses
import dis
import enum
import inspect
import types
from typing import Callable

import torch

from ..._torch import pytree
from ... import _torch
from ...errors import ExportError


class Refused(ExportError):
    """A Function that cannot be captured soundly; the message names it and its call."""


def refused(name: str, where: str, why: str) -> Refused:
    return Refused(f"torch.autograd.Function {name} at {where}: {why}")


class TracedCtx:
    """The ``ctx`` of a Function's forward and backward while they are traced.
    What the user sets on it is kept in ``__dict__``; ours, in ``_state``."""

    def __init__(self, cls_name: str, needs_input_grad: tuple, where: str):
        self._state = {"name": cls_name, "where": where, "saved": (), "non_differentiable": (),
                       "materialize_grads": True, "dirty": ()}
        self.needs_input_grad = needs_input_grad

    def save_for_backward(self, *tensors):
        self._state["saved"] = tensors

    @property
    def saved_tensors(self):
        return self._state["saved"]

    saved_variables = saved_tensors

    def mark_non_differentiable(self, *tensors):
        self._state["non_differentiable"] = tensors

    def set_materialize_grads(self, value: bool):
        self._state["materialize_grads"] = bool(value)

    def save_for_forward(self, *tensors):
        """For forward-mode AD only, which the program does not run."""

    def mark_dirty(self, *tensors):
        """The inputs the forward updated in place and returns: the caller's
        tensors themselves, with the Function's history (see :mod:`.results`)."""
        self._state["dirty"] = tensors

    def user_attributes(self) -> dict:
        return {k: v for k, v in vars(self).items() if k not in ("_state", "needs_input_grad")}


# values a ctx attribute or a global the backward reads may hold: fixed at export
_FIXED = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device,
          torch.layout, torch.memory_format, torch.Size, enum.Enum, type, range, slice,
          types.FunctionType, types.BuiltinFunctionType, types.ModuleType,
          type(Ellipsis), frozenset, *_torch.OP_TYPES)


def is_fixed(value) -> bool:
    return isinstance(value, _FIXED)


def unfixed_state(value) -> str | None:
    """What in ``value`` is neither fixed at export time nor passed to the
    backward (see :func:`passed`), or None."""
    for leaf in leaves(value)[0]:
        if passed(leaf) is None and not is_fixed(leaf):
            return type(leaf).__name__
    return None


def leaves(value):
    """A ctx attribute flattened; a torch.Size stays whole (pytree would give it back as a tuple)."""
    return pytree.tree_flatten(value, is_leaf=lambda v: isinstance(v, torch.Size))


@dataclasses.dataclass(frozen=True)
class Passed:
    """How a ctx attribute's leaf reaches the backward: as a saved tensor, the
    leaf itself or (a size of a dynamic dimension, which the backward's trace
    must read from one of its inputs) a one-element tensor of that shape."""

    carrier: Callable  # the leaf -> the tensor saved
    value: Callable  # the saved tensor -> the leaf's value in the backward


def _carrier(shape) -> torch.Tensor:
    return torch.zeros(()).expand(shape)


_AS_TENSOR = Passed(lambda t: t, lambda t: t)
_AS_SIZE = Passed(_carrier, lambda t: t.shape)
_AS_INT = Passed(lambda n: _carrier((n,)), lambda t: t.shape[0])


def passed(leaf) -> Passed | None:
    if isinstance(leaf, torch.Tensor):
        return _AS_TENSOR
    if isinstance(leaf, torch.SymInt):
        return _AS_INT
    if isinstance(leaf, torch.Size) and any(isinstance(d, torch.SymInt) for d in leaf):
        return _AS_SIZE
    return None


def backward_function(cls):
    """The Function's ``backward`` (or ``vjp``, its other name, if that is the one defined)."""
    backward = cls.backward
    base = torch.autograd.Function.backward
    return cls.vjp if getattr(backward, "__func__", backward) is getattr(base, "__func__", base) else backward


def state_the_backward_reads(fn) -> tuple[str, str] | None:
    """(name, type) of a global or closure variable the backward's own code
    reads that holds state not fixed at export time (a list, a dict, a
    tensor, a module, an object), or None. Code it calls is not searched."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells = dict(zip(code.co_freevars, fn.__closure__ or ()))
    for instr in dis.get_instructions(code):
        if instr.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            name = instr.argval
            if name not in fn.__globals__:  # a builtin
                continue
            value = fn.__globals__[name]
        elif instr.opname in ("LOAD_DEREF", "LOAD_CLASSDEREF") and instr.argval in cells:
            name = instr.argval
            try:
                value = cells[name].cell_contents
            except ValueError:
                continue
        else:
            continue
        if not is_fixed(value):
            return name, type(value).__name__
    return None
