"""Mutations beyond data updates, in the style of PyTorch's AOTAutograd
mutation tests (test/functorch/test_aotdispatch.py): a function ``f``, its
inputs with and without requires_grad, compared with eager by
``assert_matches_eager`` (outputs and which require grad, gradients, inputs,
parameters and buffers afterwards: values, size, strides, storage offset and
which share a storage, under grad mode on and off, re-export stable). Kinds:
storage swaps (``set_``), metadata mutations (``t_``, ``transpose_``,
``unsqueeze_``, ``resize_``), inputs sharing memory, updates inside autocast
blocks (the cast cache)."""
import pytest
import torch

import cases
import predispatch
from predispatch.program.program import program_meta
from predispatch.testing.eager import assert_matches_eager


class F(torch.nn.Module):
    """``fn(*inputs)`` as a module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


def both(fn, *inputs, requires_grad=(True, False)):
    """Check ``fn`` with inputs that require grad and with inputs that do not."""
    for rg in requires_grad:
        assert_matches_eager(F(fn), inputs, inputs_require_grad=rg)


# --- set_ -------------------------------------------------------------------

def test_set__of_an_input_under_no_grad():
    """AOTAutograd's test_input_mutation_set__input_mutation: ``a`` keeps its own
    autograd history (a leaf) and takes ``b``'s storage."""
    def f(a):
        b = torch.arange(9, dtype=a.dtype).reshape(3, 3)
        with torch.no_grad():
            a.set_(b)
        return a * b
    both(f, torch.ones(3, 3))


def test_set__to_another_input_shares_its_storage_afterwards():
    def f(a, b):
        with torch.no_grad():
            a.set_(b)
        return a * b
    both(f, torch.randn(3, 3), torch.randn(3, 3))


def test_set__then_a_data_mutation_of_the_source():
    """test_set__and_data_mutation_good: the update of ``b`` shows in ``a``."""
    def f(a, b):
        with torch.no_grad():
            a.set_(b)
            b.mul_(2)
        return a + b
    both(f, torch.ones(3, 3), torch.ones(3, 3))


def test_set__steals_a_view_chain_then_is_mutated_through_a_view():
    """test_set__steals_view_chain (grad mode: eager's set_ has no derivative,
    so inputs that do not require grad)."""
    def f(a, b):
        a_ = a.mul(2)
        b_ = b.mul(2)
        b_slice = b_[1].view(3, 3)
        a_.set_(b_slice)
        a_.view(-1).mul_(2)  # mutates b_ too
        return a_ * b_slice
    both(f, torch.ones(3, 3), torch.zeros(3, 9), requires_grad=(False,))


def test_two_set__calls_that_cancel_out():
    """test_input_mutation_set__nop: ``a`` ends on its own storage, unchanged."""
    def f(a):
        b = torch.arange(9, dtype=a.dtype)
        a_old = torch.ops.aten.alias.default(a)
        with torch.no_grad():
            a.set_(b)
            a.set_(a_old)
        return a + b.reshape(3, 3)
    both(f, torch.ones(3, 3))
    ep = predispatch.export_predispatch(F(f), (torch.ones(3, 3),))
    assert program_meta(ep)["layouts"]["inputs_0"]["storage"] == "own"


def test_set__of_a_buffer_under_no_grad_to_another_shape():
    class SwapsBuffer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("state", torch.zeros(2))

        def forward(self, x):
            with torch.no_grad():
                self.state.set_(x.detach().sum(0) * 1.0)
            return x * self.state
    assert_matches_eager(SwapsBuffer(), (torch.randn(3, 4),))


def test_set__of_a_fresh_intermediate():
    def f(x, y):
        t = x * 1.0
        with torch.no_grad():
            t.set_(y)
        return t * 2 + y
    both(f, torch.randn(4), torch.randn(4))


