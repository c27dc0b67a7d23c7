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


class SetsAnInputWhereALinearsViewWent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, z):
        z.uniform_(-1.0, 1.0)
        v = self.lin(z)  # of a 1-d input: a view, with a history
        u = z.unsqueeze(0)
        with torch.no_grad():
            v.set_(z)
        with torch.no_grad():
            x.set_(z)
        return u


def test_set__of_an_input_to_memory_a_value_with_a_history_took_first():
    """Fuzz seed 111986: ``v`` (with a history) and then the input ``x`` are
    set_() on ``z``'s memory, each under a no_grad block of its own; the program writes ``x`` back as
    that memory's value, whose kept history is ``v``'s, but it sets the
    caller's tensor on that memory and writes its values under no_grad: ``x``
    keeps its own history, as eager's, and no gradient comes from the
    write-back (it was refused, as if one could)."""
    # inputs that do not require grad: eager refuses z.uniform_() of a leaf that does
    assert_matches_eager(SetsAnInputWhereALinearsViewWent(), (torch.randn(3, 4), torch.randn(3, 4)[1]),
                         inputs_require_grad=False)


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


@pytest.mark.parametrize("then", ["mul_", "zero_", "unsqueeze_ then mul_", "set_ again then mul_", "nothing",
                                  "after a t_(): nothing", "after a t_(): mul_"])
def test_set__leaves_earlier_views_on_the_old_memory_following_the_tensors_history(then):
    """Views made before ``t.set_()`` keep the old memory's values but share
    ``t``'s version counter: eager regenerates their history from ``t``'s
    next update in grad mode (a view of a view too)."""
    def f(x, y):
        t = x * 2.0
        col = t[:, 0]
        part = col[1:]
        if "t_()" in then:  # the history regenerated at the swap's read goes through the transpose
            t.t_()
        with torch.no_grad():
            t.set_(y * 3)
        if "set_ again" in then:
            with torch.no_grad():
                t.set_(x * 5)
        if "unsqueeze_" in then:
            t.unsqueeze_(0)
        if "mul_" in then:
            t.mul_(y[0, 0])
        if then == "zero_":
            t.zero_()
        return col * 1, part, t
    both(f, torch.randn(4, 4), torch.randn(4, 4))


class ViewLeftPastTheMemorySet(torch.nn.Module):
    """A view made before ``t.set_()`` to memory that ends before the view
    ends (a slice of a larger buffer, a row of it), read where it may
    require grad: eager regenerates the view's history over memory ``t`` no
    longer covers. (An input so set_: tests/fuzz_regressions, seed 61034.)"""

    def __init__(self, source):
        super().__init__()
        self.source = source
        self.register_buffer("l", torch.randn(5, 4))

    def forward(self, x):
        t = x * 2.0
        v = t[2:]
        with torch.no_grad():
            t.set_(self.l[:2] if self.source == "slice" else self.l[0])
        return v * 1.0


@pytest.mark.parametrize("source", ["slice", "row"])
def test_a_view_left_past_the_memory_set_gives_is_refused_naming_the_set_(source):
    with pytest.raises(predispatch.ExportError, match=r"memory that ends before a view of it made before ends"):
        predispatch.export_predispatch(ViewLeftPastTheMemorySet(source), (torch.randn(3, 4),))


@pytest.mark.parametrize("writes", [("base", "view"), ("base", "other view", "view"), ("base", "view of view")])
def test_views_replayed_between_callers_mode_writes_keep_the_bases_history(writes):
    """Under a no_grad caller, each write of a caller's-mode segment keeps
    the base's history; a grad-mode view replayed between two of them (in
    grad mode, as eager regenerates it) reads it."""
    def f(x):
        with torch.enable_grad():
            base = x @ x
            row, column = base[0], base[:, 1]
            tail = row[1:]
        for w in writes:
            {"base": base, "view": row, "other view": column, "view of view": tail}[w].mul_(0.5)
        with torch.enable_grad():
            return torch.tanh(row) + column.sum() + tail.sum()
    both(f, torch.randn(4, 4))


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


@pytest.mark.parametrize("first", [None, (1, 2)], ids=["resize_as_", "resize_ then resize_as_"])
def test_resize_as__of_an_input_is_its_resize_(first):
    """Was a raw error when the program ran (its write-back had the old
    shape), or a tracing failure after a resize_ (torch's test_autograd
    test_resize_version_bump): resize_as_ goes as resize_ to the template's
    shape, grown past the storage by the same rule."""
    def f(x, y):
        if first is not None:
            x.resize_(first)
        x.resize_as_(y)
        x.fill_(1.0)
        return x * 1
    assert_matches_eager(F(f), (torch.randn(1), torch.randn(3)), inputs_require_grad=False)


