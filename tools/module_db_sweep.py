"""Every module of torch's ModuleInfo database, exported and compared with eager.

    python tools/module_db_sweep.py                       # the full sweep: two samples a module, train and eval
    python tools/module_db_sweep.py --only Linear,LSTM    # some modules (their class names)
    python tools/module_db_sweep.py --samples 5           # more samples a module
    python tools/module_db_sweep.py --profile fast        # what CI runs (one sample; eval only where it differs)
    python tools/module_db_sweep.py --json sweep.json     # the per-case records too
    python tools/module_db_sweep.py --example-requires-grad  # export with inputs requiring grad, as called

For each ModuleInfo of ``module_db`` that supports float32 on the CPU, its
first samples (``module_inputs_func(..., requires_grad=True, training=...)``)
in train and in eval mode: the module built from the sample's constructor
input (after ``torch.manual_seed(0)``, so runs are reproducible; a lazy
module materialized by one call under ``no_grad``, as a user's first batch
would), put in the mode, and checked with
:func:`predispatch.testing.eager.assert_matches_eager` on the sample's
forward input (outputs and which require grad, gradients of inputs and
parameters, buffers and inputs afterwards, torch's generator afterwards:
eager and the program draw from one seed, so dropout is compared too;
under grad mode on and off, re-export stable). The inputs that require grad
in the calls are the sample's; the export's example inputs require none
(assert_matches_eager's way), or the same with ``--example-requires-grad``
(a forward that reads ``requires_grad`` holds the example's answer and
refuses a call answering otherwise: ``RequiresGradCallError``, a failure).

Each case ends as ``matched``, ``refused`` (an ``ExportError``: its first
line), ``failed`` (the program differs from eager, or the export raised
something else), ``timeout`` (over ``--timeout`` s of CPU time) or
``skipped`` (eager itself does not run the sample, or the sample holds an
input the export cannot take: no forward input, a sparse or nested tensor).
For a refusal or a failure the sweep also says whether
``torch.export.export(..., strict=False)`` exports the module (a case it
fails too is less urgent). Prints one line per failure and refusal, the
counts, and the refusals grouped by reason.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import functools
import io
import logging
import numbers
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.utils._pytree as pytree

import predispatch
from predispatch.testing.eager import assert_matches_eager, fresh_inputs, run_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools.sweep_common
from tools.sweep_common import (  # noqa: E402
    Result, first_line, time_limit, timed_out, write_json)

MODES = ("train", "eval")
MATCHED, REFUSED, FAILED, TIMEOUT, SKIPPED = "matched", "refused", "failed", "timeout", "skipped"
STATUSES = (MATCHED, REFUSED, FAILED, TIMEOUT, SKIPPED)
RTOL, ATOL = 1e-4, 1e-5  # float32 composites reassociate sums (layer_norm, attention)
# leaves a forward input may hold besides tensors (export specializes on them)
PLAIN = (numbers.Number, str, type(None), torch.dtype, torch.device, torch.Size)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # the module's class name (and the ModuleInfo's position where two share one)
    mode: str  # "train" | "eval"
    sample: int  # the sample's position in module_inputs_func's list
    source: str = "module_db"

    @property
    def name(self) -> str:
        return f"{self.model}:{self.mode}:{self.sample}"


def module_infos(only=None):
    """(name, ModuleInfo) of every ModuleInfo supporting float32 on the CPU;
    a class with two ModuleInfos gets its position after the second."""
    from torch.testing._internal.common_modules import module_db

    seen = collections.Counter()
    for info in module_db:
        cls = info.module_cls.__name__
        seen[cls] += 1
        if (only and cls not in only) or torch.float32 not in info.supported_dtypes("cpu"):
            continue
        yield (cls if seen[cls] == 1 else f"{cls}#{seen[cls]}"), info


@functools.lru_cache(maxsize=2)  # a case takes one of up to ~900 samples (LinearCrossEntropyLoss)
def samples(info, training: bool) -> list:
    """The ModuleInfo's samples, float32 on the CPU, the same every run
    (each case runs on copies: a module or its inputs never change them)."""
    torch.manual_seed(0)
    return list(info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=True,
                                        training=training))


def unfeedable(sample) -> str:
    """'' if the export can take the sample's forward input, else why not."""
    if sample.forward_input is None:
        return "no forward input"
    for leaf in pytree.tree_leaves((sample.forward_input.args, sample.forward_input.kwargs)):
        if isinstance(leaf, torch.Tensor):
            if leaf.layout != torch.strided or leaf.is_nested:
                return f"a {leaf.layout} tensor input"
        elif not isinstance(leaf, PLAIN):
            return f"an input of type {type(leaf).__name__}"
    return ""


