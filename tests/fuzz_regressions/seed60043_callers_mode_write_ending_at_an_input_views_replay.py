# fuzz seed 60043: AssertionError: [..] which outputs require grad (with a history leading to a leaf): eager [..], program [..]
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def forward(self, y, z):
        v0 = y.detach()
        v1 = v0.sin()
        with torch.enable_grad():
            v1.copy_(z)
        v1[1:] = z
        v0.mul_(0.9)
        v1.mul_(0.9)
        return v1


def test_repro():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 4, generator=g)
    args = (y, y[1],)
    assert_matches_eager(M(), args, inputs_require_grad=True)
