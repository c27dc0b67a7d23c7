"""Exceptions and warnings of predispatch's public contract."""
from __future__ import annotations

import os
import traceback

import torch


class ExportError(RuntimeError):
    """A module that cannot be exported soundly: the message names the
    construct and the user's source line."""


class BackwardAutocastMismatchError(RuntimeError):
    """The backward ran under an autocast state other than the one assumed
    when the program was compiled, in a way that changes its result."""


class BackwardAutocastMismatchWarning(UserWarning):
    """Warning form of :class:`BackwardAutocastMismatchError`."""


_LIBRARY_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)


def is_library_file(filename: str) -> bool:
    """A file of torch or of predispatch itself, never the user's."""
    return filename.startswith(_LIBRARY_DIRS)


def _innermost_user_frame(frames) -> str:
    for f in reversed(list(frames)):
        if not is_library_file(f.filename):
            return f"{f.filename}:{f.lineno} in {f.name}: {f.line}"
    return "unknown location"


def user_location() -> str:
    """The innermost frame of the current Python stack that is the user's."""
    return _innermost_user_frame(traceback.extract_stack())


def exception_location(e: BaseException) -> str:
    """The innermost frame of an exception's traceback that is the user's."""
    return _innermost_user_frame(traceback.extract_tb(e.__traceback__))


def node_location(stack_trace: str | None) -> str:
    """The innermost user frame of an fx node's ``stack_trace`` text."""
    frames, lines = [], (stack_trace or "").strip().splitlines()
    for i, line in enumerate(lines):
        line = line.strip()
        if line.startswith('File "'):
            path, rest = line.split('"')[1], line.split('"')[2]
            lineno = int(rest.split("line")[1].split(",")[0])
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            frames.append(traceback.FrameSummary(path, lineno, rest.split(" in ")[-1].strip(),
                                                 line=None if code.startswith("File ") else code))
    return _innermost_user_frame(frames)
