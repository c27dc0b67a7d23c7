"""Bugs found by the differential fuzzer (tools/fuzz), each as the minimal
module it shrank to, with the diagnosis. Open ones are xfail(strict=True):
remove the marker with the fix. Fixed: 1-108 (4b's nested
autocast(enabled=False) case by the refusal reading autocast nesting, 10 by
marking no_grad view replays, 15 and 16 by noting grad-mode views at no_grad
entries; 7 and 22, once refusals, are exported since the eighth session).
Open: the three cases of the forty-first session at the end.

A test passes when the program matches eager (outputs, gradients, states,
G1/G3, G7) or, where ``refusal_ok``, when export refuses it with
``predispatch.ExportError`` (a sound refusal).
"""
import contextlib

import pytest
import torch
import torch.nn as nn

import predispatch
from predispatch.testing.eager import assert_matches_eager

BF16 = {"rtol": 2e-2, "atol": 2e-2}


def inputs(*shapes):
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randn(*s, generator=g) for s in shapes)


def open_bug(*values, reason):
    """A parametrize case for an open bug: xfail(strict=True) until fixed."""
    return pytest.param(*values, marks=pytest.mark.xfail(strict=True, reason=reason))


def linear_of_a_vector_is_a_view() -> bool:
    """Does this torch's eager ``linear`` of a 1-D input with a bias return a
    view (torch 2.13, 2.14: yes; 2.15: no)? Refusals that rest on it follow it."""
    lin = nn.Linear(2, 2)
    return lin(torch.ones(2))._is_view()


def assert_refused_where_eager_views(module, args, match: str):
    """Refused (``match``) where this torch's linear of a vector is a view,
    whose history eager regenerates through a new layout; elsewhere it is
    an ordinary tensor, and the program matches eager."""
    if linear_of_a_vector_is_a_view():
        with pytest.raises(predispatch.ExportError, match=match):
            predispatch.export_predispatch(module, args)
    else:
        assert_sound(module, args, inputs_require_grad=False)
        assert_sound(module, args, inputs_require_grad=True)


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


def test_parameter_updated_inside_autocast_is_refused_or_matches():
    assert_sound(ParameterUpdatedInsideAutocast(), inputs((3, 4)), refusal_ok=True, **BF16)


# --------------------------------------------------------------------------
# 5. An in-place op through a `.detach()` alias, in grad mode. Eager: the
# data of the base changes (its version counter too) but its autograd
# identity does not: a leaf stays a leaf whose later uses get gradients, an
# intermediate keeps its grad_fn. The trace records it as a grad-mode
# mutation (the recorder watches no_grad spans only), so (a) a parameter or
# an input is written back with `copy_` in grad mode, which autograd refuses
# on a leaf that requires grad ("a leaf Variable that requires grad is being
# used in an in-place operation"), and (b) no keep_history is inserted, so
# later uses of the base read a value with no history: gradients are lost.

class MutateInputThroughDetach(nn.Module):
    def forward(self, x):
        x.detach().add_(1.0)
        return x * 2


class MutateParameterThroughDetach(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x):
        self.w.detach().mul_(0.5)
        return self.w * x


class MutateIntermediateThroughDetach(nn.Module):
    def forward(self, x):
        y = x.sin()
        y.detach().mul_(2.0)
        return y


@pytest.mark.parametrize("module", [
    MutateInputThroughDetach,
    MutateParameterThroughDetach,
    MutateIntermediateThroughDetach])
def test_mutation_through_detached_alias(module):
    assert_sound(module(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 6. program._snapshot_reads gives a snapshot to the readers of the target
# among the *ancestors* of the written-back value, but not to the value node
# itself: for `self.b.mul_(x)` the value is `mul(b, x)`, which reads `b`
# directly. MulBackward saves `b`; the write-back `b.copy_(mul)` then bumps
# its version and the backward fails ("... modified by an inplace operation
# ... output 0 of CopyBackwards"). Eager's mul_ saved a copy of the old b.
# Fix: computing = _ancestors(value) | {value}.

class BufferMultipliedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("b", torch.randn(3, 4, generator=g))

    def forward(self, x):
        self.b.mul_(x)
        return self.b


class InputMultipliedByParameter(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x):
        x.mul_(self.w)
        return x


class RelaidSumThenHiddenUpdate(nn.Module):
    """43 (seed 9303): unsqueeze_ of a 0-d sum, nn.init.constant_, a view."""

    def forward(self, z):
        v0 = z.sum()
        v0.unsqueeze_(0)
        torch.nn.init.constant_(v0, 0.5)
        v2 = v0.view(-1)
        return v2 - v2


@pytest.mark.parametrize("module, require", [
    (RelaidSumThenHiddenUpdate, True), (BufferMultipliedInPlace, True), (InputMultipliedByParameter, False)])
def test_grad_mode_mutation_saved_by_its_own_op(module, require):
    assert_sound(module(), inputs((3, 4)), inputs_require_grad=require)


# --------------------------------------------------------------------------
# 7. A view made before a no_grad block and mutated inside it: the recorder
# (the recorder) watches only the tensors passed to functions
# inside the span, i.e. the view, not its base. The base's new value (a
# slice_scatter/select_scatter computed under no_grad) is never recorded as
# a replacement, so no keep_history is inserted, and later uses of the base
# lose its autograd history (eager: the leaf keeps receiving gradients).
# Fix: at the end of a span compare the current node of every tensor seen
# so far (or of the bases of the watched views), not only of those touched.

class InputViewMutatedUnderNoGrad(nn.Module):
    def forward(self, x, y):
        v = x[0]
        with torch.no_grad():
            v.add_(1.0)
        return x * y


class ParameterViewMutatedUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x):
        v0 = self.w[1:]
        with torch.set_grad_enabled(False):
            v0.add_(self.p)
        return self.p @ self.w


@pytest.mark.parametrize("module, n_inputs", [
    (InputViewMutatedUnderNoGrad, 2), (ParameterViewMutatedUnderNoGrad, 1)])
def test_base_of_view_mutated_under_no_grad_keeps_history(module, n_inputs):
    assert_sound(module(), inputs(*[(3, 4)] * n_inputs))


# --------------------------------------------------------------------------
# 8. G7: the printed subgraph placeholders keep raw node names (printing.py
# normalizes only the names of non-placeholder nodes), and keep_history nodes
# are created in the order of the recorder's watch dict, which differs
# between the first export and the re-export of ep.module(): the first prints
# `def enable_grad_1(keep_history_1, x)`, the re-export
# `def enable_grad_1(keep_history, x)`. The same happens without
# keep_history: any raw name (a view regenerated after dead ones, the
# `where` of copy_pass: `where_self` vs `where`) shows through. Fix: normalize
# subgraph placeholder names in the printer (e.g. after the outer argument's
# printed name), and/or create keep_history nodes in graph order.

class TwoParametersUpdatedUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x):
        with torch.no_grad():
            self.w.add_(1.0)
            self.p.add_(1.0)
        with torch.enable_grad():
            y = self.p * x
        return y


