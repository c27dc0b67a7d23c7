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
from predispatch.ir.autograd_function_op import AUTOGRAD_FUNCTION
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


class Weighted(torch.autograd.Function):
    """Tensors made from data in its forward and its backward: constants the
    op takes as inputs (the program lifts them)."""

    @staticmethod
    def forward(ctx, x):
        w = torch.tensor([0.5, 1.5, 2.0, 1.0])
        ctx.save_for_backward(w)
        return x * w

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        return g * w * torch.tensor(2.0)


class MadeFromData(torch.nn.Module):
    def forward(self, x):
        return Weighted.apply(x * 3)


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
    "made_from_data": (MadeFromData, (torch.randn(2, 4),)),
}


@pytest.mark.parametrize("inputs_require_grad", [True, False], ids=["inputs_grad", "inputs_no_grad"])
@pytest.mark.parametrize("name", CASES)
def test_matches_eager(name, inputs_require_grad):
    make, args = CASES[name]
    torch.manual_seed(0)
    assert_matches_eager(make(), args, inputs_require_grad=inputs_require_grad)


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


class RelaysSaved(torch.autograd.Function):
    """Its backward gives a saved input another layout in place (AOTAutograd refuses it too)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.t_()
        return g * 2


class UpdatesSavesUpdates(torch.autograd.Function):
    """Updates its input, saves it, and updates it again in the backward:
    eager's backward writes the caller's tensor, the program would write the
    forward's new value."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.save_for_backward(x)
        return x * 3

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.add_(1)
        return g * x


