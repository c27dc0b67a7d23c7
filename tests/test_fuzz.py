"""Differential fuzzing, fast CI profile: random programs with grad/autocast
regions, views and mutations, each compared with eager.

A program eager refuses is discarded; one that export refuses with
``predispatch.ExportError`` is fine; anything else must match eager (the
kit's ``assert_matches_eager``). On a failure hypothesis shrinks the program
and prints it as a pasteable test (module source, inputs, the check).

The long profile: ``python -m tools.fuzz.run --examples 1000``.
"""
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, note, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools.fuzz

from tools.fuzz.generator import programs  # noqa: E402
from tools.fuzz.oracle import FAILURE, INVALID, check  # noqa: E402

CI_PROFILE = settings(
    derandomize=True,
    max_examples=200,
    deadline=None,
    database=None,
    print_blob=False,
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


@CI_PROFILE
@given(programs())
def test_random_programs_match_eager_or_are_refused(program):
    note(f"program:{program!r}")
    outcome = check(program)
    assume(outcome.status != INVALID)  # eager itself raised
    if outcome.status == FAILURE:
        note(f"failure: {outcome.reason}\n{outcome.detail}")
        raise outcome.exc