class RegionReadingARegeneratedView(nn.Module):
    """No keep_history here: the raw name of the view the region reads
    (slice_2 first, slice_1 on re-export) shows through the printer."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("s", torch.randn(4, generator=g))

    def forward(self, x):
        v0 = self.s[1:]
        self.s.zero_()
        with torch.set_grad_enabled(False):
            v4 = v0.float()
        return v4


@pytest.mark.parametrize("module", [
    TwoParametersUpdatedUnderNoGrad, RegionReadingARegeneratedView])
def test_subgraph_placeholder_names_are_stable_on_reexport(module):
    assert_sound(module(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 4b. The refusal of 4 (the recorder's _refuse_stale_autocast_cache) fired only
# for an in-place op whose first argument *is* a parameter while autocast is
# enabled (views and inputs: fixed in cbbb265; the nested
# autocast(enabled=False) case is still open). Eager's cache (cached_cast: any leaf that requires grad, keyed by
# TensorImpl, cleared only when the outermost autocast block exits) goes
# stale in more cases, each a silent mismatch today:
#   - the parameter updated through a view (`self.w.view(-1).mul_(-1)`),
#   - the update under a nested `autocast(enabled=False)` (the outer block's
#     cache is still alive),
#   - a user input that requires grad (a leaf too) updated in the block.
# Fix: refuse an in-place op on a parameter, a floating user input, or a view
# of either, anywhere inside an outermost autocast block (track the autocast
# nesting with the _enter/_exit_autocast markers rather than
# torch.is_autocast_enabled()).

class _Weight(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))


class ParameterViewUpdatedInsideAutocast(_Weight):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.w
            with torch.no_grad():
                self.w.view(-1).mul_(-1.0)
            b = x @ self.w
        return a, b


class ParameterUpdatedUnderNestedAutocastOff(_Weight):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.w
            with torch.autocast("cpu", enabled=False):
                with torch.no_grad():
                    self.w.mul_(-1.0)
            b = x @ self.w
        return a, b


class InputUpdatedInsideAutocast(_Weight):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.w
            with torch.no_grad():
                x.mul_(-1.0)
            b = x @ self.w
        return a, b




@pytest.mark.parametrize("module", [
    ParameterViewUpdatedInsideAutocast,
    ParameterUpdatedUnderNestedAutocastOff,
    InputUpdatedInsideAutocast])
def test_stale_autocast_cache_variants_are_refused_or_match(module):
    assert_sound(module(), inputs((3, 4)), refusal_ok=True, **BF16)


# --------------------------------------------------------------------------
# 9. (a regression of the fix for 1) export.py runs copy_pass.replace_copies
# before keep_histories: the trace recorded `v.copy_(y)` under no_grad as a
# Replacement whose `new` node is the aten.copy node, which replace_copies
# has erased, so insert_kept_histories skips it (`_alive(r.new)` is false) and
# `v` loses its autograd history (eager: v keeps its grad_fn, x gets a
# gradient). Fix: run replace_copies after keep_histories (checked: that
# makes these pass), or map the record's nodes through the rewrite.

class CopyIntoIntermediateUnderNoGrad(nn.Module):
    def forward(self, x, y):
        v = x * 2
        with torch.no_grad():
            v.copy_(y)
        return v


class CopyIntoProductOfParametersUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))
        self.u = nn.Parameter(torch.randn(4, 4, generator=g))

    def forward(self, x):
        v = self.u @ self.w
        with torch.no_grad():
            v.copy_(self.w)
        return v


@pytest.mark.parametrize("module, n_inputs", [
    (CopyIntoIntermediateUnderNoGrad, 2),
    (CopyIntoProductOfParametersUnderNoGrad, 1)])
def test_copy_under_no_grad_keeps_history(module, n_inputs):
    assert_sound(module(), inputs(*[(3, 4)] * n_inputs))


# --------------------------------------------------------------------------
# 10. A view of a view made under no_grad, taken in grad mode. Eager: the
# no_grad view does not require grad, nor does any view of it. Functional
# views are relative to their base: `v0.view(-1)` is replayed from the base
# as select+view at the point of the call, in grad mode, reading the
# keep_history'd parameter, so the output requires grad and the parameter
# gets a gradient eager never gives. (The fix for 3 materializes the view
# itself in its block, not views derived from it later.) Fixed: the recorder
# tracks views made under no_grad (and views of them) and marks the view ops
# functionalization replays for them in grad mode (in a call that reads one,
# or when an output is one); the keep-history pass leaves their inputs
# without history.

class ViewOfNoGradView(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))

    def forward(self, x):
        with torch.no_grad():
            self.w.add_(2.0)
            v0 = self.w[0]
        return v0.view(-1)


def test_view_of_no_grad_view_does_not_require_grad():
    assert_sound(ViewOfNoGradView(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 11. insert_kept_histories inserts a keep_history node for every replacement,
# used or not. For an intermediate mutated under no_grad and never read
# again the node is dead, yet it keeps the region returning the mutated
# value; the re-export of ep.module() has neither, so G7 fails (an extra
# region output and keep_history node in the first graph). Fix: skip a
# replacement whose new value has no user after the span (or run DCE on the
# pure nodes before outlining regions).

class UnusedMutatedIntermediate(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, z):
        v0 = self.p + 1.0
        with torch.no_grad():
            v0.add_(1.0)
            v2 = v0[0]
            z.add_(v2)
        return z * 2


def test_unused_keep_history_is_not_in_the_graph():
    assert_sound(UnusedMutatedIntermediate(), inputs((4,)))


# --------------------------------------------------------------------------
# 12. `@torch.set_grad_enabled(False)` applied inside forward (a local
# function) is refused: "a bare torch._C._set_grad_enabled call, outside any
# grad-mode context manager ... at unknown location". set_grad_enabled
# changes the mode in __init__ and restores it in __call__ (decoration);
# _torch.grad_mode_caller only knows __init__/__enter__/__exit__, so the
# restore in __call__ is "bare". (Decorating at class level works: that
# happens before tracing.) Valid code, so this is a spurious refusal, and
# the message has no location. Fix: treat set_grad_enabled.__call__ as the
# exit of the block its __init__ opened (then it is an empty block).

class SetGradEnabledDecoratorInForward(nn.Module):
    def forward(self, x):
        v0 = x * 2.0

        @torch.set_grad_enabled(False)
        def f0():
            return v0 * 3.0

        return f0() + v0


def test_set_grad_enabled_decorator_inside_forward():
    assert_matches_eager(SetGradEnabledDecoratorInForward(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 13. keep_history.may_require_grad runs once, before insert_kept_histories
# inserts anything, and counts a value computed under no_grad as never
# requiring grad. A parameter updated under no_grad is read through
# keep_history later, so it does require grad, and so do values computed
# from it in grad mode (here in an enable_grad block nested in the no_grad
# block); but they are missing from may_grad, so when they are mutated under
# no_grad insert_kept_histories skips them (`old not in may_grad`) and their
# history is lost: eager gives `w` a gradient, the program gives None. (The
# fuzzer's form: `self.lin.bias[0] = self.n` then `v0 = self.n + self.lin.bias`
# under enable_grad, then `v0.mul_(0)`.) Fix: let may_grad follow the
# keep_history nodes (treat a replacement's new value as requiring grad when
# its old value may), e.g. recompute it as the pass inserts them.

class MutatedUnderNoGradAfterKeptParameterUse(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))
        self.register_buffer("b", torch.randn(3, 4, generator=g))

    def forward(self, x):
        with torch.no_grad():
            self.w.add_(1.0)
            with torch.enable_grad():
                v = self.w * self.b
            v.mul_(2.0)
        return v


def test_value_made_from_kept_parameter_keeps_history():
    assert_sound(MutatedUnderNoGradAfterKeptParameterUse(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 14. (after the fixes of 5, 7 and 11) Two history-hiding updates in a row: a
# parameter changed under no_grad through a view made before the block, then
# changed again through a detached alias in grad mode. Each alone keeps the
# parameter's history; together neither keep_history is inserted and the
# parameter gets no gradient (eager: it does). The first replacement's new
# value has no user after its span (only the detached alias, made inside the
# span, is used later), so the "no dead keep_history" rule skips it; the
# second replacement then starts from that no_grad value, which is neither
# in may_grad nor kept, and is skipped too. Fix: when a replacement is
# skipped as dead, remember its old value, so a later replacement of its new
# value chains to it (old = kept_of.get(r.old) or skipped_origin.get(r.old)).

class ViewUpdateThenDetachedUpdateOfParameter(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))

    def forward(self, x):
        v0 = self.w.unsqueeze(0)
        with torch.no_grad():
            v0.mul_(2.0)
            v1 = v0.detach()
        v1.add_(2.0)
        return v0[0]


def test_view_update_then_detached_update_keeps_history():
    assert_sound(ViewUpdateThenDetachedUpdateOfParameter(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 15. Found by the long run on the final tree (seed 7): eager gives
# lin.bias a zero gradient (b takes bias's history through `b[1:] = bias`,
# then `b.copy_(...)` gives it CopyBackwards, which sends zeros), the program
# gives None. Diagnosis: v0 = b[1:] is made in grad mode; b is mutated under
# no_grad and v0 used there (`v0[0]`), so functionalization replays v0 inside
# the no_grad span; `v0.sin()` after the span reads that replay, which has no
# history. The same loses a real gradient in the smaller module of 16. Fixed:
# at each no_grad entry the recorder notes the grad-mode value of every
# grad-mode view; a view replayed inside the span is a replacement (old = that
# value), so later uses read keep_history; dead code is eliminated only after
# the history stage, which may need such an otherwise unused old value.

class BufferAliasesOfParameterThenOverwritten(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)
        self.register_buffer("b", torch.randn(3, 4, generator=g))

    def forward(self, x):
        v0 = self.b[1:]
        self.b[1:] = self.lin.bias
        self.b.copy_(torch.full_like(self.b, 1.0))
        v1 = self.b.float()
        with torch.set_grad_enabled(True):
            with torch.no_grad():
                v1[:, 1:3] = 2.0
                v2 = v0[0]
            v6 = v0.sin()
        return (v6, v2)


def test_zero_gradient_through_overwritten_buffer_aliases():
    assert_sound(BufferAliasesOfParameterThenOverwritten(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 16. (found while diagnosing 15) A view made in grad mode, its base mutated
# under no_grad and the view used there, then used again in grad mode: eager
# sends the gradient through the view to the base's history; the program read
# the view's replay inside the span and gave the input no gradient at all.

class ViewReplayedInsideNoGrad(nn.Module):
    def forward(self, x):
        w2 = x * 1.0
        v0 = w2[0]
        with torch.no_grad():
            w2.add_(1.0)
            s = v0.sum()
        return v0 * 3 + s


def test_view_replayed_inside_no_grad_keeps_history():
    assert_sound(ViewReplayedInsideNoGrad(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 17. (found by a 3000-program run, seed 23, after the fix of 15) G7: the
# first export kept an unused lifted constant (`-1.0` of `v0[:, 1:3] = -1.0`)
# as a CONSTANT_TENSOR input. The trace keeps replaced values alive for the
# history stage, so torch lifted the constant they read; when the history
# stage did not need them, they died, and the constant's input stayed.
# Fixed: the dead-code stage also drops constants only dead code read.

class ConstantReadOnlyByAnUnneededReplacedValue(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)

    def forward(self, y):
        v0 = y @ self.w
        v0.mul_(0)
        with torch.autocast("cpu", enabled=False):
            v2 = v0 * 2.0
        v0[:, 1:3] = -1.0
        with torch.no_grad():
            v0.sub_(0.5)
            v4 = v2.float()
        v0.add_(v0)
        return v4


def test_unused_lifted_constant_is_not_an_input():
    assert_sound(ConstantReadOnlyByAnUnneededReplacedValue(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 18. (fifth session: found once assert_matches_eager compared which outputs
# have a history under a no_grad caller, seeds 1111 and 1313) An update in the
# code that runs in the caller's grad mode (outside every grad block), here
# `v1[0] = ...` on a value made in an enable_grad block: under a caller's
# no_grad eager keeps v1's history; the program computed the new value under
# no_grad, without it. Fixed: the recorder sees writes where
# functionalization does (the view `v1[0]` is made inside __setitem__, so the
# call's own tensors are noted too) and later reads that can show a history
# get keep_history_if_no_grad(old, new).

class UpdateInTheCallersModeThroughIndexAssignment(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(4, 4)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)

    def forward(self, y):
        @torch.enable_grad()
        def f0():
            v0 = self.lin.weight.float()
            v1 = v0 + v0
            return (v0, v1,)
        _, v1, = f0()
        v1[0] = self.lin.bias
        return v1


def test_update_in_the_callers_mode_keeps_history_under_no_grad():
    assert_sound(UpdateInTheCallersModeThroughIndexAssignment(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 19. (same comparison, seed 1313) A view made inside an enable_grad block of a
# tensor mutated before: functionalization replays it from its base when the
# output is read, after the forward, in the caller's mode; under no_grad the
# output had no history. The recorder brought views up to date only where the
# trace's grad mode changed (enable_grad inside grad mode changes nothing).
# Fixed: at every grad-mode marker.

class ViewOfAMutatedTensorReturnedFromEnableGrad(nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            h = x * 2
            h.mul_(0.9)
            v = h.unsqueeze(0)
        return v


def test_view_made_in_enable_grad_keeps_its_history_when_returned():
    assert_sound(ViewOfAMutatedTensorReturnedFromEnableGrad(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 20. (seed 1313, five programs; also in the code of the fourth session) The
# program failed at run time: "view size is not compatible with input
# tensor's size and stride". `b.view(4, 3).t().copy_(x)`: functionalization
# replays the base as `view(t(copy), [3, 4])`; the copy pass wrote copy as
# `where(True, src, dst)`, laid out as src (contiguous), so `t()` of it is not
# viewable as [3, 4] (the fake values, copied from copy's, said dst's
# strides). Fixed: `where(False, dst, src)` is laid out as dst, like copy.

class CopyThroughATransposedView(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        with torch.no_grad():
            v0 = self.b.view(4, 3)
            v0.t().copy_(x)
        return v0.t()


def test_copy_into_a_transposed_view_keeps_the_layout():
    assert_sound(CopyThroughATransposedView(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 21. (seed 1515; also in the code of the fourth session) A view of a view made
# under no_grad, returned: functionalization replays it from its base after
# the forward, in grad mode. 10's fix keeps keep_history out of such replays,
# but here the base itself was computed in grad mode: the output had a
# history (and the input a gradient) eager never gives. Fixed: a replay of a
# no_grad view reads detach(base).

class ViewOfANoGradViewOfAGradTensor(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        v0 = x + x
        v0.mul_(0.9)
        with torch.no_grad():
            v1 = v0[0]
        v2 = v1.view(-1)
        self.b.copy_(v1)
        return (v2, v1)


def test_replayed_view_of_a_no_grad_view_has_no_history():
    assert_sound(ViewOfANoGradViewOfAGradTensor(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 22. (seed 1515) An in-place update of a detached alias whose operand got its
# history back from keep_history (mutated under no_grad before): eager gives
# the alias that history, which the graph cannot carry; 7's refusal checked
# the operand's raw no_grad value, which has none, and exported a program
# whose output had no history. Fixed: the operand's kept history counts.
# Since the eighth session the alias's own history is kept (a snapshot of the
# update, read through keep_history): exported, and compared with eager.

class DetachedAliasUpdatedWithAKeptHistory(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = self.w.sum(0)
        with torch.no_grad():
            v0.mul_(0.9)
        v2 = (x @ self.w).detach()
        v2.mul_(v0)
        return v2


def test_detached_alias_updated_with_a_kept_history_has_it():
    assert_sound(DetachedAliasUpdatedWithAKeptHistory(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 23. (seed 1616) Two views of a tensor made in an enable_grad block; one is
# updated in the caller's mode (or the base under no_grad), the other
# returned. Functionalization replays the returned view from the updated base
# after the forward, in the caller's mode: under a caller's no_grad the replay
# was a view made under no_grad, without history, while eager's view (made in
# grad mode) keeps one. Fixed: the recorder replays such output views itself,
# marked with where they were made; replays of views made in a block that set
# grad on get an enable_grad block.

class OtherViewOfABaseUpdatedInTheCallersMode(nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            h = x * 2
            a = h.unsqueeze(0)
            b = h.unsqueeze(1)
        a.mul_(3)
        return b


class ViewOfABaseUpdatedUnderNoGradAfterEnableGrad(nn.Module):
    def forward(self, x):
        with torch.enable_grad():
            h = x * 2
            b = h.unsqueeze(1)
        with torch.no_grad():
            h.mul_(3)
        return b


@pytest.mark.parametrize("module", [OtherViewOfABaseUpdatedInTheCallersMode(),
                                    ViewOfABaseUpdatedUnderNoGradAfterEnableGrad()])
def test_returned_view_made_in_enable_grad_is_replayed_in_grad_mode(module):
    assert_sound(module, inputs((3,)))


# --------------------------------------------------------------------------
# 24. (seed 1818) A buffer updated inside an enable_grad block with a value
# that has a history, then returned, under a caller's no_grad: eager's buffer
# has that history; the program wrote the new value back in the caller's
# mode and returned the buffer without it. Fixed: a value with a history is
# written back in grad mode (a leaf parameter still under no_grad).

class BufferUpdatedWithAHistoryInsideEnableGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.zeros(3, 4))

    def forward(self, x):
        with torch.enable_grad():
            self.b[0] = self.lin.bias
        return x * 2, self.b


def test_buffer_updated_with_a_history_inside_enable_grad_keeps_it():
    assert_sound(BufferUpdatedWithAHistoryInsideEnableGrad(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 25. (seed 2020) As 23, with the view replayed where it is next read (a
# product in the caller's mode) rather than after the forward, and the base
# updated through a detached alias. Fixed: once the forward has entered a
# grad block, the recorder replays a grad-mode view read by a call itself,
# marked, before the call.

class GradModeViewReadAfterAHiddenUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        with torch.enable_grad():
            v0 = self.p[0]
        v0.detach().add_(-1.0)
        return x[0] * v0, v0


def test_grad_mode_view_read_after_a_hidden_update_keeps_its_history():
    assert_sound(GradModeViewReadAfterAHiddenUpdate(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 26. (seed 2222) As 25, with the view replayed by the recorder's own
# bookkeeping (bringing the values a segment wrote up to date at the next
# grad-mode marker) rather than by a call reading it: the replay was not
# marked. Fixed: every sync the recorder makes marks grad-mode view replays.

class GradModeViewReplayedAtTheNextMarker(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        with torch.enable_grad():
            v0 = self.p.view(-1)
            with torch.no_grad():
                v1 = v0.detach()
        v1.mul_(2.0)
        with torch.no_grad():
            v5 = x * 2
        return v5, v0


def test_grad_mode_view_replayed_by_the_recorder_keeps_its_history():
    assert_sound(GradModeViewReplayedAtTheNextMarker(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 27. (seed 81) Views made in an enable_grad block of a value with a history,
# updated in place in the caller's mode, one returned. Under a no_grad
# caller eager keeps the history (an update under no_grad), and the returned
# view shows it; the program's replay of the view, in an enable_grad block
# (it was made in one), reads the updated base without the kept history:
# the caller-mode keep went after the segment, not before that replay
# block. Fixed: the keep goes in the caller's mode before the first replay
# of the value in an enable_grad block (also when the segment goes on after).

class GradModeViewsUpdatedInTheCallersMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.enable_grad():
            v0 = self.lin(self.lin.weight)
            v2 = v0.t()
            v3 = v2[:, 1:3]
        v3.zero_()
        v2.mul_(0.9)
        return v3


def test_grad_mode_views_updated_in_the_callers_mode_keep_their_history():
    assert_sound(GradModeViewsUpdatedInTheCallersMode(), inputs((3, 4)))


class GradModeViewsUpdatedThenAnEmptyBlock(GradModeViewsUpdatedInTheCallersMode):
    def forward(self, x):
        with torch.enable_grad():
            v0 = self.lin(self.lin.weight)
            v2 = v0.t()
            v3 = v2[:, 1:3]
        v2[:, 0] = 1.0
        v3.zero_()
        v2.mul_(0.9).add_(v2, alpha=0.1)
        with torch.no_grad():  # the marker replays v3 in the middle of the segment
            pass
        return v3


def test_grad_mode_views_replayed_inside_the_segment_keep_their_history():
    assert_sound(GradModeViewsUpdatedThenAnEmptyBlock(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 28. (seed 87) A view made under no_grad of a value updated under no_grad,
# viewed again in grad mode and returned (twice): eager's views have no
# history; the program's replay of the output view has one. Fixed in the
# eleventh session: every replay of a view made under no_grad (or of a view
# of one), wherever functionalization makes it (at a grad-mode marker, at
# the output), reads its base without history, not only replays made by the
# op reading the view.

class NoGradViewOfAnUpdatedValueViewedInGradMode(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, y):
        with torch.set_grad_enabled(True):
            v0 = self.n * y
            with torch.enable_grad():  # noqa: SIM117 (the fuzzer's nesting, kept)
                with torch.set_grad_enabled(False):
                    v0.mul_(v0)
                    v1 = v0[1:]
                    v2 = self.n.unsqueeze(0)
            v3 = v1[:, 0]
        with torch.set_grad_enabled(True):
            @torch.enable_grad()
            def f0():
                self.b[0] = v2
            f0()
            with torch.enable_grad():
                pass
        return (v3, v2, v3)


def test_no_grad_view_of_an_updated_value_viewed_in_grad_mode():
    assert_sound(NoGradViewOfAnUpdatedValueViewedInGradMode(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 29. (seeds 9003-9005, eighth session) A detached alias updated in grad mode
# with an operand that requires grad (a leaf made in the forward, a
# parameter): eager gives the alias, and every view of the detach result it
# belongs to, the update's history; they were refused. Now kept: reads of
# them, which functionalization replays from memory through the detach, read
# keep_history(the update, value); views made before the update regenerate
# theirs from it (as_strided of the update), as eager's autograd does.

class ViewsOfADetachedAliasUpdatedWithALeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = self.bias.detach()
        v1 = v0[1:]  # made before the update
        v0.add_(2.0)
        with torch.no_grad():
            v4 = v0.detach().requires_grad_()
        v5 = v4.detach().requires_grad_()
        v0.sub_(v5)  # v0, and v1 with it, get the leaf's history
        return v1 * 1.0, v0.unsqueeze(0)


class DetachedAliasIndexAssignedAParameter(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = x.detach()
        v0.add_(2.0)
        v2 = v0.detach().requires_grad_()
        v0[0] = self.lin.bias
        return v2, v0


class UpdatedAgainInTheCallersMode(nn.Module):
    """The alias's own history (from an enable_grad block) is where its later
    caller's-mode updates start."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        with torch.enable_grad():
            v0 = self.lin(self.p)
            v1 = torch.sigmoid(v0)
            v2 = v0.detach()
            v2.add_(v1)
        v2.mul_(0.9).add_(x, alpha=0.1)
        return -v2


