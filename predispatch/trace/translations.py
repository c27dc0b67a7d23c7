"""Constructs a graph can hold, translated while the forward is traced.

Each is a context manager wrapping, for the traced forward (see
:mod:`predispatch._torch.patching`), what the construct calls, so that the trace
records what eager does: an inference-mode block as a no_grad block, a
rebound buffer as a rebinding the program writes back, an autocast block with eager's cast-cache
flag and (given no dtype) the dtype current at run time. (What no graph can
hold is refused in :mod:`predispatch.trace.refusals`.)
"""
from __future__ import annotations

import contextlib

import torch

from .. import _torch
from ..errors import ExportError, user_location
from .._torch.patching import patched

_INFERENCE_MODES: list[bool] = []  # the modes of the inference_mode blocks open, innermost last


def inside_inference_mode() -> bool:
    """Is the innermost inference_mode block open while tracing one that
    switches inference mode on (where autograd records nothing, even with
    grad mode switched back on)?"""
    return bool(_INFERENCE_MODES) and _INFERENCE_MODES[-1]


@contextlib.contextmanager
def inference_mode_as_no_grad():
    """``torch.inference_mode()`` switches grad mode off in C++, where the
    recorder cannot see it: the program would differentiate the block. While
    tracing, the block is a ``torch.no_grad()`` block (what it means for
    gradients; inference tensors' other restrictions are not kept), and
    ``inference_mode(False)``, which switches grad mode on (and recording back
    on inside an inference_mode block), a ``torch.enable_grad()`` block."""
    def enter(_original):
        def call(self):
            _INFERENCE_MODES.append(bool(self.mode))
            self._predispatch_block = torch.no_grad() if self.mode else torch.enable_grad()
            self._predispatch_block.__enter__()
        return call

    def exit_(_original):
        def call(self, *exc):
            _INFERENCE_MODES.pop()  # first: the block's exit may switch grad mode back on
            return self._predispatch_block.__exit__(*exc)
        return call

    saved = _INFERENCE_MODES[:]
    try:
        with patched(torch.inference_mode, "__enter__", enter), \
                patched(torch.inference_mode, "__exit__", exit_):
            yield
    finally:
        _INFERENCE_MODES[:] = saved


def buffer_rebinding_checked():
    """``self.b = value`` for a registered buffer rebinds the attribute, as in
    eager: the name holds ``value`` from then on, while the old tensor and its
    aliases keep their values (a rebinding writes into nothing). The program
    writes the buffer back as the forward left it (see
    :func:`rebound_buffers`). Refused here, naming the line: another device,
    and a new shape or dtype with a history autograd would follow through the
    buffer (the program's buffers hold values, not histories)."""
    def setting(setattr_):
        def call(self, name, value):
            old = self.__dict__.get("_buffers", {}).get(name)
            if old is not None and isinstance(value, torch.Tensor) and value is not old:
                refuse_unsound_rebinding(name, old, value, user_location())
            return setattr_(self, name, value)
        return call
    return patched(torch.nn.Module, "__setattr__", setting)


def rebound_buffers(before: dict, after: dict, strip=lambda name: name) -> dict:
    """The buffers (name -> tensor, as the forward started and as it left
    them) that the forward rebound, by any means (``self.b = v``,
    ``register_buffer``, ``_buffers[name] = v``) -> the tensor each holds
    now; one rebound back to its own tensor is not. (``strip``: a name as
    the user knows it, for a refusal.)"""
    found = {}
    for name, value in after.items():
        old = before.get(name)
        if old is not None and value is not None and value is not old:
            refuse_unsound_rebinding(strip(name), old, value, "the forward's end")
            found[name] = value
    return found


