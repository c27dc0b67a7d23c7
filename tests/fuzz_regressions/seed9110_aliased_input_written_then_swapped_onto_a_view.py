# fuzz seed 9110: mismatch: input after the call
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, y, z):
        v0 = z[0]
        z.mul_(2.0)
        y.set_(v0)
        return self.n


def test_repro():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 4, generator=g)
    args = (y, y[1],)
    assert_matches_eager(M(), args, inputs_require_grad=False)

