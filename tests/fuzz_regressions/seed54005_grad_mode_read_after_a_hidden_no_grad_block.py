# fuzz seed 54005: mismatch: grad mode after the call (a grad-mode read after a library call's hidden no_grad block)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("s", torch.zeros(4))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        torch.nn.init.constant_(self.s, 0.5)
        prev0 = torch.is_grad_enabled()
        torch.set_grad_enabled(prev0)
        v0 = self.n * 0.5
        return v0


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)

