"""torch.autograd.Function exported with its own backward (issue 16).

Each case is compared with eager (outputs, which require grad, gradients of
inputs and parameters, states, and G7 re-export) by ``assert_matches_eager``;
the straight-through estimator also by its graph.
"""
from __future__ import annotations

import copy

import pytest
import torch

import predispatch
from predispatch.autograd_functions import AUTOGRAD_FUNCTION
from predispatch.testing import GraphTestCase, assert_invariants
from predispatch.testing.eager import assert_matches_eager


class STE(torch.autograd.Function):
    """Rounds to quarters; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g


class STEModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return STE.apply(self.lin(x)) * 2


class ScaledTanh(torch.autograd.Function):
    """Saves an intermediate and its output, keeps a number and a dtype on ctx."""

    @staticmethod
    def forward(ctx, x, scale: float):
        t = torch.tanh(x * scale)
        ctx.save_for_backward(x, t)
        ctx.scale, ctx.dtype = scale, x.dtype
        return t * 2

    @staticmethod
    def backward(ctx, g):
        x, t = ctx.saved_tensors
        return (g * 2 * (1 - t * t) * ctx.scale).to(ctx.dtype), None


class SavesIntermediates(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return ScaledTanh.apply(self.lin(x), 0.5)


class SplitSign(torch.autograd.Function):
    """Two outputs, the second non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        sign = torch.sign(x)
        ctx.save_for_backward(sign)
        ctx.mark_non_differentiable(sign)
        return x.abs(), sign

    @staticmethod
    def backward(ctx, g_abs, g_sign):
        (sign,) = ctx.saved_tensors
        return g_abs * sign


class TwoOutputs(torch.nn.Module):
    def forward(self, x):
        magnitude, sign = SplitSign.apply(x * 3)
        return magnitude * 2, sign


class InRegions(torch.nn.Module):
    """One Function call under no_grad (its backward never runs), one in an
    autocast region."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            frozen = STE.apply(self.lin(x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = STE.apply(self.lin(x) @ self.lin.weight)
        return y.float() + frozen


class CastToFloat(torch.autograd.Function):
    """``custom_fwd(cast_inputs=float32)``: under autocast, runs in float32
    with autocast off; ``custom_bwd``: the backward under the forward's state."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g


class KeepsAutocast(torch.autograd.Function):
    """``custom_fwd`` without casting: the backward runs under the forward's autocast."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g


class CustomAmp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = CastToFloat.apply(x, self.w)
            z = KeepsAutocast.apply(x, self.w)
        return y + z.float()


class UsedTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return STE.apply(self.lin(STE.apply(x)))


class SelectiveLinear(torch.autograd.Function):
    """Computes only the gradients asked for (``ctx.needs_input_grad``), in
    the forward too: it saves the input only when the weight needs a gradient."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        gx = g @ w if ctx.needs_input_grad[0] else None
        gw = g.t() @ x if ctx.needs_input_grad[1] else None
        return gx, gw


class NeedsInputGrad(torch.nn.Module):
    def __init__(self, freeze=False):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4), requires_grad=not freeze)
        self.v = torch.nn.Parameter(torch.randn(3, 3))

    def forward(self, x):
        return SelectiveLinear.apply(SelectiveLinear.apply(x, self.w), self.v)


class PartsWithoutMaterializing(torch.autograd.Function):
    """``set_materialize_grads(False)``, ``once_differentiable``, a tensor and
    a tuple kept as ctx attributes, and a non-tensor output."""

    @staticmethod
    def forward(ctx, x, bias):
        ctx.set_materialize_grads(False)
        ctx.x, ctx.pair = x, (bias, 2.0)
        return x * bias, torch.exp(x), "done"

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_prod, g_exp, _g_tag):
        bias, two = ctx.pair
        gx = torch.zeros_like(ctx.x)
        if g_prod is not None:
            gx = gx + g_prod * bias
        if g_exp is not None:
            gx = gx + g_exp * torch.exp(ctx.x) * two / 2
        gb = None if g_prod is None else (g_prod * ctx.x).sum(0)
        return gx, gb


class WithoutMaterializing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        prod, e, tag = PartsWithoutMaterializing.apply(x, self.bias)
        return prod + e, tag


class SetupContextSquare(torch.autograd.Function):
    """The ``setup_context`` style, with a default argument."""

    @staticmethod
    def forward(x, power=2):
        return x ** power

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, power = inputs
        ctx.save_for_backward(x)
        ctx.power = power

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * ctx.power * x ** (ctx.power - 1), None


class ClippedBackward(torch.autograd.Function):
    """Its backward calls another Function (itself captured inside the backward)."""

    @staticmethod
    def forward(ctx, x):
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        return STE.apply(g.clamp(-0.5, 0.5))


class Nested(torch.nn.Module):
    def forward(self, x):
        return SetupContextSquare.apply(ClippedBackward.apply(x) * 3)


