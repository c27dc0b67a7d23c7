"""Unexpected errors while a module is exported, said as ``ExportError``.

The contract allows no raw torch error: an exception raised inside torch's
or predispatch's code while the module is traced (an internal error of
either, or a torch error the trace hit where eager would not), or while a
later stage of the pipeline works on the graph, becomes an
``ExportError`` naming the construct being traced (the user's torch call,
and the op torch was dispatching) and the user's line, with the original
chained as its ``__cause__``.

What is not converted keeps its meaning: an ``ExportError`` (a refusal
already said in user terms), torch.export's ``UserError`` (its documented
answer to a dynamic-shapes problem), and an exception the user's own code
raised (its innermost frame is the user's: ``raise MyError`` in a forward,
a Python error in the model's code), which eager would raise as it is, but
for an attribute the trace's tensors lack (a tensor subclass's own).
A torch error the model would hit in eager too (a shape mismatch) is
converted: still a ``RuntimeError``, its message kept in the new one.
"""
from __future__ import annotations

import contextlib
import traceback
import types

import torch

from .. import _torch
from ..errors import ExportError, exception_location, is_library_file
from .refusals import CONTROL_FLOW_CALL


@contextlib.contextmanager
def internal_errors_as_export_errors(stage: str = "capture"):
    """Inside (the pipeline's ``stage``): an unexpected exception from
    library code is an ``ExportError``."""
    try:
        yield
    except (ExportError, _torch.UserError):
        raise
    except Exception as e:
        if _traced_tensor_lacks(e):
            raise ExportError(
                f"tensor attribute {e.name!r} at {exception_location(e)} cannot be exported: the trace "
                f"holds tensors as plain tensors, without the attributes and methods of a tensor subclass "
                f"({type(e).__name__}: {_text(e)})") from e
        if not _raised_in_library(e):
            raise
        construct, where = raising_construct(e) or "the module", exception_location(e)
        if where == "unknown location":  # no line of the module's code on the stack: raised before or after it ran
            where = f"no line of its code (raised in {_innermost_frame(e)})"
        if _torch.is_uncaptured_control_flow(e):  # however the operator was reached (imported before the export)
            raise ExportError(f"{construct} at {where} cannot be exported soundly: {CONTROL_FLOW_CALL}") from e
        what = "torch failed while tracing it" if stage == "capture" else f"the {stage} stage failed on it"
        if _torch.has_no_kernel_for_its_shape(e):
            what = ("torch has no fake kernel for its output, whose shape the input's values decide, so no "
                    "trace can hold it (torch.export's neither)")
        raise ExportError(
            f"{construct} at {where} cannot be exported: {what} "
            f"({type(e).__name__}: {_text(e)}). Where the module runs in eager with these inputs, "
            "this is a limitation or bug of predispatch or torch; the original error is chained "
            "as __cause__") from e


def _traced_tensor_lacks(e: BaseException) -> bool:
    """An attribute the user's code read of a tensor while it was traced: one
    of a tensor subclass's own (eager's tensor is the subclass; the traced
    one is a FunctionalTensor, or the plain tensor a subclass's own torch
    function made of it)."""
    return isinstance(e, AttributeError) and isinstance(getattr(e, "obj", None), torch.Tensor)


def _raised_in_library(e: BaseException) -> bool:
    """Was ``e`` raised by torch's or predispatch's code (its innermost
    Python frame theirs), rather than by the user's?"""
    frames = _frames(e)
    return bool(frames) and (is_library_file(frames[-1].f_code.co_filename)
                             or frames[-1].f_code.co_filename == "<string>")


def raising_construct(e: BaseException) -> str | None:
    """What the user's code was calling when ``e`` was raised, from its
    traceback: the outermost torch call a torch-function mode saw below the
    user's innermost frame (``func`` of a ``__torch_function__``) and the
    innermost op a dispatch mode saw (``func`` of a ``__torch_dispatch__``);
    else the library function the user's frame called. None if none of
    these."""
    frames = _frames(e)
    users = [i for i, f in enumerate(frames) if not is_library_file(f.f_code.co_filename)
             and f.f_code.co_filename != "<string>"]
    below = frames[users[-1] + 1:] if users else frames
    calls = [_func_name(f) for f in below if f.f_code.co_name == "__torch_function__"]
    ops = [_func_name(f) for f in below if f.f_code.co_name == "__torch_dispatch__"]
    call = next((c for c in calls if c), None)
    op = next((o for o in reversed(ops) if o), None)
    if call and op and op != call:
        return f"{call} (op {op})"
    if call or op:
        return call or f"op {op}"
    return f"{below[0].f_code.co_name}()" if users and below else None


def _innermost_frame(e: BaseException) -> str:
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{frame.filename.split('site-packages/')[-1]}:{frame.lineno} in {frame.name}"


def _frames(e: BaseException) -> list[types.FrameType]:
    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _func_name(frame: types.FrameType) -> str | None:
    func = frame.f_locals.get("func")
    if func is None:
        return None
    if isinstance(func, _torch.OpOverload):
        return str(func)
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    module = getattr(func, "__module__", None) or ""
    return f"{module}.{name}" if module.startswith("torch") and not module.startswith("torch._") else name


def _text(e: BaseException) -> str:
    text = str(e).strip()
    return text if text else "no message"