class ViewOfTheDetachResultUpdated(nn.Module):
    """An update through a view of a detach result gives the detach result
    (its autograd base) the history."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = self.b.detach()
        v0.mul_(v0)
        with torch.enable_grad():
            v2 = v0.unsqueeze(0)
        v2[0] = self.lin.bias.unsqueeze(0)
        return v0


@pytest.mark.parametrize("module", [ViewsOfADetachedAliasUpdatedWithALeaf(),
                                    DetachedAliasIndexAssignedAParameter(),
                                    UpdatedAgainInTheCallersMode(), ViewOfTheDetachResultUpdated()],
                         ids=lambda m: type(m).__name__)
def test_detached_aliases_updated_with_a_history_keep_it(module):
    assert_sound(module, inputs((3, 4)))


# --------------------------------------------------------------------------
# 30. (seed 9007, eighth session; pre-existing, hidden by a refusal) A buffer
# updated in an enable_grad block, then through a view in the caller's mode,
# then through another view by a hidden no_grad block (nn.init.constant_):
# the hidden update's kept history chained to the value before the caller's-
# mode update, dropping it (the gradient missed its factor 0.9). Fixed: a
# no_grad or hidden update after a caller's-mode one whose history no read
# showed keeps keep_history_if_no_grad of it (the update's history in grad
# mode, the first one's under no_grad).

class HiddenUpdateAfterACallersModeUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        with torch.enable_grad():
            self.b.mul_(self.bias)
            v0 = self.b.view(4, 3)
        v2 = v0.t()
        v0.mul_(0.9)
        torch.nn.init.constant_(v2, 0.5)
        return v2[:, 1:3]


def test_a_hidden_update_after_a_callers_mode_update_keeps_its_history():
    assert_sound(HiddenUpdateAfterACallersModeUpdate(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 31. (CI profile, ninth session, the generator's aliased inputs) f(x, x, z)
# with only z mutated: inputs that alias but are only read compute the same
# either way, yet ep.module() checked every input group against the pattern
# seen at export and refused the call. Fixed: only groups holding a mutated
# input are traced as views and checked at run time.

class AliasedReadsAnotherMutated(nn.Module):
    def forward(self, x, y, z):
        with torch.no_grad():
            z.add_(2.0)
        return x.sin() + y.cos()


def test_aliased_inputs_only_read_beside_a_mutated_one():
    x, z = inputs((3, 4), (4,))
    assert_sound(AliasedReadsAnotherMutated(), (x, x, z))
    m = predispatch.export_predispatch(AliasedReadsAnotherMutated(), (x, x, z.clone())).module()
    with pytest.raises(RuntimeError, match="share memory otherwise"):
        m(x, x, x[0])  # now the mutated input aliases the others: refused, not miscomputed


# --------------------------------------------------------------------------
# 32. (CI profile, ninth session) An input given another shape by set_ under
# no_grad, then used in grad mode: eager's leaf takes a gradient of its new
# shape, the program's input could not ("_HistoryBackward returned an invalid
# gradient"). Refused now; ``unsqueeze_(0)`` (the gradient reduces to the old
# shape and copies back losslessly) and the input returned as it is still export.

class InputSetToAnotherShape(nn.Module):
    def forward(self, x, z):
        with torch.no_grad():
            x.set_(z)
        return x * 2


class InputUnsqueezedInPlace(nn.Module):
    def forward(self, x):
        with torch.no_grad():
            x.unsqueeze_(0)
        return x * 2


def test_an_input_set_to_another_shape_then_differentiated_is_refused():
    with pytest.raises(predispatch.ExportError, match="given another shape.*under no_grad.*x.set_"):
        predispatch.export_predispatch(InputSetToAnotherShape(), inputs((3, 4), (4,)))
    assert_sound(InputUnsqueezedInPlace(), inputs((3, 4)), inputs_require_grad=True)


# --------------------------------------------------------------------------
# 33. (seed 9101, ninth session) An intermediate given a buffer's storage by
# set_ under no_grad keeps its autograd history (eager's set_ under no_grad
# does), and an index assignment in grad mode then computes from it: the
# untouched part's gradient reached the Linear in eager, nothing in the
# program (the update was replayed from the buffer's memory, without history).
# 34. (found diagnosing 33) A detached alias updated twice in grad mode: the
# second update lost the first one's history for the part it does not write.
# Fixed: an in-place update, in grad mode, of a tensor with a history of its
# own is traced on a copy carrying that history, whose values are then
# written to the tensor's memory; set_ gives its target that own history.
# 35. (CI profile, ninth session) A layout change (unsqueeze_, t_) of such a
# tensor in grad mode changes its history's layout as well.

class SwappedIntermediateUpdatedInGradMode(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        v1 = self.lin(x.detach().requires_grad_())
        with torch.no_grad():
            v1.set_(self.b)
        v1[:, 1:3] = self.n
        return v1


class DetachedAliasUpdatedTwiceInGradMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        t = self.b.detach()
        t.mul_(x)
        t[:, 1:3] = 0.0
        return t * 1


class SwappedIntermediateRelaidInGradMode(nn.Module):
    def __init__(self, relayout):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)
        self.relayout = relayout

    def forward(self, x):
        v0 = x @ self.w
        v1 = v0 * 2.0
        with torch.no_grad():
            v1.set_(v0)
        self.relayout(v1)
        return v0.detach(), v1 * 3


@pytest.mark.parametrize("module", [
    SwappedIntermediateUpdatedInGradMode(), DetachedAliasUpdatedTwiceInGradMode(),
    SwappedIntermediateRelaidInGradMode(lambda t: t.unsqueeze_(0)),
    SwappedIntermediateRelaidInGradMode(lambda t: t.t_()),
], ids=["set_-then-setitem", "detached-alias-twice", "set_-then-unsqueeze_", "set_-then-t_"])
def test_an_update_in_grad_mode_computes_from_the_tensor_s_own_history(module):
    assert_sound(module, inputs((3, 4)), inputs_require_grad=True)


# --------------------------------------------------------------------------
# 36. (seeds 9202-9204, ninth session) A tensor with a history given another
# shape by set_ under no_grad, then read or returned: eager's backward feeds
# the old history gradients of the new shape, which its nodes sum, broadcast
# or index as their formulas happen to (Linear's bias got 2 in eager where a
# reduction gives 8); the program raised in backward or differed. Refused now
# (32 is the case of a parameter or input).
# 37. (seed 9202) A set_ target updated by a hidden no_grad block before the
# swap: its history is the one the history stage keeps across that update,
# not the update's value (the program's output had none).

class IntermediateSetToAnotherShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v2 = self.lin(x.sum(0))
        with torch.no_grad():
            v2.set_(self.lin.weight)
        return v2 * 2.0


class SwappedAfterAHiddenUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))

    def forward(self, y):
        v1 = self.p @ self.w
        torch.nn.init.zeros_(v1)
        with torch.no_grad():
            v1.set_(y)
        return v1


def test_a_tensor_set_to_another_shape_keeping_its_history_is_refused():
    assert_refused_where_eager_views(IntermediateSetToAnotherShape(), inputs((3, 4)),
                                     r"another shape \(4, 4\).*v2.set_")


def test_a_set__target_keeps_the_history_kept_across_a_hidden_update():
    assert_sound(SwappedAfterAHiddenUpdate(), inputs((3, 4)), inputs_require_grad=True)


# --------------------------------------------------------------------------
# 38-42. (seeds 9201-9204, ninth session; 38-40 open), found by the generator's new
# kinds (layout changes, set_, aliased inputs):
# 38. an intermediate's layout changed in grad mode (transpose_), updated by a
#     hidden no_grad block, then by an index assignment in grad mode: the
#     output has no history (functionalization makes the relaid tensor a view
#     of its old value, replayed from the no_grad update without history).
# 39. likewise with unsqueeze_, a no_grad copy_ and an update through a view.
# 40. an input set_ to a view of an intermediate: values right, but the
#     program re-laid the input as a compact tensor where eager leaves it a
#     strided view into the intermediate's storage. Fixed (eleventh session):
#     the write-back lays the value out on a storage of its own as eager's was.
# 41. a parameter's memory updated through a tensor set_ to it, after autograd
#     saved the parameter: set_ does not share the version counter, so eager
#     computes the gradient from the updated value unchecked; the program from
#     the value it had. Fixed: refused (an op that read the value before the
#     update, or made it with a backward reading its output, as relu's does).
# 42. a leaf made in the forward set_ to the parameter it was detached from,
#     then read in grad mode: the trace's own autograd raised "A view was
#     created in no_grad mode ... modified inplace" (set_ was traced as set_ to
#     an alias made under no_grad). Fixed: the alias is made with grad on.
# 43. (seed 9303) as 38: unsqueeze_ in grad mode, then a hidden no_grad update.
# 38, 39, 43 fixed in the tenth session with 54 (below). (43's test had
# called the module instance with no input, so its xfail hid a TypeError.)

class RelaidThenHiddenUpdateThenSetitem(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        v1 = self.p @ self.w
        v1.transpose_(0, 1)
        torch.nn.init.zeros_(v1)
        v1[0] = self.n
        return v1


class UnsqueezedThenNoGradCopyThenViewUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v0 = self.lin(self.s)
        v0.unsqueeze_(0)
        with torch.no_grad():
            v0.copy_(torch.full_like(v0, -1.0))
        v4 = v0[:, 1:3]
        v4.mul_(0.9).add_(v4, alpha=0.1)
        return v0


class InputSetToAViewOfAnIntermediate(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = self.lin.weight.relu()
        with torch.no_grad():
            x.set_(v0[:, 1:3])
        return v0.relu()


class SavedParameterUpdatedThroughASwap(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = self.w @ self.w
        with torch.no_grad():
            v0.set_(self.w)
        v0[0] = 2.0
        return v0


class LeafSetToItsSource(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))
        self.bias = nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x):
        v0 = self.bias.detach().requires_grad_()
        with torch.no_grad():
            v0.set_(self.bias)
        v3 = v0 @ self.w
        return self.w * v3.sum()


@pytest.mark.parametrize("module, require", [
    (RelaidThenHiddenUpdateThenSetitem(), True),
    (UnsqueezedThenNoGradCopyThenViewUpdate(), False),
    (InputSetToAViewOfAnIntermediate(), False),
])
def test_open_mutation_bugs_of_the_ninth_session(module, require):
    assert_sound(module, inputs((3, 4)), inputs_require_grad=require)


def test_an_update_through_a_swap_of_a_saved_value_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"set_\(\) made shared.*v0\[0\] = 2.0|v0\[0\] = 2.0.*set_\(\) made shared"):
        predispatch.export_predispatch(SavedParameterUpdatedThroughASwap(), inputs((3, 4)))


def test_a_leaf_set_to_its_source_then_read():
    assert_sound(LeafSetToItsSource(), inputs((3, 4)), inputs_require_grad=False)


# --------------------------------------------------------------------------
# 44. (seeds 9402, 9403, ninth session) A tensor set_ to a source of another
# shape, then indexed in Python: the trace's tensor wrapper kept its old
# shape (torch's functionalization updates the wrapper for other layout
# changes, not for set_), and indexing raised a raw IndexError. Fixed: the
# wrapper takes the new layout.

class SetToAnotherShapeThenIndexed(nn.Module):
    def forward(self, x):
        h = torch.zeros(())
        with torch.no_grad():
            h.set_(x)
        h[0] = 1.0
        return h * x.sum()


def test_a_tensor_set_to_another_shape_is_indexed_as_that_shape():
    assert_sound(SetToAnotherShapeThenIndexed(), inputs((3, 4)), inputs_require_grad=False)


# --------------------------------------------------------------------------
# 45. (seed 9502, ninth session) f(x, x[2]) returning the view input as it is
# while x is updated through a detached alias, under a no_grad caller: eager
# returns the caller's tensor (a view with a history), the program a view it
# computed under no_grad. Fixed: an input seen through another and returned
# as it is is the caller's tensor.
# 46. (seed 9502) A tensor with a history (not a view's) set_ to a parameter
# of another shape, then updated in grad mode: the update lost the history
# autograd reduces the gradient into (eager's CopySlices reaches the bias).
# 47. (seed 9504) An update through a set_() target inside a library call
# (nn.init.constant_) of memory autograd saved: now seen and refused (41).

class ViewInputReturnedAsItIs(nn.Module):
    def forward(self, y, z):
        v0 = y.detach()
        v0.add_(1.0)
        return z


class SwappedToAnotherShapeThenUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.bias = nn.Parameter(torch.randn(4, generator=g))

    def forward(self, x):
        v0 = self.bias + 1.0
        with torch.no_grad():
            v0.set_(self.p)
        v0[1:] = -1.0
        return v0


class SavedValueUpdatedInALibraryCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = torch.sigmoid(self.p)
        v2 = (v0 * 2).sin()
        v2.set_(v0)
        torch.nn.init.constant_(v2, 0.5)
        return v0.sum()


def test_a_view_input_returned_as_it_is_is_the_caller_s():
    x = inputs((3, 4))[0]
    assert_sound(ViewInputReturnedAsItIs(), (x, x[2]))  # under a caller's grad mode on and off


def test_a_tensor_set_to_another_shape_then_updated_keeps_its_history():
    assert_sound(SwappedToAnotherShapeThenUpdated(), inputs((3, 4)))


def test_a_saved_value_updated_through_a_swap_in_a_library_call_is_refused():
    with pytest.raises(predispatch.ExportError, match="set_\\(\\) made shared"):
        predispatch.export_predispatch(SavedValueUpdatedInALibraryCall(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 48. (seeds 9601, 9603, 9604, ninth session) A tensor without a history set_
# to a parameter under no_grad, then read (directly, through a view, after a
# copy_ or an update through a detached alias): its own history is none, but
# dropping that empty history read the value, which carried the parameter's
# history (the program's output required grad, eager's did not). Fixed: such
# a read is the value detached, and reads of it lose their history in turn.

class HistorylessSetToAParameter(nn.Module):
    def __init__(self, after):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))
        self.bias = nn.Parameter(torch.randn(4, generator=g))
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.after = after

    def forward(self, x):
        v0 = self.b * 2.0
        with torch.no_grad():
            v0.set_(self.w)
        return self.after(self, v0)


def _through_a_detached_alias(m, v0):
    v1 = v0.detach()
    v1.mul_(v1)
    return v0[0]


def _copied_then_viewed(m, v0):
    v0.copy_(v0)
    return v0.t()


def _zeroed_then_assigned(m, v0):
    v0.mul_(0)
    v0[:, 0] = m.bias
    return v0


@pytest.mark.parametrize("after", [_through_a_detached_alias, _copied_then_viewed, _zeroed_then_assigned])
def test_a_historyless_tensor_set_to_a_parameter_has_no_history(after):
    assert_sound(HistorylessSetToAParameter(after), inputs((3, 4)), inputs_require_grad=True)


# --------------------------------------------------------------------------
# 49. (seed 9604, ninth session) f(y, y[1]) where the forward relays y
# (y.t_()) and then uses the view input in an op that saves it: eager's t_()
# bumped the version before the op saved the view; the program's layout
# write-back bumped it after, and backward raised "modified by an inplace
# operation". Fixed: a layout write-back keeps the version counter.

class RelaidInputBesideItsView(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, y, z):
        y.t_()
        return z @ self.w


def test_a_relaid_input_beside_its_view_saved_for_backward():
    y = inputs((3, 4))[0]
    assert_sound(RelaidInputBesideItsView(), (y, y[1]), inputs_require_grad=False)


# --------------------------------------------------------------------------
# 50-55. (seeds 9801-9804, tenth session)
# 50. keep_history(old, new) took new's history where only old's is meant
#     (old requires no grad): an autograd.Function's output requires grad when
#     any input does. A detached alias of an input that requires no grad,
#     updated with a parameter, left the input requiring grad; likewise a
#     set_() target's memory. Fixed: the history not taken is detached.
# 51. A buffer updated in a grad block, then by an index assignment in the
#     caller's mode, returned, under a no_grad caller: eager's buffer keeps the
#     grad block's history; the program's output was the write-back value,
#     computed under no_grad. Fixed: only an input's own old value is skipped
#     (the write-back returns the tensor itself); a value computed in the
#     graph keeps its history.
# 52. The first update in grad mode of a detached alias of part of its base
#     (x.view(...).detach(), x[1:4].detach(), and views of those), with an
#     operand that requires grad: the alias's own history was found only where
#     the base's new value showed it (a direct scatter). Fixed: traced on a
#     copy of the alias, as later updates already were.
# 53. torch 2.13's derivative of as_strided_scatter for `self` is wrong
#     (gradcheck fails): a write through an as_strided view (the user's, or
#     a detached alias's copy above) gave wrong gradients. Fixed: the write
#     is rewritten as where(written, as_strided_scatter(zeros, src), self).
# 54. A value relaid in grad mode (unsqueeze_), then updated under no_grad,
#     by a hidden block or through a detached alias: functionalization keeps
#     it as a view of its old value, replayed from the updated base at each
#     read, so the kept history sat on one replay and later reads lost it.
#     Fixed: a replacement of the same view of two bases is the bases'.
# 55. An input given another shape under no_grad (set_) read by an op whose
#     output is relaid under no_grad (unsqueeze_) and returned: the refusal's
#     reachability check ran before that output's history was kept, so it saw
#     no gradient path, and backward raised. Fixed: checked once every history
#     is kept; a kept history passes a gradient in any mode.

class DetachedAliasOfAnInputUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, z):
        v0 = z.detach()
        v0.sub_(self.bias)
        return torch.sigmoid(z)


class SetToAnInputThenUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, y):
        v0 = self.bias.sin()
        with torch.no_grad():
            v0.set_(y)
        v0.sub_(v0)
        return y


class BufferUpdatedInAGradBlockThenAssigned(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        with torch.enable_grad():
            self.b.mul_(0.9).add_(self.p, alpha=0.1)
        self.b[:, 0] = self.n
        return self.b


@pytest.mark.parametrize("module", [DetachedAliasOfAnInputUpdated(), SetToAnInputThenUpdated()])
def test_a_kept_history_requires_grad_as_its_old_value(module):
    x = inputs((4,))[0] if isinstance(module, DetachedAliasOfAnInputUpdated) else inputs((3, 4))[0]
    assert_sound(module, (x,), inputs_require_grad=False)


def test_a_buffer_given_a_history_in_a_grad_block_keeps_it_under_a_no_grad_caller():
    assert_sound(BufferUpdatedInAGradBlockThenAssigned(), inputs((3, 4)), inputs_require_grad=True)


class PartialDetachedAliasUpdated(nn.Module):
    def __init__(self, update):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.q = nn.Parameter(torch.randn(3, generator=g))
        self.register_buffer("b", torch.randn(5, 4, generator=g))
        self.register_buffer("n", torch.zeros(()))
        self.update = update

    def forward(self, x):
        return self.update(self, x)


def _viewed_parameter_assigned_a_leaf(m, x):  # the fuzzer's (seed 9803)
    v2 = m.n.detach().requires_grad_()
    v4 = m.p.view(4, 3).detach()
    v4[1:] = v2
    return v4


def _viewed_parameter_assigned_a_parameter(m, x):
    v4 = m.p.view(4, 3).detach()
    v4[1:] = m.q
    return v4 * 2


def _strided_part_multiplied_by_an_input(m, x):
    v4 = m.p[:, ::2].detach()
    v4.mul_(x[:, :2])
    return v4, m.p


def _rows_of_a_buffer_then_a_view_updated(m, x):  # also 53: a view of the alias's copy
    v4 = m.b[1:4].detach()
    v4.add_(x)
    w = v4[0]
    w.mul_(m.q[0])
    return v4, w


@pytest.mark.parametrize("update", [_viewed_parameter_assigned_a_leaf, _viewed_parameter_assigned_a_parameter,
                                    _strided_part_multiplied_by_an_input, _rows_of_a_buffer_then_a_view_updated])
@pytest.mark.parametrize("require", [False, True])
def test_a_first_update_of_a_detached_alias_of_part_of_its_base(update, require):
    assert_sound(PartialDetachedAliasUpdated(update), inputs((3, 4)), inputs_require_grad=require)


class WrittenThroughAnAsStridedView(nn.Module):
    def forward(self, x):
        y = x * 1
        y.as_strided([2], [2], 1).mul_(3)
        return y


def test_a_write_through_an_as_strided_view_has_eagers_gradient():
    assert_sound(WrittenThroughAnAsStridedView(), inputs((3, 4)), inputs_require_grad=True)


class RelaidThenUpdatedUnseen(nn.Module):
    def __init__(self, update):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))
        self.update = update

    def forward(self, z):
        v0 = -z
        v0.unsqueeze_(0)
        self.update(self, v0)
        return v0.t()


def _assigned_under_no_grad(m, v0):
    with torch.no_grad():
        v0[:, 1:3] = m.n


def _assigned_through_a_detached_alias(m, v0):
    v0.detach()[:, 1:3] = m.n


def _multiplied_under_no_grad(m, v0):
    with torch.no_grad():
        v0.mul_(2)


def _through_a_detached_alias_of_a_leaf(m, v0):  # the fuzzer's (seed 9803)
    v1 = v0.detach().requires_grad_()
    v1.detach()[:, 1:3] = m.n


@pytest.mark.parametrize("update", [_assigned_under_no_grad, _assigned_through_a_detached_alias,
                                    _multiplied_under_no_grad, _through_a_detached_alias_of_a_leaf])
def test_a_value_relaid_in_grad_mode_keeps_its_history_across_an_unseen_update(update):
    assert_sound(RelaidThenUpdatedUnseen(update), inputs((4,)), inputs_require_grad=True)


class InputSwappedThenReadByARelaidOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        @torch.set_grad_enabled(False)
        def f0():
            x.set_(self.s)
            with torch.enable_grad():
                v0 = self.lin(x)
            v0.unsqueeze_(0)
            return v0
        return f0()


def test_a_reshaped_input_reached_through_a_later_kept_history_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"given another shape \(4,\) under no_grad"):
        predispatch.export_predispatch(InputSwappedThenReadByARelaidOutput(), inputs((3, 4)))


# --------------------------------------------------------------------------
# 56-57. (seeds 9901-9903, tenth session) Refusals that were not needed:
# 56. an update through a set_() target of memory an op had read was refused
#     for any reading op; only one whose backward saves that operand (per
#     torch's derivative formulas: mul saves its factors, add and clone
#     nothing, predispatch's own ops nothing) and that a gradient reaches
#     from an output matters; a sharer with the writer's version counter is
#     eager's own check's business. (The update's own ops were counted as
#     readers too.)
# 57. set_() to the memory the tensor has (itself: `v.float()` of a float32
#     tensor is the tensor; a view of itself) froze its storage in
#     functionalization, so a later update was refused; it is a new layout at
#     most, traced as as_strided_ (nothing where the layout is the same).

class SharedMemoryReadBeforeTheUpdate(nn.Module):
    def __init__(self, forward):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))
        self.q = nn.Parameter(torch.randn(3, 4, generator=g))
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.body = forward

    def forward(self, x):
        return self.body(self, x)


def _saved_by_an_op_no_output_differentiates(m, x):
    v0 = m.p[1:]
    v1 = m.lin(v0)  # saves v0 for the weight's gradient, which nothing asks for
    with torch.no_grad():
        v1.set_(v0)
    v1.sub_(v1)
    return x * 2


def _read_by_ops_that_save_nothing(m, x):
    v3 = m.q + x
    v2 = x.clone()
    with torch.no_grad():
        v2.set_(x)
    v2[0] = 0.0
    return v3, x


def _read_as_a_leaf(m, x):
    v1 = m.w.detach().requires_grad_()
    v2 = v1.unsqueeze(0)
    h = m.b * 1.0
    with torch.no_grad():
        h.set_(m.w)
    h.copy_(torch.full_like(h, 2.0))
    return v2


def _set_to_a_view_of_itself(m, x):
    v0 = m.b.sin()
    v1 = v0.view(-1)
    with torch.no_grad():
        v0.set_(v1)
    torch.nn.init.zeros_(v0)
    return v1 + 1.0


def _set_back_to_itself(m, x):
    v1 = x @ m.w
    v1.mul_(0.9).add_(x, alpha=0.1)
    v0 = torch.sigmoid(m.b)
    with torch.no_grad():
        v0.set_(v1)
        v1.set_(v0)
    v0.mul_(0)
    return v1.unsqueeze(0), v1


@pytest.mark.parametrize("body", [_saved_by_an_op_no_output_differentiates, _read_by_ops_that_save_nothing,
                                  _read_as_a_leaf, _set_to_a_view_of_itself, _set_back_to_itself])
def test_updates_of_shared_memory_eager_runs_soundly(body):
    assert_sound(SharedMemoryReadBeforeTheUpdate(body), inputs((3, 4)), inputs_require_grad=False)


# --------------------------------------------------------------------------
# 58. (seed 9901, tenth session; a regression of 54) A tensor set_() to one
# parameter, then to another: the two swaps' values are the same view
# (alias) of two parameters, and 54's rule lifted the replacement to them,
# so later reads of the second parameter carried the first one's history.
# Fixed: a replacement is lifted to the bases only where the new base is
# computed from the old. (Exported then, not refused: a parameter or input
# relaid under no_grad whose value reaches no output but its own write-back,
# the caller's tensor with its own history.)

class SwappedFromOneParameterToAnother(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))
        self.p = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x):
        with torch.no_grad():
            x.set_(self.w)
        with torch.no_grad():
            x.set_(self.p)
        x.unsqueeze_(0)
        with torch.no_grad():
            x.set_(torch.zeros(2))
        return self.p * 2


def test_a_second_swap_does_not_give_one_parameter_anothers_history():
    assert_sound(SwappedFromOneParameterToAnother(), inputs((3, 4)), inputs_require_grad=False)


# --------------------------------------------------------------------------
# 59. (seed 9903, tenth session; exported since 57-58) An input set_() to
# another input that is then set_() to a buffer: eager leaves the first on
# the second's original storage; ep.module() relaid the second before the
# first took "its" storage, so the first ended on the buffer's. Fixed: a
# layout write-back takes the source's storage as the call left it, before
# any layout write-back.

class SetToAnInputThatMovesOn(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, y):
        x.unsqueeze_(0)
        with torch.no_grad():
            y.set_(x)
            x.set_(self.n.detach())
        return y * 2


def test_an_input_keeps_the_storage_it_was_set_to_when_that_input_moves_on():
    assert_sound(SetToAnInputThatMovesOn(), inputs((3, 4), (3, 4)), inputs_require_grad=False)


# --------------------------------------------------------------------------
# 60-63. (seeds 9904, 9905, tenth session)
# 60. An input relaid (unsqueeze_) and updated through a view taken before:
#     ep.module()'s layout write-back wrote the data with the input's version
#     bump while the program's saved views of it were still needed, and
#     backward raised "modified by an inplace operation". Fixed: readers
#     computing a relaid input's new value read a snapshot, as for others.
# 61. A tensor set_() to a value, updated in grad mode through its own
#     history: the recorder's write of the update's values to the shared
#     memory kept a zero-gradient link to the tensor's history, whose shape
#     is no longer the memory's, and the value's reader's backward raised.
#     Fixed: that write carries the values only. (The fuzzer's tensor was
#     an input: since session 37 that is refused, the program having written
#     the input back with the memory's history, where eager's keeps its own;
#     the test's tensor is a value the forward made.)
# 62. A leaf made in the forward, read in an enable_grad block, under a
#     no_grad caller: the leaf was dropped as unseen because with grad on
#     what it reaches requires grad anyway. Fixed: unseen in both modes.
# 63. f(y, y[1]) writing y[1] and then set_() of y to other memory: the
#     view input kept the old memory and its update, which the program lost.
#     Refused (ExportError naming the line); see input_aliasing. (Refusing
#     only where the memory the views see was written, judged by their
#     values' nodes, let wrong programs through on seed 9922: not done.)

class RelaidInputUpdatedThroughAnEarlierView(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = x[1:]
        v1 = x[:, 1:3]
        x.unsqueeze_(0)
        v0.mul_(self.bias)
        return v1[0]


class SwappedThenUpdatedFromItsHistory(nn.Module):
    def __init__(self, input_swapped=False):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("s", torch.randn(4, generator=torch.Generator().manual_seed(1)))
        self.input_swapped = input_swapped

    def forward(self, x):
        x = x if self.input_swapped else x * 1.0
        with torch.enable_grad():
            x.mul_(0.9).add_(self.bias, alpha=0.1)
            v0 = self.s.relu()
        with torch.no_grad():
            x.set_(v0)
        x.mul_(0.9).add_(v0, alpha=0.1)
        return v0


class LeafReadInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = self.w + self.w
        v1 = v0.t()
        v2 = v0.detach().requires_grad_()
        with torch.enable_grad():
            return v1 + v2.t()


@pytest.mark.parametrize("module, require", [(RelaidInputUpdatedThroughAnEarlierView(), False),
                                             (SwappedThenUpdatedFromItsHistory(), False),
                                             (LeafReadInAGradBlock(), True)])
def test_fuzz_60_to_62(module, require):
    assert_sound(module, inputs((3, 4)), inputs_require_grad=require)


class SwappedThenUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.randn(4, generator=torch.Generator().manual_seed(1)))

    def forward(self, x):
        v0 = self.s.relu()
        with torch.no_grad():
            x.set_(v0)
        x.mul_(0.9).add_(v0, alpha=0.1)
        return v0


def test_an_input_set_to_other_memory_then_written_in_grad_mode_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"x.mul_\(0.9\).add_\(v0, alpha=0.1\) of a parameter, "
                                                      r"buffer or input that set_\(\) gave other memory"):
        predispatch.export_predispatch(SwappedThenUpdated(), inputs((3, 4)))


class SetInGradModeTo(nn.Module):
    def __init__(self, source):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        self.source = source

    def forward(self, x):
        x.set_({"parameter": lambda: self.w, "computed": lambda: self.w * 2,
                "leaf": lambda: self.w.detach().requires_grad_()}[self.source]())
        return self.w.sum()


@pytest.mark.parametrize("source", ["parameter", "computed", "leaf"])
def test_an_input_set_in_grad_mode_to_a_tensor_that_requires_grad_is_refused(source):
    """Eager links the caller's tensor to the source's history through set_'s node."""
    with pytest.raises(predispatch.ExportError, match=r"set_\(\) in grad mode at .* gives a parameter, buffer or "
                                                      r"input the memory of a tensor that requires grad"):
        predispatch.export_predispatch(SetInGradModeTo(source), inputs((4, 4)))