class DirtyNotReturned(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
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


class RecomputesWithAutograd(torch.autograd.Function):
    """Memory-saving recomputation by running autograd in the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x).exp()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            (gx,) = torch.autograd.grad(torch.sin(x).exp(), x, g)
        return gx


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
    (ReadsGlobalState, (), "reads '_GRAD_SCALES' (a dict, global or from a closure)"),
    (KeepsModuleOnCtx, ("self",), "keeps a Calls in ctx.owner"),
    (RelaysSaved, (), "its backward gives an input another layout or storage in place"),
    (UpdatesSavesUpdates, (), "its backward updates in place a tensor it saved that is an input its forward"),
    (DirtyNotReturned, (), "marks dirty an input it does not return"),
    (DataDependent, (), "data-dependent Python control flow"),
    (TooFewGradients, ("x",), "returns 1 gradients for 2 inputs"),
    (RecomputesWithAutograd, (), "in its backward: grad() at"),
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


# --------------------------------------------------------------------------
# Inputs a Function returns or updates in place, in its forward or its
# backward (issue 38): they reach the caller as eager's do.

class Identity(torch.autograd.Function):
    """Returns its input itself: eager gives the caller a view of it with the Function's history."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 0.5


class LastRowsTransposed(torch.autograd.Function):
    """Returns a view of its input (a slice, transposed)."""

    @staticmethod
    def forward(ctx, x):
        return x[1:].t()

    @staticmethod
    def backward(ctx, g):
        grad = g.new_zeros(g.shape[1] + 1, g.shape[0])
        grad[1:] = g.t() * 3
        return grad


class Doubles(torch.autograd.Function):
    """Updates its input, marks it dirty and returns it: the caller's tensor
    itself, with the Function's history."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 3


class DoublesWithoutGradient(torch.autograd.Function):
    """Marks its input dirty, its backward gives no gradient: eager's input
    takes the Function's history and none of its old value's (no zeros)."""

    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, g):
        return None


class DoublesNonDifferentiable(torch.autograd.Function):
    """Marks its input dirty and non-differentiable: eager gives it no
    history; the input keeps its own, as an update under no_grad."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        ctx.mark_non_differentiable(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 3


class RunningMean(torch.autograd.Function):
    """Updates a buffer it is given (not marked dirty), as a BatchNorm-like Function does."""

    @staticmethod
    def forward(ctx, x, mean):
        mean.mul_(0.9).add_(x.mean(0) * 0.1)
        return x - mean

    @staticmethod
    def backward(ctx, g):
        return g * 2, None


class WithRunningMean(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        return RunningMean.apply(x * 1, self.mean)


class Scales(torch.autograd.Function):
    """Updates its input (not marked dirty): eager's forward runs under
    no_grad, so the input keeps its history."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        return x + 1

    @staticmethod
    def backward(ctx, g):
        return g * 5


class Increments(torch.autograd.Function):
    """Updates its input and returns it, not marked dirty: the input keeps
    its history, the output is a view of it with the Function's."""

    @staticmethod
    def forward(ctx, x):
        x.add_(1)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 5


class WritesSavedInput(torch.autograd.Function):
    """Its backward updates the input it saved: the caller's tensor, after the backward."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.add_(1)
        return g * x


class WritesGradient(torch.autograd.Function):
    """Its backward updates the gradient it is given."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        g.mul_(3)
        return g


class Forward(torch.nn.Module):
    """``fn(*inputs)`` as a module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def _returned_then_written_under_no_grad(x):
    h = x * 1
    y = Identity.apply(h)
    out = y * 2
    with torch.no_grad():
        y.mul_(2)  # reaches h, which keeps its history
    return out, h + 1


def _returned_then_its_base_written(x):
    h = x * 1
    y = LastRowsTransposed.apply(h)
    h.add_(1)  # y sees it (eager forbids using y in autograd after it)
    return y * 2


def _marks_dirty(x):
    h = x * 1
    doubled = Doubles.apply(h)  # h itself
    return doubled * 2, h + 1, Doubles.apply(x[1:]) * 1, x * 1


def _marks_dirty_without_gradient(x):
    # (not on a view: eager's CopySlices then drops the base's whole gradient, the rows
    # the Function did not write too; the program gives those rows theirs)
    return DoublesWithoutGradient.apply(x * 1) * 2, DoublesWithoutGradient.apply(x + 1).sum()


def _marks_dirty_non_differentiable(x):
    h = x * 1
    return DoublesNonDifferentiable.apply(h) + 0, h * 2


def _updates_input_and_its_view_reads(x):
    h = x * 1
    row = h[0]
    out = Scales.apply(h)
    return out + row, h * 3


LEAVES, HISTORY, PLAIN = ("leaves", True, False), ("history", True, True), ("plain", False, True)
RETURNED_OR_UPDATED = {  # name: (module, inputs, kinds of inputs (name, require grad, with history), grad modes)
    "returns_its_input": (lambda: Forward(lambda x: (Identity.apply(x), Identity.apply(x * 2) * 3)),
                          (torch.randn(3, 4),), (LEAVES, HISTORY, PLAIN), (True, False)),
    "returns_a_view_of_its_input": (
        lambda: Forward(lambda x: (LastRowsTransposed.apply(x), ViewOfInput.apply(x * 1) + 1)),
        (torch.randn(3, 4),), (LEAVES, HISTORY, PLAIN), (True, False)),
    "returned_input_then_written_under_no_grad": (lambda: Forward(_returned_then_written_under_no_grad),
                                                  (torch.randn(3, 4),), (LEAVES, HISTORY, PLAIN), (True, False)),
    "returned_input_then_its_base_written": (lambda: Forward(_returned_then_its_base_written),
                                             (torch.randn(3, 4),), (PLAIN,), (True, False)),
    "returned_input_then_its_base_written_no_grad": (lambda: Forward(_returned_then_its_base_written),
                                                     (torch.randn(3, 4),), (HISTORY,), (False,)),
    "marks_dirty": (lambda: Forward(_marks_dirty), (torch.randn(3, 4),), (HISTORY, PLAIN), (True, False)),
    "marks_dirty_without_gradient": (lambda: Forward(_marks_dirty_without_gradient),
                                     (torch.randn(3, 4),), (LEAVES, HISTORY, PLAIN), (True, False)),
    "marks_dirty_non_differentiable": (lambda: Forward(_marks_dirty_non_differentiable), (torch.randn(3, 4),),
                                       (LEAVES, HISTORY, PLAIN), (True, False)),
    "updates_a_buffer": (WithRunningMean, (torch.randn(3, 4),), (LEAVES, HISTORY, PLAIN), (True, False)),
    "updates_its_input": (lambda: Forward(lambda x: Scales.apply(x) * x), (torch.randn(3, 4),),
                          (LEAVES, HISTORY, PLAIN), (True, False)),
    "updates_an_intermediate_a_view_reads": (lambda: Forward(_updates_input_and_its_view_reads),
                                             (torch.randn(3, 4),), (LEAVES, HISTORY, PLAIN), (True, False)),
    "updates_and_returns_its_input": (lambda: Forward(lambda x: Increments.apply(x * 1) * 2), (torch.randn(3, 4),),
                                      (LEAVES, HISTORY, PLAIN), (True, False)),
    "backward_writes_a_saved_input": (
        lambda: Forward(lambda x, y: (WritesSavedInput.apply(x) * 3, WritesSavedInput.apply(y[1:]) + 1)),
        (torch.randn(3, 4), torch.randn(3, 4)), (LEAVES, HISTORY, PLAIN), (True, False)),
    "backward_writes_its_gradient": (lambda: Forward(lambda x: WritesGradient.apply(x) * 2), (torch.randn(3, 4),),
                                     (LEAVES, HISTORY, PLAIN), (True, False)),
}


@pytest.mark.parametrize("name", RETURNED_OR_UPDATED)
def test_returned_or_updated_inputs_match_eager(name):
    """Outputs, gradients, the inputs' and the buffers' values after the
    backward, and (inputs with a history) the history the call leaves them."""
    make, args, kinds, grad_modes = RETURNED_OR_UPDATED[name]
    for _kind, requires_grad, with_history in kinds:
        torch.manual_seed(0)
        assert_matches_eager(make(), args, inputs_require_grad=requires_grad, inputs_with_history=with_history,
                             grad_modes=grad_modes)


@pytest.mark.parametrize("name", [n for n, (_, _, kinds, _) in RETURNED_OR_UPDATED.items() if LEAVES in kinds])
def test_returned_or_updated_inputs_train_through_compile_training(name):
    make, args, _kinds, _modes = RETURNED_OR_UPDATED[name]
    torch.manual_seed(0)
    module = make()
    _eager_and(predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(module), args)),
               module, args)


def test_a_returned_input_is_an_alias_of_it_as_in_eager():
    """``ep.module()``'s output is a view of the input (updating it updates
    the input) with the Function's history, as eager's."""
    module = Forward(lambda x: (Identity.apply(x), LastRowsTransposed.apply(x)))
    program = predispatch.export_predispatch(copy.deepcopy(module), (torch.randn(3, 4),)).module()
    for m in (module, program):
        leaf = torch.ones(3, 4, requires_grad=True)
        x = leaf * 1
        same, view = m(x)
        assert same._base is x and view._base is x
        same.sum().backward()
        assert torch.equal(leaf.grad, torch.full((3, 4), 0.5))  # the Function's backward
        x = torch.ones(3, 4)
        same, view = m(x)
        with torch.no_grad():
            same.add_(1)
        assert torch.equal(x, torch.full((3, 4), 2.0)) and torch.equal(view, torch.full((4, 2), 2.0))


class AddsTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, y):
        x.add_(y)
        return x * y

    @staticmethod
    def backward(ctx, g):
        return g, g


class WritesOneOfTwoSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x, x[0])
        return x * 2

    @staticmethod
    def backward(ctx, g):
        x, row = ctx.saved_tensors
        x.add_(1)
        return g * row


@pytest.mark.parametrize("fn, construct", [
    (lambda x: AddsTo.apply(x, x[0]), "its forward updates in place an input that shares memory with another"),
    (lambda x: WritesOneOfTwoSaved.apply(x * 1),
     "its backward updates in place a tensor it saved that shares memory with another tensor it saved"),
], ids=["forward", "backward"])
def test_an_update_another_input_reads_is_refused(fn, construct):
    """Each input of a subgraph is a tensor of its own to its trace: an update
    of memory another input shares would not reach that input's reads."""
    with pytest.raises(predispatch.ExportError, match=construct):
        predispatch.export_predispatch(Forward(fn), (torch.randn(3, 4),))


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


# --------------------------------------------------------------------------
# Quantization-aware training: fake quantization with straight-through
# estimators and learned scales, trained a few SGD steps.


class FakeQuantize(torch.autograd.Function):
    """LSQ fake quantization (Esser et al., 2020): rounds to ``scale`` steps
    clamped to [qmin, qmax]; the input's gradient passes straight through
    inside the range, the scale gets the step-size gradient."""

    @staticmethod
    def forward(ctx, x, scale, qmin: int, qmax: int):
        ctx.save_for_backward(x, scale)
        ctx.qmin, ctx.qmax = qmin, qmax
        return torch.clamp(torch.round(x / scale), qmin, qmax) * scale

    @staticmethod
    def backward(ctx, g):
        x, scale = ctx.saved_tensors
        v = x / scale
        inside = (v >= ctx.qmin) & (v <= ctx.qmax)
        step = torch.where(inside, torch.round(v) - v, torch.clamp(v, ctx.qmin, ctx.qmax))
        return g * inside, (g * step).sum().reshape(scale.shape), None, None


class QATLinear(torch.nn.Module):
    """4-bit weights with a learned scale; activations scaled by a running
    maximum (a buffer updated under no_grad in training)."""

    def __init__(self, n_in, n_out):
        super().__init__()
        self.linear = torch.nn.Linear(n_in, n_out)
        self.weight_scale = torch.nn.Parameter(torch.tensor(0.05))
        self.register_buffer("act_max", torch.tensor(1.0))

    def forward(self, x):
        if self.training:
            with torch.no_grad():
                self.act_max.mul_(0.9).add_(0.1 * x.abs().amax())
        xq = FakeQuantize.apply(x, self.act_max / 7, -8, 7)
        wq = FakeQuantize.apply(self.linear.weight, self.weight_scale, -8, 7)
        return torch.nn.functional.linear(xq, wq, self.linear.bias)


class QATNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = QATLinear(8, 16), QATLinear(16, 4)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)))


