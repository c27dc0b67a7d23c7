"""Run the differential fuzzer and print a report.

    python -m tools.fuzz.run --examples 1000 --seed 0     # from the repo root
    python -m tools.fuzz.run --replay failure.py --minimize
    python -m tools.fuzz.run --examples 500 --seed 9100 --minimize --save tests/fuzz_regressions
    python -m tools.fuzz.run --shares 2000                # which share of programs shows each feature

Draws N programs (``tools.fuzz.generator.programs``; one in five with
repeated layers sharing Python state, ``tools.fuzz.layered``), checks each against
eager (``tools.fuzz.oracle.check``) and prints: programs generated, valid,
matched, rejected (by reason), invalid (eager raised, by reason), the valid
programs showing each feature (random state, bare switches, branches and
what their other inputs showed) and every failure as a pasteable test plus
its error; with ``--minimize`` also a minimal program for each kind of
failure; with ``--save DIR`` each kind's failure (minimal, where minimized)
written to DIR as a regression data file, marked open
(``tests/test_fuzz.py`` replays them). Exits 1 if anything failed.
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import sys
import time

from hypothesis import HealthCheck, Phase, given, seed, settings

from .generator import FEATURES, Program, programs
from .layered import LayeredProgram, any_programs
from .minimize import minimize
from .oracle import FAILURE, INVALID, MATCHED, REJECTED, check


def fuzz(n: int, seed_value: int, max_statements: int, progress=None, features=None):
    """[(program, outcome)] for ``n`` programs drawn with ``seed_value``
    (with ``features``, each program may draw those of :data:`FEATURES`, and
    no repeated layers)."""
    results = []
    strategy = (any_programs(max_statements=max_statements) if features is None
                else programs(max_statements=max_statements, features=features))

    @seed(seed_value)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False)
    @given(strategy)
    def one(program):
        results.append((program, check(program)))
        if progress is not None:
            progress(len(results), results[-1][1])

    one()
    return results


def _counts(outcomes, status):
    return collections.Counter(o.reason for o in outcomes if o.status == status)


def _print_counts(title, counter):
    print(f"{title}: {sum(counter.values())}")
    for reason, k in counter.most_common():
        print(f"    {k:5d}  {reason}")


def _print_features(results) -> None:
    """Valid programs showing each feature, and how they ended."""
    print("valid programs showing (matched / rejected / failed):")
    for feature in FEATURES:
        ends = collections.Counter(o.status for p, o in results
                                   if o.status != INVALID and feature in getattr(p, "features", ()))
        print(f"    {sum(ends.values()):5d}  {feature} ({ends[MATCHED]} / {ends[REJECTED]} / {ends[FAILURE]})")
    seen = [o.branches for _, o in results if o.branches is not None]
    print(f"    other inputs of {len(seen)} matched branching programs: keeping the branches "
          f"{sum(s.kept for s in seen)} matched eager; taking another {sum(s.flipped_raised for s in seen)} "
          f"raised the check, {sum(s.flipped_matched for s in seen)} matched eager without it")


def shares(n: int, seed_value: int) -> None:
    """The share of ``n`` drawn programs showing each feature (no checks run)."""
    drawn = []

    @seed(seed_value)
    @settings(max_examples=n, phases=[Phase.generate], database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def one(program):
        drawn.append(program.features)

    one()
    for feature in FEATURES:
        k = sum(feature in f for f in drawn)
        print(f"{feature}: {k}/{len(drawn)} ({100 * k / len(drawn):.1f}%)")
    k = sum(bool(f) for f in drawn)
    print(f"any of them: {k}/{len(drawn)} ({100 * k / len(drawn):.1f}%)")


def save(folder: str, seed_value: int, found: dict, only: str | None = None) -> list[pathlib.Path]:
    """Each failure (``{reason: program}``) written to ``folder`` as a data
    file: a header line (the seed, ``--only`` if given, what failed), the
    open mark, the source."""
    out = pathlib.Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for i, (reason, program) in enumerate(found.items()):
        slug = re.sub(r"[^a-z0-9]+", "_", reason.lower()).strip("_")[:48]
        path = out / f"seed{seed_value}_{i + 1}_{slug}.py"
        run = f"{seed_value} --only {only}" if only else f"{seed_value}"
        path.write_text(f"# fuzz seed {run}: {reason}\n# open: found by tools.fuzz.run, not diagnosed yet\n"
                        + program.source)
        written.append(path)
    return written


def _tail(text: str, lines: int) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def report(results, elapsed: float, *, error_lines: int, minimized: dict, refusals: int = 0) -> None:
    outcomes = [o for _, o in results]
    by_status = collections.Counter(o.status for o in outcomes)
    valid = len(outcomes) - by_status[INVALID]
    print("=" * 78)
    print(f"programs generated: {len(results)} ({len({p.source for p, _ in results})} distinct) "
          f"in {elapsed:.1f}s")
    print(f"valid (eager ran):  {valid}")
    print(f"matched:            {by_status[MATCHED]}")
    _print_counts("rejected (ExportError)", _counts(outcomes, REJECTED))
    _print_counts("invalid (eager raised)", _counts(outcomes, INVALID))
    _print_features(results)
    _print_counts("FAILURES", _counts(outcomes, FAILURE))
    failures = [(p, o) for p, o in results if o.status == FAILURE]
    for i, (p, o) in enumerate(failures):
        print("-" * 78)
        print(f"FAILURE {i + 1}/{len(failures)}: {o.reason}")
        print(p.source)
        print(_tail(o.detail, error_lines))
    for i, (p, o) in enumerate([(p, o) for p, o in results if o.status == REJECTED][:refusals]):
        print("-" * 78)
        print(f"REFUSED {i + 1}: {o.detail.strip() or o.reason}")
        print(p.source)
    for reason, p in minimized.items():
        print("-" * 78)
        print(f"MINIMAL program for: {reason}")
        print(p.source)
    print("=" * 78)


def replay(path: str, *, minimize_it: bool) -> int:
    """Check one program given as source (e.g. a failure pasted into a file)."""
    with open(path) as f:
        source = f.read()
    program = (LayeredProgram if "class Layer(nn.Module)" in source else Program).from_source(source)
    outcome = check(program)
    print(f"{outcome.status}: {outcome.reason}" if outcome.reason else outcome.status)
    if outcome.status == FAILURE:
        print(outcome.detail)
        if minimize_it and isinstance(program, Program):
            small = minimize(program, lambda c: (lambda oc: oc.status == FAILURE
                                                 and oc.reason == outcome.reason)(check(c)))
            print("MINIMAL program:")
            print(small.source)
    return 1 if outcome.status == FAILURE else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz.run", description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=200, help="programs to run (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="hypothesis seed (default 0)")
    parser.add_argument("--max-statements", type=int, default=12)
    parser.add_argument("--minimize", action="store_true",
                        help="shrink one failing program per kind of failure")
    parser.add_argument("--error-lines", type=int, default=12,
                        help="traceback lines printed per failure (default 12)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    parser.add_argument("--show-refusals", type=int, default=0, metavar="N",
                        help="print the first N refused programs with their error")
    parser.add_argument("--replay", metavar="FILE",
                        help="check the program in FILE (a printed failure) instead of fuzzing")
    parser.add_argument("--save", metavar="DIR",
                        help="write each kind of failure (minimal, with --minimize) to DIR as a data file, marked open")
    parser.add_argument("--only", metavar="FEATURES",
                        help=f"comma-separated, of {', '.join(FEATURES)}: every program may draw "
                             "these (one statement in four), no other, and no repeated layers")
    parser.add_argument("--shares", type=int, metavar="N",
                        help="draw N programs and print the share showing each feature (no checks)")
    args = parser.parse_args(argv)

    import torch
    torch.set_num_threads(1)  # see TORCH-2.13-NOTES: stalls with 2 threads on small calls

    if args.replay:
        return replay(args.replay, minimize_it=args.minimize)
    if args.shares:
        shares(args.shares, args.seed)
        return 0

    def progress(k, outcome):
        if not args.quiet and (k % 50 == 0 or outcome.status == FAILURE):
            tag = f"  failure: {outcome.reason}" if outcome.status == FAILURE else ""
            print(f"[{k}/{args.examples}] {time.time() - start:.0f}s{tag}", file=sys.stderr, flush=True)

    start = time.time()
    features = None
    if args.only:
        features = [f.strip() for f in args.only.split(",")]
        unknown = set(features) - set(FEATURES)
        if unknown:
            parser.error(f"--only: unknown {sorted(unknown)}; known: {list(FEATURES)}")
    results = fuzz(args.examples, args.seed, args.max_statements, progress, features)
    elapsed = time.time() - start

    minimized = {}
    if args.minimize:
        for p, o in results:
            if o.status == FAILURE and o.reason not in minimized and isinstance(p, Program):
                reason = o.reason
                minimized[reason] = minimize(
                    p, lambda c, r=reason: (lambda oc: oc.status == FAILURE and oc.reason == r)(check(c)))
    report(results, elapsed, error_lines=args.error_lines, minimized=minimized, refusals=args.show_refusals)
    if args.save:
        found = {}
        for p, o in results:
            if o.status == FAILURE and o.reason not in found:
                found[o.reason] = minimized.get(o.reason, p)
        for path in save(args.save, args.seed, found, args.only):
            print(f"written: {path}")
    return 1 if any(o.status == FAILURE for _, o in results) else 0


if __name__ == "__main__":
    sys.exit(main())