def test_an_input_written_in_grad_mode_then_set_to_other_memory_is_refused():
    """Eager keeps the history the write gave the caller's tensor, on the new memory."""
    with pytest.raises(predispatch.ExportError, match=r"x.set_\(v0\) gives a parameter, buffer or input that "
                                                      r"the forward wrote in grad mode other memory"):
        predispatch.export_predispatch(SwappedThenUpdatedFromItsHistory(input_swapped=True), inputs((3, 4)))


class ViewInputWrittenThenCoverSwapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, y, z):
        v2 = y + 1.0
        z[1:] = 2.0  # (from a tensor, self.n: refused earlier, y written in grad mode, then set_())
        with torch.no_grad():
            y.set_(v2)
        return z * 2


def test_an_aliased_input_moved_to_other_memory_is_refused():
    y = inputs((3, 4))[0]
    with pytest.raises(predispatch.ExportError, match=r"other inputs of the call view.*y.set_\(v2\)"):
        predispatch.export_predispatch(ViewInputWrittenThenCoverSwapped(), (y, y[1]))


# --------------------------------------------------------------------------
# 64. (seed 9909, tenth session) A value updated under no_grad (nn.init in a
# no_grad function) and then set_() to another tensor in the same span: its
# kept history was the no_grad update's value, which has none. Fixed: a
# set_() target keeps the history it had when grad mode went off.
# 65. (seed 9909) A view made in the caller's grad mode (p.t()), its base
# updated through a set_() target inside an enable_grad block and the view
# read there: under a no_grad caller eager's view has no history, the
# program's replay inside the block had one. Fixed (eleventh session): a
# replay in a grad block of a view whose outermost part was made in the
# caller's mode reads keep_history(that part as made, its replay) where no
# write changed the base's history (eager keeps the view's history then,
# none under a no_grad caller; after a write autograd saw, eager
# regenerates it from the base's, or raises); and keep_history cuts the
# history it does not take (a no_grad view's false requires_grad too).

class UpdatedUnderNoGradThenSwapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v0 = self.lin(self.s)

        @torch.set_grad_enabled(False)
        def f1():
            torch.nn.init.constant_(v0, 0.5)
            v0.set_(self.lin.bias)
        f1()
        return v0


def test_a_swapped_value_keeps_the_history_it_had_before_the_no_grad_span():
    assert_sound(UpdatedUnderNoGradThenSwapped(), inputs((3, 4)), inputs_require_grad=True)


class CallersModeViewReadInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        v0 = self.p.t()
        x = x * 1.0  # (the fuzzer's was the input, which is refused since session 37: see 61)
        x.set_(self.p)
        with torch.enable_grad():
            x[0] = self.n
            return torch.tanh(v0)


class CallersModeViewReducedInAGradBlockThenSwapped(nn.Module):
    """65 again (seed 9914): the view read inside the block by a reduction."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)

    def forward(self, x):
        v0 = self.w[:, 1:3]
        with torch.inference_mode(False):
            v1 = v0.mean(-1, keepdim=True)
        with torch.set_grad_enabled(True):
            with torch.no_grad():
                v1.set_(v0)
            v1.mul_(0.9).add_(v1, alpha=0.1)
        return v1


@pytest.mark.parametrize("module, require", [
    (CallersModeViewReadInAGradBlock(), False),
    (CallersModeViewReducedInAGradBlockThenSwapped(), True),
])
def test_a_callers_mode_view_replayed_in_a_grad_block(module, require):
    assert_sound(module, inputs((3, 4)), inputs_require_grad=require)


# 66. (seed 9915) f(x, x): one updated through the other under no_grad, then
# relaid (transpose_), then read in grad mode: the history kept for the
# relaid value sat on one replay of it, the read replayed it again without
# (the program's output required no grad). Fixed: later replays of the same
# view read the kept one; then this is the leaf given another shape under
# no_grad and differentiated (eager's .grad takes the new shape): refused.

class SameInputTwiceUpdatedThenRelaid(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, y):
        with torch.no_grad():
            y[1:] = self.n
            x.transpose_(0, 1)
        return x[0]


def test_the_same_input_twice_updated_then_relaid_is_refused():
    x = inputs((3, 4))[0]
    with pytest.raises(predispatch.ExportError, match=r"given another shape \(4, 3\) under no_grad.*transpose_"):
        predispatch.export_predispatch(SameInputTwiceUpdatedThenRelaid(), (x, x))


# 67. (seed 9915, tenth session; a regression of 56) A leaf made from an
# input, read by linear (which saves it for the weight's gradient), then its
# memory updated through a set_() target: the reader was not found through
# the leaf's requires_grad op, and the weight's gradient came out other than
# eager's (which reads the updated memory). Fixed: readers are found through
# predispatch's own ops, as through views; refused again.

class LeafSavedThenUpdatedThroughASwap(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y):
        v0 = y.detach().requires_grad_()
        y.sub_(-1.0)
        v1 = self.lin(v0)
        with torch.no_grad():
            v1.set_(y)
        v1.mul_(0.9).add_(x, alpha=0.1)
        return v1, v0


def test_a_leaf_saved_by_an_op_then_updated_through_a_swap_is_refused():
    x = inputs((3, 4))[0]
    with pytest.raises(predispatch.ExportError, match=r"set_\(\) made shared"):
        predispatch.export_predispatch(LeafSavedThenUpdatedThroughASwap(), (x, x))


# 68. (seed 9916, tenth session) An input that requires grad, updated in grad
# mode through its detached alias (v0 = y.detach(); v0.mul_(...)) and then
# under no_grad: the update was also noted as a grad-mode write of the input,
# whose kept history (the update's, which has none) replaced the input's own.
# Fixed: a grad-mode write that writes through detached aliases alone is
# hidden from autograd, as eager's is.

class InputUpdatedThroughItsDetachedAlias(nn.Module):
    def __init__(self, chained):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        self.chained = chained

    def forward(self, y):
        v0 = y.detach()
        if self.chained:
            v0.mul_(0.9).add_(v0, alpha=0.1)
        else:
            v0.mul_(0.9)
        torch.nn.init.zeros_(v0)
        return y + 1.0


@pytest.mark.parametrize("chained", [False, True])
def test_an_input_updated_through_its_detached_alias_keeps_its_history(chained):
    assert_sound(InputUpdatedThroughItsDetachedAlias(chained), inputs((3, 4)), inputs_require_grad=True)


# 69. (seed 9923, tenth session) A detach of a set_() target (itself a
# detached alias with a history of its own), the target then updated in grad
# mode: the detach was given the update's history, as a view of the target
# is; eager's detach has none. Fixed: only views whose autograd base is the
# updated alias regenerate its history.

class DetachOfASwappedTensorAfterItsUpdate(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = self.lin.weight * 2.0
        with torch.no_grad():
            v0.set_(self.w)
        v1 = v0.detach()
        v0.sub_(self.lin.bias)
        v1[:, 0] = 2.0
        return v1


def test_a_detach_of_a_swapped_tensor_has_no_history_after_its_update():
    assert_sound(DetachOfASwappedTensorAfterItsUpdate(), inputs((3, 4)), inputs_require_grad=True)


# 70. (seed 9923, eleventh session) A value relaid in the caller's mode
# (unsqueeze_), updated there, then written inside an enable_grad block:
# under a no_grad caller eager's value keeps its history across the
# caller's-mode update, so the block's write has one. Functionalization reads
# a relaid value through replays of it from its base, so no read of the
# update's own node showed the history and no keep was made. Fixed: later
# replays of the view read the updated node itself (as for no_grad spans).

class RelaidInCallersModeThenWrittenInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        @torch.enable_grad()
        def f0():
            return self.lin(self.s)
        v0 = f0()
        v0.unsqueeze_(0)
        v0.mul_(0.9).add_(v0, alpha=0.1)

        @torch.enable_grad()
        def f1():
            v0[0] = self.n
        f1()
        return v0


@pytest.mark.parametrize("require", [False, True])
def test_a_value_relaid_in_the_callers_mode_keeps_its_history_in_a_grad_block(require):
    assert_sound(RelaidInCallersModeThenWrittenInAGradBlock(), inputs((3, 4)), inputs_require_grad=require)


# 71. (seed 9923, eleventh session) A view of a parameter updated under
# no_grad, made in the caller's mode (or in a no_grad block), then viewed
# again inside a block that turns grad on (inference_mode(False)) and
# returned: functionalization replays the whole chain inside the block, where
# it read the kept history; eager's view of a view made under no_grad has
# none. Fixed: the replay's caller's-mode part reads the history it was made
# with; a no_grad view's replays are marked wherever they are made.

class ViewOfAnUpdatedParameterViewedInAGradBlock(nn.Module):
    def __init__(self, in_no_grad):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)
        self.in_no_grad = in_no_grad

    def forward(self, y):
        with torch.no_grad():
            self.w.zero_()
            if self.in_no_grad:
                v1 = self.w[0]
        if not self.in_no_grad:
            v1 = self.w[0]
        with torch.inference_mode(False):
            v2 = v1[1:]
        return v2


@pytest.mark.parametrize("in_no_grad", [False, True])
def test_a_view_of_an_updated_parameter_viewed_in_a_grad_block(in_no_grad):
    assert_sound(ViewOfAnUpdatedParameterViewedInAGradBlock(in_no_grad), inputs((3, 4)))


# 72-74. (seeds 10101-10102, eleventh session) Refusals that were not needed:
# the reshaped-history refusal (a tensor given another shape under no_grad
# keeps its history, of the old shape) fired where eager's history is usable
# or unseen. Now exported: a history reaching the output only through
# detach() (72); a tensor relaid in place (transpose_), which functionalization
# holds as a view of its own memory, is no view in eager: its history is the
# computed value's, which autograd checks as the program's (73); a leaf
# relaid in the caller's mode is one under a no_grad caller only (eager
# refuses its update in grad mode), and returning it returns the caller's
# tensor, whose history is its own (74).

class SwappedInputDetachedIntoALeaf(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            x.set_(self.s)
        return x.detach().requires_grad_()


class RelaidInputUpdatedThenSwapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        with torch.set_grad_enabled(True):
            x.transpose_(0, 1)
            x.mul_(0.9).add_(x, alpha=0.1)
            with torch.no_grad():
                x.set_(self.w)
        return self.s @ self.w


class InputRelaidInTheCallersModeReturned(nn.Module):
    def forward(self, x):
        x.transpose_(0, 1)
        with torch.enable_grad():
            y = x * 2.0
        return y.sum(), x


@pytest.mark.parametrize("module, require", [
    (SwappedInputDetachedIntoALeaf(), True), (SwappedInputDetachedIntoALeaf(), False),
    (RelaidInputUpdatedThenSwapped(), False), (InputRelaidInTheCallersModeReturned(), False)])
def test_reshaped_histories_eager_can_use_are_exported(module, require):
    assert_sound(module, inputs((3, 4)), inputs_require_grad=require)


# 75. (seed 10202, eleventh session) linear of a vector returns a view in
# eager; set_() to other memory of the same shape regenerates that view's
# history from its base through the new layout (an as_strided at the new
# offset), which a program cannot reproduce: it gave another gradient for
# the input. Now refused (a view given other memory, as given another
# shape, where a gradient reaches it).

class ViewSwappedToMemoryOfTheSameShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, z):
        v0 = self.lin(z)
        v0.set_(z)
        v1 = self.lin(z)
        with torch.no_grad():
            v1.set_(v0)
        return v1


def test_a_view_swapped_to_memory_of_the_same_shape_is_refused():
    z = inputs((3, 4))[0][1]
    assert_refused_where_eager_views(ViewSwappedToMemoryOfTheSameShape(), (z,), "given other memory")


# 76. (seed 10203, eleventh session; from before it) f(y, y[1]): y set_() to
# its own row (another shape), the row returned as it is: eager regenerates
# the row's history through y's new layout, for a gradient of y's new shape;
# the program's backward raised. Now refused, naming the line.

class InputRelaidToItsOwnRowReturned(nn.Module):
    def forward(self, y, z):
        with torch.no_grad():
            y.set_(z)
            z.add_(z)
        return z


def test_an_input_relaid_while_its_view_input_is_returned_is_refused():
    y = inputs((3, 4))[0]
    with pytest.raises(predispatch.ExportError, match=r"is returned as it is while input 0 is given another shape at .*y\.set_\(z\)"):
        predispatch.export_predispatch(InputRelaidToItsOwnRowReturned(), (y, y[1]))


# 77. (seed 9922, found again once 78 let these through) f(x, x[2]): the view
# input read inside an enable_grad block before its memory was written: the
# program read the view as made at the start, in the caller's mode, which
# under a no_grad caller has no history; eager's view, made by the caller,
# has its own. Fixed: view inputs are made (and replayed in the caller's
# mode) inside an enable_grad block, as views a grad block made are.
# 78. An input others view moved to other memory by set_() is refused only
# where that old memory was written (the views keep it; nothing to write
# back otherwise).

class ViewInputReadInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x, y, z):
        with torch.set_grad_enabled(True):
            self.b.mul_(0.9).add_(y, alpha=0.1)
            v0 = z.relu()
            with torch.no_grad():
                x.set_(self.b)
        return v0


def test_a_view_input_keeps_its_own_history_under_a_no_grad_caller():
    x = inputs((3, 4))[0]
    assert_sound(ViewInputReadInAGradBlock(), (x, x, x[2]), inputs_require_grad=True)


class CoverSwappedItsOldMemoryOnlyRead(nn.Module):
    """78: f(x, x[0]), x moved to a parameter's memory, x[0] only read."""

    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        self.lin = nn.Linear(4, 4)

    def forward(self, x, z):
        with torch.no_grad():
            x.set_(self.p)
        v1 = self.lin(self.p)
        v1.mul_(0.9).add_(v1, alpha=0.1)
        return v1, self.lin(z)


@pytest.mark.parametrize("require", [False, True])
def test_a_cover_moved_away_from_memory_only_read_is_exported(require):
    x = inputs((3, 4))[0]
    assert_sound(CoverSwappedItsOldMemoryOnlyRead(), (x, x[0]), inputs_require_grad=require)


# 79. (seed 10302, eleventh session; from before it) A buffer written in grad
# mode through its detached alias with a value that requires grad: a view of
# the buffer made before, read after, was replayed from the written memory
# with that value's history; eager's buffer (and its view) has none, the
# write being hidden from autograd. Fixed: a hidden write keeps the old
# history also where the old value has none.
# 80. (seed 10302) f(x, x, z): x set_() to itself (a no-op), z updated: the
# export traced x and y as one tensor (x was mutated at first), then
# recorded only z as mutated, and ep.module()'s aliasing check, looking at
# groups holding a mutated input only, refused every call. Fixed: the
# groups traced as aliasing are checked too.

