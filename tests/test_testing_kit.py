"""predispatch.testing: the eager-comparison helpers themselves."""
import pytest
import torch

from predispatch.testing.eager import Run, assert_matches_eager, assert_runs_match


class ReturnsALabel(torch.nn.Module):
    def forward(self, x):
        return x * 2, "label"


def test_non_tensor_outputs_are_compared_with_eq():
    assert_matches_eager(ReturnsALabel(), (torch.randn(2),))


def _run(*outputs, require_grad=None):
    return Run(outputs=list(outputs), input_grads=[], param_grads={}, params={}, buffers={},
               inputs_after=[], outputs_with_history=require_grad or [False] * len(outputs))


@pytest.mark.parametrize("eager, exported", [
    (_run(torch.ones(2), "label"), _run(torch.ones(2), "other")),
    (_run(torch.float32), _run(torch.bfloat16)),
    (_run("1"), _run(1)),
    (_run(1), _run("1")),
])
def test_a_different_non_tensor_output_fails(eager, exported):
    with pytest.raises(AssertionError, match="output"):
        assert_runs_match(eager, exported)


def test_an_output_that_lost_its_history_fails():
    eager = _run(torch.ones(2), require_grad=[True])
    with pytest.raises(AssertionError, match="require grad"):
        assert_runs_match(eager, _run(torch.ones(2), require_grad=[False]))
