# fuzz seed 51009: mismatch: output (a draw into a tensor not laid out contiguously)
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        gen0 = torch.Generator().manual_seed(42)
        v0 = torch.randn(3, 4, generator=gen0)
        torch._C._set_grad_enabled(False)
        v0.transpose_(0, 1)
        v1 = torch.nn.functional.dropout(v0, 0.5, training=True)
        return v1


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
