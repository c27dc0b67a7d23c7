# fuzz seed 60061: AssertionError: [..] which outputs require grad (with a history leading to a leaf): eager [..], program [..]
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v0 = self.s.detach().requires_grad_()
        v1 = v0[0]
        y = self.w * 2
        v = y[0]
        torch._C._set_grad_enabled(False)
        y.add_(1)
        return (x * 1, v1, v)


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)