@pytest.mark.parametrize("resize", ["resize_", "resize_as_"])
def test_resize__to_the_sizes_a_strided_view_has_keeps_its_strides(resize):
    """Eager's resize_ to the sizes a tensor has is no op; functionalization's
    laid the view out anew, contiguous over the same memory (op_db's
    resize_as_ on ``base[..., 1]``: found when resize_as_ became resize_)."""
    def f(base, template):
        v = base[..., 1]
        return v.resize_(5, 5, 5) if resize == "resize_" else v.resize_as_(template)
    assert_matches_eager(F(f), (torch.randn(5, 5, 5, 2), torch.randn(5, 5, 5)), inputs_require_grad=False)


def test_resize__growing_memory_a_view_shares_is_refused():
    """Was silently wrong (torch's test_functionalization
    test_resize_larger_invalid): eager grows the memory a view and its base
    share, so the base reads what is written through the view; the program
    moved the resized view to memory of its own. (torch's functionalization
    refuses it too.)"""
    def of_an_intermediate(x):
        y = x + 1
        z = y.view(4, 4)
        z.resize_(5, 5)
        z.view(25).fill_(1)
        return y, z + 1

    def of_an_input(x):
        z = x.view(4, 4)
        z.resize_(5, 5)
        z.view(25).fill_(1)
        return z + 1
    for f in (of_an_intermediate, of_an_input):
        with pytest.raises(predispatch.ExportError, match=r"resize_ at .*z\.resize_\(5, 5\) grows memory other tensors share"):
            predispatch.export_predispatch(F(f), (torch.ones(8, 2),))


def test_unsqueeze__of_an_intermediate_under_no_grad_keeps_its_history():
    """Was silently wrong: the program dropped the gradient to x."""
    def f(x):
        y = x * 1.0
        with torch.no_grad():
            y.unsqueeze_(0)
        return y * 2
    both(f, torch.randn(4))


def RESIZE(v):
    return v.resize_(3, 2)


@pytest.mark.parametrize("relaid, shape", [
    (lambda v: v.t_(), (2, 2, 3)), (lambda v: v.transpose_(0, 1), (2, 2, 3)), (lambda v: v.unsqueeze_(1), (2, 2, 3)),
    (lambda v: v.squeeze_(), (2, 2, 1, 3)), (lambda v: v.as_strided_((2, 2), (1, 2)), (2, 2, 3)),
    (RESIZE, (2, 2, 3))],
    ids=["t_", "transpose_", "unsqueeze_1", "squeeze_", "as_strided_", "resize_"])
def test_a_view_of_an_input_relaid_in_the_callers_mode(relaid, shape):
    """Was refused (op_db's in-place metadata ops on ``base[1]``) as a view
    keeping a history of its old shape: in grad mode, eager's relayout is an
    op of the view's history; under a no_grad caller the view, made there,
    has no history to keep (eager's raises when used)."""
    def f(base):
        return relaid(base[1])
    assert_matches_eager(F(f), (torch.randn(shape),), inputs_require_grad=False)
    if relaid is not RESIZE:  # (eager cannot resize a tensor that requires grad)
        assert_matches_eager(F(f), (torch.randn(shape),), inputs_with_history=True, grad_modes=(True,))


def test_a_view_of_an_input_relaid_in_the_callers_mode_then_read_in_a_grad_block_is_exported():
    """Under a no_grad caller the relaid view has no history; an enable_grad
    block reading it then raises in eager (a view made in no_grad, changed
    in place): the grad-mode call is the one to match."""
    def f(base):
        v = base[1].t_()
        with torch.enable_grad():
            return v * 2
    assert_matches_eager(F(f), (torch.randn(2, 2, 3),), inputs_with_history=True, grad_modes=(True,))


def test_a_view_made_in_a_grad_block_relaid_in_the_callers_mode_then_differentiated_is_refused():
    """Under a no_grad caller the view keeps its history, of the old shape,
    and eager regenerates it through the new layout when the grad block
    reads it. (The reach check stopped at the output, given a no_grad
    caller's modes: this exported, and its backward raised.)"""
    def f(x):
        with torch.enable_grad():
            v = (x * 2)[0]
        v.t_()
        with torch.enable_grad():
            return v * 3
    with pytest.raises(predispatch.ExportError, match=r"given another shape \(4, 3\) under no_grad"):
        predispatch.export_predispatch(F(f), (torch.randn(2, 3, 4),))