def mark_rebound(t: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
    """A buffer a program rebinds, met again when ``ep.module()`` is exported:
    its write-back is a rebinding too (see :mod:`predispatch.program.write_backs`),
    to ``value`` where given (a tensor of another dtype, which no write can hold)."""
    if _torch.is_traced(t):
        t._predispatch_rebound = True
        if value is not None:
            t._predispatch_rebound_to = value
    return t


def was_rebound(t: torch.Tensor) -> bool:
    return getattr(t, "_predispatch_rebound", False)


def as_rebound(buffers: dict) -> dict:
    """Each buffer (name -> tensor) as the tensor it was rebound to by :func:`mark_rebound`, if any."""
    return {name: getattr(t, "_predispatch_rebound_to", t) for name, t in buffers.items()}


def refuse_unsound_rebinding(name: str, old: torch.Tensor, value: torch.Tensor, where: str) -> None:
    if (old.shape, old.dtype, old.device) != (value.shape, value.dtype, value.device):
        _refuse_unswappable(name, old, value, where)
    if old.dtype != value.dtype:
        _refuse_reinterpreted(name, old, value, where)


def _refuse_reinterpreted(name: str, old: torch.Tensor, value: torch.Tensor, where: str) -> None:
    """A rebound buffer's new dtype over its own bytes (``self.b = self.b.view(torch.int32)``)."""
    if _torch.is_traced(value) and _torch.storage_of(value) == _torch.storage_of(old):
        raise ExportError(
            f"reassigning buffer {name!r} at {where} with a view of its own memory as "
            f"another dtype ({value.dtype}) cannot be exported soundly: the program would write "
            "the new values back, not reinterpret the buffer's bytes; assign a copy (.clone())")


def _refuse_unswappable(name: str, old: torch.Tensor, value: torch.Tensor, where: str) -> None:
    if not _torch.is_traced(value):
        raise ExportError(
            f"reassigning buffer {name!r} at {where} with a tensor of another shape or "
            f"dtype ({tuple(value.shape)}, {value.dtype}) that the traced forward did not make (a "
            "global, a closure's tensor) cannot be exported soundly: the program would not hold "
            "it; compute it in the forward, or register it as a buffer")
    if old.device != value.device:
        raise ExportError(
            f"reassigning buffer {name!r} at {where} with a tensor on another device "
            f"({value.device}, the buffer is on {old.device}) cannot be exported soundly: the "
            "program's buffers stay on their device; move the module instead")
    if _torch.requires_grad_in_trace(value) and not _torch.requires_grad_in_trace(old):
        raise ExportError(
            f"reassigning buffer {name!r} at {where} with a tensor of another shape or "
            f"dtype ({tuple(value.shape)}, {value.dtype}) that requires grad cannot be exported "
            "soundly: the program writes the buffer's new value back, not its autograd history, "
            "which later reads of the buffer would differentiate through; assign a detached "
            "tensor (or keep the buffer's shape and dtype: a copy)")


@contextlib.contextmanager
def autocast_blocks_as_in_eager(eager_cache_default: bool, at_block_edge=lambda: None):
    """What an autocast block leaves to run time, recorded as such.

    The cast cache: make_fx turns it off while tracing, so a block that does
    not say ``cache_enabled`` would be recorded with the cache off, and the
    program would cast a weight used twice twice, rounding its gradient
    otherwise than eager. The block records eager's default; the trace itself
    keeps the cache off.

    The dtype: ``torch.autocast("cpu")`` without one takes the dtype current
    when the block is entered (an enclosing autocast's, or
    ``torch.set_autocast_dtype``'s). The block records None, so the program
    takes it at run time too; the trace runs with the current one.

    ``at_block_edge()`` runs before each enter and exit (the recorder's: a
    grad-mode change it did not see ends there, not inside the block)."""
    def init(original):
        def call(self, device_type, dtype=None, enabled=True, cache_enabled=None):
            original(self, device_type, dtype, enabled,
                     eager_cache_default if cache_enabled is None else cache_enabled)
            self._predispatch_dtype_at_run_time = dtype is None
        return call

    def enter(original):
        def call(self):
            at_block_edge()
            tracing = torch.is_autocast_cache_enabled()
            tracer = _torch.current_tracer()
            last = None if tracer is None else _torch.last_node(tracer.graph)
            entered = original(self)  # sets the cache flag and records the block with it
            torch.set_autocast_cache_enabled(tracing)
            if last is not None and getattr(self, "_predispatch_dtype_at_run_time", False):
                for node in _torch.nodes_after(last):
                    if node.target is _torch.ENTER_AUTOCAST:
                        node.args = (node.args[0], None, *node.args[2:])
            return entered
        return call

    def exit_(original):
        def call(self, *exc):
            at_block_edge()
            return original(self, *exc)
        return call

    with patched(torch.autocast, "__init__", init), patched(torch.autocast, "__enter__", enter), \
            patched(torch.autocast, "__exit__", exit_):
        yield


def scalar_tensors_formatted_as_in_eager():
    """``f"expert_{idx}"`` of a 0-dim tensor formats its value in eager
    (``Tensor.__format__`` reads it with ``item()``) and the tensor's repr
    for a traced tensor, a string eager never makes. While tracing, the
    value is read as eager reads it: a value of the data, so a data-dependent
    construct (refused, or taken as the example's with ``data_dependent="specialize"``)."""
    def formatting(original):
        def call(self, format_spec):
            if self.dim() != 0 or self.is_meta or not _torch.is_traced(self):
                return original(self, format_spec)
            value = self.detach().item()
            kind = bool if self.dtype is torch.bool else float if self.is_floating_point() else int
            return format(kind(value), format_spec)
        return call
    return patched(torch.Tensor, "__format__", formatting)
