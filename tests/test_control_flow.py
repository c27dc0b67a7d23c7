"""torch's control-flow operators kept in the program (issue 41): torch.cond, while_loop, map, scan.

Each module is compared with eager by ``assert_matches_eager`` (outputs,
which require grad, gradients of inputs and parameters, buffers and inputs
afterwards, under grad mode on and off, re-export stable), and each program
is checked to hold the operator itself. Several modules are our versions of
those in PyTorch's test/export/test_export.py (named in their docstrings).
"""
from __future__ import annotations

import io
import re

import pytest
import torch
from torch.export import Dim

import predispatch
from predispatch.testing import GraphTestCase
from predispatch.testing.eager import assert_matches_eager

COND = torch.ops.higher_order.cond
WHILE_LOOP = torch.ops.higher_order.while_loop
MAP = torch.ops.higher_order.map_impl
SCAN = torch.ops.higher_order.scan


def _hop_map(f, xs, *args):
    from torch._higher_order_ops.map import map as hop_map  # imported late: captured all the same

    return hop_map(f, xs, *args)


def _while_loop(cond_fn, body_fn, carried):
    from torch._higher_order_ops.while_loop import while_loop

    return while_loop(cond_fn, body_fn, carried)


def _ops_in(ep) -> set:
    """Every call target in the program's graphs, subgraphs included."""
    return {n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"}


# ---------------------------------------------------------------- torch.cond


class CondOnValue(torch.nn.Module):
    """A predicate from a tensor's value; branches read a parameter, a buffer and a closure's tensor."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)
        self.register_buffer("shift", torch.full((3,), 0.5))

    def forward(self, x):
        y = x * 2

        def true_fn(x):
            return self.lin(x) + self.shift + y

        def false_fn(x):
            return x.cos() - self.shift

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,))


class CondBuffers(torch.nn.Module):
    """test_cond_buffers: methods as branches, a frozen parameter and a buffer."""

    def __init__(self):
        super().__init__()
        self.register_parameter("param", torch.nn.Parameter(torch.ones(2, 3), requires_grad=False))
        self.register_buffer("buffer", torch.ones(2, 3) + 1)

    def true_fn(self, x):
        return x + self.param

    def false_fn(self, x):
        return x + self.buffer

    def forward(self, x):
        return torch.cond(x.sum() > 0, self.true_fn, self.false_fn, [x])


class _Bar(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        def true_fn(x):
            return self.linear(x).cos()

        def false_fn(x):
            return self.linear(x).sin()

        return torch.cond(x.shape[0] > 4, true_fn, false_fn, [x])


class CondInSubmodule(torch.nn.Module):
    """test_cond_with_module_stack_export_with: a cond on a shape, inside a submodule."""

    def __init__(self):
        super().__init__()
        self.bar = _Bar()

    def forward(self, x):
        return x.cos() + self.bar(x)


class _BufferCos(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buffer", torch.ones(6, 4))

    def forward(self):
        return self.buffer.cos()


class CondCallsASubmodule(torch.nn.Module):
    """test_export_cond: a branch calls a submodule that reads its buffer."""

    def __init__(self):
        super().__init__()
        self.a = _BufferCos()

    def forward(self, x):
        def true_fn(x):
            return x.cos() + self.a().sum()

        def false_fn(x):
            return x.sin()

        return torch.cond(x.sum() > 0, true_fn, false_fn, [x])


class CondClosureOverInt(torch.nn.Module):
    """A closure over a Python int and a module attribute int."""

    k = 3

    def forward(self, x, y):
        n = 2

        def true_fn(x, y):
            return x * n + y * self.k

        def false_fn(x, y):
            return x - y

        return torch.cond(y.mean() < x.mean(), true_fn, false_fn, (x, y))


class CondSameNamesAsOuter(torch.nn.Module):
    """Branch placeholders named as the outer values (test_cond_branches_... placeholder collisions)."""

    def forward(self, x, y):
        x_1 = x + 1

        def true_fn(x, x_1):
            return x + x_1

        def false_fn(x, x_1):
            return x * x_1

        return torch.cond(y.sum() > 0, true_fn, false_fn, (x, x_1))


class CondPytreeOutputs(torch.nn.Module):
    """Several outputs, as a dict, and nested operands."""

    def forward(self, x, y):
        def true_fn(pair):
            a, b = pair
            return {"sum": a + b, "prod": a * b}

        def false_fn(pair):
            a, b = pair
            return {"sum": a - b, "prod": a / (b.abs() + 1)}

        out = torch.cond(x.sum() > y.sum(), true_fn, false_fn, ((x, y),))
        return out["sum"], out["prod"]


class NestedCond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        def inner_true(x):
            return x * self.w

        def inner_false(x):
            return x + self.w

        def true_fn(x):
            return torch.cond(x.mean() > 0, inner_true, inner_false, (x,)) + 1

        def false_fn(x):
            return x.tanh()

        return torch.cond(x.sum() > -10, true_fn, false_fn, (x,))


class CondUnderNoGradAndAutocast(torch.nn.Module):
    """A cond inside a no_grad block and one inside an autocast block."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        with torch.no_grad():
            a = torch.cond(x.sum() > 0, lambda x: self.lin(x).sin(), lambda x: x.cos(), (x,))
        with torch.autocast("cpu", torch.bfloat16):
            b = torch.cond(x.sum() > 0, lambda x: self.lin(x), lambda x: self.lin(x * 2), (x,))
        return a + b.float()


class RegionsInsideBranches(torch.nn.Module):
    """no_grad and autocast blocks inside a branch: regions of the branch's subgraph."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        def true_fn(x):
            with torch.no_grad():
                z = x * 3
            with torch.autocast("cpu", torch.bfloat16):
                w = self.lin(x)
            return z + w.float()

        def false_fn(x):
            return self.lin(x).relu()

        return torch.cond(x.sum() > 0, true_fn, false_fn, (x,))


class BufferUpdatedAroundCond(torch.nn.Module):
    """A buffer updated under no_grad before the cond, read inside it."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.steps.add_(1)
        return torch.cond(x.sum() > 0, lambda x: x * self.steps, lambda x: x - self.steps, (x,))


class CondBranchesReturnTheSameInt(torch.nn.Module):
    """test_cond_branches_return_same_int: no operands, a number from both branches."""

    def forward(self, x):
        idx = torch.cond(x.sum() > 3, lambda: 0, lambda: 0, tuple())
        return x[idx]


class CondReadsConstants(torch.nn.Module):
    """A plain tensor attribute (a constant of the program) and a tensor made from data in a branch."""

    def __init__(self):
        super().__init__()
        self.const = torch.tensor([1.0, 2.0, 3.0])

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x * self.const, lambda x: x + torch.tensor([5.0, 6.0, 7.0]), (x,))