def train(module, batches, steps=4):
    """Losses of ``steps`` SGD steps, and the state after."""
    optimizer = torch.optim.SGD(module.parameters(), lr=0.05)
    losses = []
    for x, target in batches[:steps]:
        loss = (module(x) - target).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.detach())
    # compile_training's module holds the program as flat.module
    return losses, {k.removeprefix("flat.module."): v.detach().clone()
                    for k, v in module.state_dict().items()}


@pytest.mark.parametrize("how", ["module", "compile_training"])
def test_qat_trains_like_eager(how):
    torch.manual_seed(0)
    net = QATNet()
    batches = [(torch.randn(6, 8), torch.randn(6, 4)) for _ in range(4)]
    ep = predispatch.export_predispatch(copy.deepcopy(net), (batches[0][0],))
    assert_invariants(ep)
    assert sum(n.target is AUTOGRAD_FUNCTION for m in ep.graph_module.modules()
               if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes) == 4
    program = copy.deepcopy(ep.module()) if how == "module" else predispatch.compile_training(ep)
    eager_losses, eager_state = train(net, batches)
    losses, state = train(program, batches)
    torch.testing.assert_close(losses, eager_losses)
    assert state.keys() == eager_state.keys()
    for name in eager_state:
        torch.testing.assert_close(state[name], eager_state[name], msg=name)
    assert not torch.equal(eager_state["first.weight_scale"], torch.tensor(0.05)), "the scale learns"