def build(info, sample, training: bool):
    """(module in the mode, args, kwargs, which flat inputs require grad)."""
    args, kwargs = tuple(sample.forward_input.args), dict(sample.forward_input.kwargs)
    torch.manual_seed(0)
    constructor = sample.constructor_input
    module = info.module_cls(*constructor.args, **constructor.kwargs).to(torch.float32)
    module.train(training)
    if info.is_lazy:  # uninitialized parameters take their shapes from a first call
        with torch.no_grad():
            module(*copy.deepcopy(args), **copy.deepcopy(kwargs))
    # per flat input, as fresh_inputs counts them: the sample's own choice
    requires_grad = [isinstance(x, torch.Tensor) and x.requires_grad
                     for x in pytree.tree_leaves((args, kwargs))]
    return module, args, kwargs, requires_grad


def eager_refuses(module, args, kwargs, requires_grad) -> str:
    """'' if eager runs the module (forward and backward) under grad mode on and off, else why not."""
    try:
        for grad_mode in (True, False):
            run_module(copy.deepcopy(module), args, kwargs, grad_mode=grad_mode, inputs_require_grad=requires_grad)
        return ""
    except Exception as e:
        return "eager: " + first_line(e)


def torch_export_outcome(module, args, kwargs, seconds: int) -> str:
    """Does ``torch.export.export(strict=False)`` export the module? 'ok' or its error."""
    try:  # its failures print the partial graph: not this sweep's output
        with time_limit(seconds), contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            torch.export.export(copy.deepcopy(module), *fresh_inputs(args, kwargs, False), strict=False)
        return "ok"
    except Exception as e:
        return "timeout" if timed_out() else "fails: " + first_line(e)


def run_case(info, case: Case, seconds: int = 60, example_requires_grad: bool = False) -> tuple[str, str, dict]:
    """(status, detail, extra) of one case; ``extra`` holds the sample's
    description and, for a refusal or failure, torch.export's outcome.
    ``example_requires_grad``: export with example inputs that require grad
    as the calls' do (else none does, as assert_matches_eager exports)."""
    training = case.mode == "train"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            sample = samples(info, training)[case.sample]
        except Exception as e:
            return SKIPPED, "samples: " + first_line(e), {}
        extra = {"sample": case.sample, "desc": sample.desc}
        why = unfeedable(sample)
        if why:
            return SKIPPED, why, extra
        try:
            built = build(info, sample, training)
        except Exception as e:
            return SKIPPED, "constructor: " + first_line(e), extra
        why = eager_refuses(*built)
        if why:
            return SKIPPED, why, extra
        status, detail = _compare(*built, seconds, example_requires_grad)
        if status in (REFUSED, FAILED):
            extra["torch_export"] = torch_export_outcome(built[0], built[1], built[2], seconds)
        return status, detail, extra


def _export_like_calls(requires_grad):
    """export_predispatch with example inputs that require grad as the calls'
    do: a forward reading ``requires_grad`` (F.linear_cross_entropy's chunked
    path) holds the example's answer, and refuses a call that answers otherwise."""
    def export(module, args, kwargs=None, **options):
        args, kwargs = fresh_inputs(args, kwargs, requires_grad)
        return predispatch.export_predispatch(module, args, kwargs, **options)
    return export


