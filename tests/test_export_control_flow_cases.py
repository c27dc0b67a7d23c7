"""PyTorch's torch.export tests of control flow, as predispatch programs (issue 41's audit).

Every test of PyTorch's ``test/export/test_export.py`` whose module calls
``torch.cond``, ``map`` (``functorch.experimental.control_flow.map``),
``while_loop`` or ``scan`` has a row in :data:`CASES`, naming it: our own
version of its module (the same construct, written here). torch.export
exports each (2.13 and 2.15, when the table was written); predispatch
exports each, and ``assert_matches_eager`` compares the program with eager
(outputs, which require grad, gradients of inputs and parameters, buffers
and inputs afterwards, under grad mode on and off, re-export stable), once
on the example inputs and once on inputs that take the other branch.
design/control-flow.md holds the audit's table.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
from unittest import mock

import pytest
import torch
from functorch.experimental.control_flow import cond as functorch_cond, map as functorch_map
from torch.export import Dim

import predispatch
from predispatch.testing.eager import assert_matches_eager


def _while_loop(cond_fn, body_fn, carried):
    from torch._higher_order_ops.while_loop import while_loop

    return while_loop(cond_fn, body_fn, carried)


def _scan(combine_fn, init, xs):
    from torch._higher_order_ops.scan import scan

    return scan(combine_fn, init, xs)


# ---------------------------------------------------------------- torch.cond


class UnbackedPredicate(torch.nn.Module):
    """test_unbacked_to_cond: a predicate on nonzero's (unbacked) size, branches reducing."""

    def forward(self, a):
        nz = a.nonzero()
        return torch.cond(nz.size(0) > 3, lambda t: (t + 1).sum(), lambda t: (t + 3).sum(), (nz,)) * 2


class UnbackedPassthrough(torch.nn.Module):
    """test_unbacked_to_cond_passthrough: the unbacked size flows through the branches."""

    def forward(self, a):
        nz = a.nonzero()
        return torch.cond(nz.size(0) > 3, lambda t: t + 1, lambda t: t + 3, (nz,)) * 2


class BranchesReturnInts(torch.nn.Module):
    """test_cond_branches_return_constant_int (``same``: test_cond_branches_return_same_int)."""

    def __init__(self, same: bool):
        super().__init__()
        self.same = same

    def forward(self, x):
        row = torch.cond(x.sum() > 3, lambda: 1, lambda: 1 if self.same else 2, ())
        return x[row] * 2


class SymIntClosure(torch.nn.Module):
    """test_cond_access_identical_symint_closure: dynamic int inputs read by both branches."""

    def forward(self, x, trigger, target):
        return torch.cond(trigger == 1, lambda: x * target, lambda: x + target, ())


class ItemsInBranches(torch.nn.Module):
    """test_cond_contains_unbacked_no_escape: ``.item()`` of closure tensors in the branches."""

    def forward(self, p, b1, b2, c):
        return torch.cond(p, lambda t: t * b1.item(), lambda t: t - b2.item(), (c,)) + 1


class IntAttributeClosure(torch.nn.Module):
    """test_cond_int_closure: a bool tensor predicate, an int attribute read in the branches."""

    def __init__(self):
        super().__init__()
        self.k = 3

    def forward(self, p, x):
        return torch.cond(p, lambda t: t * self.k, lambda t: t - self.k, (x,)).exp()


class _Cosine(torch.nn.Module):
    def subroutine(self, x):
        return x.cos() * 2

    def forward(self, x):
        return self.subroutine(x)


class BoundMethodBranches(torch.nn.Module):
    """test_export_cond_preserve_torch_fn_for_subgraphs: a submodule's bound ``forward`` and a
    method of the module as branches (functorch's ``cond``), exported in eval mode."""

    def __init__(self):
        super().__init__()
        self.inner = _Cosine()

    def other(self, x):
        return x.sin() - 1

    def forward(self, x):
        return functorch_cond(x.sum() <= 2, self.inner.forward, self.other, [x])