class BufferViewAfterAHiddenWriteOfItsAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, y):
        v0 = y.sum()
        v1 = self.b.detach()
        v3 = self.b.view(-1)
        v1[1:] = v0
        return v0.sin(), v3


class SetToItselfBesideAnUpdatedInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y, z):
        with torch.no_grad():
            x.set_(y)
        z.sub_(self.lin.bias)
        return y.sum(0) + z


def test_a_buffer_view_after_a_hidden_write_of_its_alias_has_no_history():
    assert_sound(BufferViewAfterAHiddenWriteOfItsAlias(), inputs((3, 4)), inputs_require_grad=True)


def test_inputs_traced_as_aliasing_are_checked_as_such():
    x, z = inputs((3, 4), (4,))
    assert_sound(SetToItselfBesideAnUpdatedInput(), (x, x, z), inputs_require_grad=False)


# 81. (seed 10401, eleventh session) As 76, the view input's own view
# returned: refused where the view input of an input given another shape is
# differentiated (a graph check, as the program's value of it is a node).

class InputRelaidToItsOwnRowWhoseViewIsReturned(nn.Module):
    def forward(self, y, z):
        with torch.no_grad():
            y.set_(z)
        return z[1:]


def test_a_view_input_of_a_reshaped_input_differentiated_is_refused():
    y = inputs((3, 4))[0]
    with pytest.raises(predispatch.ExportError, match=r"given another shape"):
        predispatch.export_predispatch(InputRelaidToItsOwnRowWhoseViewIsReturned(), (y, y[1]))


# 82. (seed 10501, eleventh session) f(x, x, x[2]): x set_() to its own row
# under no_grad, then returned: eager's set_ gives the leaf a gradient
# accumulator of its new shape; the program's write-back re-laid it with
# as_strided_, which keeps the old accumulator (made when the caller took
# x[2]), and backward raised. Fixed: the write-back re-lays with set_.

class InputSetToItsOwnRowReturned(nn.Module):
    def forward(self, x, y, z):
        with torch.no_grad():
            x.set_(z)
            y.mul_(0.9).add_(y, alpha=0.1)
        return y.float(), y


def test_an_input_set_to_its_own_row_gets_a_gradient_of_its_new_shape():
    x = inputs((3, 4))[0]
    assert_sound(InputSetToItsOwnRowReturned(), (x, x, x[2]), inputs_require_grad=True)


# 83. (seed 10502, eleventh session) A value given a
# buffer's memory by set_() inside a grad block (it keeps its matmul
# history), then written in the caller's mode: under a no_grad caller eager's
# write keeps that history; the program's own-history copy took the write's
# (none under no_grad). Fixed: the update of a tensor with a history of its
# own keeps the one before under a no_grad caller (keep_history_if_no_grad).

class SwappedInABlockWrittenInTheCallersMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)
        self.register_buffer("s", torch.zeros(4))
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        with torch.set_grad_enabled(True):
            v0 = self.s + self.w.sum(0)  # (found as s @ w: its backward saves s, which the write
            with torch.no_grad():        # below updates; now refused, see 95)
                v0.set_(self.s)
        v0[0] = self.n
        return v0


def test_a_swapped_value_written_in_the_callers_mode_keeps_its_history_under_no_grad():
    assert_sound(SwappedInABlockWrittenInTheCallersMode(), inputs((3, 4)), inputs_require_grad=True)


# 84. (seed 10602, eleventh session; from before it) A view of an input taken
# before the input is set_() to it (another shape), read after: eager
# regenerates the view's history through the input's new layout (a gradient
# of its new shape, on a new accumulator); the program's backward raised.
# Now refused as a leaf given another shape (its views made before count).

class ViewOfAnInputReadAfterTheInputIsSetToIt(nn.Module):
    def forward(self, x):
        v2 = x[0]
        with torch.no_grad():
            x.set_(v2)
        return v2.sum(0)


def test_a_view_of_an_input_read_after_the_input_is_reshaped_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"given another shape \(4,\) under no_grad"):
        predispatch.export_predispatch(ViewOfAnInputReadAfterTheInputIsSetToIt(), inputs((3, 4)))


# 85-87. (seeds 10703-10704, eleventh session; each from before it)
# 85. An input set_() to a parameter under no_grad, then relaid in the
#     caller's mode (t_()): the relayout of a set_() target (to the recorder
#     a detached alias of the parameter) gave it the parameter's history, as
#     an update of the alias would; a new layout leaves the base's value as
#     it was. Fixed (now the sound refusal of a leaf given another shape).
# 86. A value relaid in place (unsqueeze_) and then written twice through its
#     detached alias: the first hidden write was kept on the bases, and the
#     second found no history for the relaid value (its output had none).
#     Fixed: a value lifted to its bases keeps its own history for its next
#     update.
# 87. A value relaid in place (unsqueeze_), set_() to a parameter of another
#     shape, then updated in grad mode: set_ kept no history for it, taking
#     the relaid value (a view op in the graph) for an eager view; its update
#     lost the input's gradient. Fixed: the recorder knows it is no view.

class SwappedInputRelaidInTheCallersMode(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            x.set_(self.lin.weight)
        x.t_()
        x.transpose_(0, 1)
        return x * self.s


class RelaidThenWrittenTwiceThroughItsDetachedAlias(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = self.lin.bias @ self.w
        v1 = v0.detach()
        v0.unsqueeze_(0)
        v1.mul_(0.9).add_(v1, alpha=0.1)
        return v0.clone()


class RelaidThenSwappedThenUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)

    def forward(self, x):
        v0 = x.sum()
        v0.unsqueeze_(0)
        with torch.no_grad():
            v0.set_(self.w)
        v0.unsqueeze_(0)
        v0.mul_(0.9).add_(v0, alpha=0.1)
        return v0


@pytest.mark.parametrize("module, refusal_ok", [
    (SwappedInputRelaidInTheCallersMode(), True), (RelaidThenWrittenTwiceThroughItsDetachedAlias(), False),
    (RelaidThenSwappedThenUpdated(), False)])
def test_fuzz_85_to_87(module, refusal_ok):
    for require in (False, True):
        assert_sound(module, inputs((3, 4)), inputs_require_grad=require, refusal_ok=refusal_ok)


# 88. (seed 10803, eleventh session) v0.set_(v1) under no_grad, then
# v0.mul_(v1): eager's mul_ saves v1 and then overwrites its memory (set_
# shares no version counter), so its backward silently reads the product;
# the program read v1 as it was. Now refused: the update's own op reading a
# sharer of the memory it writes, as another operand, counts as a reader.

class UpdateSavingTheOperandItOverwrites(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = self.lin.bias * 0.5
        v1 = x.detach().requires_grad_()
        with torch.no_grad():
            v0.set_(v1)
        v0.mul_(v1)
        return v0


def test_an_update_saving_the_operand_it_overwrites_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"set_\(\) made shared"):
        predispatch.export_predispatch(UpdateSavingTheOperandItOverwrites(), inputs((3, 4)))


# 89. (seed 11002, eleventh session; from before it) f(y, y[1]) writing the
# view input through its detached alias: exported twice in one process, the
# second export failed in a view's storage bounds check, because of entries
# the first left in FakeTensorMode's dispatch cache (shared by every fake mode
# of the process). Fixed: each export starts from an empty cache.

class DetachedAliasOfAViewInputWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, y, z):
        self.s.sub_(z)
        v0 = z.detach()
        z.copy_(z)
        y[:, 1:3] = 0.5
        v2 = v0.view(-1)
        v2.mul_(self.lin.bias)
        return z.detach().requires_grad_()


def test_an_export_does_not_read_the_fake_cache_an_earlier_one_left():
    y = inputs((3, 4))[0]
    for _ in range(2):
        assert_sound(DetachedAliasOfAViewInputWritten(), (y, y[1]), inputs_require_grad=False)


# 90. (seed 11001, eleventh session; from before it) Two inputs set_() to the
# same value: both mutation outputs were one node, which torch's graph
# signature cannot map to two targets (a raw SpecViolationError). Fixed: the
# second gets an alias of it (the same memory, as eager's two tensors share).

class TwoInputsSetToOneValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, y, z):
        v0 = self.lin(y)
        v0[:, 0] = self.n
        with torch.no_grad():
            x.set_(v0)
        self.n.add_(1.0)
        with torch.no_grad():
            z.set_(v0)
        return v0, v0


def test_two_inputs_set_to_one_value():
    assert_sound(TwoInputsSetToOneValue(), inputs((3, 4), (3, 4), (4,)), inputs_require_grad=False)


# 91. (found writing 90, eleventh session) The same with both set_() calls in
# one no_grad block: values and gradients matched, but after the call eager's
# x and z share the value's storage and the program's did not. Fixed: an
# input laid on memory the forward made that an earlier input took is laid
# on that input's new storage ("shared").

class TwoInputsSetToOneValueInOneBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, y, z):
        v0 = self.lin(y)
        with torch.no_grad():
            x.set_(v0)
            z.set_(v0)
        return v0


def test_two_inputs_set_to_one_value_in_one_block_share_its_storage():
    assert_sound(TwoInputsSetToOneValueInOneBlock(), inputs((3, 4), (3, 4), (4,)), inputs_require_grad=False)


# 92, 93. (seeds 11003-11004, eleventh session) A value with a history of
# one shape set_() under no_grad to memory of another shape (eager keeps the
# history; autograd reduces the gradient of the new shape to it), then read
# as another tensor's in-place operand: the program's output had no history
# where eager's has one (92), or its backward raised where eager's did not
# (93). 92: the recorder dropped a set_() target's history where the new
# shape was another (it left it to the history stage, which sees only the
# value the block left, not one a later write of the memory made); it now
# keeps it across every read, and the history stage checks those reads'
# shapes as its own keeps'. 93: eager's add_ passes the history the
# gradient of v0's shape (3, 4) unreduced (autograd reduces a gradient to
# the shape the history was made with, not to the tensor's); the program
# reduces it to the new shape () first, which cannot broadcast back: refused
# (a history whose shape does not broadcast to the new one).

class ReshapedHistoryReadAsAnOperand(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v0 = self.b.sin()
        v3 = self.s.detach().requires_grad_() @ self.w
        with torch.no_grad():
            v3.set_(v0)
        v0.mul_(0.9).add_(v3, alpha=0.1)
        return v0


class ScalarSwappedIntoALinearThenAdded(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        v0 = self.b.clone()
        v2 = self.lin(self.b)
        with torch.no_grad():
            v2.set_(v0.sum())
        v0.add_(v2)
        return v0[1:][0]


def test_a_reshaped_history_read_as_an_operand():
    assert_sound(ReshapedHistoryReadAsAnOperand(), inputs((3, 4)), inputs_require_grad=False)


def test_a_history_that_does_not_broadcast_to_the_new_shape_is_refused():
    with pytest.raises(predispatch.ExportError, match="not reduced to the new shape"):
        predispatch.export_predispatch(ScalarSwappedIntoALinearThenAdded(), inputs((3, 4)))


# 94. (seed 11102, eleventh session) A view of a computed value made before
# the value is set_() under no_grad to memory of another layout, returned:
# eager regenerates the view's history through the value's new layout (the
# gradient reaching the input differed). Refused where differentiated until
# the fortieth session; since then the view's read regenerates it as eager
# does (as_strided of the value as read, on its new layout).

class ViewMadeBeforeASwapReturned(nn.Module):
    def forward(self, y):
        v0 = y.unsqueeze(0)
        v1 = v0.mean(-1, keepdim=True)
        v4 = v1.view(-1)
        with torch.no_grad():
            v1.set_(v0)
        return v0[0], v4


@pytest.mark.parametrize("require", [True, False])
def test_a_view_made_before_a_swap_to_another_layout_regenerates_its_history(require):
    assert_matches_eager(ViewMadeBeforeASwapReturned(), inputs((3, 4)), inputs_require_grad=require)


# 95. (seed 11202, eleventh session) z's memory written through a set_()
# target after a linear saved z for the weight's gradient, the memory also
# written before through a detached alias of the target: eager's backward
# reads the written values (set_ shares no version counter); the saved-value
# refusal did not fire and the weight's gradient differed. It asked that the
# value read require grad; after the hidden write it does not, but the
# linear still saves it for the weight's gradient. Now refused.

class SavedInputWrittenThroughASwapAfterAHiddenWrite(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, z):
        v0 = self.lin(z)
        v0.set_(z)
        v1 = v0.detach()
        v1.mul_(0.9).add_(v1, alpha=0.1)
        v2 = self.lin(z)
        v0.add_(v0)
        return v2


def test_a_saved_input_written_through_a_swap_after_a_hidden_write_is_refused():
    z = inputs((3, 4))[0][2].clone().requires_grad_()
    with pytest.raises(predispatch.ExportError, match="an op differentiated already saved for its backward"):
        predispatch.export_predispatch(SavedInputWrittenThroughASwapAfterAHiddenWrite(), (z,))


# 96. (seed 11301, twelfth session; from before it) An input that requires
# grad set_() under no_grad to a parameter's detached alias of another shape,
# whose memory is then written through that alias: eager's input keeps its
# leaf history (a .grad of the new shape: refused where differentiated, as
# without the write), but the program read the input from the written memory
# with no history at all (its output did not require grad). The recorder left
# a set_() target's history of another shape to the history stage, which
# sees the value the block left, not one a later write of the memory made:
# it now keeps every set_() target's history across its reads, and the
# history stage checks those reads' shapes as its own keeps'.

class InputSwappedToAnAliasThenWrittenThroughIt(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, z):
        v0 = self.lin.weight.detach()
        with torch.no_grad():
            z.set_(v0)
        v0.mul_(v0)
        return -z


def test_a_leaf_swapped_to_another_shape_then_written_through_a_sharer_is_refused():
    with pytest.raises(predispatch.ExportError, match="a .grad of the new shape"):
        predispatch.export_predispatch(InputSwappedToAnAliasThenWrittenThroughIt(),
                                       (inputs((4,))[0].requires_grad_(),))


# 97. (seed 11301, twelfth session; from before it) Inputs that are views into
# a larger storage (z = y[1], at offset 4), one set_() to the other then
# updated: the program laid x at offset 0 of z's storage (functionalization's
# offsets count from a base an update replaces by a fresh tensor at offset
# 0). Layouts are now followed on meta shadows of the inputs, as eager lays
# them out (predispatch.trace.eager_layout; more cases in test_mutation_kinds).

class SwappedToAnOffsetInputThenUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, z):
        v0 = self.n.detach().requires_grad_()
        with torch.no_grad():
            x.set_(z)
        v1 = z[1:]
        with torch.no_grad():
            x.mul_(0.9).add_(v0, alpha=0.1)
            v2 = v1.float()
        return v2


def test_an_input_swapped_to_an_input_at_an_offset_is_laid_out_as_eager_s():
    x, y = inputs((3, 4), (3, 4))
    assert_sound(SwappedToAnOffsetInputThenUpdated(), (x, y[1]), inputs_require_grad=True)


# 98. (seed 11302, twelfth session; refused before it too, 5 programs of 433)
# A parameter's row copied into an input (x[1:] = v0), then written through
# an input set_() to it: refused as if the copy had saved the row for its
# backward. Neither copy nor full_like saves a tensor (copy has no formula in
# derivatives.yaml, so it counted as unknown): now a row of a small table.
# Refused again since session 37, for what it is: y, an input set_() under
# no_grad to a parameter's row, then written in grad mode. With inputs that
# have a history (AOTAutograd's tests pass such inputs), eager's y keeps its
# own and the copy's, on the parameter's memory; the program wrote y back
# as the parameter's row with the parameter's history, and the parameter's
# gradient differed. AOTAutograd refuses a set_() input with other writes.

class ParameterRowCopiedThenWrittenThroughASwap(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x, y):
        v0 = self.p[0]
        x[1:] = v0.unsqueeze(0)
        with torch.no_grad():
            y.set_(v0)
        y.copy_(torch.full_like(y, 0.5))
        return x


def test_an_input_set_to_a_parameter_then_written_in_grad_mode_is_refused():
    with pytest.raises(predispatch.ExportError, match=r"in-place update in grad mode at .*y.copy_\(.* of a "
                                                      r"parameter, buffer or input that set_\(\) gave"):
        predispatch.export_predispatch(ParameterRowCopiedThenWrittenThroughASwap(), inputs((3, 4), (3, 4)))


# 99. (seed 11302, twelfth session; refused before it too, 3 programs of 433)
# A view of a buffer's negation made before the negation is set_() to an
# input's row, returned: refused as a view whose history eager regenerates
# through the new layout, but nothing in it requires grad (the buffer does
# not), so there is no history to regenerate. The refusal now asks that the
# tensor may require grad.

class ViewOfAHistorylessValueMadeBeforeASwap(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, y):
        v0 = -self.b
        v3 = v0[1:]
        with torch.no_grad():
            v0.set_(y[0])
        return v3


def test_a_view_made_before_a_swap_of_a_value_without_history_is_exported():
    assert_sound(ViewOfAHistorylessValueMadeBeforeASwap(), inputs((3, 4)), inputs_require_grad=True)


# 100. (seed 11305, twelfth session; refused before it too, 4 programs of
# 456) A clone of a buffer set_() to a parameter's memory, updated there in
# grad mode, then set_() to a row of another shape: refused as a leaf (the
# parameter) given another shape. The tensor's history is its own (none):
# set_ shares the parameter's memory, not its history. The second swap's
# kept history was the value the memory held; it is now the history the
# set_() target keeps.

class CloneSwappedToAParameterThenToAnotherShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x):
        v0 = self.n.clone()
        v1 = v0.unsqueeze(0)
        with torch.no_grad():
            v0.set_(self.lin.bias)
        v0.sub_(v0)
        with torch.no_grad():
            v0.set_(v1)
        return v0.unsqueeze(0)


