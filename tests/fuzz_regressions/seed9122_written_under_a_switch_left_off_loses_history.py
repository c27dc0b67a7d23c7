# fuzz seed 9122 --only random state,bare switches,branches: which outputs require grad: eager [True], program [False] (grad_mode=True)
# open: a bare switch to no_grad left in force at the forward's end, then an in-place write of a tensor with a history (v0 = self.lin.bias * 2.0): eager keeps v0's history (it requires grad), the program's v0 has none. Closed before the end (torch.set_grad_enabled(True) after the write) or as a with no_grad block it matches; v0.mul_(0.9) alone fails too. 2.13 and 2.15.
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)

    def forward(self, y):
        v0 = self.lin.bias * 2.0
        torch.set_grad_enabled(False)
        v0.mul_(0.9).add_(v0, alpha=0.1)
        return v0


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)