class CondBranchesReturnDifferentInts(torch.nn.Module):
    """test_cond_branches_return_constant_int: the operator's result is a symbolic int, checked in range."""

    def forward(self, x):
        idx = torch.cond(x.sum() > 3, lambda: 0, lambda: 1, tuple())
        return x[idx]


class CondReadsThroughAList(torch.nn.Module):
    """A branch reads a value of the forward held in a closure's list."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(3))

    def forward(self, x):
        held = [x * self.w]
        return torch.cond(x.sum() > 0, lambda x: x + held[0], lambda x: x - held[0], (x,))


class UnbackedToCond(torch.nn.Module):
    """test_unbacked_to_cond: a predicate on an unbacked size (nonzero's)."""

    def forward(self, a):
        az = a.nonzero()
        return torch.cond(az.size(0) > 3, lambda x: (x + 1).sum(), lambda x: (x + 3).sum(), (az,)) * 2


class UnbackedThroughCond(torch.nn.Module):
    """test_unbacked_to_cond_passthrough: an unbacked size through the branches."""

    def forward(self, a):
        az = a.nonzero()
        return torch.cond(az.size(0) > 3, lambda x: x + 1, lambda x: x + 3, (az,)) * 2


class CondContainsUnbacked(torch.nn.Module):
    """test_cond_contains_unbacked_no_escape: ``.item()`` of closure tensors inside the branches."""

    def forward(self, a, b1, b2, c):
        return torch.cond(a, lambda x: x * b1.item(), lambda x: x * b2.item(), (c,)) * 2


class CondIntAttribute(torch.nn.Module):
    """test_cond_int_closure: a bool tensor input as the predicate, an int attribute read."""

    def __init__(self):
        super().__init__()
        self.num = 4

    def forward(self, a, x):
        return torch.cond(a, lambda x: x * self.num, lambda x: x + self.num, (x,)) * 2


class CondOpCalledDirectly(torch.nn.Module):
    """The higher-order op itself, as a re-export of a program calls it."""

    def forward(self, x):
        return torch.ops.higher_order.cond(x.sum() > 0, lambda x: (x.sin(),), lambda x: (x.cos(),), (x,))[0]


class _QuarterSTE(torch.autograd.Function):
    """Rounds to quarters; its own backward (triples the gradient, so the test sees it used)."""

    @staticmethod
    def forward(ctx, x):
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx, g):
        return g * 3


