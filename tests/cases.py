"""Modules that exercise the hard corners of the contract (shared by tests)."""
import torch
import torch.nn as nn


class Seed(nn.Module):
    """The seed example of the design: a mutation under no_grad, then a use."""

    def forward(self, x):
        x = x * 1.0
        with torch.no_grad():
            x.mul_(2)
        y = x * x
        return y


class InputMutatedUnderNoGrad(nn.Module):
    def forward(self, x, y):
        with torch.no_grad():
            x.add_(1)
        return x * y


class InputMutatedThroughView(nn.Module):
    def forward(self, x, y):
        with torch.no_grad():
            x[0].mul_(3)
            v = x.view(-1)
            v[1:3].add_(1)
        return x.sin() + y


class InputMutatedWithGrad(nn.Module):
    """A plain (grad mode) mutation of an input that does not require grad."""

    def forward(self, x, y):
        x.add_(y)
        return x * 2


class EMA(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("shadow", torch.zeros(4, 4))

    def forward(self, x):
        with torch.no_grad():
            self.shadow.mul_(0.9).add_(0.1 * self.lin.weight)
            self.lin.weight.mul_(0.99)  # weight decay in place
        return self.lin(x) + self.shadow.sum()


class Counter(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        self.steps.add_(1)
        with torch.no_grad():
            self.total.add_(x.sum(0))
        return x * self.steps


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x)).relu()


class NestedGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        a = x * self.w
        with torch.no_grad():
            b = a * 2
            with torch.enable_grad():
                c = a * self.w
                with torch.set_grad_enabled(False):
                    d = c + 1
                    with torch.no_grad():  # same state: not a region
                        e = d * 3
            f = b + e
        return a + c + f


@torch.no_grad()
def _decorated_half(x):
    return x * 0.5


class DecoratedNoGrad(nn.Module):
    def forward(self, x):
        return _decorated_half(x) + x


class AutocastBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
            with torch.autocast("cpu", enabled=False):
                z = self.lin(y.float())
        return y.float() + z


class AutocastInsideNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.lin(x)
        return self.lin(x) + y.float()


class NoGradInsideAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with torch.no_grad():
                y = self.lin(x)
            z = self.lin(x)
        return z.float() * y.float()


class TopLevelEnableGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))

    def forward(self, x):
        with torch.enable_grad():
            y = x * self.w
        return y


class AliasingOutputs(nn.Module):
    def forward(self, x):
        return x, x.view(-1), x[0], x * 2


class SameTensorTwice(nn.Module):
    def forward(self, a, b):
        with torch.no_grad():
            a.add_(1)
        return a * b


class TimesWeightTimes(nn.Module):
    """Reads both inputs, writes neither: exported with one tensor twice
    (``f(x, x)``), its trace reads one tensor for both."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))

    def forward(self, x, y):
        return x * self.w * y


class PytreeIO(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, inputs, scale=2, bias=None, *, extra):
        x, y = inputs["x"], inputs["pair"][1]
        out = self.lin(x) * scale + y
        if bias is not None:
            out = out + bias
        return {"out": out, "parts": [out.sum(), None, 3], "extra": extra * 2}


class DynamicBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x):
        with torch.no_grad():
            s = x.mean(0, keepdim=True)
        return self.lin(x - s)


class TypeAs(nn.Module):
    def forward(self, x, y):
        return x.type_as(y) * 2 + x.reshape(-1).view(x.shape)


class DecoratedSetGradEnabled(nn.Module):
    @torch.set_grad_enabled(False)
    def stats(self, x):
        return x.mean() * 2

    def forward(self, x):
        return x * self.stats(x)


class MutatedThroughDetachedAlias(nn.Module):
    """Eager: an in-place update of a detached alias changes x and its views
    without touching their autograd history."""

    def forward(self, x):
        v0 = x[0]
        v1 = v0.detach()
        v1.mul_(0.9).add_(v1, alpha=0.1)
        return v1 * 1.0, v0.sin()


class ViewMadeBeforeNoGrad(nn.Module):
    def forward(self, x):
        v = x[1:]
        with torch.no_grad():
            v.mul_(2)
        return x * 3


class DetachedAliasUpdatedWithGrad(nn.Module):
    def forward(self, x):
        v0 = x.detach()
        v0.add_(x * 2.0)
        return v0.sum()


class MutatedUnderNoGradAfterEnableGrad(nn.Module):
    """A value made in an enable_grad block inside no_grad, from a parameter
    updated under no_grad, then mutated under no_grad: both keep history."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.lin.bias[0] = self.n
            with torch.enable_grad():
                v0 = self.n + self.lin.bias
            v3 = v0.sin()
            v0.mul_(0.5)
        return v3, v0 * x
