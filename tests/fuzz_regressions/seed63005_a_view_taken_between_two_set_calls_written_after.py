# fuzz seed 63005: mismatch: params (now refused)
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
        self.register_buffer("s", torch.zeros(4))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, z):
        v0 = self.n + self.lin.bias
        v0.set_(self.s)
        v1 = v0.view(-1)
        v0.set_(self.lin.bias)
        v1.add_(v0)
        return z


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)