class FunctionInABranch(torch.nn.Module):
    """A custom autograd.Function inside a branch keeps its own backward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: _QuarterSTE.apply(self.lin(x)), lambda x: x.sin(), (x,))


class _CondInForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.cos(), (x,))

    @staticmethod
    def backward(ctx, g):
        return g * 2


class CondInAFunctionsForward(torch.nn.Module):
    def forward(self, x):
        return _CondInForward.apply(x * 1)


class BufferUpdatedAfterCondReadIt(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(3))

    def forward(self, x):
        out = torch.cond(x.sum() > 0, lambda x: x + self.total, lambda x: x - self.total, (x,))
        with torch.no_grad():
            self.total.add_(x)
        return out


# ---------------------------------------------------------------- map and while_loop


class MapWithArgs(torch.nn.Module):
    """test_map_buffers' shape: a body over rows, an extra argument, an intermediate updated in place."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buffer", torch.tensor(7.0))

    def forward(self, xs, y):
        def body(x, y):
            z = x + y + self.buffer
            z.add_(4)
            return z.sin()

        return _hop_map(body, xs, y)


class _Outside(torch.nn.Module):
    def __init__(self, requires_grad: bool):
        super().__init__()
        self.register_parameter("param", torch.nn.Parameter(torch.tensor(5.0), requires_grad=requires_grad))
        self.register_buffer("buffer", torch.tensor(6.0) + 1)


def _map_reading(outside: torch.nn.Module):
    class MapReadsAModuleOutside(torch.nn.Module):
        """test_map_buffers (an expected failure of torch.export's): the body reads a module
        outside the exported one; an intermediate updated in place."""

        def forward(self, xs, y):
            def body(x, y):
                z = x + y + outside.param + outside.buffer
                z.add_(4)
                return z

            return _hop_map(body, xs, y)

    return MapReadsAModuleOutside()


class WhileLoopCounter(torch.nn.Module):
    """test_while_loop_simple."""

    def forward(self, i, x):
        return _while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (i, x))


class WhileLoopReadsAParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor([0.5, 2.0, 1.0]))

    def forward(self, i, x):
        def body(i, x):
            return i - 1, (x * self.scale).cos()

        return _while_loop(lambda i, x: i > 0, body, (i, x))