CASES = {
    "straight_through": (STEModule, (torch.randn(2, 4),)),
    "saves_intermediates": (SavesIntermediates, (torch.randn(2, 4),)),
    "two_outputs": (TwoOutputs, (torch.randn(2, 4),)),
    "in_regions": (InRegions, (torch.randn(2, 4),)),
    "custom_amp": (CustomAmp, (torch.randn(3, 4),)),
    "used_twice": (UsedTwice, (torch.randn(2, 4),)),
    "needs_input_grad": (NeedsInputGrad, (torch.randn(2, 4),)),
    "needs_input_grad_frozen": (lambda: NeedsInputGrad(freeze=True), (torch.randn(2, 4),)),
    "without_materializing": (WithoutMaterializing, (torch.randn(2, 4),)),
    "nested": (Nested, (torch.randn(2, 4),)),
}


@pytest.mark.parametrize("inputs_require_grad", [True, False], ids=["inputs_grad", "inputs_no_grad"])
@pytest.mark.parametrize("name", CASES)
def test_matches_eager(name, inputs_require_grad):
    make, args = CASES[name]
    torch.manual_seed(0)
    assert_matches_eager(make(), args, rtol=1e-2, atol=1e-2, inputs_require_grad=inputs_require_grad)


# --------------------------------------------------------------------------
# What cannot be captured soundly: refused, naming the Function and the line.


def line_of(fn, text):
    import inspect

    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


class ViewOfInput(torch.autograd.Function):
    """Gradient reversal written with an alias: the output is a view of the input."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return -g


_GRAD_SCALES = {"scale": 1.0}  # changed between calls


class ReadsGlobalState(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * _GRAD_SCALES["scale"]


class KeepsModuleOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, owner):
        ctx.owner = owner  # the backward reads its attributes when it runs
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * ctx.owner.scale, None


class MarksDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class MutatesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        return g


class DataDependent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        if x.sum() > 0:
            return x * 2
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g


class TooFewGradients(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        return x * y

    @staticmethod
    def backward(ctx, g):
        return (g,)


class Calls(torch.nn.Module):
    """Calls ``fn.apply`` on an intermediate (and the extra arguments)."""

    def __init__(self, fn, *extra):
        super().__init__()
        self.fn, self.extra = fn, extra
        self.scale = 2.0

    def forward(self, x):
        extra = [self if e == "self" else x if e == "x" else e for e in self.extra]
        return self.fn.apply(x * 1, *extra)


@pytest.mark.parametrize("fn, extra, construct", [
    (ViewOfInput, (), "returns one of its inputs or a view of one"),
    (ReadsGlobalState, (), "reads the global '_GRAD_SCALES'"),
    (KeepsModuleOnCtx, ("self",), "keeps a Calls in ctx.owner"),
    (MarksDirty, (), "ctx.mark_dirty"),
    (MutatesInput, (), "updates an input in place"),
    (DataDependent, (), "data-dependent Python control flow"),
    (TooFewGradients, ("x",), "returns 1 gradients for 2 inputs"),
], ids=lambda v: v.__name__ if isinstance(v, type) else None)
def test_what_cannot_be_captured_soundly_is_refused(fn, extra, construct):
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(Calls(fn, *extra), (torch.randn(2, 3),))
    message = str(info.value)
    assert f"torch.autograd.Function {fn.__name__} at {__file__}:" in message, message
    assert f"{__file__}:{line_of(Calls.forward, 'self.fn.apply(')}" in message, message
    assert construct in message, message


def test_a_data_dependent_forward_names_its_own_line():
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(Calls(DataDependent), (torch.randn(2, 3),))
    assert f"{__file__}:{line_of(DataDependent.forward, 'if x.sum() > 0')}" in str(info.value)


class KeepsShape(torch.autograd.Function):
    """Keeps sizes on ctx: with a dynamic batch they reach the backward as the
    shapes of (one-element) saved tensors."""

    @staticmethod
    def forward(ctx, x):
        ctx.shape, ctx.rows = x.shape, x.shape[0]
        return x.reshape(-1) * 2

    @staticmethod
    def backward(ctx, g):
        return g.reshape(ctx.shape) * 2 * ctx.rows / ctx.rows


class FlattensWithDynamicBatch(torch.nn.Module):
    def forward(self, x):
        return KeepsShape.apply(STE.apply(x * 1.5))


def test_sizes_kept_on_ctx_follow_a_dynamic_batch():
    batch = torch.export.Dim("batch", min=2)
    ep = predispatch.export_predispatch(FlattensWithDynamicBatch(), (torch.randn(3, 4),),
                                        dynamic_shapes=({0: batch},))
    for rows in (3, 5):
        x = torch.randn(rows, 4)
        eager, program = x.clone().requires_grad_(), x.clone().requires_grad_()
        FlattensWithDynamicBatch()(eager).square().sum().backward()
        ep.module()(program).square().sum().backward()
        torch.testing.assert_close(program.grad, eager.grad)
