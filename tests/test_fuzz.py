"""Differential fuzzing, fast CI profile: random programs with grad/autocast
regions, views and mutations, random state, bare grad-mode switches and
branches on tensor values, each compared with eager; and the programs the
fuzzer found failing, replayed from their data files.

A program eager refuses is discarded; one that export refuses with
``predispatch.ExportError`` is fine; anything else must match eager (the
kit's ``assert_matches_eager``; a branching program also on other inputs).
On a failure hypothesis shrinks the program and prints it as a pasteable
test (module source, inputs, the check).

The long profile: ``python -m tools.fuzz.run --examples 1000``.

**Found programs** (``tests/fuzz_regressions/*.py``): a regression found by
the fuzzer is a data file replayed by one test. Each file is a program's
source as ``python -m tools.fuzz.run`` prints it (minimal, with
``--minimize``; ``--save DIR`` writes them), under a first line
``# fuzz seed N: <what failed>``. An open bug has a second line
``# open: <diagnosis>`` and its replay is a strict xfail: delete that line
with the fix. A replay passes when the program matches eager or is soundly
refused (``ExportError``), as the oracle judges it.
"""
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, assume, given, note, settings

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools.fuzz

import predispatch  # noqa: E402
from predispatch.testing.eager import assert_matches_eager  # noqa: E402
from tools.fuzz.generator import FEATURES, Program, programs  # noqa: E402
from tools.fuzz.layered import LayeredProgram, layered_programs  # noqa: E402
from tools.fuzz.oracle import FAILURE, INVALID, check, check_other_inputs  # noqa: E402
from tools.fuzz.run import save  # noqa: E402

FOUND = Path(__file__).resolve().parent / "fuzz_regressions"
HEADER = re.compile(r"# fuzz seed \d+[^:]*: \S.*")  # the seed (its run's options, torch), what failed
OPEN = "# open:"

