"""Every aten in-place op of torch's OpInfo database, exported and compared with eager.

    python tools/inplace_sweep.py                 # the full sweep: every op, every case
    python tools/inplace_sweep.py --only add_,eq_ # some ops (their in-place names)
    python tools/inplace_sweep.py --profile fast  # what CI runs (one case per op)

For each OpInfo of ``op_db`` with an ``inplace_variant``, float32 on the CPU,
its first sample that eager runs in place: the in-place op applied, inside a
``no_grad`` block or in grad mode, to an intermediate (``y = x * 1.0``) or to
a user input, and checked with :func:`predispatch.testing.eager.assert_matches_eager`
(outputs and which require grad, gradients, inputs, parameters and buffers
afterwards, under grad mode on and off, re-export stable). A case eager
itself refuses (an in-place op on a leaf that requires grad, a sample whose
result does not fit in place) is skipped; an ``ExportError`` is a refusal;
anything else is a failure. Prints one line per failure and the counts.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import sys
import time
import traceback
import warnings

import torch
import torch.utils._pytree as pytree

import predispatch
from predispatch.testing.eager import assert_matches_eager, run_module

CONTEXTS = ("no_grad", "grad")
TARGETS = ("intermediate", "input")
MATCHED, REFUSED, FAILED, SKIPPED = "matched", "refused", "failed", "skipped"


@dataclasses.dataclass(frozen=True)
class Case:
    op: str  # the in-place variant's name, with the OpInfo's variant if any (add_, linalg.norm_)
    context: str  # "no_grad" | "grad"
    target: str  # "intermediate" | "input"

    @property
    def name(self) -> str:
        return f"{self.op}-{self.context}-{self.target}"


class InPlace(torch.nn.Module):
    """``target`` updated in place by ``op`` with the sample's other arguments;
    tensors among them are inputs of the forward (they may require grad)."""

    def __init__(self, op, spec, context: str, target: str):
        super().__init__()
        self.op, self.spec, self.context, self.target = op, spec, context, target

    def forward(self, x, *tensors):
        args, kwargs = pytree.tree_unflatten(_fill(self.spec, tensors), self.spec[1])
        y = x * 1.0 if self.target == "intermediate" else x
        block = torch.no_grad() if self.context == "no_grad" else contextlib.nullcontext()
        with block:
            self.op(y, *args, **kwargs)
        return y


def _fill(spec, tensors):
    """The sample's flat argument leaves, tensors taken from the forward's."""
    leaves, it = list(spec[0]), iter(tensors)
    return [next(it) if isinstance(v, _TensorSlot) else v for v in leaves]


class _TensorSlot:
    """Where a tensor of the sample's arguments goes."""


def _split(sample) -> tuple[tuple, list]:
    """(spec: (leaves with tensors as slots, treespec), the tensors)."""
    leaves, treespec = pytree.tree_flatten((tuple(sample.args), dict(sample.kwargs)))
    tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
    slots = [_TensorSlot() if isinstance(v, torch.Tensor) else v for v in leaves]
    return (slots, treespec), tensors


def inplace_opinfos():
    """(name, OpInfo) of every OpInfo with an in-place variant, float32 on the CPU."""
    from torch.testing._internal.common_methods_invocations import op_db

    seen = set()
    for info in op_db:
        if info.inplace_variant is None or torch.float32 not in info.supported_dtypes("cpu"):
            continue
        name = info.name.replace(".", "_") + (f"_{info.variant_test_name}" if info.variant_test_name else "") + "_"
        if name not in seen:
            seen.add(name)
            yield name, info


def _eager_runs(module, args, inputs_require_grad) -> bool:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for grad_mode in (True, False):
                run_module(copy.deepcopy(module), args, None, grad_mode=grad_mode,
                           inputs_require_grad=inputs_require_grad)
        return True
    except Exception:
        return False


