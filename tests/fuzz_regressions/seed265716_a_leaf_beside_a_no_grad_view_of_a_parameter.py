# fuzz seed 265716: mismatch: which outputs require grad (with a history leading to a leaf)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("s", torch.zeros(4))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, y):
        self.n.mul_(0.9).add_(self.n, alpha=0.1)
        v0 = self.lin.bias[1:]
        v1 = self.p[:, 1:3]
        with torch.no_grad():
            y.set_(v1)
        v2 = v0.detach().requires_grad_()
        with torch.inference_mode(False):
            with torch.no_grad():
                x.set_(self.b)
            v3 = v0 - v2
            v3.add_(v0)
            self.b.mul_(self.s)
        return v3


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
