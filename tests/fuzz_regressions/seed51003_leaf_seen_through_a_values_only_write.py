# fuzz seed 51003: G7: re-export changed the graph (a leaf shown only through a values-only write)
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
        v1 = self.s.detach().requires_grad_()
        v2 = v1.sum()
        with torch.no_grad():
            v2.set_(x)
        v2[1:] = self.lin.bias
        return v2


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