class AssignsData(torch.nn.Module):
    """``t.data = v``: ``t`` takes ``v``'s memory and layout, keeping its
    autograd identity (a parameter stays the leaf it was)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3, 4, generator=torch.Generator().manual_seed(0)))
        self.register_buffer("b", torch.zeros(3, 4))

    def forward(self, x, y):
        self.w.data = self.w.data * 0.5
        self.b.data = x * 2
        x.data = y
        h = x * self.w
        h.data = torch.zeros(3, 4)  # an intermediate: its history stays
        return x + 1, h.sum() + self.w.sum()


def test_assigning_tensor_data():
    for rg in (True, False):
        assert_matches_eager(AssignsData(), (torch.randn(3, 4), torch.randn(3, 4)), inputs_require_grad=rg)


def test_set__of_an_input_mutated_again_afterwards():
    def f(x, y):
        with torch.no_grad():
            x.set_(y)
            x.add_(1)  # y too: they share the storage
        return x * 2
    both(f, torch.randn(4), torch.randn(4))


# --- metadata mutations -------------------------------------------------------

def test_t__of_an_input():
    def f(x):
        x.t_()
        return x * 2
    both(f, torch.randn(3, 4), requires_grad=(False,))


def test_t__of_an_input_under_no_grad_keeps_it_a_leaf():
    def f(x):
        with torch.no_grad():
            x.t_()
        return x
    both(f, torch.randn(3, 3))


def test_transpose__then_mul__of_an_input():
    def f(x):
        x.transpose_(0, 1)
        x.mul_(2)
        return x + 1
    both(f, torch.randn(3, 4), requires_grad=(False,))


def test_resize__of_an_input_within_and_past_its_storage():
    def shrink(x):
        x.resize_(6)
        return x * 2

    def grow(x):
        x.resize_(2, 8)
        x.fill_(1.0)
        return x * 2
    both(shrink, torch.randn(3, 4), requires_grad=(False,))
    both(grow, torch.randn(3, 4), requires_grad=(False,))


def test_unsqueeze__of_an_intermediate_under_no_grad_keeps_its_history():
    """Was silently wrong: the program dropped the gradient to x."""
    def f(x):
        y = x * 1.0
        with torch.no_grad():
            y.unsqueeze_(0)
        return y * 2
    both(f, torch.randn(4))


def test_metadata_mutation_of_a_parameter_under_no_grad():
    class Transposes(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(3, 3))

        def forward(self, x):
            with torch.no_grad():
                self.w.t_()
            return x @ self.w
    assert_matches_eager(Transposes(), (torch.randn(2, 3),))


# --- inputs that start inside a larger storage -------------------------------
# Functionalization counts offsets from its own base, which an update replaces
# by a fresh tensor at offset 0; eager's tensors keep counting from their
# storage. Each input here is a view at some offset into memory no other
# input covers (f(y[1:3], y[3])): its layout and values afterwards are eager's.

def _update_then_transpose(x, z):
    x.mul_(2)
    x.t_()


def _transpose_then_update(x, z):
    x.t_()
    x.mul_(2)


def _set_then_update(x, z):
    x.set_(z)
    x.mul_(2)


def _update_then_set(x, z):
    z.mul_(2)
    x.set_(z)


def _set_to_a_view_then_update(x, z):
    x.set_(z[1:])
    x.add_(1)


def _update_then_set_to_a_view(x, z):
    z.add_(1)
    x.set_(z[1:])


def _set_then_relay_the_source(x, z):
    x.set_(z)
    z.t_()
    z.add_(1)


def _update_then_resize(x, z):
    x.add_(1)
    x.resize_(2)


def _swap_both_ways(x, z):
    # z ends on part of x's memory (z's own): x's values are written back too
    x.set_(z)
    x.add_(1)
    z.set_(x[1:])
    z.mul_(3)


def _relaid(body):
    def f(x, z):
        with torch.no_grad():
            body(x, z)
        return x.detach() + 0, z.detach() + 0
    return f


_STORAGE = torch.randn(5, 4)


@pytest.mark.parametrize("body", [
    _update_then_transpose, _transpose_then_update, _set_then_update, _update_then_set,
    _set_to_a_view_then_update, _update_then_set_to_a_view, _set_then_relay_the_source,
    _update_then_resize, _swap_both_ways])
@pytest.mark.parametrize("x, z", [(_STORAGE[1:3], _STORAGE[3:5].clone()[0]), (torch.randn(2, 4), _STORAGE[3]),
                                  (_STORAGE[1:3], _STORAGE[4])], ids=["x_at_4", "z_at_12", "both"])
def test_inputs_inside_a_larger_storage_are_left_as_eager_leaves_them(body, x, z):
    assert_matches_eager(F(_relaid(body)), (x, z), inputs_require_grad=False)


def test_as_strided_with_a_storage_offset_eager_counts_otherwise_is_refused():
    def f(x):
        with torch.no_grad():
            x.add_(1)
            x.as_strided_((2,), (1,), x.storage_offset() + 1)
        return x.detach() + 0
    with pytest.raises(predispatch.ExportError, match=r"as_strided_\(\) with a storage offset"):
        predispatch.export_predispatch(F(f), (_STORAGE[1:3],))
    assert_matches_eager(F(f), (torch.randn(2, 4),), inputs_require_grad=False)  # it starts its storage


def _both_to_the_value(x, z, v):
    x.set_(v[1:])
    z.set_(v)


def _the_second_to_a_view_of_the_value(x, z, v):
    x.set_(v)
    z.set_(v[1:].t())


def _the_second_through_the_first_then_updated(x, z, v):
    x.set_(v)
    z.set_(x[0])
    z.mul_(2)


def _apart_then_relaid(x, z, v):
    x.set_(v[1:])
    z.set_(v[:1])
    x.t_()


@pytest.mark.parametrize("body", [_both_to_the_value, _the_second_to_a_view_of_the_value,
                                  _the_second_through_the_first_then_updated, _apart_then_relaid])
def test_inputs_set__to_memory_the_forward_made_share_it_as_in_eager(body):
    class SetToAValue(torch.nn.Module):
        def forward(self, x, z, w):
            v = w * 2
            with torch.no_grad():
                body(x, z, v)
            return v, x.detach() + 0
    assert_matches_eager(SetToAValue(), (torch.randn(2, 4), torch.randn(3), torch.randn(3, 4)),
                         inputs_require_grad=False)


# --- inputs sharing memory ----------------------------------------------------

class MutatesSecondReadsFirst(torch.nn.Module):
    def forward(self, x, y):
        with torch.no_grad():
            y.mul_(2)  # x, whose row y is, sees it in eager
        return x + 0


def test_the_same_tensor_twice_one_mutated():
    x = torch.randn(3)
    assert_matches_eager(cases.SameTensorTwice(), (x, x))
    assert_matches_eager(cases.SameTensorTwice(), (x, x.clone()))


def test_an_input_and_a_view_of_it_one_mutated():
    b = torch.randn(2, 4)
    for rg in (True, False):
        assert_matches_eager(MutatesSecondReadsFirst(), (b, b[0]), inputs_require_grad=rg)


def test_inputs_that_do_not_overlap_are_distinct():
    b = torch.randn(2, 4)
    assert_matches_eager(MutatesSecondReadsFirst(), (b[0], b[1]), inputs_require_grad=False)


def test_calls_whose_inputs_alias_otherwise_than_at_export_raise():
    b = torch.randn(2, 4)
    aliased = predispatch.export_predispatch(MutatesSecondReadsFirst(), (b, b[0])).module()
    with pytest.raises(RuntimeError, match="share memory otherwise"):
        aliased(torch.randn(2, 4), torch.randn(4))
    distinct = predispatch.export_predispatch(MutatesSecondReadsFirst(), (b, b[0].clone())).module()
    c = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="share memory otherwise"):
        distinct(c, c[0])
    distinct(c, c[1].clone())  # distinct, as at export


def test_partially_overlapping_inputs_one_mutated_are_refused():
    b = torch.randn(4)
    with pytest.raises(predispatch.ExportError, match="partially overlap"):
        predispatch.export_predispatch(MutatesSecondReadsFirst(), (b[:3], b[1:]))


# --- updates inside autocast: the cast cache ------------------------------------

class StaleCastOfAParameter(torch.nn.Module):
    """Eager caches the bf16 cast of ``lin.weight`` at its first use in the
    block; the update does not reach the second ``lin`` (it does reach the
    code after the block, and inside a nested ``autocast(enabled=False)``)."""

    def __init__(self, cache_enabled=None):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.cache_enabled = cache_enabled

    def forward(self, x):
        kw = {} if self.cache_enabled is None else {"cache_enabled": self.cache_enabled}
        with torch.autocast("cpu", dtype=torch.bfloat16, **kw):
            a = self.lin(x)
            with torch.no_grad():
                self.lin.weight.mul_(-1)
            b = self.lin(x)
            with torch.autocast("cpu", enabled=False):
                c = self.lin(x.float())
        d = self.lin(x)
        return a.float() + b.float(), c, d


@pytest.mark.parametrize("cache_enabled", [None, False], ids=["cached", "cache_off"])
def test_a_parameter_updated_inside_autocast_is_read_as_eager_s_cached_cast(cache_enabled):
    ep = assert_matches_eager(StaleCastOfAParameter(cache_enabled), (torch.randn(2, 4),))
    cached = [n for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
              for n in m.graph.nodes if n.target is torch.ops.predispatch.autocast_cached.default]
    assert len(cached) == 1  # the second lin in the block; not the nested or later ones


def test_a_frozen_parameter_updated_inside_autocast_is_not_cached():
    module = StaleCastOfAParameter()
    module.lin.weight.requires_grad_(False)
    assert_matches_eager(module, (torch.randn(2, 4),))


class UpdatedInsideAutocast(torch.nn.Module):
    """A buffer, and an input (cached by eager only when it is a leaf that
    requires grad), updated between two uses in one autocast block."""

    def __init__(self):
        super().__init__()
        self.register_buffer("s", torch.randn(4, 4))

    def forward(self, x, w):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = x @ self.s + x @ w
            with torch.no_grad():
                self.s.mul_(2)
                w.mul_(2)
            b = x @ self.s + x @ w
        return a.float() + b.float()


@pytest.mark.parametrize("requires_grad", [True, False])
def test_inputs_and_buffers_updated_inside_autocast(requires_grad):
    assert_matches_eager(UpdatedInsideAutocast(), (torch.randn(2, 4), torch.randn(4, 4)),
                         inputs_require_grad=requires_grad)
