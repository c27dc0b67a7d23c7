# fuzz seed 60024: AssertionError: [..] which outputs require grad (with a history leading to a leaf): eager [..], program [..]
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)

    def forward(self, x):
        with torch.set_grad_enabled(True):
            v1 = self.w @ self.w
            v2 = v1[0]
        v1.mul_(0)
        v2.mul_(0.9).add_(v2, alpha=0.1)
        with torch.set_grad_enabled(True):
            v3 = torch.tanh(v2)
        return v3


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
