"""What the model sweeps (``vision_sweep.py``, ``transformers_sweep.py``)
share: a case's outcome, the per-case time limit, the summary table and the
JSON records.

Each case ends as ``passed``, ``refused`` (an ``ExportError``: the reason is
its first line), ``failed`` (the program differs from eager, or the export
raised something else), ``skipped`` (not built, or eager itself does not
run it) or ``timeout``; a sweep may add its own statuses (``STATUSES`` is
the order they are printed in).
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import signal

import torch

PASSED, REFUSED, FAILED, SKIPPED, TIMEOUT = "passed", "refused", "failed", "skipped", "timeout"
STATUSES = (PASSED, REFUSED, FAILED, TIMEOUT, SKIPPED)


@dataclasses.dataclass
class Result:
    case: object  # a frozen dataclass with ``source``, ``model``, ``mode`` and ``name``
    status: str
    detail: str = ""
    seconds: float = 0.0
    params: int = 0
    extra: dict = dataclasses.field(default_factory=dict)  # what a sweep records beside


class CaseTimeout(Exception):
    pass


_expired: list[bool] = [False]


@contextlib.contextmanager
def time_limit(seconds: int):
    """At most ``seconds`` of this process's CPU time, not wall time: on a
    shared machine a case's limit does not depend on its neighbours' load."""
    def expire(signum, frame):
        _expired[0] = True
        raise CaseTimeout(f"over {seconds} s of CPU time")
    previous = signal.signal(signal.SIGPROF, expire)
    _expired[0] = False
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def timed_out() -> bool:
    """Did the last :func:`time_limit` expire? (Code the alarm interrupts may
    catch the ``CaseTimeout`` and raise another error in its place.)"""
    return _expired[0]


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:300] if text else ''}"


def eager_runs(model, args, kwargs=None) -> str:
    """'' if eager runs the model on the input, else why not."""
    try:
        out = copy.deepcopy(model)(*args, **(kwargs or {}))
        del out
        return ""
    except Exception as e:
        return "eager: " + first_line(e)


def print_table(results: list, seconds: float, statuses=STATUSES) -> None:
    print(f"\n{len(results)} cases in {seconds:.0f} s")
    print(f"{'source':12s} {'mode':6s} {'tried':>6s}" + "".join(f" {s:>8s}" for s in statuses))
    for source, mode in sorted({(r.case.source, r.case.mode) for r in results}):
        rows = [r for r in results if (r.case.source, r.case.mode) == (source, mode)]
        count = {s: sum(r.status == s for r in rows) for s in statuses}
        print(f"{source:12s} {mode:6s} {len(rows) - count[SKIPPED]:6d}" + "".join(f" {count[s]:8d}" for s in statuses))
    models = {(r.case.source, r.case.model) for r in results if r.status != SKIPPED}
    passed = {m for m in models if all(r.status == PASSED for r in results if (r.case.source, r.case.model) == m)}
    print(f"models tried {len(models)}, passed in every mode tried {len(passed)}")
    for status in statuses[1:]:
        for r in results:
            if r.status == status:
                print(f"{status.upper():8s} {r.case.name}: {r.detail}")


def write_json(path: str, results: list, seconds: float, **header) -> None:
    records = [{"source": r.case.source, "model": r.case.model, "mode": r.case.mode, "status": r.status,
                "detail": r.detail, "seconds": round(r.seconds, 1), "params": r.params, **r.extra}
               for r in results]
    with open(path, "w") as f:
        json.dump({"torch": torch.__version__, "seconds": round(seconds), **header, "cases": records}, f, indent=1)
