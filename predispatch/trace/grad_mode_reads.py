"""Where the mode a ``torch.set_grad_enabled(x)`` call passes comes from.

A toggle called as a function has no exit: whether a later toggle restores
the caller's mode depends on what it passes. The bytecode says which
``torch.is_grad_enabled()`` call a variable holds (``prev =
torch.is_grad_enabled()``, its one assignment), or that the value is computed
from such reads, or comes from outside the code; each read in the user's code
leaves a marker node among the blocks' markers, so the regions stage knows
whether the mode read was the caller's. (See design/regions-and-mutations.md.)
"""
from __future__ import annotations

import bisect
import contextlib
import dis
import functools
import sys

import torch

from .. import _torch
from ..errors import is_library_file
from ..ir.meta_keys import DERIVED, GRAD_MODE_READ, UNKNOWN
from .._torch.patching import patched


@functools.lru_cache(maxsize=256)
def _instructions(code) -> tuple[list, list[int]]:
    """A code object's instructions, and their offsets."""
    listed = list(dis.get_instructions(code))
    return listed, [ins.offset for ins in listed]


def _current(frame) -> int | None:
    """The index of the instruction ``frame`` is executing (``f_lasti`` may
    point into its inline cache, which ``dis`` does not list)."""
    _, offsets = _instructions(frame.f_code)
    i = bisect.bisect_right(offsets, frame.f_lasti) - 1
    return i if i >= 0 else None


_LOADS = ("LOAD_FAST", "LOAD_DEREF", "LOAD_NAME", "LOAD_GLOBAL", "LOAD_CLASSDEREF")
_STORES = ("STORE_FAST", "STORE_DEREF", "STORE_NAME", "STORE_GLOBAL")
_SKIPPED = ("PRECALL", "KW_NAMES", "CACHE")


def passed_mode(frame):
    """What the call ``frame`` is making passes as its last argument, read from
    the bytecode: ``(code, offset)`` of the ``torch.is_grad_enabled()`` call
    whose result it is (``prev = torch.is_grad_enabled(); ...;
    torch.set_grad_enabled(prev)``, the one assignment of ``prev``);
    ``DERIVED`` when computed from grad-mode reads otherwise (``not prev``,
    ``use = torch.is_grad_enabled() and flag``, a reassigned ``prev``);
    ``UNKNOWN`` when its origin is not in this code (a parameter, an
    attribute, a global); None for a constant of the code."""
    if frame is None:
        return None
    code = frame.f_code
    listed, _ = _instructions(code)
    i = _previous(listed, _current(frame))
    if i is None or listed[i].opname == "LOAD_CONST":
        return None
    derived = _names_from_grad_mode(code)
    if listed[i].opname not in _LOADS:  # an expression
        return _origin(listed, _statement(listed, i)[0], i + 1, derived)
    name = listed[i].argval
    stores = [j for j, ins in enumerate(listed) if ins.opname in _STORES and ins.argval == name]
    if len(stores) == 1 and (read := _bare_read(listed, stores[0])) is not None:
        return (code, read)
    if name in derived:
        return DERIVED
    if not stores:
        return UNKNOWN
    origins = {_origin(listed, _statement(listed, j)[0], j, derived) for j in stores}
    return None if origins == {None} else UNKNOWN


def _origin(listed: list, start: int, end: int, derived: set):
    """The origin of the value ``listed[start:end]`` computes: DERIVED if it
    reads the grad mode, None if it is made of constants, else UNKNOWN."""
    span = listed[start:end]
    if any(ins.argval == "is_grad_enabled" or (ins.opname in _LOADS and ins.argval in derived)
           for ins in span):
        return DERIVED
    loads = [ins for ins in span if ins.opname.startswith("LOAD") and ins.opname != "LOAD_CONST"]
    return None if not loads else UNKNOWN


@functools.lru_cache(maxsize=256)
def _names_from_grad_mode(code) -> frozenset:
    """Variables of ``code`` some assignment of which reads the grad mode,
    directly or through another such variable."""
    listed, _ = _instructions(code)
    stores = [(j, ins.argval) for j, ins in enumerate(listed) if ins.opname in _STORES]
    derived: set = set()
    while True:
        more = {name for j, name in stores if name not in derived
                and _origin(listed, _statement(listed, j)[0], j, derived) == DERIVED}
        if not more:
            return frozenset(derived)
        derived |= more


def _statement(listed: list, i: int) -> tuple[int, int]:
    """The index range of the statement holding ``listed[i]``."""
    start = i
    while start > 0 and listed[start].starts_line is None:
        start -= 1
    end = i
    while end + 1 < len(listed) and listed[end + 1].starts_line is None:
        end += 1
    return start, end


def _previous(listed: list, i: int | None) -> int | None:
    """The index of the instruction before ``listed[i]``, call bookkeeping skipped."""
    while i is not None and i > 0:
        i -= 1
        if listed[i].opname not in _SKIPPED:
            return i
    return None


def _bare_read(listed: list, store: int) -> int | None:
    """The offset of the call when the store is of ``torch.is_grad_enabled()`` itself."""
    call = _previous(listed, store)
    if call is None or listed[call].opname != "CALL" or listed[call].arg != 0:
        return None
    callee = _previous(listed, call)
    if callee is None or listed[callee].argval != "is_grad_enabled":
        return None
    return listed[call].offset


def grad_mode_read(*_):
    """The target of a grad-mode read's marker node (the regions stage drops them)."""


_torch.mark_side_effectful(grad_mode_read)


@contextlib.contextmanager
def noting_grad_mode_reads(sync_grad_mode=lambda: None):
    """``torch.is_grad_enabled()`` in the user's code leaves a marker node in
    the graph, among the blocks' markers: the regions stage then knows
    whether the mode a toggle passes back was the caller's when read.
    ``sync_grad_mode()`` first marks a change of mode no torch-function mode
    saw (a library call's no_grad block, ended by now) before the read."""
    def make(original):
        def call():
            frame = sys._getframe(2)  # through patched()'s dispatch
            tracer = _torch.current_tracer()
            if tracer is not None and not is_library_file(frame.f_code.co_filename):
                sync_grad_mode()
                node = tracer.graph.call_function(grad_mode_read, ())
                node.meta[GRAD_MODE_READ] = (frame.f_code, _instructions(frame.f_code)[1][_current(frame)])
            return original()
        return call

    with patched(torch, "is_grad_enabled", make):
        yield
