# fuzz seed 63002: mismatch: which inputs have a history leading to a leaf after the call
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

    def forward(self, x, y, z):
        x.unsqueeze_(0)
        with torch.inference_mode(False):
            v0 = y.clone()
            z.mul_(0.9).add_(self.lin.bias, alpha=0.1)
        y.mul_(0.9).add_(y, alpha=0.1)
        v2 = v0 + 1.0
        return v2


def test_repro():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g)
    args = (x, x, x[2],)
    assert_matches_eager(M(), args, inputs_require_grad=False)