def build(info, case: Case, samples: int = 8):
    """(module, args, inputs_require_grad) of the first sample eager runs, or None."""
    torch.manual_seed(0)
    inputs_require_grad = not (case.context == "grad" and case.target == "input")  # else eager refuses
    try:
        sample_iter = info.sample_inputs("cpu", torch.float32, requires_grad=False)
        candidates = [s for _, s in zip(range(samples), sample_iter)]
    except Exception:
        return None
    for sample in candidates:
        if not isinstance(sample.input, torch.Tensor):
            continue
        spec, tensors = _split(sample)
        module = InPlace(info.inplace_variant, spec, case.context, case.target)
        args = (sample.input.detach().clone(), *[t.detach().clone() for t in tensors])
        if _eager_runs(module, args, inputs_require_grad):
            return module, args, inputs_require_grad
    return None


@contextlib.contextmanager
def _unseeded_wrappers():
    """OpInfo's random ops re-seed inside their lambdas (``wrapper_set_seed``),
    which an export refuses; the comparison seeds each run itself."""
    from torch.testing._internal import common_methods_invocations as db

    wrapper = db.wrapper_set_seed
    db.wrapper_set_seed = lambda op, *args, **kwargs: op(*args, **kwargs)
    try:
        yield
    finally:
        db.wrapper_set_seed = wrapper


def run_case(info, case: Case) -> tuple[str, str]:
    """(status, detail) of one case."""
    with _unseeded_wrappers():
        return _run_case(info, case)


def _run_case(info, case: Case) -> tuple[str, str]:
    built = build(info, case)
    if built is None:
        return SKIPPED, "eager refuses every sample tried"
    module, args, inputs_require_grad = built
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            assert_matches_eager(module, args, inputs_require_grad=inputs_require_grad,
                                 rtol=1e-4, atol=1e-5)
        except predispatch.ExportError as e:
            return REFUSED, str(e).splitlines()[0]
        except Exception as e:
            return FAILED, f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"
    return MATCHED, ""


def cases(profile: str, only=None):
    """(OpInfo, Case) pairs: ``full`` every context and target; ``fast`` one
    case per op, rotating through the four."""
    combos = [Case("", c, t) for c in CONTEXTS for t in TARGETS]
    for i, (name, info) in enumerate(inplace_opinfos()):
        if only and name not in only:
            continue
        chosen = combos if profile == "full" else [combos[i % len(combos)]]
        for combo in chosen:
            yield info, dataclasses.replace(combo, op=name)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=("full", "fast"), default="full")
    parser.add_argument("--only", default="", help="comma-separated in-place op names (add_,eq_)")
    parser.add_argument("--traceback", action="store_true", help="print each failure's traceback")
    options = parser.parse_args(argv)
    torch.set_num_threads(1)
    only = set(filter(None, options.only.split(",")))
    counts: dict[tuple[str, str], int] = {}
    start = time.perf_counter()
    for info, case in cases(options.profile, only):
        try:
            status, detail = run_case(info, case)
        except Exception:
            status, detail = FAILED, "crash: " + traceback.format_exc().strip().splitlines()[-1]
        key = (case.context, case.target)
        counts[(status, *key)] = counts.get((status, *key), 0) + 1
        if status in (FAILED, REFUSED):
            print(f"{status.upper():8s} {case.name}: {detail}", flush=True)
    print(f"\n{time.perf_counter() - start:.0f} s")
    for context in CONTEXTS:
        for target in TARGETS:
            row = {s: counts.get((s, context, target), 0) for s in (MATCHED, REFUSED, FAILED, SKIPPED)}
            ran = row[MATCHED] + row[REFUSED] + row[FAILED]
            print(f"{context:8s} {target:13s} matched {row[MATCHED]:4d} / {ran:4d}   refused {row[REFUSED]:3d}"
                  f"   failed {row[FAILED]:3d}   skipped (eager refuses) {row[SKIPPED]:3d}")
    return 1 if any(s == FAILED for s, *_ in counts) else 0


if __name__ == "__main__":
    sys.exit(main())
