# fuzz seed 53010: AssertionError: which outputs require grad (a caller's-mode write, then a write through a detached alias of it, under a no_grad caller)
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

    def forward(self, x):
        with torch.enable_grad():
            v0 = self.lin.weight + self.s
        v0.mul_(0.9).add_(v0, alpha=0.1)
        v2 = v0.unsqueeze(0)
        v3 = v2.detach()
        v3.add_(2.0)
        return v0


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)
