"""Every aten in-place op of torch's OpInfo database, exported and compared
with eager (``tools/inplace_sweep.py``): here its fast profile, one case per
op (inside no_grad or in grad mode, on an intermediate or a user input, in
turn); ``python tools/inplace_sweep.py`` runs all four cases of each."""
import sys
from pathlib import Path

import pytest
import torch

from predispatch.testing.eager import assert_matches_eager

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools
from tools import inplace_sweep  # noqa: E402

CASES = list(inplace_sweep.cases("fast"))


@pytest.mark.parametrize("info, case", CASES, ids=[case.name for _, case in CASES])
def test_in_place_op_matches_eager(info, case):
    status, detail = inplace_sweep.run_case(info, case)
    if status == inplace_sweep.SKIPPED:
        pytest.skip(detail)
    assert status == inplace_sweep.MATCHED, detail


class ComparedInPlace(torch.nn.Module):
    def __init__(self, op, other):
        super().__init__()
        self.op, self.other = op, other

    def forward(self, x):
        y = x * 1
        return getattr(y, self.op)(self.other)


@pytest.mark.parametrize("other", [0, 0.5, torch.tensor(0.5)], ids=["int", "float", "tensor"])
@pytest.mark.parametrize("op", ["ge_", "gt_", "le_", "lt_", "eq_", "ne_"])
def test_an_in_place_comparison_with_a_number_is_its_scalar_overload(op, other):
    """Was refused (torch's test_functionalization test_metadata_change): the
    out-of-place variant was found by argument names only, ge_.Scalar as
    ge.Tensor, which does not take a number."""
    assert_matches_eager(ComparedInPlace(op, other), (torch.tensor([[-1.0, 2.0], [0.5, 3.0]]),))
