"""Bugs found by the differential fuzzer (tools/fuzz), each as the minimal
module it shrank to. Each is xfail(strict=True) until fixed: remove the
marker with the fix.

A test passes when the program matches eager (outputs, gradients, states,
G1/G3, G7) or, where ``refusal_ok``, when export refuses it with
``predispatch.ExportError`` (a sound refusal).
"""
import pytest
import torch
import torch.nn as nn

import predispatch
from predispatch.testing.eager import assert_matches_eager

BF16 = {"rtol": 2e-2, "atol": 2e-2}


def inputs(*shapes):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(*s, generator=g) for s in shapes)


def assert_sound(module, args, *, refusal_ok=False, **kw):
    if not refusal_ok:
        assert_matches_eager(module, args, **kw)
        return
    try:
        assert_matches_eager(module, args, **kw)
    except predispatch.ExportError:
        pass


# --------------------------------------------------------------------------
# 1. copy_ with grad: functionalization turns `dst.copy_(src)` (and every
# index assignment `t[i] = v`, which is `t[i].copy_(v)`) into the functional
# `aten.copy.default(dst, src)`. In a pre-dispatch graph that op runs above
# autograd, and aten::copy has no derivative formula (only copy_ has one, in
# VariableTypeManual.cpp), so the backward of ep.module() raises
# "derivative for aten::copy is not implemented" whenever src requires grad.

COPY_BUG = "aten.copy in the graph has no autograd formula: backward of a copy_/setitem with grad fails"


class CopyIntoIntermediate(nn.Module):
    def forward(self, x, y):
        v = x * 1.0
        v.copy_(y)
        return v


class IndexAssignment(nn.Module):
    def forward(self, x, y):
        v = x * 1.0
        v[0] = y[0]
        return v


class BufferCopiedFromInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3, 4))

    def forward(self, x):
        self.b.copy_(x)
        return self.b * 2.0


@pytest.mark.xfail(strict=True, reason=COPY_BUG)
@pytest.mark.parametrize("module, n_inputs", [
    (CopyIntoIntermediate, 2), (IndexAssignment, 2), (BufferCopiedFromInput, 1)])
def test_copy_with_grad(module, n_inputs):
    assert_sound(module(), inputs(*[(3, 4)] * n_inputs))


# --------------------------------------------------------------------------
# 2. A block with no node in it still takes a region number
# (region_pass.choose_regions numbers blocks before _outline drops the empty
# ones), so the first export names the next region enable_grad_1; re-exporting
# ep.module(), which has no trace of the empty block, names it enable_grad_0:
# G7 (re-export gives the same graph) fails.

class EmptyBlockBeforeRegion(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            pass
        with torch.enable_grad():
            y = x * 2
        return y


class ViewOnlyBlock(nn.Module):
    """The fuzzer's form: the autocast block holds only a view, which
    functionalization emits later, at its use (see 3), leaving it empty."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.register_buffer("b", torch.randn(3, 4, generator=g))

    def forward(self, x):
        self.b.add_(1.0)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            v0 = self.b.detach()
        with torch.set_grad_enabled(True):
            v1 = v0 @ self.w
        return v1


@pytest.mark.xfail(strict=True, reason="an empty block consumes a region number: G7 renames on re-export")
@pytest.mark.parametrize("module", [EmptyBlockBeforeRegion, ViewOnlyBlock])
def test_empty_block_does_not_shift_region_names(module):
    assert_sound(module(), inputs((3, 4)), **BF16)


# --------------------------------------------------------------------------
# 3. Functionalization regenerates a view of a mutated tensor lazily, at its
# first use (FunctionalTensorWrapper::sync_ -> regenerate_from_base), and
# dead-code-eliminates the view node made where the source made it. The view
# then lands in whatever grad block uses it: a view taken under no_grad and
# used in an enable_grad block becomes a differentiable view in the program
# (eager: it never requires grad), so gradients flow where eager has none.

class NoGradViewOfMutatedTensor(nn.Module):
    def forward(self, x):
        y = x * 2
        y.add_(1)
        with torch.no_grad():
            v = y[0]
        with torch.enable_grad():
            z = v * 3
        return z


@pytest.mark.xfail(strict=True, reason="a view of a mutated tensor is emitted at its use, in another grad block")
def test_view_stays_in_the_grad_block_it_was_made_in():
    assert_sound(NoGradViewOfMutatedTensor(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 4. Eager's autocast weight cache (aten/src/ATen/autocast_mode.cpp,
# cached_cast) keys a leaf parameter's low-precision cast by its TensorImpl
# and does not see in-place updates: after `w.mul_(-1)` under no_grad inside
# the autocast block, eager's second matmul still uses the old bf16 weight.
# The program computes with the new weight. The program cannot match this
# silently, so export should refuse it (ExportError) - or model the cache.

class ParameterUpdatedInsideAutocast(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.w
            with torch.no_grad():
                self.w.mul_(-1.0)
            b = x @ self.w
        return a, b


@pytest.mark.xfail(strict=True, reason="eager's autocast cast cache is stale after an in-place update; "
                   "the program silently differs")
def test_parameter_updated_inside_autocast_is_refused_or_matches():
    assert_sound(ParameterUpdatedInsideAutocast(), inputs((3, 4)), refusal_ok=True, **BF16)
