"""Every aten in-place op of torch's OpInfo database, exported and compared
with eager (``tools/inplace_sweep.py``): here its fast profile, one case per
op (inside no_grad or in grad mode, on an intermediate or a user input, in
turn); ``python tools/inplace_sweep.py`` runs all four cases of each."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools
from tools import inplace_sweep  # noqa: E402

CASES = list(inplace_sweep.cases("fast"))


@pytest.mark.parametrize("info, case", CASES, ids=[case.name for _, case in CASES])
def test_in_place_op_matches_eager(info, case):
    status, detail = inplace_sweep.run_case(info, case)
    if status == inplace_sweep.SKIPPED:
        pytest.skip(detail)
    assert status == inplace_sweep.MATCHED, detail