def _compare(module, args, kwargs, requires_grad, seconds: int, example_requires_grad: bool) -> tuple[str, str]:
    export = _export_like_calls(requires_grad) if example_requires_grad else None
    try:
        with time_limit(seconds):
            assert_matches_eager(module, args, kwargs, export=export, inputs_require_grad=requires_grad,
                                 rtol=RTOL, atol=ATOL)
    except predispatch.ExportError as e:
        return REFUSED, str(e).strip().splitlines()[0] if str(e).strip() else ""
    except Exception as e:  # a CaseTimeout, or another error the alarm's code raised in its place
        return (TIMEOUT, f"over {seconds} s of CPU time") if timed_out() else (FAILED, first_line(e))
    return MATCHED, ""


def cases(profile: str, only=None, count: int | None = None):
    """(ModuleInfo, Case) pairs: ``full`` the first ``count`` (2) samples in
    train and eval mode; ``fast`` the first sample in train mode, and in eval
    mode too where the ModuleInfo says the modes differ."""
    count = count or (2 if profile == "full" else 1)
    for name, info in module_infos(only):
        modes = MODES if profile == "full" or info.train_and_eval_differ else ("train",)
        for mode in modes:
            try:
                made = len(samples(info, mode == "train"))
            except Exception:
                made = 1  # run_case says why it cannot make them
            for i in range(min(count, made)):
                yield info, Case(name, mode, i)


def print_summary(results: list, seconds: float) -> None:
    print(f"\n{len(results)} cases in {seconds:.0f} s")
    for mode in MODES:
        row = collections.Counter(r.status for r in results if r.case.mode == mode)
        print(f"{mode:6s}" + "".join(f"  {s} {row[s]:4d}" for s in STATUSES))
    total = collections.Counter(r.status for r in results)
    print("total " + "".join(f"  {s} {total[s]:4d}" for s in STATUSES))
    reasons = collections.Counter(r.detail for r in results if r.status == REFUSED)
    for reason, n in reasons.most_common():
        cases = ", ".join(r.case.name for r in results if r.status == REFUSED and r.detail == reason)
        print(f"REFUSED x{n}: {reason}\n    {cases}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("full", "fast"), default="full")
    parser.add_argument("--only", default="", help="comma-separated module class names (Linear,LSTM)")
    parser.add_argument("--samples", type=int, default=None, help="samples per module and mode (full: 2, fast: 1)")
    parser.add_argument("--timeout", type=int, default=60, help="CPU seconds per case")
    parser.add_argument("--example-requires-grad", action="store_true",
                        help="export with example inputs that require grad as the calls' do")
    parser.add_argument("--json", default="", help="write the per-case records here")
    parser.add_argument("--traceback", action="store_true", help="print each crash's traceback")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    # an unbacked symbol's "unable to find user code": a refusal's message says where
    logging.getLogger("torch.fx.experimental.symbolic_shapes").setLevel(logging.ERROR)
    only = set(filter(None, options.only.split(",")))
    results, start = [], time.perf_counter()
    for info, case in cases(options.profile, only, options.samples):
        began = time.perf_counter()
        try:
            status, detail, extra = run_case(info, case, options.timeout, options.example_requires_grad)
        except Exception:  # the sweep's own fault: recorded, the sweep goes on
            if options.traceback:
                traceback.print_exc()
            status, detail, extra = FAILED, "crash: " + traceback.format_exc().strip().splitlines()[-1], {}
        results.append(Result(case, status, detail, time.perf_counter() - began, extra=extra))
        if status in (FAILED, REFUSED, TIMEOUT):
            beside = f"  [torch.export {extra['torch_export']}]" if "torch_export" in extra else ""
            print(f"{status.upper():8s} {case.name}: {detail}{beside}", flush=True)
    seconds = time.perf_counter() - start
    print_summary(results, seconds)
    if options.json:
        write_json(options.json, results, seconds, profile=options.profile, samples=options.samples,
                   example_requires_grad=options.example_requires_grad)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
