# fuzz seed 52002: mismatch: which inputs have a history leading to a leaf after the call (an input set_() in grad mode to a tensor that requires grad)
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
        self.register_buffer("b", torch.randn(3, 4, generator=g))

    def forward(self, y):
        v0 = self.lin.weight.detach().requires_grad_()
        y.set_(v0)
        return self.b


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False)