CI_PROFILE = settings(
    derandomize=True,
    max_examples=120,  # about 16 s; the long profile (above) is the tool's
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


@settings(CI_PROFILE, max_examples=20)
@given(layered_programs())
def test_repeated_layers_sharing_python_state_match_eager_and_reuse_changes_nothing(program):
    """Layer reuse under fuzzing: each program also compares reuse on and off node for node."""
    _check_program(program)


# --------------------------------------------------------------------------
# The generator draws the statements the contract added, in a modest share.

# what some drawn forward must show: one of each group of texts
DRAWN = [("torch.manual_seed(",), ("torch.random.fork_rng(",), ("torch.get_rng_state()", ".get_state()"),
         ("torch.set_rng_state(", ".set_state("), ("torch.Generator().manual_seed(",), ("generator=gen",),
         ("torch.rand_like(", "torch.randn_like("), ("torch.bernoulli(", "bernoulli_("), ("dropout(",),
         ("torch.randn(", "torch.rand("), ("normal_(", "uniform_("),
         ("torch._C._set_grad_enabled(",), ("= torch.is_grad_enabled()",), ("if ",), (".item() > 0.5",), (" else ",)]


def _drawn(n: int, **kw) -> list[Program]:
    drawn = []

    @settings(derandomize=True, max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(programs(**kw))
    def one(program):
        drawn.append(program)
        assert Program.from_source(program.source).source == program.source  # prints as it replays

    one()
    return drawn


def test_generator_draws_random_state_switches_and_branches_in_a_modest_share():
    drawn = _drawn(400)
    for feature in FEATURES:
        share = sum(feature in p.features for p in drawn) / len(drawn)
        assert 0.04 <= share <= 0.3, f"{feature}: {share:.0%} of the programs"
    plain = sum(not p.features for p in drawn) / len(drawn)
    assert plain >= 0.5, f"{plain:.0%} of the programs without the new statements"


def test_generator_draws_each_form():
    forwards = ["\n".join(p.forward_lines) for p in _drawn(200, features=FEATURES)]
    missing = [texts for texts in DRAWN if not any(t in f for t in texts for f in forwards)]
    assert not missing, f"never drawn: {missing}"
    switched = [line for f in forwards for line in f.splitlines()
                if re.match(r" {12,}torch\.(_C\._)?set_grad_enabled\(", line)]
    assert switched, "no bare switch inside a block"


# --------------------------------------------------------------------------
# The oracle sees what these programs can get wrong: the generator and the
# grad mode the call leaves, and other inputs of a branching program.

class _Times2(torch.nn.Module):
    def forward(self, x):
        return x * 2


class _SeedsAtTheEnd(_Times2):
    def forward(self, x):
        y = x * 2
        torch.manual_seed(3)
        return y


class _SwitchesOff(_Times2):
    def forward(self, x):
        y = x * 2
        torch.set_grad_enabled(False)
        return y


class _Branches(_Times2):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x * 3


def _export_times2(module, *args, **kwargs):
    return predispatch.export_predispatch(_Times2(), *args, **kwargs)


@pytest.mark.parametrize("module, message", [(_SeedsAtTheEnd, "random generator after the call"),
                                             (_SwitchesOff, "grad mode after the call")])
def test_a_program_leaving_another_generator_or_grad_mode_fails(module, message):
    with pytest.raises(AssertionError, match=message):
        assert_matches_eager(module(), (torch.ones(2),), export=_export_times2)


def test_a_program_not_checking_a_branch_fails_on_inputs_that_take_another():
    x = torch.ones(3, 4)
    ep = predispatch.export_predispatch(_Branches(), (x,), data_dependent="specialize")
    seen = check_other_inputs(_Branches(), (x,), ep, seeds=range(2, 20))
    assert seen.kept == 1 and seen.flipped_raised == 1
    unchecked = predispatch.export_predispatch(_Times2(), (x,))  # takes the example's branch, no check
    with pytest.raises(AssertionError, match="take another branch in eager; the program did not raise"):
        check_other_inputs(_Branches(), (x,), unchecked, seeds=range(2, 20))


# --------------------------------------------------------------------------
# The programs the fuzzer found, replayed from their data files.

def _found(folder: Path) -> list:
    """A case per data file, a strict xfail where marked open."""
    cases = []
    for path in sorted(folder.glob("*.py")):
        mark = next((line for line in path.read_text().splitlines()[:2] if line.startswith(OPEN)), None)
        marks = [pytest.mark.xfail(strict=True, reason=mark[len(OPEN):].strip())] if mark else []
        cases.append(pytest.param(path, marks=marks, id=path.stem))
    return cases


def _replay(path: Path) -> None:
    text = path.read_text()
    program = (LayeredProgram if "class Layer(nn.Module)" in text else Program).from_source(text)
    outcome = check(program)
    assert outcome.status != INVALID, f"{path.name}: eager raises on it now ({outcome.reason}): stale?"
    if outcome.status == FAILURE:
        raise AssertionError(f"{path.name}: {outcome.reason}\n{outcome.detail}")


@pytest.mark.parametrize("path", _found(FOUND))
def test_found_program_matches_eager_or_is_refused(path):
    _replay(path)


def test_found_programs_name_their_seed_and_failure():
    for path in FOUND.glob("*.py"):
        first = path.read_text().splitlines()[0]
        assert HEADER.fullmatch(first), f"{path.name}: first line not '# fuzz seed N: <what failed>': {first}"


def test_a_saved_failure_is_a_data_file_replayed_as_an_open_bug(tmp_path):
    source = ("class M(nn.Module):\n    def forward(self, x):\n        torch.set_grad_enabled(False)\n"
              "        v0 = x * 2.0\n        if v0.sum() > 0:\n            v0.add_(1.0)\n        return v0\n")
    program = Program.from_source(source)
    [path] = save(str(tmp_path), 9999, {"mismatch: output": program})
    [case] = _found(tmp_path)
    assert path.read_text().startswith("# fuzz seed 9999: mismatch: output\n# open: ")
    assert [m.name for m in case.marks] == ["xfail"] and case.marks[0].kwargs["strict"]
    _replay(path)  # matches eager: an open bug fixed, its strict xfail would say so
