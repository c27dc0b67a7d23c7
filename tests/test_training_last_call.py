"""compile_training's check that a call is like the last one (``LastCall``):
it takes the last call's graphs exactly where the call's key is the last
call's, and a training loop that changes something between steps (freezes
a layer, swaps a parameter's data, switches autocast) trains as eager."""
import contextlib
import copy
import functools

import pytest
import torch

import predispatch
from predispatch import _torch
from predispatch.downstream.training.calls import CallKey
from predispatch.testing.eager import assert_runs_match, run_module


class Step(torch.nn.Module):
    """Two tensor inputs, the second written in place, and two constants."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x, y, scale: float = 2.0, shift: bool = True):
        self.count.add_(1)
        y.mul_(2)
        out = self.lin(x) * scale + y.sum()
        return out + 1 if shift else out


def _inputs():
    return [torch.randn(5, 4), torch.randn(3), 2.0, True]


@functools.cache
def _step_program():
    """Step's program, exported once: each case compiles it anew (its own state)."""
    return predispatch.export_predispatch(Step(), tuple(_inputs()))


def _parameter(train):
    return train.lin.weight


def _swap_data(dtype=None, shape=None):
    def change(train, args):
        w = _parameter(train)
        old = w.data
        w.data = torch.zeros(shape or old.shape, dtype=dtype or old.dtype)
        return args, contextlib.nullcontext(), lambda: setattr(w, "data", old)
    return change


def _replace_parameter(train, args):
    old = train.lin.weight
    train.lin.weight = torch.nn.Parameter(old.detach().clone())
    return args, contextlib.nullcontext(), lambda: setattr(train.lin, "weight", old)


def _freeze(train, args):
    _parameter(train).requires_grad_(False)
    return args, contextlib.nullcontext(), lambda: _parameter(train).requires_grad_(True)


def _under(context_factory, freeze=False):
    def change(train, args):
        if freeze:
            _parameter(train).requires_grad_(False)
        return args, context_factory(), lambda: _parameter(train).requires_grad_(True)
    return change


def _args(edit):
    def change(train, args):
        return edit(list(args)), contextlib.nullcontext(), lambda: None
    return change


def _non_leaf(args):
    with torch.enable_grad():
        args[1] = args[1].detach().requires_grad_(True).clone()
    return args


def _aliased(args):
    base = torch.randn(3)
    args[0], args[1] = base.expand(5, 3)[:, :1].expand(5, 4).contiguous(), base  # distinct memory still
    return args


# (name, change, the key changes)
CHANGES = [
    ("new tensors, same metadata", _args(lambda a: [t.clone() if isinstance(t, torch.Tensor) else t for t in a]), False),
    ("input of another shape", _args(lambda a: [torch.randn(6, 4), *a[1:]]), True),
    ("input of another dtype", _args(lambda a: [a[0].double(), *a[1:]]), True),
    ("input of other strides", _args(lambda a: [torch.randn(4, 5).t(), *a[1:]]), True),
    ("input requiring grad", _args(lambda a: [a[0].requires_grad_(), *a[1:]]), True),
    ("written input not a leaf", _args(_non_leaf), True),
    ("one tensor passed twice", _args(lambda a: [a[0], a[0][0, :3], *a[2:]]), True),
    ("distinct memory, as before", _args(_aliased), False),
    ("constant of another value", _args(lambda a: [*a[:2], 3.0, True]), True),
    ("constant of another type", _args(lambda a: [*a[:2], 2, True]), True),
    ("bool constant of another value", _args(lambda a: [*a[:2], 2.0, False]), True),
    ("parameter frozen", _freeze, True),
    ("parameter frozen, under no_grad", _under(torch.no_grad, freeze=True), True),
    ("under no_grad", _under(torch.no_grad), True),
    ("parameter replaced", _replace_parameter, True),
    ("parameter's data of another dtype", _swap_data(dtype=torch.float64), True),
    ("parameter's data of another shape", _swap_data(shape=(3, 5)), True),
    ("parameter's data swapped, same metadata", _swap_data(), False),
    ("under bf16 autocast", _under(lambda: torch.autocast("cpu", dtype=torch.bfloat16)), True),
]


