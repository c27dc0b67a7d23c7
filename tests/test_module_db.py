"""Every module of torch's ModuleInfo database, exported and compared with
eager (``tools/module_db_sweep.py``): here its fast profile, each module's
first sample in train mode, and in eval mode where the modes differ;
``python tools/module_db_sweep.py`` runs two samples of each in both."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools
from tools import module_db_sweep as sweep  # noqa: E402

CASES = list(sweep.cases("fast"))

# modules no program can hold, refused naming torch's line (torch.export fails on them too)
REFUSED = {
    "GaussianNLLLoss": "data-dependent Python control flow",  # `elif torch.any(var < 0):`
    "CTCLoss": "torch has no fake kernel for its output",  # its output's shape is the targets' values
}


@pytest.mark.parametrize("info, case", CASES, ids=[case.name for _, case in CASES])
def test_module_matches_eager(info, case):
    status, detail, _ = sweep.run_case(info, case)
    if status == sweep.SKIPPED:
        pytest.skip(detail)
    if case.model in REFUSED:
        assert status == sweep.REFUSED and REFUSED[case.model] in detail, (status, detail)
    else:
        assert status == sweep.MATCHED, detail
