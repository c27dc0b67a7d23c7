# fuzz seed 59002: mismatch: param_grads
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

    def forward(self, x):
        v0 = x.detach().requires_grad_()
        with torch.no_grad():
            v0.set_(self.lin.weight)
        v2 = v0.detach()
        v2.mul_(0.9).add_(v2, alpha=0.1)
        return v0


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)

