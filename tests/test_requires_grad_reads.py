"""A Python branch on ``requires_grad`` (an input's, a parameter's, a tensor's
made from them) is traced as the example's tensors took it; a call whose
tensors would take another path raises, naming the line, where it computed
otherwise than eager, silently (program/requires_grad_calls.py)."""
import copy
import inspect
import os

import pytest
import torch

import predispatch
from predispatch.downstream.training import CallNotSupportedError
from predispatch.ir.program_meta import program_meta
from predispatch.program.printing import format_program
from predispatch.testing.eager import assert_runs_match, run_module


class BranchesOnRequiresGrad(torch.nn.Module):
    """Scales only what will be differentiated, as a memory-saving path might."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        if x.requires_grad:
            return (x * self.w).sum()
        h = x.detach() * self.w
        if h.requires_grad:  # the parameter's flag decides
            return h.sum() * 2
        return h.sum() * 3


def _line(text: str) -> str:
    lines, first = inspect.getsourcelines(BranchesOnRequiresGrad)
    return f"{os.path.basename(__file__)}:{first + next(i for i, line in enumerate(lines) if text in line)}"


def _exported(requires_grad: bool):
    torch.manual_seed(0)
    module = BranchesOnRequiresGrad()
    x = torch.randn(3, requires_grad=requires_grad)
    return module, predispatch.export_predispatch(copy.deepcopy(module), (x,))


@pytest.mark.parametrize("requires_grad", [False, True])
def test_calls_like_the_example_match_eager(requires_grad):
    module, ep = _exported(requires_grad)
    x = torch.randn(3)
    assert_runs_match(run_module(copy.deepcopy(module), (x,), None, inputs_require_grad=requires_grad),
                      run_module(copy.deepcopy(ep.module()), (x,), None, inputs_require_grad=requires_grad))


def test_a_call_that_would_branch_otherwise_raises_naming_the_line():
    _, ep = _exported(False)
    with pytest.raises(RuntimeError, match=rf"read requires_grad at .*{_line('if x.requires_grad')}.* answered False, "
                                           r"this call's \(input:0\) answer True"):
        ep.module()(torch.randn(3, requires_grad=True))


def test_a_parameter_frozen_after_the_export_is_checked_where_read():
    _, ep = _exported(False)
    frozen = ep.module()
    frozen.w.requires_grad_(False)  # eager's h then does not require grad: another branch
    with pytest.raises(RuntimeError, match=rf"{_line('if h.requires_grad')}.*\(param:w\) answer False"):
        frozen(torch.randn(3))


def test_compile_training_checks_each_kind_of_call():
    _, ep = _exported(False)
    train = predispatch.compile_training(ep)
    train(torch.randn(3)).backward()
    with pytest.raises(CallNotSupportedError, match="read requires_grad at"):
        train(torch.randn(3, requires_grad=True))


def test_the_check_survives_exporting_again_and_save_and_load(tmp_path):
    _, ep = _exported(False)
    again = predispatch.export_predispatch(ep.module(), (torch.randn(3),))
    assert format_program(again) == format_program(ep)  # G7
    assert program_meta(again)["requires_grad_reads"] == program_meta(ep)["requires_grad_reads"]
    torch.export.save(ep, tmp_path / "p.pt2")
    loaded = predispatch.load(tmp_path / "p.pt2")  # (a plain torch.export.load runs no check of ours)
    with pytest.raises(RuntimeError, match="read requires_grad at"):
        loaded.module()(torch.randn(3, requires_grad=True))


class ReadsAMadeToRequireGradTensor(torch.nn.Module):
    def forward(self, x):
        y = x.detach().requires_grad_()  # requires grad whatever the call's x
        return x * 2 if y.requires_grad else x * 3


def test_a_read_no_call_can_change_is_not_checked():
    ep = predispatch.export_predispatch(ReadsAMadeToRequireGradTensor(), (torch.randn(3),))
    assert "requires_grad_reads" not in program_meta(ep)
    x = torch.randn(3, requires_grad=True)
    torch.testing.assert_close(ep.module()(x), x * 2)
