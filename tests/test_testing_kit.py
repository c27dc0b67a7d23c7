"""predispatch.testing: the eager-comparison helpers themselves."""
import pytest
import torch

from predispatch.testing.eager import (Run, assert_matches_eager, assert_runs_match, fresh_inputs_with_history,
                                      run_module)


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


def test_inputs_with_history_are_non_leaves_sharing_memory_as_given():
    base = torch.randn(4, 4)
    left = base[:, :2]
    (args, _), roots = fresh_inputs_with_history((left, base[:, 2:], left), None, True)
    a, b, c = args
    assert c is a and len(roots) == 1 and roots[0].is_leaf
    assert not a.is_leaf and a.requires_grad and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    assert (a.stride(), b.storage_offset()) == ((4, 1), 2) and torch.equal(b, base[:, 2:])


class TransposesFirst(torch.nn.Module):
    def forward(self, x, y):
        x.transpose_(1, 0)
        return x + y


class TransposesFirstKeepingItsHistory(torch.nn.Module):
    """A program's bug, by hand: the caller's tensor relaid, its grad_fn the old one."""

    def forward(self, x, y):
        with torch.no_grad():
            x.transpose_(1, 0)
        return x + y


def test_an_input_left_with_its_old_history_fails():
    args = (torch.randn(3, 3), torch.randn(3, 3))
    runs = [run_module(m, args, None, inputs_with_history=True) for m in (TransposesFirst(),
                                                                           TransposesFirstKeepingItsHistory())]
    assert runs[0].outputs_require_grad == runs[1].outputs_require_grad == [True]
    with pytest.raises(AssertionError, match="gradient of leaf 0"):
        assert_runs_match(*runs)


class ViewMadeToRequireGrad(torch.nn.Module):
    def forward(self, x):
        return x.view(-1).requires_grad_()


def test_a_view_made_to_require_grad_has_a_history():
    run = run_module(ViewMadeToRequireGrad(), (torch.randn(2, 2),), None, inputs_require_grad=False)
    assert run.outputs_with_history == [True]