AMBIENT = {"nothing": contextlib.nullcontext, "no_grad": torch.no_grad,
           "autocast": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}
SAME_KEY_UNDER = {"no_grad": "under no_grad", "autocast": "under bf16 autocast"}  # the change is the ambient's


@pytest.mark.parametrize("last_under", list(AMBIENT))
@pytest.mark.parametrize("name, change, key_changes", CHANGES, ids=[c[0] for c in CHANGES])
def test_the_last_calls_graphs_are_taken_exactly_where_the_key_is_the_last_calls(name, change, key_changes,
                                                                                   last_under):
    train = predispatch.compile_training(_step_program())
    with AMBIENT[last_under]():
        train(*_inputs())
        args, context, undo = change(train, _inputs())
        try:
            with context:
                leaves = _torch.call_leaves(train._program.module, tuple(args), {})
                key = CallKey.of(leaves, train._program.mutated, torch.is_grad_enabled(), train._state)
                same_key = key == train._last.key
                assert train._last.matches(leaves, train._state.tensors()) == same_key
        finally:
            undo()
    # the case changes what it says it changes
    assert same_key == (not key_changes or SAME_KEY_UNDER.get(last_under) == name)


def test_bf16_then_fp16_autocast_is_another_call():
    train = predispatch.compile_training(_step_program())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train(*_inputs())
    with torch.autocast("cpu", dtype=torch.float16):
        leaves = _torch.call_leaves(train._program.module, tuple(_inputs()), {})
        assert not train._last.matches(leaves, train._state.tensors())


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.b(torch.relu(self.a(x))).square().mean()


def _steps(module, changes, x):
    """Run a step per change (applied to ``module`` first); each step's run
    (outputs, gradients, state), as ``run_module`` records it."""
    runs = []
    for change in changes:
        change(module)
        runs.append(run_module(module, (x,), None))
    return runs


def _freeze_a(m):
    m.a.weight.requires_grad_(False)


def _thaw_a(m):
    m.a.weight.requires_grad_(True)


def _double_b(m):
    with torch.no_grad():
        m.b.weight.data = m.b.weight.data * 2  # same metadata, new memory


def test_a_loop_that_freezes_swaps_and_thaws_between_steps_trains_as_eager():
    torch.manual_seed(0)
    x = torch.randn(6, 4)
    model = Net()
    changes = [lambda m: None, lambda m: None, _freeze_a, lambda m: None, _double_b, _thaw_a, lambda m: None]
    expected = _steps(copy.deepcopy(model), changes, x)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), (x,)))
    got = _steps(train, changes, x)
    for step, (e, g) in enumerate(zip(expected, got)):
        assert_runs_match(e, g, what=f"[step {step}] ")


def _metadata_changes():
    def swap(dtype=None, shape=None):
        def change(ts):
            ts[1].data = torch.zeros(shape or ts[1].shape, dtype=dtype or ts[1].dtype)
        return change
    return {
        "requires_grad": lambda ts: ts[0].requires_grad_(False),
        "dtype": swap(dtype=torch.float64),
        "shape": swap(shape=(2, 2)),
        "strides": lambda ts: ts[1].t_(),
        "a subclass": lambda ts: ts.__setitem__(2, torch.nn.Parameter(ts[2])),
        "fewer": lambda ts: ts.pop(),
    }


@pytest.mark.parametrize("native", [True, False], ids=["torch's guard", "in Python"])
@pytest.mark.parametrize("change", list(_metadata_changes()))
def test_the_metadata_check_fails_for_each_kind_of_change(native, change):
    tensors = [torch.randn(3, requires_grad=True), torch.randn(2, 3), torch.randn(4)]
    check = _torch.metadata_check(tensors, native=native)
    assert check(list(tensors)) and check([tensors[0], *[t.clone() for t in tensors[1:]]])
    changed = list(tensors)
    _metadata_changes()[change](changed)
    assert not check(changed)
