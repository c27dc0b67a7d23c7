# fuzz seed 61015: mismatch: which inputs have a history leading to a leaf after the call (a cover relaid in the caller's mode, then written in grad mode: under a no_grad caller its memory as started was replayed without history)
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

    def forward(self, y, z):
        v0 = z.detach().requires_grad_()
        y.unsqueeze_(0)
        with torch.enable_grad():
            v1 = v0.float()
            v2 = v1.float()
            y[0] = self.lin.bias
        return v2


def test_repro():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 4, generator=g)
    args = (y, y[1],)
    assert_matches_eager(M(), args, inputs_require_grad=False)