class AsksIfExporting(torch.nn.Module):
    """test_is_exporting: ``torch.compiler.is_exporting()`` outside and inside the branches."""

    def forward(self, p, x):
        def f(t):
            return t.sin() if torch.compiler.is_exporting() else t.cos()

        y = f(x)
        return torch.cond(p, lambda t: f(t) * 3 if torch.compiler.is_exporting() else f(t) - 3,
                          lambda t: f(t) / 3 if torch.compiler.is_exporting() else f(t) + 3, (x,)) * y


class PythonBoolPredicate(torch.nn.Module):
    """test_export_cond_warns_constant_pred: a Python bool input as the predicate."""

    def forward(self, p, x):
        return torch.cond(p, lambda t: t.sin(), lambda t: t.cos(), (x,))


class _Cached(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.linspace(0.0, 1.0, 12).reshape(6, 2))

    def forward(self):
        return self.cache.sin()


class SizePredicateReadsSubmodule(torch.nn.Module):
    """test_export_cond_symbool_pred: a dynamic size's comparison as predicate, a branch calling
    a submodule that reads its buffer (test_export_cond too)."""

    def __init__(self):
        super().__init__()
        self.sub = _Cached()

    def forward(self, x):
        return functorch_cond(x.shape[0] > 4, lambda t: t.sin() * self.sub().sum(), lambda t: t.cos(), [x])


class MethodsReadState(torch.nn.Module):
    """test_cond_buffers: methods as branches reading a frozen parameter and a buffer; a
    predicate on a static shape (the branch taken at export, as torch)."""

    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.full((2, 3), 0.5), requires_grad=False)
        self.register_buffer("offset", torch.full((2, 3), 2.0))

    def plus_frozen(self, x):
        return x * self.frozen

    def plus_offset(self, x):
        return x - self.offset

    def forward(self, x):
        return functorch_cond(x.shape[0] == 4, self.plus_frozen, self.plus_offset, [x])


class _Select(torch.nn.Module):
    def forward(self, p, a, b):
        return torch.cond(p, lambda u, v: u * v, lambda u, v: u / (v.abs() + 1), [a, b])


class CondInChild(torch.nn.Module):
    """test_cond_unflatten: the cond inside a child module, a bool tensor predicate."""

    def __init__(self):
        super().__init__()
        self.child = _Select()

    def forward(self, p, a, b):
        return self.child(p, a, b) + 1


