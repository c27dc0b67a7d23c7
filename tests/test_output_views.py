"""Outputs that eager returns as views of an input the forward wrote
(design/regions-and-mutations.md, "Outputs that are views of inputs").

The graph computes such an output as a view of its own updated copy;
``ep.module()`` makes it again from the caller's tensor after the
write-backs, in the grad mode eager made it in, as AOTAutograd's runtime
wrapper does: it aliases the caller's input and, called under no_grad with
an input that requires grad, requires grad (no history), as eager's. Each
case is compared with eager (inputs with a history and leaves, in grad
mode, under no_grad and inference_mode), and the aliasing checked directly,
after save and load, re-export and ``torch.compile`` too.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn as nn

import predispatch
from predispatch.ir.program_meta import program_meta
from predispatch.program.printing import format_program
from predispatch.testing.eager import assert_matches_eager

torch.set_num_threads(1)


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *inputs):
        return self.fn(*inputs)


class AddThenView(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x.view(-1)


def view_under_no_grad(x):
    x.add_(1)
    with torch.no_grad():
        row = x[0]
    return row, x.view(-1)


def view_in_a_grad_block(x):
    with torch.no_grad():
        x.add_(1)
        with torch.enable_grad():
            row = x[1]
    return row


def grad_block_view_of_a_callers_view(x):
    x.add_(1)
    row = x[0]  # the caller's mode: under a no_grad caller, eager's view of it has no history
    with torch.enable_grad():
        part = row[1:]
    return part


def detached_views(x):
    x.mul_(2)
    return x.detach()[0], x.detach().view(-1)


def offset_view(x):
    x.add_(1)
    return x[1:, 1:]


def view_of_a_written_view(x):
    row = x[1]
    row.mul_(2)
    return row, x.unsqueeze(0)


def relaid_then_view(x):
    x.t_()
    x[0].mul_(2)
    return x.view(x.shape)


def view_of_an_input_seen_through_another(x, y):  # y = x[1]
    x.mul_(2)
    return y[0], x.view(-1)


def view_of_an_input_in_a_synthetic_base(x, y):  # x = b[1:], y = b[:2]
    x.mul_(2)
    return y[0], x[1:]


def set_then_view(x, y):
    x.mul_(2)
    x.set_(y)
    return x.view(-1)


class StateViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(randn(2, 2))
        self.register_buffer("b", randn(2, 2, seed=1))

    def forward(self, x):
        with torch.no_grad():
            self.w.mul_(2)
        self.b.add_(1)
        return self.w.view(-1), self.b[0], x + 1


def _square():
    return (randn(2, 2),)


CASES = {
    "add_then_view": (AddThenView, _square),
    "view_under_no_grad": (lambda: Fn(view_under_no_grad), _square),
    "view_in_a_grad_block": (lambda: Fn(view_in_a_grad_block), _square),
    "grad_block_view_of_a_callers_view": (lambda: Fn(grad_block_view_of_a_callers_view), lambda: (randn(2, 3),)),
    "detached_views": (lambda: Fn(detached_views), _square),
    "offset_view": (lambda: Fn(offset_view), lambda: (randn(3, 3)[1:],)),
    "view_of_a_written_view": (lambda: Fn(view_of_a_written_view), _square),
    "relaid_then_view": (lambda: Fn(relaid_then_view), lambda: (randn(3, 3),)),
    "view_of_an_input_seen_through_another": (lambda: Fn(view_of_an_input_seen_through_another),
                                              lambda: (lambda b: (b, b[1]))(randn(2, 2))),
    "view_of_an_input_in_a_synthetic_base": (lambda: Fn(view_of_an_input_in_a_synthetic_base),
                                             lambda: (lambda b: (b[1:], b[:2]))(randn(4))),
    "parameter_and_buffer": (StateViews, _square),
}

# eager itself raises here: a view made under no_grad (or inference_mode), its base then written
EAGER_RAISES = {("view_of_a_written_view", False), ("view_of_a_written_view", "inference_mode"),
                ("relaid_then_view", False), ("relaid_then_view", "inference_mode")}


@pytest.mark.parametrize("call", [True, False, "inference_mode"])
@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager_with_inputs_with_a_history(name, call):
    if (name, call) in EAGER_RAISES:
        pytest.skip("eager raises")
    make, args = CASES[name]
    assert_matches_eager(make(), args(), inputs_with_history=True, grad_modes=(call,))


@pytest.mark.parametrize("name", list(CASES))
def test_matches_eager_with_inputs_that_do_not_require_grad(name):
    make, args = CASES[name]
    assert_matches_eager(make(), args(), inputs_require_grad=False, grad_modes=(True, False, "inference_mode"))


def _input_with_history():
    leaf = randn(2, 2).requires_grad_()
    return leaf, leaf * 1


def _check_aliases_the_callers_input(module):
    """Called under no_grad and in grad mode: the output is a view of the
    caller's ``x`` (its values written), requiring grad as eager's does."""
    for grad in (False, True):
        leaf, x = _input_with_history()
        with torch.set_grad_enabled(grad):
            out = module(x)
        assert out._base is x and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
        assert torch.equal(out, (leaf.detach() + 1).view(-1))
        assert out.requires_grad and (out.grad_fn is None) == (not grad)
        if grad:
            out.sum().backward()
            assert torch.equal(leaf.grad, torch.ones(2, 2))


def test_the_output_aliases_the_callers_input_after_save_and_load(tmp_path):
    ep = predispatch.export_predispatch(AddThenView(), _square())
    _check_aliases_the_callers_input(ep.module())
    path = os.path.join(tmp_path, "add_then_view.pt2")
    torch.export.save(ep, path)
    loaded = predispatch.load(path)
    assert program_meta(loaded)["output_views"] == {
        "0": {"of": "x", "size": [4], "stride": [1], "offset": 0, "mode": "caller"}}
    _check_aliases_the_callers_input(loaded.module())


def test_the_printed_program_is_unchanged():
    """The graph returns its own view; only ep.module() makes it again."""
    ep = predispatch.export_predispatch(AddThenView(), _square())
    assert format_program(ep).split("inputs:")[0] == (
        "def forward(x: f32[2, 2]):\n"
        "    add = aten.add.Tensor(x, 1)\n"
        "    view = aten.view.default(add, [-1])\n"
        "    return (add, view)\n")


def test_exported_again_the_program_makes_the_same_views():
    for name in ("view_under_no_grad", "view_of_an_input_seen_through_another", "parameter_and_buffer"):
        make, args = CASES[name]
        ep = predispatch.export_predispatch(make(), args())
        again = predispatch.export_predispatch(ep.module(), args())
        assert format_program(again) == format_program(ep)
        assert program_meta(again)["output_views"] == program_meta(ep)["output_views"], name


def test_compiled_the_output_still_aliases_the_callers_input():
    module = predispatch.export_predispatch(AddThenView(), _square()).module()
    module.compile(backend="aot_eager")
    _check_aliases_the_callers_input(module)


def test_a_view_of_memory_set_gave_is_left_as_before():
    """The view's base moved (set_): not made again (its output is the program's)."""
    ep = predispatch.export_predispatch(Fn(set_then_view), (randn(2, 2), randn(2, 2, seed=1)))
    assert "output_views" not in program_meta(ep)


def test_symbolic_layouts_are_left_as_before():
    batch = torch.export.Dim("batch", min=2)
    ep = predispatch.export_predispatch(AddThenView(), (randn(3, 2),), dynamic_shapes=({0: batch},))
    assert "output_views" not in program_meta(ep)
    x = randn(5, 2)
    out = copy.deepcopy(ep.module())(x)
    assert torch.equal(out, x.view(-1))
