# fuzz seed 32001: G7: re-export changed the graph (a bare switch left grad mode off; inputs sharing memory traced twice, the second trace began in the mode the first left)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)

    def forward(self, y, z):
        torch.set_grad_enabled(False)
        self.w.sub_(z)
        v1 = y.detach()
        y[:, 0] = 2.0
        return v1


def test_repro():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g)
    args = (x, x[2],)
    assert_matches_eager(M(), args, inputs_require_grad=False)

