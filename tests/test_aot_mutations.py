"""AOTAutograd's mutation tests (TestAOTAutograd in PyTorch's
test/functorch/test_aotdispatch.py), ported as tests of ours against eager.

One case per test there (its name without ``test_``; ``_v2``... for a second
function or input of the same test, ``ours_`` for a case of our own): a
module, its example inputs (memory shared as there: ``x[0]`` and ``x[0]``,
``x[:, :2]`` and ``x[:, 2:]``), and what AOTAutograd does with it (runs it,
or refuses it with the message its test expects). Each case runs

- with inputs that require grad, made as AOTAutograd's tests make them: not
  leaves, a history from a leaf (``leaf * 1``), views of one such tensor
  where they share memory (``history``); with inputs that do not (``plain``);
  and, where that test also passes leaves, with leaves (``leaf``);
- called in grad mode and under ``no_grad`` (a few: ``inference_mode``),

and compares ``ep.module()`` with eager (predispatch.testing.eager with
``inputs_with_history``): outputs and which require grad, inputs' values,
layouts and storages after the call, gradients, and the history the inputs
are left with (a loss over the outputs and the inputs after the call, the
gradients it sends to the leaves). Where AOTAutograd refuses a case, a
refusal (``ExportError``) passes; a program that exports must still match.
Runs where eager itself raises are not tests of ours (``eager_raises``).
One case AOTAutograd runs is a refusal the contract documents
(``refused_by_us``: ``requires_grad_()`` on an input changes the caller's
tensor, which a program cannot): its runs pass refused with that message.

Failing runs are strict xfails, grouped by cause at the end (``OPEN``):
fixing one flips its runs.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import warnings
from typing import Callable

import pytest
import torch
import torch.nn as nn

import predispatch
from predispatch.testing.eager import assert_runs_match, fresh_inputs_with_history, run_module
from predispatch.testing.invariants import assert_invariants

torch.set_num_threads(1)


def randn(*shape, seed=0):
    """The same values for the same shape and seed: every call of a case's inputs alike."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1000 * seed + sum(shape) + len(shape)))


class F(nn.Module):
    """``fn(*inputs)`` as a module."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    module: Callable[[], nn.Module]
    inputs: Callable[[], tuple]
    aot: str = "runs"            # "raises: <the message its test expects>", "not run: ...", "ours"
    kinds: tuple = ("history", "plain")
    calls: tuple = ("grad", "no_grad")
    grad: tuple | None = None    # which flat inputs may require grad (None: every floating one)
    eager_raises: dict = dataclasses.field(default_factory=dict)  # (kind, call) -> why
    # a refusal of ours that the contract documents, though AOTAutograd runs the case: the
    # message's gist (its runs pass refused with it)
    refused_by_us: str = ""


def case(name, fn, inputs, **kw):
    return Case(name, lambda: F(fn), inputs, **kw)


def no_grad(body):
    with torch.no_grad():
        body()


# --- input data mutation ---------------------------------------------------------------------

def _mul_then_use(x):
    x.mul_(2)
    return x * 3


def _mul_and_return(x):
    x.mul_(2)
    return x


def _two_of_three_mutated(x, y, z):
    x.mul_(2)
    z.mul_(2)
    return x + y + z


def _out_variant(x, y):
    return torch.sin(x, out=y)


def _add_returns_nothing(x):
    x.add_(1)
    return ()


def _mul_then_detached_result(x):
    x.mul_(2)
    return (x + 1).detach()


def _mul_then_add(x):
    x.mul_(2)
    return x + 1


def _detached_mul(x):
    x.detach().mul_(2)
    return x + 3


def _view_mul_under_no_grad(x):
    flat = x.view(-1)
    no_grad(lambda: flat.mul_(2))
    return x + 1


def _mul_under_no_grad(x):
    no_grad(lambda: x.mul_(2))
    return x + 3


def _mul_and_result_under_no_grad(x):
    with torch.no_grad():
        x.mul_(2)
        return x + 3


def _detached_plain_and_no_grad_muls(x):
    x.detach().mul_(2)
    x.mul_(3)
    no_grad(lambda: x.mul_(4))
    return x + 5


def _batch_norm_legit(x, weight, bias, running_mean, running_var):
    return torch._native_batch_norm_legit(x, weight, bias, running_mean, running_var, True, 0.5, 1e-5)


def _add_into_returned(x, y):
    return x.add_(y)


def _squeezed_clone_mutated(x):
    y = x.clone().squeeze(-1)
    y.add_(1.0)
    return x + y


def _row_masked_fill(x):
    row = x[0]
    return row.masked_fill_(torch.ones_like(row, dtype=torch.bool), 0)


class CountsCalls(nn.Module):
    """test_buffer_copied_in_graph: a buffer updated, parameters used."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))
        self.w1 = nn.Parameter(randn(1))
        self.w2 = nn.Parameter(randn(1))

    def forward(self, x):
        self.calls.add_(1)
        return (self.w1 * x * self.w2).sum() + self.calls.sum()