class WhileLoopThresholdBuffer(torch.nn.Module):
    """The condition reads a buffer, the body a Linear (torch's while_loop docs)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 2)
        self.register_buffer("threshold", torch.tensor(3))

    def forward(self, it, x):
        return _while_loop(lambda it, val: it < self.threshold, lambda it, val: (it + 1, self.linear(val)), (it, x))


class WhileLoopUpdatesClones(torch.nn.Module):
    """torch's hop tests' simple_with_mutation: clones updated in place inside the condition and body."""

    def forward(self, x):
        def cond_fn(x):
            return x.clone().add_(1).add_(-1).sum() < 10

        def body_fn(x):
            return (x.clone().add_(1).add_(-1) + 1,)

        return _while_loop(cond_fn, body_fn, (x,))


class NestedWhileLoops(torch.nn.Module):
    """torch's hop tests' nested while_loop."""

    def forward(self, out_iter, it, y):
        def cond_fn(out_iter, it, y):
            return it.sum() < 10

        def body_fn(out_iter, it, y):
            return out_iter.clone(), it + y, y + 1

        def outer_body_fn(out_iter, it, y):
            out_iter, it, y = _while_loop(cond_fn, body_fn, (out_iter, it, y))
            return out_iter + 1, it, y

        return _while_loop(lambda out_iter, it, y: out_iter.sum() < 2, outer_body_fn, (out_iter, it, y))


class WhileLoopCarriesInts(torch.nn.Module):
    """Python ints carried beside a tensor (any int in the branches: torch's unbacked symbols),
    one used after the loop, one returned."""

    def forward(self, x):
        def body(i, steps, x):
            return i + 1, steps + 2, x * 1.5 + i

        i, steps, y = _while_loop(lambda i, steps, x: i < 3, body, (0, 1, x))
        return y * steps, i


class WhileLoopCarriesASize(torch.nn.Module):
    """A dynamic size carried and halved: the loop runs as often as the size says."""

    def forward(self, x):
        n, y = _while_loop(lambda n, y: n > 1, lambda n, y: (n // 2, y * 2), (x.shape[0], x))
        return y + n


class LoopsAndRegions(torch.nn.Module):
    """while_loop and map inside and around no_grad and autocast blocks."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, i, x, xs):
        def body(i, x):
            with torch.no_grad():
                damp = x.abs().mean()
            with torch.autocast("cpu", torch.bfloat16):
                y = self.lin(x)
            return i - 1, y.float().tanh() + damp

        _, x = _while_loop(lambda i, x: i > 0, body, (i, x))
        with torch.no_grad():
            frozen = _hop_map(lambda row: row * 2, xs)
        with torch.autocast("cpu", torch.bfloat16):
            mapped = _hop_map(lambda row, x: self.lin(row + x), xs, x)
        return x, frozen, mapped.float()


class LoopsInRegionsRegionsInBodies(torch.nn.Module):
    """while_loop and scan inside no_grad and autocast blocks; a map body and a scan combine
    function with blocks of their own."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, i, x, xs):
        from torch._higher_order_ops.scan import scan

        with torch.no_grad():
            _, frozen = _while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, self.lin(x).tanh()), (i, x))
        with torch.autocast("cpu", torch.bfloat16):
            _, low = _while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, self.lin(x).float().sin()), (i, x))

        def row(r):
            with torch.no_grad():
                scale = r.abs().max()
            with torch.autocast("cpu", torch.bfloat16):
                y = self.lin(r)
            return y.float() * scale

        def combine(carry, r):
            with torch.autocast("cpu", torch.bfloat16):
                y = self.lin(r)
            return carry + y.float(), y.float().cos()

        mapped = _hop_map(row, xs)
        with torch.no_grad():
            total, _ = scan(combine, x, xs)
        carry, ys = scan(combine, x, xs)
        return frozen, low, mapped, total, carry, ys


class ScanWithState(torch.nn.Module):
    """scan: a running carry and per-step outputs; the combine function reads a parameter and has a region."""

    def __init__(self):
        super().__init__()
        self.decay = torch.nn.Parameter(torch.tensor([0.9, 0.5, 0.1]))

    def forward(self, init, xs):
        from torch._higher_order_ops.scan import scan

        def combine(carry, x):
            with torch.no_grad():
                scale = x.abs().max()
            carry = carry * self.decay + x
            return carry, {"y": carry.sin() * scale}

        carry, out = scan(combine, init, xs)
        return carry, out["y"]


class ScanFreshCarry(torch.nn.Module):
    """scan whose combine function returns a new tensor as its carry (AOTAutograd, torch.compile's
    too, refuses a carry another output is computed from: "scan might be aliasing the input or the
    output")."""

    def __init__(self):
        super().__init__()
        self.decay = torch.nn.Parameter(torch.tensor([0.9, 0.5, 0.1]))

    def forward(self, init, xs):
        from torch._higher_order_ops.scan import scan

        def combine(carry, x):
            carry = carry * self.decay + x
            return carry.clone(), carry.sin()

        return scan(combine, init, xs)


R = torch.randn

CASES = {
    "cond_on_value": (CondOnValue, (R(2, 3),), {}),
    "cond_buffers": (CondBuffers, (R(2, 3),), {}),
    "cond_in_submodule": (CondInSubmodule, (R(4, 4),), {}),  # a static shape: the branch taken, as torch
    "cond_calls_a_submodule": (CondCallsASubmodule, (R(6, 4),), {}),
    "cond_closure_over_int": (CondClosureOverInt, (R(3), R(3)), {}),
    "cond_same_names_as_outer": (CondSameNamesAsOuter, (R(3), R(3)), {}),
    "cond_pytree_outputs": (CondPytreeOutputs, (R(3), R(3)), {}),
    "nested_cond": (NestedCond, (R(3),), {}),
    "cond_under_no_grad_and_autocast": (CondUnderNoGradAndAutocast, (R(2, 3),), {"atol": 2e-2, "rtol": 2e-2}),
    "regions_inside_branches": (RegionsInsideBranches, (R(2, 3),), {"atol": 2e-2, "rtol": 2e-2}),
    "buffer_updated_around_cond": (BufferUpdatedAroundCond, (R(3),), {}),
    "cond_op_called_directly": (CondOpCalledDirectly, (R(3),), {}),
    "function_in_a_branch": (FunctionInABranch, (R(2, 3).abs() + 0.1,), {}),
    "cond_in_a_functions_forward": (CondInAFunctionsForward, (R(2, 3).abs() + 0.1,), {}),
    # (in grad mode eager's own backward fails: torch's cond saved the buffer, updated since)
    "buffer_updated_after_cond_read_it": (BufferUpdatedAfterCondReadIt, (R(3).abs() + 0.1,),
                                          {"grad_modes": (False,)}),
    "cond_branches_return_the_same_int": (CondBranchesReturnTheSameInt, (R(3, 3),), {}),
    "cond_reads_through_a_list": (CondReadsThroughAList, (R(3),), {}),
    "cond_reads_constants": (CondReadsConstants, (R(3),), {}),
    "cond_branches_return_different_ints": (CondBranchesReturnDifferentInts, (R(3, 3) + 1,), {}),
    "unbacked_to_cond": (UnbackedToCond, (R(7),), {}),
    "unbacked_through_cond": (UnbackedThroughCond, (R(7),), {}),
    "cond_contains_unbacked": (CondContainsUnbacked, (torch.tensor(True), torch.tensor([4]), torch.tensor([3]),
                                                     R(10)), {}),
    "cond_int_attribute": (CondIntAttribute, (torch.tensor(True), R(10)), {}),
    "map_with_args": (MapWithArgs, (R(3, 2), R(2)), {}),
    "map_reads_a_module_outside": (lambda: _map_reading(_Outside(False)), (torch.ones(3, 2), torch.tensor(3.0)), {}),
    "while_loop_counter": (WhileLoopCounter, (torch.tensor(0), R(3)), {}),
    "while_loop_reads_a_parameter": (WhileLoopReadsAParameter, (torch.tensor(3), R(3)), {}),
    "while_loop_threshold_buffer": (WhileLoopThresholdBuffer, (torch.tensor(0), R(3, 2)), {}),
    "while_loop_updates_clones": (WhileLoopUpdatesClones, (R(2, 2),), {}),
    # (an int carried with a tensor that requires grad: torch's while_loop has no autograd for it, eager neither)
    "while_loop_carries_ints": (WhileLoopCarriesInts, (R(3),), {"inputs_require_grad": False}),
    "nested_while_loops": (NestedWhileLoops, (torch.tensor(0), torch.tensor(0), torch.tensor(1)), {}),
    "scan_with_state": (ScanWithState, (R(3), R(4, 3)), {}),
    "scan_fresh_carry": (ScanFreshCarry, (R(3), R(4, 3)), {}),
    "loops_in_regions_regions_in_bodies": (LoopsInRegionsRegionsInBodies, (torch.tensor(2), R(3), R(4, 3)),
                                           {"atol": 3e-2, "rtol": 3e-2}),
    "loops_and_regions": (LoopsAndRegions, (torch.tensor(2), R(2, 3), R(4, 2, 3)), {"atol": 3e-2, "rtol": 3e-2}),
}


def _flip(args):
    """The same inputs, negated (a bool one inverted): the other branch of a predicate on them."""
    return tuple(-a if a.is_floating_point() else ~a if a.dtype == torch.bool else a for a in args)


@pytest.mark.parametrize("name", CASES)
def test_matches_eager(name):
    make, args, check = CASES[name]
    torch.manual_seed(0)
    ep = assert_matches_eager(make(), args, **check)
    if name not in ("cond_in_submodule", "cond_branches_return_the_same_int"):  # (nothing to branch on)
        assert _ops_in(ep) & {COND, WHILE_LOOP, MAP, SCAN}
    torch.manual_seed(0)
    assert_matches_eager(make(), _flip(args), **check)  # the other branch, exported from it


@pytest.mark.parametrize("name", ["cond_on_value", "nested_cond", "cond_pytree_outputs"])
def test_both_branches_run_from_one_export(name):
    """One program takes either branch, as eager does, gradients included."""
    make, args, _ = CASES[name]
    torch.manual_seed(0)
    module = make()
    ep = predispatch.export_predispatch(module, args)
    for inputs in (args, _flip(args)):
        eager_in = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in inputs]
        ours_in = [a.detach().clone().requires_grad_(a.is_floating_point()) for a in inputs]
        expected, got = module(*eager_in), ep.module()(*ours_in)
        expected = expected if isinstance(expected, tuple) else (expected,)
        got = got if isinstance(got, tuple) else (got,)
        for e, g in zip(expected, got):
            torch.testing.assert_close(g, e)
        sum(e.sum() for e in expected).backward()
        sum(g.sum() for g in got).backward()
        for e, g in zip(eager_in, ours_in):
            if e.requires_grad:
                torch.testing.assert_close(g.grad, e.grad)


def test_symbolic_shape_predicate_keeps_both_branches():
    """A SymBool predicate (a dynamic size's comparison) keeps the op: either size runs its branch."""
    module = CondInSubmodule()
    ep = predispatch.export_predispatch(module, (R(6, 4),), dynamic_shapes=({0: Dim("n", min=2, max=16)},))
    assert COND in _ops_in(ep)
    for n in (3, 8):
        x = R(n, 4)
        torch.testing.assert_close(ep.module()(x), module(x))


def test_while_loop_carrying_a_dynamic_size():
    """A size carried by a loop: one program for every size, as many iterations as each says."""
    module = WhileLoopCarriesASize()
    ep = assert_matches_eager(module, (R(6),), inputs_require_grad=False,
                              dynamic_shapes=({0: Dim("n", min=2, max=64)},))
    assert WHILE_LOOP in _ops_in(ep)
    for n in (5, 17, 64):
        x = R(n)
        torch.testing.assert_close(ep.module()(x), module(x))


class CondSymIntClosure(torch.nn.Module):
    """test_cond_access_identical_symint_closure: int inputs, dynamic; the branches read one."""

    def forward(self, x, trigger, target):
        return torch.cond(trigger == 1, lambda: x + target, lambda: x * target, ())


def test_symbolic_int_read_by_branches_is_an_operand():
    module = CondSymIntClosure()
    ep = predispatch.export_predispatch(module, (R(2), 0, 2), dynamic_shapes=(None, Dim.DYNAMIC, Dim.DYNAMIC))
    assert COND in _ops_in(ep)
    for trigger, target in ((0, 2), (1, 3), (1, 5)):
        x = R(2)
        torch.testing.assert_close(ep.module()(x, trigger, target), module(x, trigger, target))


def test_branch_nodes_run_in_the_calling_module():
    """A branch's nodes carry the nn_module_stack of the operator's call (unflatten, partitioners)."""
    ep = predispatch.export_predispatch(CondInSubmodule(), (R(6, 4),), dynamic_shapes=({0: Dim("n", min=2, max=16)},))
    call = next(n for n in ep.graph_module.graph.nodes if n.target is COND)
    branch_nodes = [n for n in ep.graph_module.true_graph_0.graph.nodes if n.op == "call_function"]
    assert branch_nodes and all(n.meta["nn_module_stack"] == call.meta["nn_module_stack"] for n in branch_nodes)
    assert any(path == "bar" for path, _ in call.meta["nn_module_stack"].values())


def test_grad_mode_of_the_program_holds_inside_branches():
    """The op policy (aten.linear kept) and regions hold inside a branch."""
    ep = predispatch.export_predispatch(RegionsInsideBranches(), (R(2, 3),))
    assert torch.ops.aten.linear.default in _ops_in(ep)
    kinds = [(r.kind, r.name) for r in predispatch.regions(ep)]
    assert kinds == [("grad", "no_grad_0"), ("autocast", "autocast_bfloat16_1")]


def test_inline_regions_inlines_the_regions_of_branches():
    ep = predispatch.export_predispatch(RegionsInsideBranches(), (R(2, 3),))
    flat = predispatch.inline_regions(ep)
    assert list(predispatch.regions(flat)) == [] and COND in _ops_in(flat)
    with torch.no_grad():  # (the inlined blocks' modes are lost: compared where they do not matter)
        for x in (R(2, 3), -R(2, 3).abs()):
            torch.testing.assert_close(flat.module()(x), ep.module()(x), atol=2e-2, rtol=2e-2)


class _CondLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.mean() > 0, lambda x: self.lin(x).relu(), lambda x: self.lin(x).sigmoid(), (x,))


