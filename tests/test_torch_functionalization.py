"""PyTorch's functionalization tests (test/test_functionalization.py), each
test's function as a module (tests/torch_functionalization_cases.py), run
through predispatch against eager: views of one base written, diagonal,
slice and as_strided writes, resize_, set_, out= ops, input mutations.

Each case runs with no input requiring grad and with floating inputs that
require grad through a history (as AOTAutograd's tests make them), under
grad mode on and off: ``assert_matches_eager`` in the modes eager runs (an in-place
update of a leaf that requires grad raises in eager: not a test of ours).
A case no program can reproduce is refused, with its message (``REFUSED``).
"""
import pytest
import torch

import predispatch
import torch_functionalization_cases as ported
from predispatch.testing.eager import assert_matches_eager, run_module

# torch test -> what the refusal says (each no functional program reproduces)
REFUSED = {
    "test_set_": r"set_\.source_Storage .* y\.set_\(x\.storage\(\)\)",  # a storage, not a tensor
    "test_mixed_wrappers_invalid": "neither a parameter, a buffer nor an input",
    "test_mutation_overlapping_mem": "internal overlap",  # the order of writes to one element
    "test_mutable_op_not_inplace_or_other": "writes two of its arguments that share memory",
    "test_resize_larger_invalid": "grows memory other tensors share",
}
CONFIGS = {"no grad": dict(inputs_require_grad=False), "history": dict(inputs_with_history=True)}


def _floating(args) -> bool:
    return any(isinstance(a, torch.Tensor) and a.is_floating_point() for a in torch.utils._pytree.tree_leaves(args))


def _modes_eager_runs(case, args, options) -> tuple:
    modes = []
    for grad_mode in (True, False):
        try:
            run_module(case.make(), args, None, grad_mode=grad_mode, **options)
            modes.append(grad_mode)
        except RuntimeError:
            pass
    return tuple(modes)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", ported.CASES, ids=[c.name for c in ported.CASES])
def test_torch_functionalization_case(case, config):
    options = dict(CONFIGS[config])
    if config != "no grad":
        options.setdefault("inputs_require_grad", case.grad)
    for args in case.arg_sets:
        if config != "no grad" and not _floating(args):
            continue
        modes = _modes_eager_runs(case, args, options)
        if case.name in REFUSED:
            with pytest.raises(predispatch.ExportError, match=REFUSED[case.name]):
                assert_matches_eager(case.make(), args, grad_modes=modes or (True,), **options)
        elif modes:
            assert_matches_eager(case.make(), args, grad_modes=modes, **options)
