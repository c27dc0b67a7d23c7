"""compile_training's op-by-op forward writes a buffer's update where the
buffer lies (issue 39): a batch norm's statistics by the kernel that
computes them, its step count by ``add_``, as eager does, with eager's
results; an update read elsewhere, or computed otherwise, is left as traced."""
import copy

import pytest
import torch

import predispatch
from predispatch.downstream.training.updates_in_place import buffers_updated_in_place, mutating_twin
from predispatch.testing.eager import assert_runs_match, run_module

aten = torch.ops.aten


def test_a_functional_ops_twin_writes_the_arguments_it_returns_anew():
    assert mutating_twin(aten._native_batch_norm_legit_functional.default) == (
        aten._native_batch_norm_legit.default, (3, 4))
    assert mutating_twin(aten.add.Tensor) is None  # not a *_functional op
    assert mutating_twin(aten.native_batch_norm.default) is None


class Block(torch.nn.Module):
    def __init__(self, momentum=0.1):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4, momentum=momentum)

    def forward(self, x):
        return self.bn(self.conv(x)).relu().sum()


class ReadBeforeUpdate(torch.nn.Module):
    """The old value read, then updated in place."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("n", torch.full((4,), 2.0))

    def forward(self, x):
        y = ((x + self.n) * self.w).sum()
        self.n.mul_(0.5)
        return y


class ReadAfterUpdate(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("n", torch.ones(4))

    def forward(self, x):
        self.n.add_(1.0)
        return (x * self.w * self.n).sum()


class UpdatedFromTheInput(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        self.mean.copy_(0.9 * self.mean + 0.1 * x.detach().mean(0))
        return (x * self.w).sum()


def _forward_graph(module, x):
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,))
    train = predispatch.compile_training(ep)
    train(x)
    return train.forward_graph


def _real_inputs(gm: torch.fx.GraphModule) -> list:
    g = torch.Generator().manual_seed(0)
    vals = [n.meta["val"] for n in gm.graph.nodes if n.op == "placeholder"]
    return [torch.rand(v.shape, generator=g).to(v.dtype) + 0.5 if v.is_floating_point()
            else torch.full(v.shape, 3, dtype=v.dtype) for v in vals]


def _ops(gm: torch.fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def _assert_same_run(traced: torch.fx.GraphModule, rewritten: torch.fx.GraphModule) -> None:
    """Both graphs on equal inputs: equal outputs, and inputs left equal."""
    inputs = _real_inputs(traced)
    a, b = [x.clone() for x in inputs], [x.clone() for x in inputs]
    with torch.no_grad():
        out_a, out_b = traced(*a), rewritten(*b)
    for x, y in zip(out_a, out_b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


def test_a_batch_norms_statistics_and_step_count_are_written_where_they_lie():
    traced = _forward_graph(Block(), torch.randn(2, 3, 5, 5))
    rewritten = buffers_updated_in_place(copy.deepcopy(traced))
    ops = _ops(rewritten)
    assert aten._native_batch_norm_legit.default in ops
    assert aten._native_batch_norm_legit_functional.default not in ops
    assert aten.copy_.default not in ops and aten.copy.default not in ops  # eager's kernel writes them
    assert aten.add_.Tensor in ops  # num_batches_tracked
    assert aten.copy_.default in _ops(traced)  # the graph shown keeps its updates apart
    _assert_same_run(traced, rewritten)


@pytest.mark.parametrize("module", [ReadBeforeUpdate(), ReadAfterUpdate(), UpdatedFromTheInput()],
                         ids=lambda m: type(m).__name__)
def test_updates_read_elsewhere_or_computed_otherwise_run_as_traced(module):
    traced = _forward_graph(module, torch.randn(3, 4))
    _assert_same_run(traced, buffers_updated_in_place(copy.deepcopy(traced)))


@pytest.mark.parametrize("module, shape", [
    (Block(), (2, 3, 5, 5)), (ReadBeforeUpdate(), (3, 4)),
    (ReadAfterUpdate(), (3, 4)), (UpdatedFromTheInput(), (3, 4))], ids=lambda v: getattr(v, "__name__", None))
def test_steps_match_eager(module, shape):
    x = torch.randn(*shape)
    eager = copy.deepcopy(module)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(module), (x,)))
    for step in range(3):  # the buffers carry each step's update into the next
        for grad_mode in (True, False):
            assert_runs_match(run_module(eager, (x,), {}, grad_mode=grad_mode),
                              run_module(train, (x,), {}, grad_mode=grad_mode), what=f"[step {step}] ")
