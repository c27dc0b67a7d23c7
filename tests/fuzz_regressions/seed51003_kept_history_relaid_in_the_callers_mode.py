# fuzz seed 51003: mismatch: which outputs require grad (a kept history relaid in the caller's mode, under a no_grad caller)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v1 = self.s.detach().requires_grad_()
        @torch.set_grad_enabled(True)
        def f0():
            v2 = v1.sum()
            with torch.no_grad():
                v2.set_(x)
            return (v2,)
        v2, = f0()
        v2.t_()
        return v2


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