class CondLayers(torch.nn.Module):
    """Identical layers, each with a cond (what layer reuse meets)."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([_CondLayer() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_identical_layers_with_cond():
    torch.manual_seed(0)
    ep = assert_matches_eager(CondLayers(), (R(2, 4),))
    assert sum(n.target is COND for n in ep.graph_module.graph.nodes) == 3


@pytest.mark.parametrize("name", ["regions_inside_branches", "map_with_args", "while_loop_reads_a_parameter",
                                  "loops_and_regions", "scan_fresh_carry"])
def test_compile_training_through_control_flow(name):
    """compile_training's forward and backward graphs hold the operators: outputs and
    gradients as eager's, under grad mode and under an ambient no_grad."""
    make, args, check = CASES[name]
    tolerance = {k: v for k, v in check.items() if k in ("atol", "rtol")}
    torch.manual_seed(0)
    module = make()
    train = predispatch.compile_training(predispatch.export_predispatch(module, args))
    for inputs in (args, _flip(args)):
        ours = [a.clone().requires_grad_(a.is_floating_point()) for a in inputs]
        eager = [a.clone().requires_grad_(a.is_floating_point()) for a in inputs]
        got, expected = _as_tuple(train(*ours)), _as_tuple(module(*eager))
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, **tolerance)
        sum(g.float().sum() for g in got).backward()
        sum(e.float().sum() for e in expected).backward()
        for g, e in zip(ours, eager):
            if e.grad is not None:
                torch.testing.assert_close(g.grad, e.grad, **tolerance)
        for (n, p), q in zip(train.named_parameters(), module.parameters()):
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, msg=n, **tolerance)
            p.grad = q.grad = None
        with torch.no_grad():
            for g, e in zip(_as_tuple(train(*inputs)), _as_tuple(module(*inputs))):
                torch.testing.assert_close(g, e, **tolerance)
                assert not g.requires_grad


