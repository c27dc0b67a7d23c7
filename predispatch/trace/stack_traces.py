"""Node stack traces, computed once per user-level torch call.

torch's tracer symbolizes the whole Python stack and reads the source lines
for every node it creates, then keeps only the ``forward`` frames: about a
sixth of an export's time. Every node one torch call creates gets the same
filtered stack, and those frames repeat from layer to layer. So during each
torch call the traced code makes (and each autocast enter/exit, which reach
make_fx's mode directly), torch's per-node capture is off and the nodes the
call created are stamped with the call's stack: the same frames in the same
format as torch's (``TracerBase._filter_traceback_frames``), formatted once
per distinct stack. Nodes made outside such calls keep torch's own capture.
"""
from __future__ import annotations

import contextlib
import sys
import traceback
import types

import torch
import torch.fx

from .. import _torch
from .._torch.patching import patched


class _Stamper(_torch.TorchFunctionMode):
    def __init__(self, tracer, outer_frame):
        super().__init__()
        self.tracer = tracer
        self._kept: dict[types.CodeType, bool] = {}  # code -> is the frame shown
        self._texts: dict[tuple, str] = {}  # shown (code, line) pairs -> formatted stack
        self._last_parent = None  # (frame, its line, the stop, its shown frames) of the last walk
        # the frames around the traced forward are the same for every call: walk them once
        self._outer_frame = outer_frame
        self._outer = self._walked(outer_frame, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.call(sys._getframe(1), func, args, kwargs or {})

    def call(self, caller, func, args, kwargs):
        """``func(*args, **kwargs)``, its new nodes stamped with ``caller``'s stack."""
        last = _torch.last_node(self.tracer.graph)
        self.tracer.record_stack_traces = False
        try:
            out = func(*args, **kwargs)
        finally:
            self.tracer.record_stack_traces = True
        text = None
        for node in _torch.nodes_after(last):
            if not node.stack_trace:
                text = text or self._stack_text(caller)
                node.stack_trace = text
        return out

    def call_site_text(self, frame) -> str:
        """The stack text of a node made at ``frame`` (a layer's call site):
        the start of the texts of the nodes its callees make."""
        return self._stack_text(frame)

    def _shown_frames(self, frame, stop) -> tuple:
        """(code, line) of the frames torch would show, outermost first. The
        torch calls of one function share the frames around it: those are
        walked once while it runs at the same line (its caller's frame, the
        same object at the same line, holds the same stack)."""
        if frame is None or frame is stop:
            return ()
        parent = frame.f_back
        last = self._last_parent
        if last is not None and parent is last[0] and parent.f_lineno == last[1] and stop is last[2]:
            around = last[3]
        else:
            around = self._walked(parent, stop)
            self._last_parent = (parent, parent.f_lineno, stop, around) if parent is not None else None
        return around + self._walked(frame, parent)

    def _walked(self, frame, stop) -> tuple:
        """(code, line) of the frames torch would show from ``frame`` out to ``stop``, outermost first."""
        kept, shown = self._kept, []
        while frame is not None and frame is not stop:
            code = frame.f_code
            keep = kept.get(code)
            if keep is None:
                keep = kept[code] = _torch.is_user_stack_frame(code.co_filename, code.co_name)
            if keep:
                shown.append((code, frame.f_lineno))
            frame = frame.f_back
        return tuple(reversed(shown))

    def _stack_text(self, frame) -> str:
        key = self._outer + self._shown_frames(frame, self._outer_frame)
        text = self._texts.get(key)
        if text is None:
            summary = traceback.StackSummary.from_list(
                [(code.co_filename, line, code.co_name, None) for code, line in key])
            text = self._texts[key] = "".join(summary.format()).strip()
        return text


@contextlib.contextmanager
def stamping_stack_traces():
    """Inside a make_fx trace: stamp user stack traces per torch call (the
    stamper is given, or None where the tracer records none)."""
    tracer = _torch.current_tracer()
    if tracer is None or not tracer.record_stack_traces:
        yield None
        return
    stamper = _Stamper(tracer, sys._getframe(2))  # the frame entering this context
    with stamper, _stamping_autocast_blocks(stamper):
        yield stamper


@contextlib.contextmanager
def _stamping_autocast_blocks(stamper: _Stamper):
    """autocast's __enter__/__exit__ hand their nodes to make_fx's mode
    directly, past any other torch-function mode: stamp them here."""
    def stamped(method):
        def call(self, *exc):  # called through patched()'s dispatch: the user's frame is 2 up
            return stamper.call(sys._getframe(2), method, (self, *exc), {})
        return call

    with patched(torch.autocast, "__enter__", stamped), patched(torch.autocast, "__exit__", stamped):
        yield
