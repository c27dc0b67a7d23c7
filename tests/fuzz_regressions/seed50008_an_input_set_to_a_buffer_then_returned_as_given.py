# fuzz seed 50008: RuntimeError: Function _HistoryBackward returned an invalid gradient
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x, y):
        v0 = self.s.detach()
        with torch.no_grad():
            x.set_(v0)
        v0.mul_(0.9).add_(v0, alpha=0.1)
        return y


def test_repro():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4, generator=g)
    args = (x, x,)
    assert_matches_eager(M(), args, inputs_require_grad=True)

