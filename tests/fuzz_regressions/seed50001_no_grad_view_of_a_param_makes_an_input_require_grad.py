# fuzz seed 50001: mismatch: which inputs require grad after the call
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)
        self.register_buffer("s", torch.zeros(4))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            v0 = self.w.float()
            v0.mul_(0.9).add_(v0, alpha=0.1)
            v0[1:] = self.s
            v1 = v0[0]
        with torch.no_grad():
            v2 = self.p @ self.w
        v3 = v1.sum(0)
        v4 = self.lin(v1)
        v3.add_(self.n)
        x.add_(v3)
        v5 = v0.view(-1)
        return v5


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