# --------------------------------------------------------------------------
# The op in the graph, and through what takes a program.


class Graphs(GraphTestCase):
    def test_straight_through_estimator(self):
        """The forward's ops in one subgraph, the backward (the gradient passed
        through) in the other; the op's keywords say what its outputs are."""
        ep = predispatch.export_predispatch(STEModule(), (torch.randn(2, 4),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_lin_weight: f32[4, 4], p_lin_bias: f32[4], x: f32[2, 4]):
    linear = aten.linear.default(x, p_lin_weight, p_lin_bias)
    ste_0 = predispatch_autograd_function(self.ste_0_fwd, self.ste_0_bwd, linear, name='STE', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem = ste_0[0]
    mul = aten.mul.Tensor(getitem, 2)
    return (mul,)
def ste_0_fwd(linear: f32[2, 4]):
    mul = aten.mul.Tensor(linear, 4)
    round = aten.round.default(mul)
    div = aten.div.Tensor(round, 4)
    return (div,)
def ste_0_bwd(g: f32[2, 4]):
    return (g,)
inputs:
    p_lin_weight: PARAMETER -> lin.weight
    p_lin_bias: PARAMETER -> lin.bias
    x: USER_INPUT
outputs:
    mul: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_saved_tensors_and_ctx_values(self):
        """Saved tensors are the forward's last outputs and the backward's last
        inputs (an input saved is passed through); a ctx number is a constant."""
        ep = predispatch.export_predispatch(SavesIntermediates(), (torch.randn(2, 4),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_lin_weight: f32[4, 4], p_lin_bias: f32[4], x: f32[2, 4]):
    linear = aten.linear.default(x, p_lin_weight, p_lin_bias)
    scaled_tanh_0 = predispatch_autograd_function(self.scaled_tanh_0_fwd, self.scaled_tanh_0_bwd, linear, name='ScaledTanh', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem = scaled_tanh_0[0]
    return (getitem,)
def scaled_tanh_0_fwd(linear: f32[2, 4]):
    mul = aten.mul.Tensor(linear, 0.5)
    tanh = aten.tanh.default(mul)
    mul_1 = aten.mul.Tensor(tanh, 2)
    return (mul_1, linear, tanh)
def scaled_tanh_0_bwd(g: f32[2, 4], x: f32[2, 4], saved_0: f32[2, 4]):
    mul = aten.mul.Tensor(g, 2)
    mul_1 = aten.mul.Tensor(saved_0, saved_0)
    rsub = aten.rsub.Scalar(mul_1, 1)
    mul_2 = aten.mul.Tensor(mul, rsub)
    mul_3 = aten.mul.Tensor(mul_2, 0.5)
    _assert_tensor_metadata = aten._assert_tensor_metadata.default(mul_3, None, None, torch.float32, device=device(type='cpu'), layout=torch.strided)
    return (mul_3,)
inputs:
    p_lin_weight: PARAMETER -> lin.weight
    p_lin_bias: PARAMETER -> lin.bias
    x: USER_INPUT
outputs:
    getitem: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")


def _eager_and(program, module, args):
    """``program`` runs as eager ``module`` does; its state named as the
    module's (compile_training holds it as flat.module, torch.compile as _orig_mod)."""
    import dataclasses

    from predispatch.testing.eager import assert_runs_match, run_module

    def named_as_eager(named):
        return {k.removeprefix("flat.module.").removeprefix("_orig_mod."): v for k, v in named.items()}

    run = run_module(program, args, None)
    run = dataclasses.replace(run, param_grads=named_as_eager(run.param_grads),
                              params=named_as_eager(run.params), buffers=named_as_eager(run.buffers))
    assert_runs_match(run_module(copy.deepcopy(module), args, None), run)


def _function_ops(gm):
    return [n for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.target is AUTOGRAD_FUNCTION]


def test_save_and_load_in_a_fresh_process(tmp_path):
    import subprocess
    import sys

    torch.manual_seed(0)
    module, x = torch.nn.Sequential(STEModule(), MadeFromData()), torch.randn(2, 4)
    torch.export.save(predispatch.export_predispatch(copy.deepcopy(module), (x,)), tmp_path / "f.pt2")
    torch.save(x, tmp_path / "x.pt")
    script = (
        "import sys, torch, predispatch\n"
        "m = predispatch.load(sys.argv[1]).module()\n"
        "x = torch.load(sys.argv[2]).requires_grad_()\n"
        "m(x).square().sum().backward()\n"
        "torch.save({'x': x.grad, **{n: p.grad for n, p in m.named_parameters()}}, sys.argv[3])\n")
    subprocess.run([sys.executable, "-c", script, tmp_path / "f.pt2", tmp_path / "x.pt",
                    tmp_path / "grads.pt"], check=True)
    loaded = torch.load(tmp_path / "grads.pt")
    x.requires_grad_()
    module(x).square().sum().backward()
    torch.testing.assert_close(loaded, {"x": x.grad, **{n: p.grad for n, p in module.named_parameters()}})


def test_run_decompositions_keeps_the_op_with_its_backward():
    """Below autograd the op stays, its subgraphs decomposed with the rest."""
    torch.manual_seed(0)
    module, args = CustomAmp(), (torch.randn(3, 4),)
    decomposed = predispatch.export_predispatch(copy.deepcopy(module), args).run_decompositions()
    calls = _function_ops(decomposed.graph_module)
    assert [n.kwargs["name"] for n in calls] == ["CastToFloat", "KeepsAutocast"]
    subgraph_ops = {n.target for n in calls for sub in n.args[:2]
                    for n in getattr(decomposed.graph_module, sub.target).graph.nodes}
    assert torch.ops.aten.mm.default in subgraph_ops and torch.ops.aten.matmul.default not in subgraph_ops
    _eager_and(decomposed.module(), module, args)


def test_compile_training_puts_the_custom_backward_in_the_backward_graph():
    torch.manual_seed(0)
    module, args = SavesIntermediates(), (torch.randn(2, 4),)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(module), args))
    _eager_and(train, module, args)
    backward = train.backward_graph.graph.nodes
    # the Function's backward (times ctx.scale), not autograd's derivative of the forward
    assert torch.ops.aten.tanh_backward.default not in {n.target for n in backward}
    assert any(n.target is torch.ops.aten.mul.Tensor and 0.5 in n.args for n in backward)


def test_torch_compile_traces_the_op_into_one_graph():
    import torch._dynamo

    torch.manual_seed(0)
    module, args = SavesIntermediates(), (torch.randn(2, 4),)
    ep = predispatch.export_predispatch(copy.deepcopy(module), args)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    _eager_and(torch.compile(copy.deepcopy(ep.module()), backend=backend), module, args)
    assert len(graphs) == 1
    assert torch.ops.higher_order.autograd_function_apply in {n.target for n in graphs[0].graph.nodes}


def test_regions_inside_the_subgraphs_are_regions():
    """``regions`` finds them; ``inline_regions`` inlines them and the
    Function's forward (for consumers that take no higher-order op)."""
    torch.manual_seed(0)
    module = CustomAmp()
    ep = predispatch.export_predispatch(copy.deepcopy(module), (torch.randn(3, 4),))
    found = [(r.owner is ep.graph_module, r.name, r.args, r.depth) for r in predispatch.regions(ep)]
    assert found == [
        (True, "autocast_bfloat16_0", ("cpu", torch.bfloat16, True, True), 0),
        (False, "autocast_off_1", ("cpu", None, False, True), 1),  # custom_fwd's cast, in the forward
        (False, "autocast_off_0", ("cpu", torch.bfloat16, False, True), 1),  # custom_bwd's, as forward
        (False, "autocast_bfloat16_0", ("cpu", torch.bfloat16, True, True), 1)]
    inlined = predispatch.inline_regions(ep)
    assert not [n for m in inlined.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
                for n in m.graph.nodes if isinstance(n.target, torch._ops.HigherOrderOperator)]
    x = torch.randn(3, 4)  # now computed in float32 throughout: close to eager's bf16 matmul
    torch.testing.assert_close(inlined.module()(x), module(x), rtol=5e-2, atol=5e-2)


class PlainMatmul(torch.autograd.Function):
    """No ``custom_bwd``: eager runs its backward under the autocast the
    backward is called in."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a @ b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g @ b.t(), a.t() @ g


class MatmulInAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return PlainMatmul.apply(x, self.w)


def test_a_backward_runs_under_the_autocast_it_is_called_in():
    """As in eager: called under the forward's autocast its matmuls are cast
    (bf16 gradient, fp32 saved tensors); called outside, they fail alike."""
    torch.manual_seed(0)
    module, x = MatmulInAutocast(), torch.randn(3, 4)
    program = predispatch.export_predispatch(copy.deepcopy(module), (x,)).module()

    def grads(m, autocast):
        inp = x.clone().requires_grad_()
        out = m(inp)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out.float().square().sum().backward()
        return inp.grad, m.w.grad

    torch.testing.assert_close(grads(program, True), grads(module, True))
    for m in (module, program):
        with pytest.raises(RuntimeError, match="dtype"):
            grads(m, False)


class _DoubleMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class _AppliesAFunctionTakenBefore(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fn = _DoubleMul.apply  # bound before the export wraps Function.apply

    def forward(self, x):
        return self.fn(x) + 1


def test_a_function_applied_through_an_apply_taken_before_the_export_is_refused():
    """Was silently wrong (torch's test_autograd
    test_retains_grad_inplace_multiple_outputs, ``fn = DoubleMul.apply``):
    torch's own apply ran the forward under no_grad, traced as a no_grad
    block, and the output had no history."""
    with pytest.raises(predispatch.ExportError, match=r"applied at .*test_autograd_functions.py:\d+ .*self\.fn\(x\).* "
                                                      r"through an apply taken before the export"):
        predispatch.export_predispatch(_AppliesAFunctionTakenBefore(), (torch.randn(3),))