def _as_tuple(out):
    return out if isinstance(out, tuple) else (out,)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("name", ["cond_on_value", "regions_inside_branches", "map_with_args",
                                  "while_loop_reads_a_parameter", "scan_with_state", "cond_reads_constants"])
def test_save_load_round_trip(name):
    make, args, check = CASES[name]
    torch.manual_seed(0)
    module = make()
    ep = predispatch.export_predispatch(module, args)
    buffer = io.BytesIO()
    torch.export.save(ep, buffer)
    buffer.seek(0)
    loaded = torch.export.load(buffer)
    for inputs in (args, _flip(args)):
        torch.testing.assert_close(loaded.module()(*inputs), module(*inputs), **check)
    assert _ops_in(loaded) == _ops_in(ep)


@pytest.mark.parametrize("name", ["cond_on_value", "map_with_args", "while_loop_counter", "scan_with_state"])
def test_run_decompositions(name):
    make, args, _ = CASES[name]
    torch.manual_seed(0)
    module = make()
    lowered = predispatch.export_predispatch(module, args).run_decompositions()
    assert _ops_in(lowered) & {COND, WHILE_LOOP, MAP, SCAN}
    torch.testing.assert_close(lowered.module()(*args), module(*args))


# ---------------------------------------------------------------- refusals