class BufferOfOtherShape(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("acc", torch.ones(4, 4))
        self.w = nn.Parameter(randn(4, 2))

    def forward(self, x):
        self.acc.add_(1)
        return (self.w @ x).sum() + self.acc.sum()


DATA = [
    case("input_mutation_simple", _mul_then_use, lambda: (randn(3, 3),)),
    case("input_mutation_is_output", _mul_and_return, lambda: (randn(3, 3),)),
    case("input_mutation_multiple", _two_of_three_mutated,
         lambda: (randn(3, 3), randn(3, 3, seed=1), randn(3, 3, seed=2))),
    case("input_mutation_return", _out_variant, lambda: (randn(3, 3), torch.ones(3, 3)),
         eager_raises={("history", "grad"): "sin(): functions with out=... arguments don't support automatic "
                                            "differentiation"}),
    case("mutates_input_noncontiguous", _add_returns_nothing, lambda: (randn(4)[0::2],)),
    case("input_mutation_modifies_autograd_meta_of_aliases", _mul_then_detached_result, lambda: (randn(3, 3),)),
    case("input_mutation_noncontiguous", _mul_then_add, lambda: (randn(2, 2)[:, 0],)),
    case("input_mutation_requires_grad_detach", _detached_mul, lambda: (randn(4),),
         kinds=("leaf", "history", "plain")),
    case("input_mutation_hidden_from_autograd_aliasing", _view_mul_under_no_grad, lambda: (randn(4),)),
    case("input_mutation_requires_grad_no_grad", _mul_under_no_grad, lambda: (randn(4),),
         kinds=("leaf", "history", "plain"), calls=("grad", "no_grad", "inference_mode")),
    case("input_mutation_requires_grad_no_grad_inference_graph", _mul_and_result_under_no_grad,
         lambda: (randn(4),), kinds=("leaf", "history", "plain"), calls=("grad", "no_grad", "inference_mode")),
    case("input_mutation_requires_grad_no_grad_detach_mixed", _detached_plain_and_no_grad_muls,
         lambda: (randn(4),)),
    case("input_mutation_batchnorm", _batch_norm_legit,
         lambda: (randn(2, 5, 5, 5), randn(5, seed=1), randn(5, seed=2), torch.zeros(5), torch.ones(5)),
         grad=(True, True, True, False, False)),
    case("new_inp_requires_grad_now", _add_into_returned, lambda: (randn(20, 10), randn(20, 10, seed=1)),
         kinds=("leaf", "history", "plain"), grad=(False, True)),
    case("squeeze_mutation", _squeezed_clone_mutated, lambda: (randn(3, 1),)),
    case("default_partitioner_saves_symints_not_tensors_for_bw", _row_masked_fill, lambda: (randn(2, 2),),
         eager_raises={("history", "no_grad"): "the output, a view made under no_grad whose base was written, "
                                               "raises when a loss reads it"}),
    Case("buffer_copied_in_graph", CountsCalls, lambda: (randn(1),)),
    Case("buffer_copied_in_graph_with_different_shapes", BufferOfOtherShape, lambda: (randn(2, 4),)),
    Case("buffer_batch_norm", lambda: nn.BatchNorm1d(10), lambda: (randn(20, 10),)),
]


# --- set_ ---------------------------------------------------------------------------------------

def _set_to_arange(x):
    values = torch.arange(9, dtype=x.dtype).reshape(3, 3)
    no_grad(lambda: x.set_(values))
    return x * values


def _set_steals_view_chain(x, y):
    x2 = x.mul(2)
    y2 = y.mul(2)
    row = y2[1].view(3, 3)
    x2.set_(row)          # x2 now views y2's memory
    x2.view(-1).mul_(2)   # and so writes y2
    return x2 * row


def _set_then_update_source(x, y):
    with torch.no_grad():
        x.set_(y)
        y.mul_(2)
    return x + y


def _set_then_write_old_view(x):
    flat = x.view(-1)
    fresh = torch.ones(3, 3, requires_grad=True)
    with torch.no_grad():
        x.set_(fresh)
        flat.mul_(2)      # x's old memory, no input's any more
    return x + fresh


def _set_then_mul_with_grad(x, y):
    no_grad(lambda: x.set_(y))
    x.mul_(2)
    return x + y


def _set_there_and_back(x):
    values = torch.arange(9, dtype=x.dtype)
    old = torch.ops.aten.alias.default(x)
    with torch.no_grad():
        x.set_(values)
        x.set_(old)
    return x + values.reshape(3, 3)


SET_ = [
    case("input_mutation_set__input_mutation", _set_to_arange, lambda: (randn(3, 3),)),
    case("set__steals_view_chain", _set_steals_view_chain, lambda: (randn(3, 3), randn(3, 9, seed=1)),
         eager_raises={("history", "grad"): "derivative for set_ is not implemented"}),
    case("set__and_data_mutation_good", _set_then_update_source, lambda: (randn(3, 3), randn(3, 3, seed=1))),
    case("set__and_data_mutation_bad", _set_then_write_old_view, lambda: (randn(3, 3),),
         aot="raises: cannot mutate tensors with frozen storage"),
    case("set__not_allowed", _set_then_mul_with_grad, lambda: (randn(3, 3), randn(3, 3, seed=1)),
         aot="raises: but the input has other mutations that we cannot"),
    case("input_mutation_set__nop", _set_there_and_back, lambda: (randn(3, 3),)),
]


# --- metadata mutation --------------------------------------------------------------------------

def _transpose_then_add(x, y):
    x.transpose_(1, 0)
    return x + y


def _transpose_then_mul(x):
    x.transpose_(1, 0)
    x.mul_(2)
    return x + 1


def _resize_then_add(x, y):
    x.resize_(2, 2)
    return x + y


def _all_alias_types(x):
    x.transpose_(1, 0)
    h = x.mul(2)
    return h.squeeze(), h.transpose(1, 0), x.unsqueeze(0)


def _t_then_row_mul(x):
    x.t_()
    x[0].mul_(2)
    return x.view(x.shape)


def _t_one_view_both(x, y):
    x.t_()
    return y.view(y.shape), x.view(x.shape)


def _t_and_unsqueeze(x, y):
    x.t_()
    y.unsqueeze_(0)
    return x + y


def _t_then_add(x, y):
    x.t_()
    return (x + y,)


def _unsqueeze_both(x, y):
    x.unsqueeze_(0)
    y.unsqueeze_(0)
    return (x + y,)


def _intermediate_t(x):
    h = torch.mul(x, 3)
    h.t_()
    return h


def _intermediate_t_detached(x):
    h = torch.mul(x, 3)
    h.t_()
    h.detach_()
    return h, x + 1


def _intermediate_views_around_t(x):
    h = torch.mul(x, 3)
    before = h.unsqueeze(0)
    h.t_()
    after = h.unsqueeze(0)
    return before, h, after


def _as_strided_then_mul(x):
    x.as_strided_((2, 2), (1, 2))
    return x * 2


def _squeeze_then_add(x, y):
    x.squeeze_(0)
    return x + y


SQUARE = lambda: (randn(3, 3), randn(3, 3, seed=1))  # noqa: E731

# An input with a history given another shape under no_grad keeps its grad_fn (of the old
# shape): a loss over it after the call makes eager's own backward raise
RELAID_UNDER_NO_GRAD = {("history", "no_grad"): "eager's backward: returned an invalid gradient (old grad_fn, "
                                                "new shape)"}

METADATA = [
    case("input_mutation_metadata", _transpose_then_add, SQUARE),
    case("ours_input_mutation_metadata_not_square", _transpose_then_add, lambda: (randn(2, 3), randn(3, 2, seed=1)),
         eager_raises=RELAID_UNDER_NO_GRAD, aot="ours"),
    case("input_mutation_metadata2", _transpose_then_mul, lambda: (randn(3, 3),)),
    case("input_mutation_resize_smaller", _resize_then_add, lambda: (randn(3, 3), randn(2, 2, seed=1)),
         grad=(False, True)),
    case("output_all_alias_types", _all_alias_types, lambda: (randn(1, 2, 4),),
         eager_raises=RELAID_UNDER_NO_GRAD),
    case("input_data_and_metadata_mutation", _t_then_row_mul, lambda: (randn(3, 3),)),
    case("view_and_inplace_view", _t_one_view_both, SQUARE),
    case("dupe_arg_torture", _t_and_unsqueeze, lambda: (lambda x: (x, x))(randn(3, 3))),
    case("invalid_dupe_left_bias", _t_then_add, lambda: (lambda x: (x, x))(randn(3, 3))),
    case("invalid_dupe", _unsqueeze_both, SQUARE),
    case("invalid_dupe_v2", _unsqueeze_both, lambda: (lambda x: (x, x))(randn(3, 3))),
    case("output_aliases_intermediate_inplace_view", _intermediate_t, lambda: (randn(2, 4),),
         aot="not run: a TODO there (pytorch#90507)"),
    case("output_aliases_intermediate_inplace_view_with_detach", _intermediate_t_detached, lambda: (randn(2, 4),)),
    case("output_aliases_intermediate_inplace_view_and_view", _intermediate_views_around_t, lambda: (randn(2, 4),),
         aot="not run: a TODO there"),
    case("ours_as_strided_", _as_strided_then_mul, lambda: (randn(4),), eager_raises=RELAID_UNDER_NO_GRAD,
         aot="ours"),
    case("ours_squeeze_", _squeeze_then_add, lambda: (randn(1, 3), randn(3, seed=1)), eager_raises=RELAID_UNDER_NO_GRAD,
         aot="ours"),
]


# --- views of inputs and of intermediates returned ----------------------------------------------

def _view_of_input(x):
    return x.view(-1)


def _two_mutated_views_returned(x, y, z):
    x.mul_(2)
    z.mul_(3)
    return y.view(2, 2), z.view(2, 2)


def _views_after_data_and_metadata(x, y, z):
    y.mul_(3)
    z.t_()
    return x.view(2, 2), y.view(2, 2), z.view(2, 2)


def _add_then_view(x):
    x.add_(1)
    return x.view(-1)


def _transpose_add_diagonal(w, x, y, z):
    x.transpose_(1, 0)
    y.add_(1)
    return z + 1, x.diagonal(), w + y


def _unbind_input(x):
    return list(x.unbind(0))


def _unbind_and_view_input(x):
    return *x.unbind(0), x.view(x.shape)


def _detach_then_mul(x):
    before = x.detach()
    x.mul_(2)
    return x, before


def _requires_grad__on_input(x, y):
    x.requires_grad_(True)
    return x.mul(3), y.mul(4)


def _view_made_to_require_grad(x, y):
    flat = x.view(-1)
    flat.requires_grad_(True)
    return flat


def _detached_input_and_input(x, y):
    return x.detach(), y


def _detached_copy_and_input(x, y):
    return x.add(1).detach(), y


def _input_twice_in_a_dict(x):
    return {"a": x, "b": x}


def _row_of_first_add_return_third(x, y, z):
    x[0].add_(1)
    return z


class Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


def _identity_function(x):
    return Identity.apply(x)


def _transposed_intermediate_and_detached(x):
    h = x + 1
    t = h.transpose(0, 1)
    return t.detach(), t


def _view_of_product(x):
    return torch.mul(x, 3).view(-1)


def _unbind_product(x):
    return list(torch.mul(x, 3).unbind(0))


def _unbind_product_and_product(x):
    h = torch.mul(x, 3)
    return *h.unbind(0), h


def _unbind_product_and_view(x):
    h = torch.mul(x, 3)
    return *h.unbind(0), h.view(h.shape)


def _unbind_product_product_and_view(x):
    h = torch.mul(x, 3)
    return *h.unbind(0), h, h.view(h.shape)


def _view_of_product_and_sum(x, y):
    return torch.mul(x, 3).view(-1), y.add(1)


def _product_view_product(x):
    h = torch.mul(x, 3)
    return h, h.view(-1), h


def _two_views_of_product(x):
    h = torch.mul(x, 3)
    return h.view(-1), h.view(-1)


def _view_then_product(x):
    h = torch.mul(x, 3)
    return h.view(-1), h


def _product_then_view(x):
    h = torch.mul(x, 2)
    return h, h.view(-1)


def _view_product_detached_row(x):
    h = torch.mul(x, 3)
    return h.view(-1), h, h[0].detach()


def _views_of_two_products(x):
    h1 = torch.mul(x, 3)
    h2 = torch.mul(x, 4)
    return h1.view(-1), h2.transpose(1, 0), h1.transpose(1, 0)


VIEWS = [
    case("input_output_view_simple", _view_of_input, lambda: (randn(2, 2),),
         calls=("grad", "no_grad", "inference_mode")),
    case("input_output_view_mutate_multiple", _two_mutated_views_returned,
         lambda: (randn(2, 2), randn(2, 2, seed=1), randn(2, 2, seed=2))),
    case("input_output_view_metadata_mutate_multiple", _views_after_data_and_metadata,
         lambda: (randn(2, 2), randn(2, 2, seed=1), randn(2, 2, seed=2))),
    case("input_mutation_and_output_view", _add_then_view, lambda: (randn(2, 2),),
         calls=("grad", "no_grad", "inference_mode")),
    case("input_mutation_output_view_multiple", _transpose_add_diagonal,
         lambda: (randn(2, 2), randn(2, 2, seed=1), randn(2, 2, seed=2), randn(2, 2, seed=3))),
    case("output_aliases_input_multi_output_view", _unbind_input, lambda: (randn(3, 3),)),
    case("output_aliases_input_multi_output_view_v2", _unbind_and_view_input, lambda: (randn(3, 3),)),
    case("view_detach", _detach_then_mul, lambda: (randn(3, 3),)),
    # eager makes the caller's tensor require grad: a program cannot (the contract's refusal)
    case("input_inplace_requires_grad_true", _requires_grad__on_input, SQUARE, grad=(False, True),
         refused_by_us="requires_grad set on a parameter, buffer or input"),
    case("some_output_requires_grad_input_doesnt", _view_made_to_require_grad, SQUARE,
         kinds=("leaf", "history", "plain"), grad=(False, True)),
    case("some_outputs_dont_require_grad_view", _detached_input_and_input, SQUARE,
         kinds=("leaf", "history", "plain")),
    case("some_outputs_dont_require_grad_non_view", _detached_copy_and_input, SQUARE,
         kinds=("leaf", "history", "plain")),
    case("output_dict", _input_twice_in_a_dict, lambda: (randn(3, 3),), kinds=("leaf", "history", "plain")),
    case("dupe_arg_returned_as_output", _row_of_first_add_return_third,
         lambda: (lambda a, b: (a, b, a))(randn(2), randn(2, seed=1))),
    case("input_output_aliase_custom_autograd_function", _identity_function, lambda: (randn(2, 2),),
         kinds=("leaf", "history", "plain")),
    case("alias_of_intermediate_detach", _transposed_intermediate_and_detached, lambda: (randn(3, 3),),
         kinds=("leaf", "history", "plain")),
    case("output_aliases_intermediate_single", _view_of_product, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_multi_output_view", _unbind_product, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_multi_output_view_v2", _unbind_product_and_product, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_multi_output_view_v3", _unbind_product_and_view, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_multi_output_view_v4", _unbind_product_product_and_view,
         lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_no_grad", _view_of_product_and_sum, SQUARE, grad=(False, True)),
    case("output_aliases_intermediate_returned_multiple_times", _product_view_product, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_multiple", _two_views_of_product, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_and_returned", _view_then_product, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_and_returned_flipped", _product_then_view, lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_and_returned_different_grad", _view_product_detached_row,
         lambda: (randn(3, 3),)),
    case("output_aliases_intermediate_multiple_mixed", _views_of_two_products, lambda: (randn(3, 3),)),
]


# --- inputs that share memory -------------------------------------------------------------------

def _mul_both_return_copies(x, y):
    x.mul_(3)
    y.mul_(2)
    return x.clone().view(-1) + y.clone().view(-1)


def _mul_then_multiply_by_t(x, y):
    x.mul_(2)
    y.t_()
    return x.mul(y)


def _views_of_each(x, y):
    return x.view(x.shape), y.view(y.shape)


def _add_then_sum(x, y):
    x.add_(1)
    return x + y


def _add_then_view_other(x, y):
    x.add_(1)
    return y.view(y.shape)


def _mul_third_return_view(x, y, z):
    z.mul_(2)
    return y.add(1), z.view(-1)


def _t_then_sum(x, y):
    x.t_()
    return x + y


def _mul_first_sum_others(x, y, z):
    x.mul_(2)
    return y + 1, z + 1


def _add_second_unsqueeze_fourth(w, x, y, z):
    x.add_(1)
    z.unsqueeze_(0)
    return w + y + z, x.view(-1)


def _alias_everything(x, y, z):
    z.mul_(2)
    y.t_()
    h = x + z
    flat = h.view(-1)
    return flat, y.t(), flat.unsqueeze(0)


def _add_both_return_both(x, y):
    return x.add_(2), y.add_(2)


def _add_one_mul_other(x, y):
    x.add_(1)
    y.mul_(2)
    return x + y


def _strided(size, stride, offset):
    return lambda b: b.as_strided(size, stride, offset)


def _two_views_of(base, first, second):
    """Two views of one base (``first``, ``second``: base -> view)."""
    return lambda: (first(base()), second(base()))


def _views(make, *views):
    def inputs():
        b = make()
        return tuple(v(b) for v in views)
    return inputs


def _rows_a_and_b():
    b = randn(4, 4)
    return b[0:2], b[2:4]


FALSE_ALIASING = {   # AOTAutograd's test_input_mutation_false_aliasing: inp_callable1..6, overlap1..2
    "": lambda: _rows_a_and_b(),
    "_v2": _views(lambda: randn(256), _strided((4, 4), (8, 1), 0), _strided((4, 4), (8, 1), 28)),
    "_v3": _views(lambda: randn(4, 4), lambda b: b[:, 0:2], lambda b: b[:, 2:4]),
    "_v4": _views(lambda: randn(256), _strided((4, 4), (9, 1), 0), _strided((4, 4), (9, 1), 22)),
    "_v5": _views(lambda: randn(256), _strided((4, 4), (9, 1), 0), _strided((4, 4), (9, 1), 23)),
    "_v6": _views(lambda: randn(256), _strided((2, 4, 3), (110, 24, 4), 5), lambda b: b[196:220]),
    "_overlap1": _views(lambda: randn(256), _strided((4, 4), (9, 1), 0), _strided((4, 4), (9, 1), 24)),
    "_overlap2": _views(lambda: randn(256), _strided((4, 4), (9, 1), 0), _strided((4, 4), (9, 1), 25)),
}

ALIASED = [
    *[case(f"input_mutation_false_aliasing{suffix}", _mul_both_return_copies, inputs)
      for suffix, inputs in FALSE_ALIASING.items()],
    case("input_data_and_metadata_mutation_aliases_other_input", _mul_then_multiply_by_t,
         _views(lambda: randn(2, 2), lambda b: b[0], lambda b: b[0])),
    case("output_aliases_multiple_inputs_get_correct_one", _views_of_each,
         _views(lambda: randn(2, 2), lambda b: b.view(-1), lambda b: b[0])),
    case("input_mutation_aliases_other_input", _add_then_sum,
         _views(lambda: randn(4, 2), lambda b: b[0], lambda b: b[0])),
    case("input_mutation_aliases_other_input2", _add_then_sum,
         _views(lambda: randn(2, 2), lambda b: b[0], lambda b: b)),
    case("input_mutation_aliases_and_output_alias", _add_then_view_other,
         _views(lambda: randn(2, 2), lambda b: b.view(-1), lambda b: b.view(-1))),
    case("input_aliased_with_mutation_output_alias", _mul_third_return_view,
         lambda: (lambda b, c: (b.view(-1), c, b.view(-1)))(randn(2, 2), randn(2, 2, seed=1))),
    case("input_metadata_mutation_aliases", _t_then_sum,
         _views(lambda: randn(2, 2), lambda b: b.view(-1), lambda b: b.view(-1))),
    case("input_mutation_aliases_and_none_require_gradients", _mul_first_sum_others,
         lambda: (lambda b, c: (b.view(-1), b.view(-1), c))(randn(2, 2), randn(2, 2, seed=1)),
         grad=(False, False, True)),
    case("input_mutation_aliases_bases_out_of_order", _add_second_unsqueeze_fourth,
         lambda: (lambda b, c: (b.view(-1), c.view(-1), b.view(-1), c.view(-1)))(randn(2, 2), randn(2, 2, seed=1))),
    case("synthetic_base_base_attribute_is_none", _add_then_sum,
         _views(lambda: randn(4, 4), lambda b: b[0], lambda b: b[1])),
    case("input_mutation_alias_everything", _alias_everything,
         lambda: (lambda b, c: (b.view(-1), c, b.view(-1)))(randn(2, 2), randn(2, 2, seed=1))),
    case("duplicated_arguments_on_tensor_overlap", _add_both_return_both,
         _views(lambda: randn(10), lambda b: b, lambda b: b[1:-1])),
    case("ours_two_suffix_views_both_mutated", _add_one_mul_other,
         _views(lambda: randn(4), lambda b: b[1:], lambda b: b[1:]), aot="ours"),
]


# --- custom autograd Functions that write their inputs ------------------------------------------

class WritesSavedInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        x.mul_(2)
        return grad.clone()


class WritesInputAndIntermediate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        torch._foreach_mul_([b], [2])
        h = b + 1
        torch._foreach_mul_([h], [3])
        ctx.save_for_backward(h)
        return h * a

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        torch._foreach_mul_([h], [4])
        return grad * h, grad * h


class WritesInputOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        torch._foreach_mul_([x], [2])
        h = x + 1
        torch._foreach_mul_([h], [3])
        ctx.save_for_backward(h)
        return h

    @staticmethod
    def backward(ctx, grad):
        (h,) = ctx.saved_tensors
        torch._foreach_mul_([h], [4])
        return grad * h


class TransposesSavedInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(b)
        return a.clone(), b.clone()

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        (b,) = ctx.saved_tensors
        b.transpose_(1, 0)
        return grad_a.clone(), grad_b.clone()


class WritesGradOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        grad.mul_(2)
        return grad.clone()


@torch.library.custom_op("predispatch_aot::clone_and_zero_in_backward", mutates_args=())
def clone_and_zero_in_backward(x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    return x.clone()


@clone_and_zero_in_backward.register_fake
def _(x, other):
    return torch.empty_like(x)


def _zero_other_in_backward(ctx, grad):
    with torch.no_grad():
        ctx.other.zero_()
    return grad * 2, None


def _keep_other(ctx, inputs, output):
    ctx.other = inputs[1]


clone_and_zero_in_backward.register_autograd(_zero_other_in_backward, setup_context=_keep_other)


def _times_written_in_backward(x, y):
    return x * WritesSavedInBackward.apply(y)


def _foreach_function_sin_(x, y):
    return WritesInputAndIntermediate.apply(x, y).sin_().clone()


def _foreach_function_times(x, y):
    return WritesInputOnly.apply(y) * x


def _transposed_in_backward(x, y):
    a, b = TransposesSavedInBackward.apply(x, y)
    return a * b


def _grad_output_written(x, y):
    return WritesGradOutput.apply(x * y)


def _custom_op_zeroing_in_backward(x, other, z):
    z.mul_(5)
    return clone_and_zero_in_backward(x, other) + z


FUNCTIONS = [
    case("backward_mutation_data", _times_written_in_backward, SQUARE),
    case("fw_bw_mutation_no_functionalization1", _foreach_function_sin_, SQUARE, grad=(True, False),
         aot="runs: with functionalization disabled"),
    case("fw_bw_mutation_no_functionalization2", _foreach_function_times, SQUARE, grad=(True, False),
         aot="runs: with functionalization disabled"),
    case("backward_mutation_metadata", _transposed_in_backward, SQUARE, grad=(True, False),
         aot="raises: input that had its metadata mutated in the backward"),
    case("backward_mutation_on_grad_out", _grad_output_written, SQUARE, kinds=("leaf", "history", "plain")),
    case("backward_mutation_forward_inputs", _custom_op_zeroing_in_backward,
         lambda: (randn(3), randn(3, seed=1), randn(3, seed=2)),
         grad=(True, False, False), kinds=("leaf", "history", "plain")),
]

CASES = DATA + SET_ + METADATA + VIEWS + ALIASED + FUNCTIONS


# --- the runs -----------------------------------------------------------------------------------

def _runs_of(name, kinds=("history", "plain"), calls=("grad", "no_grad")):
    return [f"{name}-{kind}-{call}" for kind in kinds for call in calls]


# The failing runs, by cause: (reason, run ids). Each fix flips its runs (strict xfails).
OPEN: list[tuple[str, list[str]]] = [
]


def _runs():
    expected = {run: reason for reason, runs in OPEN for run in runs}
    for c in CASES:
        for kind in c.kinds:
            for call in c.calls:
                if (kind, call) in c.eager_raises:
                    continue
                run = f"{c.name}-{kind}-{call}"
                marks = [pytest.mark.xfail(strict=True, reason=expected.pop(run))] if run in expected else []
                yield pytest.param(c, kind, call, id=run, marks=marks)
    assert not expected, f"OPEN names runs that do not exist: {sorted(expected)}"


@functools.lru_cache(maxsize=None)
def _exported(name: str):
    """The program of case ``name``, or the ExportError export raised."""
    c = next(c for c in CASES if c.name == name)
    (args, _), _roots = fresh_inputs_with_history(c.inputs(), None, False)
    try:
        ep = predispatch.export_predispatch(c.module(), args)
    except predispatch.ExportError as e:
        return e
    assert_invariants(ep)
    return ep


def _program_module(ep):
    with warnings.catch_warnings():  # torch's treespec warns about itself when copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(ep.module())


def _run(module, c: Case, kind: str, call: str):
    grad = True if c.grad is None else c.grad
    return run_module(module, c.inputs(), None, grad_mode={"grad": True, "no_grad": False}.get(call, call),
                      inputs_require_grad=False if kind == "plain" else grad,
                      inputs_with_history=kind != "leaf")


@pytest.mark.parametrize("c, kind, call", list(_runs()))
def test_matches_eager(c: Case, kind: str, call: str):
    """A case AOTAutograd runs: ``ep.module()`` matches eager. A case it
    refuses: refused (``ExportError``), or matching eager."""
    ep = _exported(c.name)
    if isinstance(ep, predispatch.ExportError):
        if not (c.aot.startswith("raises") or (c.refused_by_us and c.refused_by_us in str(ep))):
            raise ep
        return
    eager = _run(c.module(), c, kind, call)
    mine = _run(_program_module(ep), c, kind, call)
    assert_runs_match(eager, mine, what=f"[{kind} inputs, {call}] ")