@pytest.mark.parametrize("made", ["fresh", "with a history"])
@pytest.mark.parametrize("then", ["add_", "copy_ in a loop", "a view's add_", "no_grad add_"])
def test_a_tensor_detached_in_place_then_updated_gets_the_updates_history(made, then):
    """Was silently wrong (torch's test_autograd test_no_unnecessary_save):
    functionalization holds ``x.detach_()`` as a view of x's old value and
    replays it after each update, dropping the update's history; eager's x
    is a tensor of its own, whose update records one."""
    def f(mu):
        x = torch.zeros(3) if made == "fresh" else mu * 2
        out = 0
        for i in range(3 if then == "copy_ in a loop" else 1):
            x.detach_()
            if then == "add_":
                x.add_(mu)
            elif then == "copy_ in a loop":
                x.copy_(mu + i)
            elif then == "a view's add_":
                x[1:].add_(mu[1:])
            else:
                with torch.no_grad():
                    x.add_(mu)
            out = out + x * (i + 1)
        return out + mu
    assert_matches_eager(F(f), (torch.randn(3),))
    assert_matches_eager(F(f), (torch.randn(3),), inputs_with_history=True)


class BufferDetachedThenUpdated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3))

    def forward(self, x):
        self.b.detach_()
        self.b.add_(x)
        return self.b * 2


def test_a_buffer_detached_in_place_then_updated_from_an_input_gives_the_output_its_history():
    """Was silently wrong: the output had no history to x."""
    assert_matches_eager(BufferDetachedThenUpdated(), (torch.randn(3),))


def test_detach__of_a_tensor_with_views_made_before_is_refused():
    def f(mu):
        x = mu * 2
        v = x[1:]
        x.detach_()
        x.add_(mu)
        return v * 3, x
    with pytest.raises(predispatch.ExportError, match=r"detach_\(\) at .* of a tensor with views made before"):
        predispatch.export_predispatch(F(f), (torch.randn(3),))


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


def _aliased(fn, *inputs, grad_modes=(True, False)):
    """``fn`` on ``inputs`` sharing memory as given (views of one tensor with a
    history from a leaf, or not requiring grad), its inputs' histories checked."""
    for rg in (True, False):
        assert_matches_eager(F(fn), inputs, inputs_require_grad=rg, inputs_with_history=True,
                             grad_modes=grad_modes)


