"""Replacing a global attribute while the forward is traced.

Some constructs bypass torch-function modes (``Tensor.set_``, autocast and
inference-mode enter/exit, ``autograd.Function.apply``, numpy's and Python's
random generators), so the trace wraps them where they live. The replacement
serves the tracing thread only: other threads (a data loader, a second
export) keep the original while an export runs, and it is restored on exit.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable


@contextlib.contextmanager
def patched(owner, name: str, make_replacement: Callable[[Callable], Callable]):
    """``owner.name`` is ``make_replacement(original)`` for this thread until exit.

    ``owner`` is a class (methods, classmethods: ``original`` takes the same
    leading ``self`` / ``cls``) or a module (its functions)."""
    own = vars(owner).get(name)  # None when inherited
    is_classmethod = isinstance(own, classmethod)
    original = own.__func__ if is_classmethod else getattr(owner, name)
    replacement = make_replacement(original)
    thread = threading.get_ident()

    def dispatch(*args, **kwargs):
        if threading.get_ident() == thread:
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
