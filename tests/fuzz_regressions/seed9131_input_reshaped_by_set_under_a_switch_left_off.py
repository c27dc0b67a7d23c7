# fuzz seed 9131 (torch 2.15): RuntimeError: Function _HistoryBackward returned an invalid gradient at index 0 - got [4] but expected shape compatible with [3, 4]
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        torch._C._set_grad_enabled(False)
        x.set_(self.s)
        return x


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)

