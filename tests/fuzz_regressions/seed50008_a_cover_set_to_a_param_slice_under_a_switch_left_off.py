# fuzz seed 50008: mismatch: gradient of input
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)

    def forward(self, x, z):
        torch._C._set_grad_enabled(False)
        v0 = self.w[1:]
        x.set_(v0)
        return z


def test_repro():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g)
    args = (x, x[0],)
    assert_matches_eager(M(), args, inputs_require_grad=True)

