# fuzz seed 60075: AssertionError: [..] torch's random generator after the call: the program left it in another state than eager
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        torch.manual_seed(7)
        v0 = self.lin.weight @ self.w
        v1 = v0.t()
        v2 = v0.detach().requires_grad_()
        v1.normal_()
        v3 = v0.float()
        v1.normal_()
        v3.mul_(0)
        return (v3, self.s)


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)