def test_a_swapped_tensor_keeps_its_own_history_across_a_second_swap():
    assert_sound(CloneSwappedToAParameterThenToAnotherShape(), inputs((3, 4)), inputs_require_grad=True)


# 101. (seed 11309, twelfth session; refused by 93's first rule, 4 programs
# of 438) A difference of shape (3,) set_() to a buffer of shape (3, 4) and
# returned: no reader broadcasts it, so a gradient reaching its history has
# the new shape in eager too, which both reject alike (autograd raises in
# eager's backward and in the program's). The refusal of a history that does
# not broadcast to the new shape now asks for a reader that broadcasts the
# tensor to a shape the history takes (93's add_).

class DifferenceSwappedToABufferOfAnotherShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))

    def forward(self, y, z):
        v0 = z[1:]
        v1 = v0 - v0
        with torch.no_grad():
            v1.set_(self.b)
        return v1


def test_a_history_no_reader_broadcasts_is_exported():
    x, y = inputs((3, 4), (3, 4))
    assert_sound(DifferenceSwappedToABufferOfAnotherShape(), (y, x[0]), inputs_require_grad=False)


# 102. (seed 11314, twelfth session; from before it) A detached alias updated
# in grad mode (its own history: none), then its base set_() to an input:
# the alias, returned, required grad in the program and not in eager. The
# base's swap marked the value node it kept as "a set_() target's history",
# and that node was also the alias's own history: the history stage gave the
# alias's read the base's kept history. The mark is now on the set_()
# target's own reads, not on the value they share.

class DetachedAliasUpdatedThenItsBaseSwapped(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = self.lin.bias.sum()
        v1 = v0.detach()
        v1.mul_(v1)
        v0.set_(x)
        return v1


def test_a_detached_alias_keeps_its_own_history_when_its_base_is_swapped():
    assert_sound(DetachedAliasUpdatedThenItsBaseSwapped(), inputs((3, 4)), inputs_require_grad=True)


# 103. (seed 60602, issue 30; five programs of 500) A value relaid in place
# in grad mode (unsqueeze_, transpose_), a view of it taken, then the value
# zeroed by nn.init.zeros_ (an update in the library's own no_grad block),
# the view read: eager's view keeps its history through the value's, the
# program's output required no grad. Functionalization holds the relaid
# value as a view of its base and replays the view from the base's new
# value; the history stage keeps the history on the bases then, but the
# trace had dropped the value's new node (nothing read the value itself),
# so nothing was kept. The trace now keeps every replaced value's node for
# the history stage, as it keeps the old one.

class ViewOfARelaidValueReadAfterALibraryUpdate(nn.Module):
    def __init__(self, relayout_in_a_block: bool):
        super().__init__()
        self.relayout_in_a_block = relayout_in_a_block
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, generator=g))

    def forward(self, x):
        v0 = self.w @ x
        with torch.enable_grad() if self.relayout_in_a_block else contextlib.nullcontext():
            v0.unsqueeze_(0)
            v0.transpose_(0, 1)
        v3 = v0[0]
        with torch.enable_grad():
            nn.init.zeros_(v0)
        return v3[0]


@pytest.mark.parametrize("in_a_block", [True, False])
@pytest.mark.parametrize("require", [True, False])
def test_a_view_of_a_relaid_value_keeps_its_history_across_an_update(in_a_block, require):
    assert_sound(ViewOfARelaidValueReadAfterALibraryUpdate(in_a_block), inputs((3, 4)),
                 inputs_require_grad=require)


# 104. (found with 103, issue 30) A value relaid under no_grad: its history
# stays of the old layout, and eager regenerates a view's history from it
# through the new layout once the value's version moves after the view was
# made (AsStridedBackward over the old history): by the relayout itself for
# a view made before, by a later update for one made after. The program
# kept the view's history as made (a view made before: gradients reached
# other elements than eager's), or lost it. Refused now where that view is
# differentiated, as for a set_() to memory of another layout (94); a
# relayout that only adds a size-1 dimension moves no element and is
# exported.

class ViewOfAValueRelaidUnderNoGrad(nn.Module):
    def __init__(self, relayout, view_first: bool):
        super().__init__()
        self.relayout, self.view_first = relayout, view_first
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(3, 4, generator=g))

    def forward(self, x):
        v0 = self.w * x
        if self.view_first:
            v3 = v0[0]
        with torch.no_grad():
            self.relayout(v0)
        if not self.view_first:
            v3 = v0[0]
        with torch.no_grad():
            v0.mul_(2.0)
        return v3 * 2


@pytest.mark.parametrize("view_first", [True, False])
def test_a_view_of_a_value_relaid_under_no_grad_is_refused(view_first):
    module = ViewOfAValueRelaidUnderNoGrad(lambda v: v.t_(), view_first)
    with pytest.raises(predispatch.ExportError, match="given another layout under no_grad"):
        predispatch.export_predispatch(module, inputs((3, 4)))


@pytest.mark.parametrize("view_first", [True, False])
def test_a_view_of_a_value_given_a_size_one_dimension_under_no_grad_is_exported(view_first):
    assert_sound(ViewOfAValueRelaidUnderNoGrad(lambda v: v.unsqueeze_(0), view_first), inputs((3, 4)))


# 105. (seed 70002, issue 30; three programs of 500, also before 103)
# f(x, x, x[2]): x set_() under no_grad to its own row (shape (4,)), the
# row then written through a detached alias, y (x itself) read: eager's y is
# the leaf of its new shape, its gradient (4,) on a new accumulator; the
# program's kept history is of the old shape (3, 4), and its backward
# raised in _HistoryBackward. The refusal of a leaf given another shape
# (84) did not fire: the hidden write kept the value's history again
# (keep_history(keep_history(y, new), newer)), and the second keep's old
# value had the new shape already. A kept history's shape is now its
# first history's (through every keep): refused as 84 is.

class InputSetToItsRowThenWrittenThroughADetach(nn.Module):
    def forward(self, x, y, z):
        with torch.no_grad():
            x.set_(z)
        v0 = z.detach()
        v0.mul_(0.9).add_(v0, alpha=0.1)
        return y.clone()


def test_an_input_set_to_its_row_then_written_through_a_detach_is_refused():
    x = inputs((3, 4))[0]
    with pytest.raises(predispatch.ExportError, match=r"given another shape \(4,\) under no_grad"):
        predispatch.export_predispatch(InputSetToItsRowThenWrittenThroughADetach(), (x, x, x[2]))


# 106. (seed 70002, issue 30; also before 103) A linear's output
# relaid (unsqueeze_) in an enable_grad block nested in a no_grad block, then
# updated in grad mode by a view made under no_grad (a parameter's row):
# eager's value requires grad (SubBackward over its history), the program's
# does not. Without the unsqueeze_ it matches. (Minimized by hand from the
# fuzzer's program: the leaf made of it, the outer enable_grad block and the
# parameter's write do not matter.) Diagnosis: the sub_ reads a no_grad view
# (v2), so the recorder marks every view op the call makes as a no_grad view
# replay (views.call_marking_view_replays), including functionalization's
# replay of v0 itself (squeeze, unsqueeze of the new value); the history
# stage then detached that replay's base. Now the no_grad views a call
# reads are replayed (and marked) before it runs; the call's own view ops
# stay unmarked.

class RelaidInANestedBlockThenUpdated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        with torch.no_grad():
            with torch.enable_grad():
                v0 = self.lin(self.s)
                v0.unsqueeze_(0)
            v2 = self.lin.bias[0]
        v0.sub_(v2)
        return v0


def test_a_value_relaid_in_a_nested_block_then_updated_keeps_its_history():
    assert_sound(RelaidInANestedBlockThenUpdated(), inputs((3, 4)), inputs_require_grad=True)


# 107. (seed 81001, issue 30; four programs of 500, also on main before 105)
# In an enable_grad block under a no_grad caller, a view of a detached alias
# updated in place by an operand that requires grad (v3.sub_(bias), v3 =
# z.detach().unsqueeze(0)), read after the block: eager regenerates the
# view's history from the alias's new one (AsStridedBackward over its
# CopySlices), in any grad mode; the program made that as_strided where the
# view was first read, in the caller's mode, and under a no_grad caller its
# output required no grad. The regenerated view is now made in grad mode,
# as the replays of the caller's own views are.

class ViewOfADetachedAliasUpdatedInABlockUnderANoGradCaller(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, z):
        with torch.enable_grad():
            v3 = z.detach().unsqueeze(0)
            v3.sub_(self.lin.bias)
        return v3


def test_a_view_of_a_detached_alias_updated_in_a_block_keeps_its_history_under_a_no_grad_caller():
    assert_sound(ViewOfADetachedAliasUpdatedInABlockUnderANoGradCaller(), inputs((4,)), inputs_require_grad=True)


# 108. (seed 815094, session 36; one program of 400, also on main before
# session 36) z = x[0], two inputs, and in a no_grad block x written,
# then z: `x.mul_(0.9); z.mul_(0.9)`; z read after the block, in grad mode.
# Eager regenerates z's history from its base, x, whose history is kept (a
# leaf requiring grad): z + 1 requires grad. In the program, x's write made
# z stale, so z's own write replayed it from x's new value inside the
# no_grad block; its updated value is read after the block as it is, with
# no kept history: the output requires no grad. (z written alone keeps its
# history, through keep_history of its view made before the block.) The
# general rule: a view's value written under no_grad keeps the history
# eager regenerates from its base, also where functionalization replayed
# the view inside the block. Fixed (session 37): the caller's views among
# the inputs are, to the recorder, views with a history in any mode, as the
# views made in grad mode are: a no_grad span that replays one keeps the
# value it had at the span's entry as the old value of its write.

class AnInputViewReplayedAndWrittenUnderNoGrad(nn.Module):
    def forward(self, x, z):
        with torch.no_grad():
            x.mul_(0.9)
            z.mul_(0.9)
        return z + 1.0


def test_an_input_view_replayed_and_written_under_no_grad_keeps_its_history():
    x = inputs((3, 4))[0]
    assert_sound(AnInputViewReplayedAndWrittenUnderNoGrad(), (x, x[0]), inputs_require_grad=True)


# 109. (issue 38: one of 4,000 programs on four fresh seeds, session 36's
# fuzzer) A detached alias of an input written, a value made from it relaid
# (unsqueeze_) under no_grad, then, in a no_grad block nested in an
# enable_grad block, given other memory (set_) of the old shape: eager's
# tensor keeps the history it had before both (shape (4,)); the program
# kept it as keep_history(keep_history(old, relaid), swapped), whose
# backward checked the gradient against the relaid (1, 4) and crashed
# ("_HistoryBackward returned an invalid gradient"). A kept history's old
# value is now its source through keep_history nodes.

class RelaidThenSwappedUnderNoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x, z):
        v0 = z.detach()
        v0[0] = self.n
        v0.mul_(0)
        v0.sub_(v0)
        v2 = -v0
        v2.mul_(z)
        with torch.no_grad():
            v2.unsqueeze_(0)
            with torch.enable_grad():
                v3 = x - z
                with torch.no_grad():
                    v2.set_(v0)
        return (v3, v3, v2)


def test_a_history_kept_across_a_relayout_and_a_swap_is_checked_at_its_own_shape():
    assert_sound(RelaidThenSwappedUnderNoGrad(), inputs((3, 4), (4,)), inputs_require_grad=True)


# 110. (issue 38, as 109) A view of a parameter made in the caller's mode
# (v0 = w[1:]), the parameter's memory written in an enable_grad block out
# of autograd's sight (through a tensor set_() to it), then a view of v0
# made there and returned: under a no_grad caller eager's v0 has no
# history, nor its view; the program replayed the returned view from the
# parameter's new value in grad mode, with the parameter's history. The
# view as made was itself made of a replay that keeps v0's history as made
# (keep_history(v0, replay)): walking the view as made back through that
# keep now finds v0, made in the caller's mode, and the returned replay
# keeps its history too. (Minimized by hand: the issue's program wrote the
# parameter through an input set_() to it, which is now refused: written in
# grad mode, it left the caller's input requiring grad with the parameter's
# history, where eager's does not.)

class CallersModeViewOfAViewReplayedInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)

    def forward(self, x):
        v0 = self.w[1:]
        t = torch.zeros(3, 4)
        with torch.enable_grad():
            with torch.no_grad():
                t.set_(v0)
            t.mul_(0.5)
            v3 = v0[0]
            t.mul_(2.0)
        return v3


class IssueProgramWritingAParameterThroughAnInputSetToIt(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x, y):
        self.s.mul_(0.5)
        v0 = self.w[1:]
        with torch.set_grad_enabled(True):
            @torch.set_grad_enabled(False)
            def f0():
                v2 = self.s[0]
                with torch.no_grad():
                    y.set_(v0)
                x.transpose_(0, 1)
                return (v2,)
            v2, = f0()
            y.mul_(v2)
            v3 = v0[0]
            y.mul_(2.0)
        self.s.mul_(0.5)
        return v3


@pytest.mark.parametrize("inputs_require_grad", [False, True])
def test_a_view_of_a_callers_mode_view_replayed_in_a_grad_block_keeps_its_history(inputs_require_grad):
    assert_sound(CallersModeViewOfAViewReplayedInAGradBlock(), inputs((4,)), inputs_require_grad=inputs_require_grad)


def test_an_input_set_to_a_parameter_then_written_in_grad_mode_is_refused_in_the_issues_program():
    with pytest.raises(predispatch.ExportError, match=r"y.mul_\(v2\) of a parameter, buffer or input that set_\(\)"):
        predispatch.export_predispatch(IssueProgramWritingAParameterThroughAnInputSetToIt(), inputs((3, 4), (3, 4)))


# 111. (seed 9110, issue 38) An input seen through a cover (f(y, y[1])) is
# written (z.mul_), then the cover is swapped onto a view of its own memory
# (y.set_(z[0])): the program wrote the group's memory back through the
# cover's new 0-d layout only, so three of z's four doubled elements kept
# their old values in the caller's memory. Fixed: a cover written and then
# relaid on its memory is written back as its memory as the call started,
# then relaid (LayoutChange.as_started); so too through the cover itself,
# and relaid by t_().

class ViewInputWrittenThenCoverSwappedOntoIt(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.register_buffer("n", torch.zeros(()))
        self.how = how

    def forward(self, y, z):
        v0 = z[0]
        if self.how == "through_the_cover":
            y[1, 1:].mul_(2.0)  # through the cover, where z sees it
        else:
            z.mul_(2.0)
        if self.how == "t_":
            y.t_()
        else:
            y.set_(v0)
        return self.n


@pytest.mark.parametrize("how", ["seed", "through_the_cover", "t_"])
def test_a_cover_swapped_onto_its_view_input_writes_back_all_it_wrote(how):
    y = inputs((3, 4))[0]
    assert_sound(ViewInputWrittenThenCoverSwappedOntoIt(how), (y, y[1]), inputs_require_grad=False)


# (seed 60067, fortieth session) A linear of a vector updated in place in
# the caller's mode, then set_() under no_grad to memory of another shape,
# a view of it returned: where eager's linear of a vector is a view (torch
# 2.13, 2.14), updated in place it stays one, and eager regenerates its
# history through the new layout (no gradient reached the input); the
# refusal looked at the updates' values, not the tensor they stay. Now
# refused there; elsewhere it matches eager.

class LinearOfAVectorUpdatedThenSwapped(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        v0 = self.lin(x[0])
        v0.mul_(0.9).add_(v0, alpha=0.1)
        with torch.no_grad():
            v0.set_(self.w)
        return v0[1:]


def test_a_linear_of_a_vector_updated_then_swapped_to_another_shape():
    assert_refused_where_eager_views(LinearOfAVectorUpdatedThenSwapped(), inputs((3, 4)),
                                     match="is given another shape")


# (seed 60101, forty-first session) The same family: a linear of a vector
# relaid in the caller's mode (unsqueeze_), overwritten (copy_), then set_()
# under no_grad back to memory of its first shape. The refusal asked whether
# the tensor the history came from (the copy, through the relayout's view)
# started as a view; eager's tensor is the one the history is kept on, which
# started as the linear's view. Refused on 2.13 and 2.14, where the program's
# backward raised ("_HistoryBackward returned an invalid gradient", eager's
# ran); elsewhere eager's backward raises (its history of shape (1, 4) meets
# a gradient of shape (4,)), and so does the program's.

class LinearOfAVectorRelaidThenSwappedBack(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v0 = self.lin(self.s)
        v0.unsqueeze_(0)
        v0.copy_(torch.full_like(v0, -1.0))
        with torch.no_grad():
            v0.set_(self.s)
        return v0 * x[0]


def test_a_linear_of_a_vector_relaid_overwritten_then_swapped_back():
    module, args = LinearOfAVectorRelaidThenSwappedBack(), inputs((3, 4))
    if linear_of_a_vector_is_a_view():
        with pytest.raises(predispatch.ExportError, match=r"another shape \(4,\).*v0.set_"):
            predispatch.export_predispatch(module, args)
        return
    with pytest.raises(RuntimeError, match="invalid gradient"):
        module(*args).sum().backward()
    program = predispatch.export_predispatch(module, args).module()
    with pytest.raises(RuntimeError, match="invalid gradient"):
        program(*args).sum().backward()


# (forty-first session, a helper's probe; the second fixed in the
# forty-third, the first in the forty-fourth) Inputs that alias, written in
# grad mode after a relayout out of autograd's sight. The second: the
# cover's write in the caller's mode (``y.add_``) kept no history under a
# no_grad caller: its new value, the relaid cover's replay, is read by
# nothing later, but the cover's memory, written back as it started, is.
# The write's history is now kept on those replayed bases (as seed 63002's).
# The first: under a no_grad caller the gradient reaching the inputs' leaf
# was eager's transposed. Written back as its memory started, the cover's
# history came through the base's update (a transpose, in the old layout),
# then relaid where autograd does not see it; eager's tensor has no such
# transpose. A relayout of the same shape that reaches all the memory
# (``t_()`` of a square) is now written back as its value in the new
# layout, whose history is eager's (the family: the test after it).

class CoverTransposedThenWrittenInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))

    def forward(self, y, v):
        y.t_()
        with torch.enable_grad():
            y.add_(self.a)
        return self.a * 1


class CoverResizedToItsSizeThenWrittenInAGradBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))
        self.w = nn.Parameter(torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, y, v):
        y.resize_(y.shape)
        with torch.enable_grad():
            y[..., :1] = self.w[:1] * self.a
        y.add_(self.w)
        return y


def _square_and_row():
    y = inputs((4, 4))[0]
    return y, y[0]


def _row_and_its_only_row():
    y = inputs((1, 4))[0]
    return y, y[0]


@pytest.mark.parametrize("module, make_args, kw", [
    (CoverTransposedThenWrittenInAGradBlock(), _square_and_row,
     {"inputs_require_grad": True, "inputs_with_history": True}),
    (CoverResizedToItsSizeThenWrittenInAGradBlock(), _row_and_its_only_row, {"inputs_require_grad": False}),
])
def test_aliased_inputs_written_in_grad_mode_after_a_relayout(module, make_args, kw):
    assert_matches_eager(module, make_args(), **kw)


class CoverRelaidAndWritten(nn.Module):
    """A square cover (``f(y, y[0])``) relaid by ``relayout`` (under no_grad,
    or in the caller's mode) and written with a history before, after or
    both: the caller's gradient and values as eager's."""

    def __init__(self, relayout, writes, relaid_under):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))
        self.relayout, self.writes, self.relaid_under = relayout, writes, relaid_under

    def write(self, y):
        with torch.enable_grad():
            y.add_(self.a)

    def forward(self, y, v):
        if "before" in self.writes:
            self.write(y)
        with torch.no_grad() if self.relaid_under == "no_grad" else contextlib.nullcontext():
            if self.relayout == "as_strided_":  # the strides reversed: a transpose of the square
                y.as_strided_(y.shape, y.stride()[::-1])
            else:
                y.t_() if self.relayout == "t_" else y.transpose_(0, 1)
        if "after" in self.writes:
            self.write(y)
        return self.a * 1


def _transposed_square_and_row():
    y = inputs((4, 4))[0].t()
    return y, y[0]


@pytest.mark.parametrize("given", ["contiguous", "transposed"])
@pytest.mark.parametrize("relaid_under", ["no_grad", "caller's mode"])
@pytest.mark.parametrize("writes", ["before", "after", "before and after"])
@pytest.mark.parametrize("relayout", ["t_", "transpose_", "as_strided_"])
def test_a_square_cover_relaid_and_written_gives_eagers_gradient(relayout, writes, relaid_under, given):
    module = CoverRelaidAndWritten(relayout, writes, relaid_under)
    make_args = _square_and_row if given == "contiguous" else _transposed_square_and_row
    for kw in ({"inputs_require_grad": True, "inputs_with_history": True}, {"inputs_require_grad": False}):
        try:
            assert_matches_eager(module, make_args(), **kw)
        except predispatch.ExportError as e:
            # torch 2.15's functionalization writes through the view with as_strided_scatter into
            # the transposed tensor, once it requires grad, which torch asserts against
            # (pytorch/pytorch#90992): refused, naming the line
            if not (relayout == "as_strided_" and given == "transposed"
                    and "as_strided_scatter is currently only supported for contiguous" in str(e)):
                raise


# (forty-fourth session, a probe of the family above; fixed the same day)
# The smallest form of the family's cover given transposed, no aliasing
# needed: an input given transposed, restrided in place by as_strided_ and
# written gave its leaf eager's gradient transposed, under a grad caller
# too, the values equal. The program writes through an as_strided view with
# as_strided_scatter, whose gradient for the values written takes the
# tensor written into as contiguous (pytorch/pytorch#90992); it now
# scatters into zeros permuted to be contiguous (passes/writes.py).

class TransposedInputRestridedThenWritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))

    def forward(self, y):
        y.as_strided_(y.shape, y.stride()[::-1])
        y.mul_(self.a)
        return self.a * 1


def test_a_transposed_input_restrided_by_as_strided_then_written():
    assert_matches_eager(TransposedInputRestridedThenWritten(), (inputs((4, 4))[0].t(),), inputs_require_grad=True,
                         inputs_with_history=True)


# (forty-first session, a helper's probe; fixed in the forty-second) The same
# tensor given twice, ``f(y, y)``, scaled in place through the second by a
# parameter, then overwritten whole. The program's ``mul`` saved its input
# for the parameter's gradient, and the write-back into the first input (the
# same tensor) bumped its version: the backward raised autograd's version
# error, where eager's ``mul_`` had saved the value before its write. Reads
# that compute a written-back input's new value read a snapshot; they are
# now found through the inputs aliasing it too.

class SameInputTwiceScaledThenOverwritten(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(0.5))

    def forward(self, y, v):
        v.mul_(self.a)
        v[...] = self.a
        return y


def _twice():
    y = inputs((3, 4))[0]
    return y, y


def test_the_same_input_twice_scaled_through_one_then_overwritten():
    assert_matches_eager(SameInputTwiceScaledThenOverwritten(), _twice(), inputs_require_grad=False)
    assert_matches_eager(SameInputTwiceScaledThenOverwritten(), _twice(), inputs_with_history=True)


# (forty-first session, a helper's probe; fixed in the forty-second) Two
# more of the linear-of-a-vector family, refused where that linear is a
# view (2.13, 2.14): eager regenerates the view's history through the
# layout set_() gives it. (1) Relaid and written inside enable_grad blocks:
# the refusal asked whether the tensor written started as a view, but the
# value kept there was a keep_history node; now it asks it of the history
# too. The program's parameter gradient was a third of eager's. (2) Relaid
# under no_grad, then written in the caller's mode: under a grad-mode
# caller the value carries the write's history, of shape (1, 4), where the
# check looked at the first one, (4,) only; every history a value may carry
# is checked now. The program's backward raised "invalid gradient". Both
# errors name the set_() line (the no_grad write's event now carries it).

class LinearOfABufferRelaidInGradBlocksThenSetToAnInput(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a = nn.Parameter(torch.randn((), generator=g))
        self.lin = nn.Linear(4, 4)
        self.register_buffer("bv", torch.randn(4, generator=g))

    def forward(self, x):
        h = self.lin(self.bv)
        with torch.enable_grad():
            h.unsqueeze_(0)
        with torch.enable_grad():
            h.squeeze_()
        with torch.enable_grad():
            h.add_(x[1])
        h.add_(self.a)
        with torch.no_grad():
            h.set_(x)
        return h.sum()


class LinearOfAVectorUnsqueezedUnderNoGradWrittenThenSet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("s", torch.randn(4, generator=torch.Generator().manual_seed(0)))

    def forward(self, x):
        h = self.lin(x[0])
        with torch.no_grad():
            h.unsqueeze_(0)
        h.add_(1)
        with torch.no_grad():
            h.set_(self.s)
        return h


def test_a_linear_of_a_buffer_relaid_in_grad_blocks_then_set_to_an_input():
    module, args = LinearOfABufferRelaidInGradBlocksThenSetToAnInput(), inputs((3, 4))
    if linear_of_a_vector_is_a_view():
        with pytest.raises(predispatch.ExportError, match=r"another shape \(3, 4\).*h.set_\(x\)"):
            predispatch.export_predispatch(module, args)
    else:
        assert_matches_eager(module, args, inputs_require_grad=False)


def test_a_linear_of_a_vector_unsqueezed_under_no_grad_written_then_set():
    module, args = LinearOfAVectorUnsqueezedUnderNoGradWrittenThenSet(), inputs((3, 4))
    if linear_of_a_vector_is_a_view():
        with pytest.raises(predispatch.ExportError, match=r"another shape \(4,\).*h.set_\(self.s\)"):
            predispatch.export_predispatch(module, args)
        return
    with pytest.raises(RuntimeError, match="invalid gradient"):  # eager's backward raises, as the program's
        module(*args).sum().backward()
    with pytest.raises(RuntimeError, match="invalid gradient"):
        predispatch.export_predispatch(module, args).module()(*args).sum().backward()


# (forty-second session) Beside seed 62007's data file: a view of a leaf
# made in the forward, left on its old memory by set_() to memory that still
# covers it. The program's backward raised "_HistoryBackward returned an
# invalid gradient": the view's history was regenerated from the leaf of the
# old shape, where eager's leaf is one of the new memory's shape. It now
# regenerates from a leaf of the new memory (recorder/swaps.py, ViewLeftBehind).

class LeafRowLeftBehindBySet(nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.register_buffer("b", torch.randn(3, 4, generator=g))
        self.register_buffer("s", torch.zeros(4))

    def forward(self, z):
        v1 = self.b.detach().requires_grad_()
        v2 = v1[0]
        with torch.no_grad():
            v1.set_(self.s)
        return v2 * z


def test_a_row_of_a_leaf_left_behind_by_set_to_memory_covering_it():
    assert_matches_eager(LeafRowLeftBehindBySet(), (torch.randn(4),), inputs_require_grad=False)