class _LinearCond(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.cond(x.sum() > 4, lambda t: self.lin(t).cos(), lambda t: self.lin(t).sin(), [x])


class LinearCondInChild(torch.nn.Module):
    """test_cond_with_module_stack_export_with: a child's cond whose branches call its Linear."""

    def __init__(self):
        super().__init__()
        self.child = _LinearCond()

    def forward(self, x):
        return x.cos() + self.child(x)


class _ShapeCond(_LinearCond):
    def forward(self, x):
        return torch.cond(x.shape[0] > 4, lambda t: self.lin(t).cos(), lambda t: self.lin(t).sin(), [x])


class ShapeCondInChild(LinearCondInChild):
    """test_cond_with_module_stack_export_with_unflatten: the same on a static shape's comparison."""

    def __init__(self):
        super().__init__()
        self.child = _ShapeCond()


class BufferPredicateGradRegion(torch.nn.Module):
    """test_predispatch_cond: a buffer as predicate, an enable_grad block in a branch (integer
    inputs in torch's test)."""

    def __init__(self, flag: bool):
        super().__init__()
        self.register_buffer("flag", torch.tensor(flag))
        self.register_buffer("step", torch.tensor(10))

    def forward(self, x, y):
        def true_fn(x, y):
            with torch.enable_grad():
                return x - 1 + self.step + y

        return torch.cond(self.flag, true_fn, lambda x, y: x + 1 - self.step + y, [x, y])


class CondThenGradBlock(torch.nn.Module):
    """test_placeholder_naming_collisions_hoo_subgraphs (1): inputs named as the graph's nodes,
    three operands, an enable_grad block after the cond."""

    def forward(self, x, mul, mul_1):
        _mul = x * x
        y = functorch_cond(_mul.sum() > 0, lambda x, y, z: x * y * z, lambda x, y, z: x + y + z,
                           [_mul, mul, mul_1])
        with torch.enable_grad():
            y = y * y
        return y


class TwoCondsNamedAsGraphs(torch.nn.Module):
    """test_placeholder_naming_collisions_hoo_subgraphs (2): inputs named as subgraphs, two conds."""

    def forward(self, input, true_graph, body_graph):
        x = input + true_graph[0] + true_graph[1]
        x = functorch_cond(x.sum() > 0, lambda x: x * 2.0, lambda x: x + 2.0, [x])
        x = functorch_cond(x.sum() > 0, lambda x: x * 2.0, lambda x: x + 2.0, [x])
        return x * body_graph[0]


# ---------------------------------------------------------------- map


class MapScalars(torch.nn.Module):
    """test_map: functorch's map over rows with two scalar tensor arguments."""

    def forward(self, xs, y, z):
        return functorch_map(lambda x, y, z: x * y + z, xs, y, z)


class _Consts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_parameter("scale", torch.nn.Parameter(torch.tensor(5.0), requires_grad=False))
        self.register_buffer("shift", torch.tensor(6.0) + 1)


def _map_reading_outside():
    outside = _Consts()

    class MapReadsOutside(torch.nn.Module):
        """test_map_buffers: the body reads a module outside the exported one and updates an
        intermediate in place."""

        def forward(self, xs, y):
            def body(x, y):
                z = x * y + outside.scale - outside.shift
                z.mul_(2)
                return z

            return functorch_map(body, xs, y)

    return MapReadsOutside()


# ---------------------------------------------------------------- while_loop


class WhileLoopThree(torch.nn.Module):
    """test_while_loop_simple: three carried tensors (a list), a counter."""

    def forward(self, ci, a, b):
        return _while_loop(lambda i, x, y: i > 0, lambda i, x, y: (i - 1, x + y, y - x), [ci, a, b])


class WhileLoopFillsRows(torch.nn.Module):
    """test_while_loop_tensor_constant_idx: a counter made in the forward (a constant), ``.item()``
    to index, a clone updated in place, the loop reading the input through its closure."""

    def forward(self, x, y0):
        def cond_fn(idx, out, acc):
            return idx < out.size(0)

        def body_fn(idx, out, acc):
            i = idx.item()
            torch._check(i >= 0)
            torch._check(i < x.size(0))
            acc = x[i] + acc
            out = out.clone()
            out[i] = acc
            return idx + 1, out, acc

        _, out, _ = _while_loop(cond_fn, body_fn, [torch.tensor(0), torch.zeros_like(x), y0])
        return out


class WhileLoopSymBoolCondition(torch.nn.Module):
    """test_while_loop_index_assertions: a condition returning a SymBool (``.item()`` compared
    with a size), the body indexing with ``.item()``."""

    def forward(self, x):
        def cond_fn(idx, acc):
            return idx.item() < x.size(0)

        def body_fn(idx, acc):
            i = idx.item()
            torch._check(i >= 0)
            torch._check(i < x.size(0))
            return idx + 1, acc + x[i]

        _, out = _while_loop(cond_fn, body_fn, [torch.full((), 0, dtype=torch.int64), torch.zeros(x.size(1))])
        return out


class WhileLoopChecks(torch.nn.Module):
    """test_while_loop_assert_separation: ``torch._check`` in the condition and in the body."""

    def forward(self, idx, x):
        i = idx.item()

        def cond_fn(idx, x):
            j = idx.item()
            torch._check(j != 5)
            return j <= 9

        def body_fn(idx, x):
            j = idx.item()
            torch._check(j % 2 == 0)
            return idx + 2, x + j

        return _while_loop(cond_fn, body_fn, [idx, x + i])


# ---------------------------------------------------------------- scan


class ScanPytreeXs(torch.nn.Module):
    """test_export_scan_pytree_output: scanned inputs in a dict in a tuple, outputs a tuple."""

    def forward(self, init, xs):
        def combine(carry, x):
            return carry * 1.5, (x[0]["a"] + carry.sum(), x[0]["b"] * 2)

        return _scan(combine, init, xs)


_GENERATOR = torch.Generator().manual_seed(41)


def R(*size):
    return torch.randn(*size, generator=_GENERATOR)


@dataclasses.dataclass(frozen=True)
class Case:
    mirrors: str  # the torch test (test/export/test_export.py) whose module this is
    make: object
    args: tuple
    export_kwargs: dict = dataclasses.field(default_factory=dict)
    check: dict = dataclasses.field(default_factory=dict)  # assert_matches_eager's options
    other: tuple | None = None  # inputs taking the other branch (default: floats negated, bools inverted)
    keeps_operator: bool = True  # False: a static predicate, the branch taken at export (as torch)
    as_exported: bool = False  # eager asked "is this an export?" answers yes, as in the program


CASES = {
    "unbacked_predicate": Case("test_unbacked_to_cond", UnbackedPredicate, (R(7),),
                               other=(torch.tensor([0.0, 0, 3, 0, 0, 1, 0]),)),
    "unbacked_passthrough": Case("test_unbacked_to_cond_passthrough", UnbackedPassthrough, (R(7),),
                                 other=(torch.tensor([0.0, 0, 3, 0, 0, 1, 0]),)),
    "branches_return_ints": Case("test_cond_branches_return_constant_int", lambda: BranchesReturnInts(False),
                                 (R(3, 3) + 1,)),
    # (the number both return is the result: the operator's output unused, dead code, which torch leaves)
    "branches_return_same_int": Case("test_cond_branches_return_same_int", lambda: BranchesReturnInts(True),
                                     (R(3, 3) + 1,), keeps_operator=False),
    "symint_closure": Case("test_cond_access_identical_symint_closure", SymIntClosure, (R(2), 0, 2),
                           {"dynamic_shapes": (None, Dim.DYNAMIC, Dim.DYNAMIC)}, other=(R(2), 1, 3)),
    "items_in_branches": Case("test_cond_contains_unbacked_no_escape", ItemsInBranches,
                              (torch.tensor(True), torch.tensor([4]), torch.tensor([3]), R(10))),
    "int_attribute_closure": Case("test_cond_int_closure", IntAttributeClosure, (torch.tensor(True), R(10))),
    "bound_method_branches": Case("test_export_cond_preserve_torch_fn_for_subgraphs (and "
                                  "test_export_cond_preserve_stack_trace_for_subgraphs)",
                                  lambda: BoundMethodBranches().eval(), (R(1, 3, 3, 3) + 1,)),
    "asks_if_exporting": Case("test_is_exporting", AsksIfExporting, (torch.tensor(False), R(3, 4)),
                              as_exported=True),
    "python_bool_predicate": Case("test_export_cond_warns_constant_pred", PythonBoolPredicate, (True, R(3, 3)),
                                  other=(False, R(3, 3)), keeps_operator=False),
    "size_predicate_reads_submodule": Case("test_export_cond_symbool_pred", SizePredicateReadsSubmodule,
                                           (R(6, 2),), {"dynamic_shapes": ({0: Dim("n", min=3, max=16)},)},
                                           other=(R(3, 2),)),
    "static_size_predicate_reads_submodule": Case("test_export_cond (an earlier revision of the file)",
                                                  SizePredicateReadsSubmodule, (R(6, 2),), keeps_operator=False),
    "methods_read_state": Case("test_cond_buffers", MethodsReadState, (R(2, 3),), keeps_operator=False),
    "cond_in_child": Case("test_cond_unflatten", CondInChild, (torch.tensor(False), R(3, 3), R(3, 3))),
    "linear_cond_in_child": Case("test_cond_with_module_stack_export_with", LinearCondInChild, (R(4, 4) + 1,)),
    "shape_cond_in_child": Case("test_cond_with_module_stack_export_with_unflatten", ShapeCondInChild,
                                (R(4, 4),), keeps_operator=False),
    "buffer_predicate_grad_region": Case("test_predispatch_cond", lambda: BufferPredicateGradRegion(False),
                                         (torch.tensor(10), torch.tensor(12))),
    "buffer_predicate_grad_region_true": Case("test_predispatch_cond", lambda: BufferPredicateGradRegion(True),
                                              (R(3), R(3))),
    "cond_then_grad_block": Case("test_placeholder_naming_collisions_hoo_subgraphs", CondThenGradBlock,
                                 (R(4), R(4), R(4)), other=(torch.zeros(4), R(4), R(4))),
    "two_conds_named_as_graphs": Case("test_placeholder_naming_collisions_hoo_subgraphs", TwoCondsNamedAsGraphs,
                                      (R(10, 4) + 1, (R(4), R(4)), (R(4),))),
    "map_scalars": Case("test_map", MapScalars, (R(6, 4), torch.tensor(5.0), torch.tensor(4.0))),
    "map_reads_outside": Case("test_map_buffers", _map_reading_outside, (R(3, 2), torch.tensor(3.0))),
    "while_loop_three": Case("test_while_loop_simple", WhileLoopThree, (torch.tensor(3), R(10, 20), R(10, 20)),
                             other=(torch.tensor(0), R(10, 20), R(10, 20))),
    "while_loop_fills_rows": Case("test_while_loop_tensor_constant_idx", WhileLoopFillsRows, (R(16, 8), R(8))),
    "while_loop_symbool_condition": Case("test_while_loop_index_assertions", WhileLoopSymBoolCondition,
                                         (R(8, 4),)),
    "while_loop_checks": Case("test_while_loop_assert_separation", WhileLoopChecks,
                              (torch.tensor([0]), torch.zeros(1)), other=(torch.tensor([10]), torch.zeros(1))),
    "scan_pytree_xs": Case("test_export_scan_pytree_output", ScanPytreeXs,
                           (torch.ones(3), ({"a": R(4, 3), "b": R(4, 3)},))),
}

_OPERATORS = {torch.ops.higher_order.cond, torch.ops.higher_order.while_loop, torch.ops.higher_order.map_impl,
              torch.ops.higher_order.scan}


def _flip(args):
    """The same inputs, floats negated and bools inverted: the other branch of a predicate on them."""
    def flipped(a):
        if isinstance(a, torch.Tensor):
            return -a if a.is_floating_point() else ~a if a.dtype == torch.bool else a
        return not a if isinstance(a, bool) else a
    return torch.utils._pytree.tree_map(flipped, args)


def _operators_in(ep) -> set:
    return {n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"} & _OPERATORS


@pytest.mark.parametrize("name", CASES)
def test_torch_export_case_matches_eager(name):
    """Exported from either example, the program gives eager's outputs, gradients and states
    for it, and holds torch's operator where the predicate is not a Python constant."""
    case = CASES[name]
    as_exported = mock.patch("torch.compiler.is_exporting", lambda: True) if case.as_exported else \
        contextlib.nullcontext()
    for args in (case.args, case.other if case.other is not None else _flip(case.args)):
        torch.manual_seed(0)
        with as_exported:
            ep = assert_matches_eager(case.make(), args, **case.export_kwargs, **case.check)
        assert bool(_operators_in(ep)) == case.keeps_operator, case.mirrors


class CheckedBranch(torch.nn.Module):
    """A ``torch._check`` in one branch on a value the caller read too (``.item()`` of ``n``)."""

    cond = staticmethod(torch.cond)

    def forward(self, p, n, x):
        y = x * n.item()

        def positive(x, n):
            k = n.item()
            torch._check(k > 0)
            return x * k

        return self.cond(p, positive, lambda x, n: x - 1, (x, n)) + y


class CheckedBranchAsDocumented(CheckedBranch):
    """torch.cond as its documentation defines it: the branch the predicate picks, called. (Eager's
    torch.cond compiles both branches with dynamo, which fails on the check of the branch not taken.)"""

    cond = staticmethod(lambda p, true_fn, false_fn, operands: (true_fn if p else false_fn)(*operands))


def _outcome(fn, *args):
    """What a call gives: its result, or the type of what it raised."""
    try:
        return fn(*args)
    except RuntimeError:
        return RuntimeError


@pytest.mark.parametrize("make, reference, example, calls", [
    (WhileLoopChecks, WhileLoopChecks, (torch.tensor([0]), torch.zeros(1)),
     [(torch.tensor([1]), torch.zeros(1)), (torch.tensor([3]), torch.zeros(1)), (torch.tensor([4]), torch.ones(1))]),
    (CheckedBranch, CheckedBranchAsDocumented, (torch.tensor(True), torch.tensor(2), torch.ones(3)),
     [(torch.tensor(False), torch.tensor(-1), torch.ones(3)), (torch.tensor(True), torch.tensor(-1), torch.ones(3)),
      (torch.tensor(True), torch.tensor(3), torch.ones(3))]),
])
def test_checks_in_branches_hold_where_the_branch_runs(make, reference, example, calls):
    """A branch's ``torch._check`` fails the call where the branch runs, and only there
    (test_while_loop_assert_separation: the condition's and the body's checks apart)."""
    program = predispatch.export_predispatch(make(), example).module()
    for args in calls:
        expected, got = _outcome(reference(), *args), _outcome(program, *args)
        assert (got is RuntimeError) == (expected is RuntimeError), f"{args}: {got}, the reference {expected}"
        if expected is not RuntimeError:
            torch.testing.assert_close(got, expected)


class LinearsInBranches(torch.nn.Module):
    """A Linear before a cond and one in each branch."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.up = torch.nn.Linear(4, 4)
        self.down = torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.first(x)
        return torch.cond(x.sum() > 0, lambda x: self.up(x), lambda x: self.down(x).relu(), (x,))


def _quantization_ops(gm) -> dict:
    """Per graph of a prepared or converted module (top level and branches, by name): its linears,
    observers and (de)quantize ops, in order."""
    kept = ("linear", "quantize", "dequantize", "activation_post_process")
    return {name or "forward": [str(n.target) for n in m.graph.nodes
                                if n.op in ("call_function", "call_module") and any(k in str(n.target) for k in kept)]
            for name, m in gm.named_modules() if isinstance(m, torch.fx.GraphModule)}


def test_pt2e_inside_branches_as_torch_flow_does():
    """torchao's PT2E flow on torch.export's program of a cond with Linears in its branches
    quantizes the Linear outside the cond only; on predispatch's program, predispatch's
    prepare_pt2e/convert_pt2e do the same: the same ops in every graph, the same results."""
    pytest.importorskip("torchao")
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer, get_default_x86_inductor_quantization_config)

    def quantizer():
        return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())

    torch.manual_seed(0)
    module, x = LinearsInBranches(), torch.randn(8, 4)
    calibration = (x, -x)
    theirs = prepare_pt2e(torch.export.export(copy.deepcopy(module), (x,)).module(), quantizer())
    ours = predispatch.prepare_pt2e(predispatch.export_predispatch(copy.deepcopy(module), (x,)).module(), quantizer())
    assert _quantization_ops(ours) == _quantization_ops(theirs)
    for batch in calibration:
        theirs(batch), ours(batch)
    theirs, ours = convert_pt2e(theirs), predispatch.convert_pt2e(ours)
    assert _quantization_ops(ours) == _quantization_ops(theirs)
    for batch in calibration:
        torch.testing.assert_close(ours(batch), theirs(batch), rtol=0, atol=0)


class IndexByItem(torch.nn.Module):
    """Checks torch's runtime-assert pass writes at the top level, a program exported again runs as ops."""

    def forward(self, x, idx):
        i = idx.item()
        torch._check(i >= 0)
        torch._check(i < x.size(0))
        return x[i] * 2


def test_checks_of_a_program_exported_again_name_their_conditions():
    """A check the first export wrote names its condition's node; exported again, the check
    (now an op of the module) names the new graph's node: the same program (G7)."""
    assert_matches_eager(IndexByItem(), (R(4, 3), torch.tensor(2)))
