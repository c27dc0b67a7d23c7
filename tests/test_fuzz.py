"""Differential fuzzing, fast CI profile: random programs with grad/autocast
regions, views and mutations, each compared with eager.

A program eager refuses is discarded; one that export refuses with
``predispatch.ExportError`` is fine; anything else must match eager (the
kit's ``assert_matches_eager``). On a failure hypothesis shrinks the program
and prints it as a pasteable test (module source, inputs, the check).

The long profile: ``python -m tools.fuzz.run --examples 1000``.
"""
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, note, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools.fuzz

from tools.fuzz.generator import programs  # noqa: E402
from tools.fuzz.layered import layered_programs  # noqa: E402
from tools.fuzz.oracle import FAILURE, INVALID, check  # noqa: E402

CI_PROFILE = settings(
    derandomize=True,
    max_examples=300,
    deadline=None,
    database=None,
    print_blob=False,
    report_multiple_bugs=False,  # shrink one failure only: each check costs 0.1-0.3 s
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                           HealthCheck.data_too_large, HealthCheck.large_base_example],
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # millisecond calls stall with 2 OpenMP threads
    yield
    torch.set_num_threads(threads)


SHRINK_SECONDS = 60  # after the first failure; then the smallest failing program so far is reported


class _Shrinking:
    """Bounds hypothesis's shrinking in time (unbounded, it can take five
    minutes at 0.1-0.3 s a check): once the budget is spent, programs not
    seen failing pass unchecked, so the shrinker settles on the smallest
    failure found; programs seen failing fail again (no Flaky)."""

    started: float | None = None
    failed: dict = {}

    @classmethod
    def check(cls, program):
        source = program.source
        if source in cls.failed:
            return cls.failed[source]
        if cls.started is not None and time.monotonic() - cls.started > SHRINK_SECONDS:
            return None
        outcome = check(program)
        if outcome.status == FAILURE:
            cls.failed[source] = outcome
            cls.started = cls.started or time.monotonic()
        return outcome


def _check_program(program):
    outcome = _Shrinking.check(program)  # a failing example prints as its source (Program._repr_pretty_)
    if outcome is None:
        return
    assume(outcome.status != INVALID)  # eager itself raised
    if outcome.status == FAILURE:
        note(f"failure: {outcome.reason}\n{outcome.detail}")
        raise outcome.exc if outcome.exc is not None else AssertionError(outcome.reason)


@CI_PROFILE
@given(programs())
def test_random_programs_match_eager_or_are_refused(program):
    _check_program(program)


@settings(CI_PROFILE, max_examples=40)
@given(layered_programs())
def test_repeated_layers_sharing_python_state_match_eager_and_reuse_changes_nothing(program):
    """Layer reuse under fuzzing: each program also compares reuse on and off node for node."""
    _check_program(program)
