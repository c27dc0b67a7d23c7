"""Values computed from constants: fresh intermediates the functional trace holds.

A plain tensor attribute, a global or a closure's tensor is a constant to
the trace (a real tensor, not a traced input), and functionalization wraps
nothing an op computes from constants alone: ``t = self.c + 2`` came out a
bare fake tensor, so ``t.sub_(1)`` stayed an in-place op in the graph and was
refused as an update of "neither a parameter, a buffer nor an input". Such
a result is new memory the forward made: wrapped, its updates are data flow
like any intermediate's. An alias of a constant (a view, a detach, the
constant itself from ``.float()``) is left bare: updating it updates the
constant, which stays refused (the program has nowhere to write it back)."""
from __future__ import annotations

import torch

from ... import _torch

_ALIASES = frozenset({torch.Tensor.detach, torch.detach, torch.ops.aten.alias, torch.ops.aten.alias.default})


def untraced_tensors(args, kwargs) -> list:
    """The tensors among a call's arguments (in lists and tuples too) that the
    trace does not hold: constants (real tensors) and what ops made of them
    alone, left bare (their aliases). Empty for nearly every call."""
    found, todo = [], [*args, *kwargs.values()]
    while todo:
        a = todo.pop()
        if isinstance(a, (list, tuple)):
            todo.extend(a)
        elif isinstance(a, torch.Tensor) and not _torch.is_traced(a):
            found.append(a)
    return found


def traced_if_fresh(func, read: list, out):
    """``out`` with each new tensor an op made from constants alone (``read``:
    its arguments the trace does not hold) wrapped for the trace."""
    if func in _ALIASES or not read or not _torch.functionalizing():  # (not a kernel's inner call)
        return out
    leaves, spec = _torch.pytree.tree_flatten(out)
    fresh = [_fresh(o, read) for o in leaves]
    if not any(fresh):
        return out
    return _torch.pytree.tree_unflatten([_torch.to_functional(o) if f else o for o, f in zip(leaves, fresh)], spec)


def _fresh(o, read: list) -> bool:
    return _torch.is_fake(o) and not o._is_view() and not any(o is a for a in read)
