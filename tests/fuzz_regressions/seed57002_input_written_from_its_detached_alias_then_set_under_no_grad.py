# fuzz seed 57002: an input written in grad mode from a detach of itself made to require grad (its memory, another autograd identity), then set_() to another input under no_grad: eager keeps the write's history, the program lost it
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
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, y):
        v0 = y.detach().requires_grad_()
        x.mul_(0.9).add_(v0, alpha=0.1)
        y.unsqueeze_(0)
        x.mul_(0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.autocast("cpu", enabled=False):
                y[0] = v0
                self.s.mul_(0)
                with torch.no_grad():
                    y.set_(x)
                self.n.mul_(0.9).add_(self.n, alpha=0.1)
            v1 = self.lin.weight + self.w
        v1.sub_(v1)
        return (v1, v0, v1)


def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=False, rtol=0.02, atol=0.02)