class MutatesItsInput(torch.nn.Module):
    def forward(self, x):
        def true_fn(x):
            x.add_(1)
            return x.sin()

        return torch.cond(x.sum() > 0, true_fn, lambda x: x.cos(), (x,))


class MutatesABuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros(3))

    def forward(self, x):
        def true_fn(x):
            self.count.add_(1)
            return x + self.count

        return torch.cond(x.sum() > 0, true_fn, lambda x: x.cos(), (x,))


class ReturnsItsInput(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x, lambda x: x.cos(), (x,))


class ReturnsAViewOfItsInput(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.view(-1), lambda x: x.cos().view(-1), (x,))


def test_a_tensor_requiring_grad_outside_the_module_is_refused_in_a_body():
    with pytest.raises(predispatch.ExportError, match="requires grad but is neither a parameter") as info:
        predispatch.export_predispatch(_map_reading(_Outside(True)), (torch.ones(3, 2), torch.tensor(3.0)))
    assert "outside.param" in str(info.value)


class MutatesInALoopBody(torch.nn.Module):
    def forward(self, x):
        def body(i, x):
            y = x * 2
            y.add_(1)
            x.mul_(y)
            return i - 1, x.sin()

        return _while_loop(lambda i, x: i > 0, body, (torch.tensor(2), x))


@pytest.mark.parametrize("module, why, at", [
    (MutatesItsInput(), "updates its input 'x' in place", r"in true_fn: x\.add_\(1\)"),
    (MutatesABuffer(), "updates 'b_count' in place, a tensor it reads", r"in true_fn: self\.count\.add_\(1\)"),
    (MutatesInALoopBody(), r"the body \(MutatesInALoopBody\.forward\.<locals>\.body\) updates its input 'x'",
     r"in body: x\.mul_\(y\)"),
    (ReturnsItsInput(), "returns one of its inputs or a view of one", "in <lambda>"),
    (ReturnsAViewOfItsInput(), "returns one of its inputs or a view of one", "in <lambda>"),
])
def test_what_torch_refuses_in_a_branch_is_refused_naming_the_line(module, why, at):
    """Named at the line inside the branch that does it (the update; where the branch is defined
    for what it returns), and the operator's call."""
    with pytest.raises(predispatch.ExportError, match=why) as info:
        predispatch.export_predispatch(module, (R(2, 3),))
    message = str(info.value)
    assert re.search(r"cannot be exported soundly, at \S*test_control_flow\.py:\d+ " + at, message), message
    call = r"called at \S*test_control_flow\.py:\d+ in (forward|_while_loop): return (torch\.cond|while_loop)\("
    assert re.search(call, message), message


class BranchesDisagree(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: (x.sin(), x.cos()), lambda x: (x.cos(),), (x,))


def test_branches_returning_different_structures_are_refused():
    with pytest.raises(predispatch.ExportError, match="branches return different structures"):
        predispatch.export_predispatch(BranchesDisagree(), (R(3),))


class BranchesOfOtherDtypes(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x.int(), (x,))


def test_branches_of_other_dtypes_are_refused_naming_the_call():
    with pytest.raises(predispatch.ExportError, match=r"torch.cond at .*test_control_flow.py.* expected same dtype"):
        predispatch.export_predispatch(BranchesOfOtherDtypes(), (R(3),))


class BranchesOfOtherSizes(torch.nn.Module):
    """Branches whose outputs differ in size: an unbacked size, checked in range, as torch's."""

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda x: x.sin(), lambda x: x[:1].cos(), (x,))


def test_branches_of_other_sizes():
    ep = predispatch.export_predispatch(BranchesOfOtherSizes(), (R(3),))
    for x in (torch.ones(3), -torch.ones(3)):
        torch.testing.assert_close(ep.module()(x), BranchesOfOtherSizes()(x))


