# fuzz seed 9131 (torch 2.15): RuntimeError: Function _HistoryBackward returned an invalid gradient at index 0 - got [4] but expected shape compatible with [3, 4]
# open: a bare switch to no_grad left in force at the forward's end, then x.set_(self.s) gives the input x (requires grad, (3, 4)) another shape, (4,): as a with no_grad block it is refused ("given another shape under no_grad and keeps its history"), under the switch it is exported and the program's x keeps a history of the old shape, so the backward crashes. torch.set_grad_enabled(False) fails the same; 2.13 and 2.15.
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

