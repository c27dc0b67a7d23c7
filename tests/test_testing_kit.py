"""predispatch.testing: the eager-comparison helpers themselves."""
import pytest
import torch

from predispatch.testing.eager import Run, assert_matches_eager, assert_runs_match


class ReturnsALabel(torch.nn.Module):
    def forward(self, x):
        return x * 2, "label"


def test_non_tensor_outputs_are_compared_with_eq():
    assert_matches_eager(ReturnsALabel(), (torch.randn(2),))


def _run(*outputs, require_grad=None, layouts=None, sharing=(), rng_state=None):
    return Run(outputs=list(outputs), input_grads=[], param_grads={}, params={}, buffers={},
               inputs_after=[], outputs_with_history=require_grad or [False] * len(outputs),
               layouts_after=layouts or {}, storage_sharing=list(sharing),
               rng_state_after=torch.get_rng_state() if rng_state is None else rng_state)


def test_a_different_generator_state_after_the_call_fails():
    torch.manual_seed(0)
    before = torch.get_rng_state()
    torch.rand(1)
    with pytest.raises(AssertionError, match="random generator after the call"):
        assert_runs_match(_run(rng_state=before), _run(rng_state=torch.get_rng_state()))


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


def test_an_input_left_with_other_strides_fails():
    eager = _run(layouts={"input 0": ((4, 3), (1, 4), 0)})
    with pytest.raises(AssertionError, match="stride"):
        assert_runs_match(eager, _run(layouts={"input 0": ((4, 3), (3, 1), 0)}))


def test_inputs_left_sharing_another_storage_fail():
    layouts = {"input 0": ((2,), (1,), 0), "input 1": ((2,), (1,), 0)}
    eager = _run(layouts=layouts, sharing=[["input 0", "input 1"]])
    with pytest.raises(AssertionError, match="share a storage"):
        assert_runs_match(eager, _run(layouts=layouts, sharing=[]))