def _graph_ops(ep) -> list:
    return [n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"]


def _mul_first_add_second(x, y):
    x.mul_(3)
    y.add_(2)
    return x + 1, y * 2


def test_partially_overlapping_inputs_are_seen_through_a_synthetic_base():
    """No input holds all the memory ``x[:3]`` and ``x[1:]`` share: both are
    views of a synthetic base made in the graph from their values (zeros
    where none reaches), and both are written back (AOTAutograd's synthetic
    base). Also truly overlapping strided views (its false-aliasing test)."""
    b = torch.randn(4)
    _aliased(_mul_first_add_second, b[:3], b[1:])
    c = torch.randn(64)
    _aliased(_mul_first_add_second, c.as_strided((4, 4), (9, 1), 0), c.as_strided((4, 4), (9, 1), 24))
    ep = predispatch.export_predispatch(F(_mul_first_add_second), (b[:3], b[1:]))
    assert torch.ops.aten.zeros.default in _graph_ops(ep)
    assert [s.kind.name for s in ep.graph_signature.output_specs][:2] == ["USER_INPUT_MUTATION"] * 2


def test_the_same_views_twice_not_starting_their_storage_both_mutated():
    """Two ``b[1:]`` (distinct tensors): neither starts its storage, so
    neither is the other's base (functionalization replays a view of it from
    a value that starts at 0 once it is written): a synthetic base."""
    b = torch.randn(4)
    _aliased(_mul_first_add_second, b[1:], b[1:])


def _reads_first_after_the_others_mutated(x, *others):
    for y in others:
        y.mul_(2)
    return x + 0


@pytest.mark.parametrize("inputs", [
    lambda b: (b[2:8], b[3:5]),  # a cover starting at 2 (was traced through it: wrong values)
    lambda b: (b.view(2, 5)[:, :3], b.view(2, 5)[1, :2]),  # a cover with gaps
    lambda b: (b[:5].view(5, 1).t(), b[1:3]),  # dense from the start: the base itself
    lambda b: (lambda v: (b[1:5], v, v))(b[2:4]),  # the same view twice, a cover at 1
], ids=["offset", "gaps", "transposed", "view_twice"])
def test_an_input_covering_the_others_is_their_base_where_it_starts_its_storage_densely(inputs):
    _aliased(_reads_first_after_the_others_mutated, *inputs(torch.randn(10)))


def test_inputs_sharing_a_storage_but_no_element_are_distinct():
    """Interleaved columns, strided rows (AOTAutograd's false aliasing): their
    spans meet, their elements do not: traced as distinct inputs; a call
    whose inputs share elements raises."""
    b = torch.randn(4, 4)
    _aliased(_mul_first_add_second, b[:, 0:2], b[:, 2:4])
    ep = predispatch.export_predispatch(F(_mul_first_add_second), (b[:, 0:2], b[:, 2:4]))
    assert torch.ops.aten.as_strided.default not in _graph_ops(ep)
    c = torch.randn(4, 4)
    with pytest.raises(RuntimeError, match="share memory otherwise"):
        ep.module()(c[:, 0:2], c[:, 1:3])


def test_elements_too_many_to_compare_count_as_shared(monkeypatch):
    """Past the elements compared one by one, spans that meet count as
    overlapping: the inputs are seen through a synthetic base, which holds
    for inputs that do not overlap too."""
    from predispatch.trace import input_aliasing

    monkeypatch.setattr(input_aliasing, "_ELEMENTS_COMPARED", 4)
    b = torch.randn(4, 4)
    ep = assert_matches_eager(F(_mul_first_add_second), (b[:, 0:2], b[:, 2:4]), inputs_with_history=True)
    assert torch.ops.aten.zeros.default in _graph_ops(ep)


def test_calls_whose_inputs_alias_otherwise_than_through_the_synthetic_base_raise():
    b = torch.randn(6)
    module = predispatch.export_predispatch(F(_mul_first_add_second), (b[:3], b[1:4])).module()
    c = torch.randn(6)
    module(c[:3], c[1:4])  # as at export
    for other in ((c[:3], c[1:4].clone()), (c[1:4], c[2:5]), (c[:3], c[2:5])):
        with pytest.raises(RuntimeError, match="share memory otherwise"):
            module(*other)


@pytest.mark.parametrize("views", [lambda b: (b, b[0]), lambda b: (b[0, :3], b[0, 1:])], ids=["cover", "synthetic"])
def test_a_loaded_program_checks_its_inputs_aliasing_as_exported(views, tmp_path):
    """The record's views come back from a saved program as lists: compared as
    the views they are (a call aliasing as at export ran, not raised)."""
    ep = predispatch.export_predispatch(F(_mul_first_add_second), views(torch.randn(2, 4)))
    torch.export.save(ep, tmp_path / "p.pt2")
    module = predispatch.load(tmp_path / "p.pt2").module()
    b = torch.randn(2, 4)
    c = b.clone()
    expected = ep.module()(*views(c))
    torch.testing.assert_close(module(*views(b)), expected)
    torch.testing.assert_close(b, c)
    with pytest.raises(RuntimeError, match="share memory otherwise"):
        module(*[v.clone() for v in views(b)])


@pytest.mark.parametrize("views", [lambda b: (b, b[0]), lambda b: (b[0, :3], b[0, 1:])], ids=["cover", "synthetic"])
def test_a_program_whose_inputs_share_memory_decomposes(views):
    """torch's run_decompositions traces the program again on its example
    inputs, which AOTAutograd's export refuses where they share memory and
    one is mutated: the graph holds their aliasing itself, so they are
    traced apart; the result still checks a call's aliasing."""
    def decomposed(module, args, kwargs):
        return predispatch.export_predispatch(module, args, kwargs).run_decompositions()

    ep = assert_matches_eager(F(_mul_first_add_second), views(torch.randn(2, 4)), export=decomposed,
                              inputs_with_history=True, check_reexport=False)
    with pytest.raises(RuntimeError, match="share memory otherwise"):
        ep.module()(*[v.clone() for v in views(torch.randn(2, 4))])


def _adds_to_second_relays_fourth(w, x, y, z):
    x.add_(1)
    z.unsqueeze_(0)
    return w + y + z


def test_a_view_relaid_while_its_cover_is_written_takes_eager_s_layout():
    """AOTAutograd's test_input_mutation_aliases_bases_out_of_order: ``z`` is
    seen through ``x`` (the same memory), whose write-back carries the
    values; ``z``'s own layout change is written back too."""
    b, c = torch.randn(2, 2), torch.randn(2, 2)
    _aliased(_adds_to_second_relays_fourth, b.view(-1), c.view(-1), b.view(-1), c.view(-1))


def _relays_second_mutates_first(x, y):
    y.t_()
    x.mul_(2)
    return y + 0


def test_an_input_relaid_through_a_synthetic_base_in_grad_mode():
    b = torch.randn(3, 3)
    _aliased(_relays_second_mutates_first, b[:2, :2], b[1:, 1:], grad_modes=(True,))


def test_an_input_relaid_through_a_synthetic_base_under_no_grad():
    b = torch.randn(3, 3)
    assert_matches_eager(F(_relays_second_mutates_first), (b[:2, :2], b[1:, 1:]), inputs_with_history=True,
                         grad_modes=(False,), check_reexport=False)


def test_an_explicit_storage_offset_on_an_input_seen_through_a_synthetic_base_is_refused():
    """The synthetic base holds the memory from the group's first element:
    functionalization counts an ``as_strided`` offset from there, eager from
    the storage's start."""
    def reads_at_an_offset(x, y):
        y.mul_(2)
        return x.as_strided((2,), (1,), x.storage_offset() + 1) * 1

    b = torch.randn(8)
    with pytest.raises(predispatch.ExportError, match=r"as_strided\(\) with a storage offset"):
        predispatch.export_predispatch(F(reads_at_an_offset), (b[2:5], b[3:6]))


def test_an_op_writing_one_tensor_as_two_of_its_arguments_is_refused():
    """Was silently wrong (torch's test_functionalization
    test_mutable_op_not_inplace_or_other): eager's values are what the
    kernel writes last; the program wrote back one of the results. Two
    arguments written into disjoint parts of one tensor are exported."""
    def same_buffer(x):
        b = torch.zeros(4)
        torch.aminmax(x, dim=0, out=(b, b))
        return b

    def same_input(x):
        return torch._fused_moving_avg_obs_fq_helper(x, x, x, x, x, x, x, 1.0, 0, 1, 0)

    def rows_of_one_buffer(x):
        b = torch.zeros(2, 4)
        torch.aminmax(x, dim=0, out=(b[0], b[1]))
        return b
    for f, x in ((same_buffer, torch.randn(3, 4)), (same_input, torch.ones(1))):
        with pytest.raises(predispatch.ExportError, match=r"at .*test_mutation_kinds.py:\d+ .* writes two of its "
                                                          r"arguments that share memory"):
            predispatch.export_predispatch(F(f), (x,))
    assert_matches_eager(F(rows_of_one_buffer), (torch.randn(3, 4),), inputs_require_grad=False)


def test_inputs_sharing_memory_as_different_dtypes_one_mutated_are_refused():
    b = torch.randn(4)
    with pytest.raises(predispatch.ExportError, match="share memory as different dtypes"):
        predispatch.export_predispatch(F(_mul_first_add_second), (b, b.view(torch.int32)))


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


# --- a user input named as a top-level parameter or buffer (a probe's finding, session 42)


class InputsNamedLikeState(torch.nn.Module):
    """``forward(self, x, *, mask)`` of a module with a parameter ``x`` and a
    buffer ``mask``, each written in place beside the inputs of their names.
    ``ep.module()`` took a write-back's target by name, the state's first:
    the input's new value went into the buffer (or failed on the parameter)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mask", torch.zeros(3, 4))
        self.x = torch.nn.Parameter(torch.randn(4))

    def forward(self, x, *, mask):
        mask.add_(1)
        self.mask.add_(2)
        with torch.no_grad():
            x.mul_(2)
            self.x.mul_(0.5)
        return x * self.x + mask


def test_inputs_named_like_state_are_written_back_to_the_caller():
    args, kwargs = (torch.randn(3, 4),), {"mask": torch.randn(3, 4)}
    assert_matches_eager(InputsNamedLikeState(), args, kwargs, inputs_require_grad=False)
    ep = predispatch.export_predispatch(InputsNamedLikeState(), args, kwargs)
    assert [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"] == [
        "x_input", "mask_input"]


def test_a_program_exported_with_one_tensor_twice_refuses_two():
    """torch reads one tensor for both inputs of ``f(x, x)`` (a fake tensor
    per tensor): the program holds for calls that repeat it, and refuses
    two tensors, where it computed with one of them."""
    x = torch.randn(3, 4)
    program = predispatch.export_predispatch(cases.TimesWeightTimes(), (x, x)).module()
    assert_matches_eager(cases.TimesWeightTimes(), (x, x))
    with pytest.raises(RuntimeError, match="inputs 0 and 1 of this call are two tensors.*gave one tensor for both"):
        program(torch.randn(3, 4), torch.randn(3, 4))


class SetToAnInputUnderNoGrad(torch.nn.Module):
    """A tensor without history given an input's memory under no_grad keeps
    its own (no) history in eager; the program's new value is a view of the
    input made under no_grad, which requires grad as the input does."""

    def __init__(self, buffer: bool):
        super().__init__()
        self.register_buffer("b", torch.zeros(3, 4))
        self.buffer = buffer

    def forward(self, x):
        y = self.b if self.buffer else torch.zeros(3, 4)
        with torch.no_grad():
            y.set_(x)
        return y * 2


@pytest.mark.parametrize("buffer", [False, True], ids=["made-in-forward", "buffer"])
def test_a_tensor_set_to_an_input_under_no_grad_keeps_its_own_history(buffer):
    assert_matches_eager(SetToAnInputUnderNoGrad(buffer), (torch.randn(3, 4),), inputs_with_history=True)
    assert_matches_eager(SetToAnInputUnderNoGrad(buffer), (torch.randn(3, 4),))


class WritesThroughAnIntegerView(torch.nn.Module):
    """A write through a view of a floating tensor as integers: autograd does
    not track that view, so the tensor keeps its history (like a write
    through ``detach()``); the program's value had none."""

    def __init__(self, of_input: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.of_input = of_input

    def forward(self, x):
        y = x if self.of_input else x * self.w
        y.view(torch.int32).bitwise_and_(-2)
        return y * self.w if self.of_input else y


@pytest.mark.parametrize("of_input", [False, True], ids=["intermediate", "input"])
def test_a_write_through_an_integer_view_keeps_the_history(of_input):
    assert_matches_eager(WritesThroughAnIntegerView(of_input), (torch.randn(3, 4),), inputs_require_grad=False)
    assert_matches_eager(WritesThroughAnIntegerView(of_input), (torch.randn(3, 4),), inputs_with_history=True)


class SwapsDimsInPlace(torch.nn.Module):
    """``swapdims_``/``swapaxes_`` (composites of ``transpose_``): traced as
    the relayout they are, where they were traced as a copy of the swapped
    value into the tensor (torch's failure to expand it was refused)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        x.swapaxes_(0, 1)
        y = x * self.w
        y.swapdims_(0, 1)
        return y * 2


def test_swapdims_in_place_relays_as_transpose_does():
    assert_matches_eager(SwapsDimsInPlace(), (torch.randn(3, 4),), inputs_require_grad=False)


class GrownThenShapeRead(torch.nn.Module):
    """A buffer registered empty and grown by ``resize_`` on first use (as
    torch.ao's per-channel observers do), its size then read in Python: the
    trace's tensor answered its old size."""

    def __init__(self):
        super().__init__()
        self.register_buffer("low", torch.tensor([]))

    def forward(self, x):
        y = x * 1
        y.resize_(x.shape[0] + 1, x.shape[1])
        self.low.resize_(x.shape[0])
        self.low.copy_(x.amin(1))
        return torch.zeros(y.shape) + self.low.numel(), self.low * 2


def test_a_tensor_grown_by_resize_reads_its_new_size():
    assert_matches_eager(GrownThenShapeRead(), (torch.randn(2, 4),), inputs_require_grad=False)


class ClipsThroughDataAfterUse(torch.nn.Module):
    """A weight read by ops that save it for backward, then clipped through
    ``.data`` in the same forward: eager's ``.data`` has a version counter of
    its own, so its backward runs, reading the clipped weight. Written back
    as any other write, the program's raised autograd's version error."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        y = torch.tanh(self.lin(x)) * self.w
        self.lin.weight.data.clamp_(-0.1, 0.1)
        self.w.data.mul_(0.5)
        return y


def test_a_weight_clipped_through_data_after_its_use():
    torch.manual_seed(0)
    assert_matches_eager(ClipsThroughDataAfterUse(), (torch.randn(3, 4),))
