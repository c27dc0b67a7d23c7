# fuzz seed 62007: mismatch: which outputs require grad (a view of a leaf made in the forward, left on its old memory by set_() under no_grad to smaller memory: the swap kept the leaf's value, not the leaf, as its own history, so the view's history was dropped; now refused, naming the set_)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("s", torch.zeros(4))

    def forward(self, z):
        v1 = self.b.detach().requires_grad_()
        v2 = v1.t()
        with torch.no_grad():
            v1.set_(self.s)
        v3 = v2 + v2
        return v3


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)

