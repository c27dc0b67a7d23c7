"""Tools that take an ExportedProgram keep working on ours (the contract:
``run_decompositions``, ``torch.export.unflatten``, save and load), compared
with eager: outputs, gradients, parameters and buffers after the call."""
import copy

import pytest
import torch

import cases
import predispatch
from predispatch.testing.eager import assert_runs_match, run_module


def _check_against_eager(module, args, runnable, grad_mode=True):
    eager = run_module(copy.deepcopy(module), args, None, grad_mode=grad_mode)
    mine = run_module(runnable, args, None, grad_mode=grad_mode)
    assert_runs_match(eager, mine)


@pytest.mark.parametrize("case, args", [
    (cases.EMA, (torch.randn(2, 4),)),  # a parameter and a buffer updated under no_grad
    (cases.Seed, (torch.randn(3),)),
])
def test_run_decompositions_keeps_eager_write_backs(case, args):
    """Outputs and states after the call; not gradients: torch's
    run_decompositions traces below autograd and inlines the regions, so a
    no_grad block no longer cuts gradients (EMA's shadow would pass one)."""
    torch.manual_seed(0)
    module = case()
    ep = predispatch.export_predispatch(copy.deepcopy(module), args)
    decomposed = ep.run_decompositions()
    assert isinstance(decomposed, predispatch.PredispatchProgram)
    assert predispatch.autocast_policy(decomposed) == predispatch.autocast_policy(ep)
    _check_against_eager(module, args, copy.deepcopy(decomposed.module()), grad_mode=False)


@pytest.mark.parametrize("case, args", [
    (cases.Seed, (torch.randn(3),)),
    (cases.AutocastBlocks, (torch.randn(2, 4),)),
    (cases.BatchNormNet, (torch.randn(4, 3),)),
])
def test_unflatten_places_regions_in_their_modules(case, args):
    """torch.export.unflatten places each node by its module stack: the
    region's submodule and call carry the stack of the code that opened it.
    Its write-backs are ours, as ep.module()'s: BatchNorm's running
    statistics, which its backward saved, are written back hidden from
    autograd (torch's copy_ failed the backward's version check)."""
    torch.manual_seed(0)
    module = case()
    ep = predispatch.export_predispatch(copy.deepcopy(module), args)
    _check_against_eager(module, args, torch.export.unflatten(ep))


@pytest.mark.parametrize("case, args, dynamic_shapes", [
    (cases.AutocastBlocks, (torch.randn(2, 4),), None),
    (cases.EMA, (torch.randn(2, 4),), None),
    (cases.AliasingOutputs, (torch.randn(3, 4),), None),
    (cases.DynamicBatch, (torch.randn(4, 4),), ({0: torch.export.Dim("batch")},)),
])
def test_torch_compile_of_the_program_module(case, args, dynamic_shapes):
    """Dynamo traces torch's own region calls (it does not know our faster
    ones) and puts the run-time code's op entry points in its graph as calls:
    one graph, no break; a failed trace must not leave autocast state behind."""
    torch.manual_seed(0)
    module = case()

    def export():
        return predispatch.export_predispatch(copy.deepcopy(module), args,
                                              dynamic_shapes=dynamic_shapes).module()

    explained = torch._dynamo.explain(export())(*copy.deepcopy(args))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    program = export()
    assert "aten_" in program.code  # the run-time code, not a regenerated copy
    program.compile(backend="aot_eager")
    _check_against_eager(module, args, program)
    assert not torch.is_autocast_enabled("cpu")
    if dynamic_shapes:
        for p in program.parameters():
            p.grad = None
        _check_against_eager(module, (torch.randn(7, 4),), program)


def test_a_copy_of_the_program_module_compiles_as_one_graph():
    """Region submodules of ep.module() are plain GraphModules: a deepcopy
    (or a recompile) of a lazy one is lazy again, which dynamo cannot inline
    (a graph break per region, an error with fullgraph=True)."""
    torch.manual_seed(0)
    module, args = cases.AutocastBlocks(), (torch.randn(2, 4),)
    program = copy.deepcopy(predispatch.export_predispatch(copy.deepcopy(module), args).module())
    program.compile(backend="aot_eager", fullgraph=True)
    _check_against_eager(module, args, program)


class _SizedByTheBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, state):
        y = self.lin(x)
        with torch.no_grad():
            state.add_(y)
        return y.new_zeros(x.shape[0], 1) + y * 2


def test_run_decompositions_of_a_dynamic_program_keeps_the_record():
    """With dynamic shapes the first op node is a ``sym_size``, which
    run_decompositions makes anew: the record sits on a tensor op instead, so
    the policy and the write-back modes survive (an input that requires grad,
    updated under no_grad, is written back under no_grad)."""
    batch = torch.export.Dim("batch", min=2)
    ep = predispatch.export_predispatch(_SizedByTheBatch(), (torch.randn(3, 4), torch.zeros(3, 4)),
                                        dynamic_shapes=({0: batch}, {0: batch}),
                                        backward_pass_autocast="off", on_backward_autocast_mismatch="warn")
    decomposed = ep.run_decompositions()
    assert predispatch.autocast_policy(decomposed) == predispatch.autocast_policy(ep)
    x, state = torch.randn(5, 4, requires_grad=True), torch.zeros(5, 4, requires_grad=True)
    decomposed.module()(x, state).sum().backward()
    assert x.grad is not None
