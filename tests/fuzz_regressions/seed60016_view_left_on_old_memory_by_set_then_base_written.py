# fuzz seed 60016: mismatch: param_grads
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)

    def forward(self, x):
        v0 = self.lin.weight * 2.0
        v1 = v0[:, 0]
        with torch.no_grad():
            v0.set_(self.w)
        v0.unsqueeze_(0)
        v0.mul_(x[0])
        return (v1[1:], v1)


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)
