# fuzz seed 54010: mismatch: which inputs have a history leading to a leaf after the call (written through an index, then set_() under no_grad)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.register_buffer("b", torch.randn(3, 4, generator=g))

    def forward(self, x):
        x.unsqueeze_(0)
        x[0] = self.p
        with torch.no_grad():
            x.set_(self.p)
        return self.b


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
