# fuzz seed 9110: mismatch: input after the call
# open: z = y[1] written (z.mul_), then y swapped onto z[0], memory of its own storage (y.set_(v0)): the program writes back through y's new 0-d layout only (as_strided(where, [], [], 4)), so z's other three elements keep their old values where eager doubles them; the swap keeps y's storage, so trace/functional_trace.py's _refuse_moved_covers (storage_changed) does not refuse it either. 2.13 and 2.15.
import torch
import torch.nn as nn
from predispatch.testing.eager import assert_matches_eager


class M(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, y, z):
        v0 = z[0]
        z.mul_(2.0)
        y.set_(v0)
        return self.n


def test_repro():
    g = torch.Generator().manual_seed(1)
    y = torch.randn(3, 4, generator=g)
    args = (y, y[1],)
    assert_matches_eager(M(), args, inputs_require_grad=False)