class PythonBranchOnValue(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x.sin()
        return x.cos()


def test_data_dependent_refusal_points_at_cond():
    with pytest.raises(predispatch.ExportError, match=r"torch\.cond\(pred, true_fn, false_fn, operands\), "
                                                      r"which keeps both branches") as info:
        predispatch.export_predispatch(PythonBranchOnValue(), (R(3),))
    assert "if x.sum() > 0" in str(info.value)


class AssociativeScan(torch.nn.Module):
    def forward(self, xs):
        from torch._higher_order_ops.associative_scan import associative_scan

        return associative_scan(lambda a, b: a + b, xs, dim=0, combine_mode="generic")


def test_generic_associative_scan_is_traced_as_its_ops():
    """combine_mode="generic" (the CPU one) runs the combine function in Python: plain ops, as eager."""
    assert_matches_eager(AssociativeScan(), (R(4, 3),))


# ---------------------------------------------------------------- the printed program


class SmallCond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x):
        def true_fn(x):
            with torch.no_grad():
                y = x * 2
            return self.lin(x) + y

        return torch.cond(x.sum() > 0, true_fn, lambda x: x.cos(), (x,))


class TestGraphs(GraphTestCase):
    def test_cond_with_a_region_in_a_branch(self):
        ep = predispatch.export_predispatch(SmallCond(), (torch.ones(1, 2),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_lin_weight: f32[2, 2], p_lin_bias: f32[2], x: f32[1, 2]):
    sum = aten.sum.default(x)
    gt = aten.gt.Scalar(sum, 0)
    cond = cond(gt, self.true_graph_0, self.false_graph_0, (x, p_lin_weight, p_lin_bias))
    getitem = cond[0]
    return (getitem,)
def true_graph_0(x: f32[1, 2], p_lin_weight: f32[2, 2], p_lin_bias: f32[2]):
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, x)
    getitem = no_grad_0[0]
    linear = aten.linear.default(x, p_lin_weight, p_lin_bias)
    add = aten.add.Tensor(linear, getitem)
    return (add,)
def true_graph_0.no_grad_0(x: f32[1, 2]):
    mul = aten.mul.Tensor(x, 2)
    return (mul,)
def false_graph_0(x: f32[1, 2], p_lin_weight: f32[2, 2], p_lin_bias: f32[2]):
    cos = aten.cos.default(x)
    return (cos,)
inputs:
    p_lin_weight: PARAMETER -> lin.weight
    p_lin_bias: PARAMETER -> lin.bias
    x: USER_INPUT
outputs:
    getitem: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_while_loop_and_map(self):
        class Loops(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.scale = torch.nn.Parameter(torch.ones(2))

            def forward(self, i, x, xs):
                _, x = _while_loop(lambda i, x: i > 0, lambda i, x: (i - 1, x * self.scale), (i, x))
                return _hop_map(lambda row, x: row + x, xs, x)

        ep = predispatch.export_predispatch(Loops(), (torch.tensor(2), torch.ones(2), torch.ones(3, 2)))
        self.assertGraphExpectedInline(ep, """\
def forward(p_scale: f32[2], i: i64[], x: f32[2], xs: f32[3, 2]):
    while_loop = while_loop(self.cond_graph_0, self.body_graph_0, (i, x), (p_scale,))
    getitem = while_loop[1]
    map_impl = map_impl(self.body_graph_1, [xs], [getitem])
    getitem_1 = map_impl[0]
    return (getitem_1,)
def cond_graph_0(i: i64[], x: f32[2], p_scale: f32[2]):
    gt = aten.gt.Scalar(i, 0)
    return gt
def body_graph_0(i: i64[], x: f32[2], p_scale: f32[2]):
    sub = aten.sub.Tensor(i, 1)
    mul = aten.mul.Tensor(x, p_scale)
    return (sub, mul)
def body_graph_1(xs: f32[2], getitem_1: f32[2]):
    add = aten.add.Tensor(xs, getitem_1)
    return (add,)
inputs:
    p_scale: PARAMETER -> scale
    i: USER_INPUT
    x: USER_INPUT
    xs: USER_INPUT
outputs:
    getitem_1: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_while_loop_carrying_ints(self):
        ep = predispatch.export_predispatch(WhileLoopCarriesInts(), (torch.ones(2),))
        self.assertGraphExpectedInline(ep, """\
def forward(x: f32[2]):
    while_loop = while_loop(self.cond_graph_0, self.body_graph_0, (0, 1, x), ())
    getitem = while_loop[0]
    getitem_1 = while_loop[1]
    getitem_2 = while_loop[2]
    mul = aten.mul.Tensor(getitem_2, getitem_1)
    return (mul, getitem)
def cond_graph_0(i, steps, x: f32[2]):
    lt = lt(i, 3)
    return lt
def body_graph_0(i, steps, x: f32[2]):
    add = add(i, 1)
    add_1 = add(steps, 2)
    mul = aten.mul.Tensor(x, 1.5)
    add_2 = aten.add.Tensor(mul, i)
    return (add, add_1, add_2)
inputs:
    x: USER_INPUT
outputs:
    mul: USER_OUTPUT
    getitem: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")
