# fuzz seed 61034: RuntimeError: setStorage: ... out of bounds (a view of an input left on its old memory by set_() to smaller memory: the program's forward regenerated its history by as_strided past the new memory; now refused, naming the set_)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("s", torch.zeros(4))

    def forward(self, y):
        v0 = y[1:]
        y.set_(self.s)
        v1 = torch.rand_like(v0)
        v3 = self.b.t()
        return v3


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)

