# fuzz seed 60063: mismatch: param_grads
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

    def forward(self, x):
        @torch.enable_grad()
        def f0():
            with torch.no_grad():
                with torch.no_grad():
                    v0 = self.lin.weight.t()
                    v1 = v0.detach().requires_grad_()
            v2 = self.lin(v1)
            v3 = v0.detach()
            v4 = v2.unsqueeze(0)
            return (v0, v1, v2, v3, v4,)
        v0, v1, v2, v3, v4, = f0()
        with torch.autocast("cpu", enabled=False):
            v2.t_()
        with torch.no_grad():
            v2.set_(v3)
        with torch.autocast("cpu", enabled=False):
            pass
        return v4

def test_repro():
    g = torch.Generator().manual_seed(1)
    args = (torch.randn(3, 4, generator=g),)
    assert_matches_eager(M(), args, inputs_require_grad=True)

