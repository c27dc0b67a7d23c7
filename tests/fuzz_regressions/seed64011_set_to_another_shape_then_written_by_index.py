# fuzz seed 64011: mismatch: outputs_with_history
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

    def forward(self, x):
        self.n.mul_(0.9).add_(self.n, alpha=0.1)
        v0 = self.s.detach().requires_grad_()
        v1 = v0 * 0.5
        with torch.no_grad():
            v1.set_(self.lin.weight)
        v1[:, 0] = v0
        v1.mul_(0.9).add_(v1, alpha=0.1)
        return v1


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
