"""Replacing a global attribute (often torch's) for the tracing thread, while the forward is traced.

Some constructs bypass torch-function modes (``Tensor.set_``, autocast and
inference-mode enter/exit, ``autograd.Function.apply``, numpy's and Python's
random generators), so the trace wraps them where they live. The replacement
serves the tracing thread only: other threads (a data loader, a second
export) keep the original while an export runs, and it is restored on exit.
A trace of its own in the middle of a trace (an autograd.Function's
subgraphs) sets its own replacements up, with the outer ones suspended.
It lives in the seam: what torch's objects are (a Python ``classmethod``, a
C method descriptor) changes between releases.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import types
from typing import Callable

_levels = itertools.count()  # patches in the order they are made
_local = threading.local()  # floor: this thread's patches made before it are suspended


@contextlib.contextmanager
def patched(owner, name: str, make_replacement: Callable[[Callable], Callable]):
    """``owner.name`` is ``make_replacement(original)`` for this thread until exit.

    ``owner`` is a class (methods, classmethods: ``original`` takes the same
    leading ``self`` / ``cls``) or a module (its functions)."""
    own = vars(owner).get(name)  # None when inherited
    is_classmethod = isinstance(own, (classmethod, types.ClassMethodDescriptorType))
    original = _unbound(own) if is_classmethod else getattr(owner, name)
    replacement = make_replacement(original)
    thread, level = threading.get_ident(), next(_levels)

    @functools.wraps(original)  # a patch made over another names what it replaces
    def dispatch(*args, **kwargs):
        if threading.get_ident() == thread and level >= getattr(_local, "floor", 0):
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    setattr(owner, name, classmethod(dispatch) if is_classmethod else dispatch)
    try:
        yield
    finally:
        if own is None:
            delattr(owner, name)
        else:
            setattr(owner, name, own)


def _unbound(own) -> Callable:
    """A classmethod's function, taking ``cls`` first: a Python ``classmethod``'s
    own, or one calling a C classmethod bound to ``cls``
    (``torch.autograd.Function.apply`` is one since torch 2.14)."""
    if isinstance(own, classmethod):
        return own.__func__

    def unbound(cls, *args, **kwargs):
        return own.__get__(None, cls)(*args, **kwargs)
    return functools.update_wrapper(unbound, own)


@contextlib.contextmanager
def patches_suspended():
    """Until exit, the patches made so far serve this thread as the originals
    do; patches made meanwhile work as usual."""
    previous = getattr(_local, "floor", 0)
    _local.floor = next(_levels)
    try:
        yield
    finally:
        _local.floor = previous
