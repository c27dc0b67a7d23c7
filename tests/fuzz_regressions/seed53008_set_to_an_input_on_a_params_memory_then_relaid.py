# fuzz seed 53008: mismatch: which inputs have a history leading to a leaf after the call (set_() under no_grad to a parameter, relaid in grad mode)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x, y):
        with torch.no_grad():
            y.set_(self.p)
        v0 = y.float()
        x.set_(v0)
        y.unsqueeze_(0)
        v3 = self.w.mean(-1, keepdim=True)
        with torch.set_grad_enabled(False):
            x.mul_(0)
        return v3


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
