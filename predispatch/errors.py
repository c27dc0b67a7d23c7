"""Exceptions and warnings of predispatch's public contract."""
from __future__ import annotations


class ExportError(RuntimeError):
    """A module that cannot be exported soundly: the message names the
    construct and the user's source line."""


class BackwardAutocastMismatchError(RuntimeError):
    """The backward ran under an autocast state other than the one assumed
    when the program was compiled, in a way that changes its result."""


class BackwardAutocastMismatchWarning(UserWarning):
    """Warning form of :class:`BackwardAutocastMismatchError`."""


def user_frame(stack_trace: str | None) -> str:
    """The innermost user frame ("file:line in fn: code") of a node's stack
    trace, skipping torch's own frames; "unknown location" if none."""
    if not stack_trace:
        return "unknown location"
    lines = [line.strip() for line in stack_trace.strip().splitlines()]
    frames = []
    for i, line in enumerate(lines):
        if line.startswith('File "'):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith("File ") else ""
            frames.append((line, code))
    for line, code in reversed(frames):
        if "/site-packages/torch/" not in line and "/predispatch/" not in line:
            return _format_frame(line, code)
    return _format_frame(*frames[-1]) if frames else "unknown location"


def _format_frame(line: str, code: str) -> str:
    # 'File "/x/model.py", line 12, in forward' -> '/x/model.py:12 in forward'
    try:
        path = line.split('"')[1]
        rest = line.split('"')[2]
        lineno = rest.split("line")[1].split(",")[0].strip()
        fn = rest.split(" in ")[-1].strip()
        where = f"{path}:{lineno} in {fn}"
    except IndexError:
        where = line
    return f"{where}: {code}" if code else where
