"""§3 compile_training's default backend takes a step in eager's memory
(issue 39): a saved tensor is freed at its last use in the backward, not
held to the backward's end, and a pointwise op whose first operand dies
there writes into it (a tied weight's two gradients summed in place, as
eager's autograd sums them), with eager's results."""
import copy
import weakref

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._python_dispatch import TorchDispatchMode

import predispatch
from predispatch.downstream.training.in_place import write_into_dead_operands
from predispatch.testing.eager import assert_runs_match, run_module

aten = torch.ops.aten


class TiedLanguageModel(torch.nn.Module):
    """An embedding whose weight is also the head's: two gradients for one tensor."""

    def __init__(self, vocab=64, width=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.body = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return torch.nn.functional.cross_entropy(self.head(torch.relu(self.body(self.embed(ids)))).flatten(0, 1),
                                                 ids.flatten())


class OpsCalled(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func, [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def test_a_tied_weights_gradients_are_summed_in_place_with_eagers_result():
    model, ids = TiedLanguageModel(), torch.randint(0, 64, (2, 8))
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), (ids,)))
    loss = train(ids)
    with OpsCalled() as called:
        loss.backward()
    weight = tuple(model.embed.weight.shape)
    sums = {func for func, shapes in called.ops if func in (aten.add.Tensor, aten.add_.Tensor)
            and shapes == [weight, weight]}
    assert sums == {aten.add_.Tensor}
    functional = {n.target for n in train.backward_graph.graph.nodes}
    assert aten.add.Tensor in functional and aten.add_.Tensor not in functional  # the graph shown is functional
    train.zero_grad(set_to_none=True)
    assert_runs_match(run_module(model, (ids,), {}), run_module(train, (ids,), {}))


class Stack(torch.nn.Module):
    def __init__(self, depth=6, width=32):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


class AliveSaved(TorchDispatchMode):
    """At each op of the backward, how many of the forward's saved activations are alive."""

    def __init__(self, saved):
        super().__init__()
        self.saved, self.alive = saved, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.alive.append(sum(ref() is not None for ref in self.saved))
        return func(*args, **(kwargs or {}))


def test_saved_activations_are_freed_at_their_last_use_in_the_backward():
    model, x = Stack(), torch.randn(64, 32)
    train = predispatch.compile_training(predispatch.export_predispatch(model, (x,)))
    parameters = {id(p) for p in train.parameters()}
    saved = []

    def pack(t):
        if id(t) not in parameters and t.shape == (64, 32):
            saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = train(x)
    assert len(saved) >= 6
    with AliveSaved(saved) as seen:
        loss.backward()
    assert seen.alive[0] == len(saved)
    assert seen.alive[-1] <= 2, seen.alive  # the first layer's input and output: the rest freed on the way


def _graph(fn, *args):
    return make_fx(fn)(*args)


def _targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("fn, args, in_place", [
    # the product dies at the add: written into
    (lambda a, b: torch.mul(a, b) + b, (torch.randn(4, 3), torch.randn(4, 3)), [aten.mul.Tensor, aten.add_.Tensor]),
    # the product read again after the add: the add is not written into it; the sum dies at the last mul
    (lambda a, b: ((p := a * b) + b) * p, (torch.randn(4, 3), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.add.Tensor, aten.mul_.Tensor]),
    # a commutative op: the second operand written into, where the first is a view
    (lambda a, b: (a * 2).view(4, 3) + (b * 2), (torch.randn(12), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.view.default, aten.mul.Tensor, aten.add_.Tensor]),
    # ... of the result's layout only (the result would have the view's strides, transposed)
    (lambda a, b: (a * 2).t() + (b * 2), (torch.randn(3, 4), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.t.default, aten.mul.Tensor, aten.add.Tensor]),
    # not commutative: only the first
    (lambda a, b: (a * 2).t() - (b * 2), (torch.randn(3, 4), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.t.default, aten.mul.Tensor, aten.sub.Tensor]),
    # an input: never written
    (lambda a, b: a + b, (torch.randn(4, 3), torch.randn(4, 3)), [aten.add.Tensor]),
    # a chain: a residual sum written into the product, then a relu into the sum (memory of its own still)
    (lambda a, b: torch.relu(a * b + b), (torch.randn(4, 3), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.add_.Tensor, aten.relu_.default]),
    # ... but not where the product is read again (the sum is its memory too)
    (lambda a, b: (torch.relu((p := a * b) + b), p), (torch.randn(4, 3), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.add.Tensor, aten.relu_.default]),
    # a view of a fresh result: not memory of its own
    (lambda a, b: (a * b).t() + b.t(), (torch.randn(4, 3), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.t.default, aten.t.default, aten.add.Tensor]),
    # broadcast: the result is larger than the operand
    (lambda a, b: (a * 2) + b, (torch.randn(3), torch.randn(4, 3)), [aten.mul.Tensor, aten.add.Tensor]),
    # promoted: the result is of another dtype
    (lambda a, b: (a * 2) + b, (torch.randn(4, 3, dtype=torch.bfloat16), torch.randn(4, 3)),
     [aten.mul.Tensor, aten.add.Tensor]),
    # a draw is not made in place (the numbers drawn would be others)
    (lambda a: torch.bernoulli(a * 0 + 0.5), (torch.randn(4, 3),), [aten.mul.Tensor, aten.add_.Tensor,
                                                                     aten.bernoulli.default]),
])
def test_a_pointwise_op_writes_into_an_operand_only_where_it_dies_there(fn, args, in_place):
    gm = _graph(fn, *args)
    write_into_dead_operands(gm)
    assert _targets(gm) == in_place
    if fn.__code__.co_argcount == 2:
        torch.testing.assert_close(gm(*args), fn(*args))
        torch.testing.assert_close(gm(*args), fn(*args))  # the inputs left as they were


def test_a_gradient_the_backward_returns_may_take_its_operands_layout():
    """Only returned by a backward graph, a result's strides are not read
    (autograd lays a gradient out as its parameter)."""
    def fn(a, b):
        return (a * 2).t() + (b * 2)

    args = (torch.randn(3, 4), torch.randn(4, 3))
    gm = write_into_dead_operands(_graph(fn, *args), backward=True)
    assert _targets(gm)[-1] == aten.add_.Tensor
    torch.testing.assert_close(gm(*args), fn(*args))
    read_again = write_into_dead_operands(_graph(lambda a, b: ((a * 2).t() + (b * 2)).sum(0), *args),
                                          backward=True)
    assert aten.add.Tensor in _targets(read_again)  # read again in the graph: its strides are


class ConvNormBlocks(torch.nn.Module):
    """Residual conv, batch-norm, relu blocks in train mode (a ResNet's)."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.BatchNorm2d(4)
        self.conv2, self.bn2 = torch.nn.Conv2d(4, 4, 3, padding=1), torch.nn.BatchNorm2d(4)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + y).sum()


def test_a_batch_norms_running_statistics_are_not_saved_for_its_backward():
    """In train mode its backward reads the batch's statistics only: the
    forward saves no copy of the running ones (eager saves none either)."""
    model, x = ConvNormBlocks().train(), torch.randn(2, 3, 6, 6)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), (x,)))
    for _ in range(3):  # the running statistics updated each step, as eager's
        assert_runs_match(run_module(model, (x,), {}), run_module(train, (x,), {}))
        for m in (model, train):
            m.zero_grad(set_to_none=True)
    norms = [n for n in train.backward_graph.graph.nodes if n.target == aten.native_batch_norm_backward.default]
    assert len(norms) == 2 and all(n.args[3] is None and n.args[4] is None for n in norms)
    clones = [n for n in train.forward_graph.graph.nodes if n.target == aten.clone.default]
    saved = {p.name for p in train.backward_graph.graph.nodes if p.op == "placeholder"}
    assert not any(c.name in saved for c in clones)


def test_the_backward_reads_saved_activations_without_detaching_them():
    """AOTAutograd's backward graph detaches each saved activation before
    the op that reads it: run op by op, nothing is made for that."""
    model, x = ConvNormBlocks().train(), torch.randn(2, 3, 6, 6)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), (x,)))
    assert aten.detach.default in {n.target for n in train.backward_graph.graph.nodes}  # the graph shown keeps them
    loss = train(x)
    with OpsCalled() as called:
        loss.backward()
    assert aten.threshold_backward.default in {func for func, _ in called.ops}
    activation = (2, 4, 6, 6)  # (detaches of parameter-shaped gradients are AccumulateGrad's, eager's too)
    assert [shapes for func, shapes in called.ops if func == aten.threshold_backward.default][0][1] == activation
    assert not [shapes for func, shapes in called.ops if func == aten.detach.default and shapes == [activation]]
    model(x).backward()  # the same step in eager: the statistics updated as the program's
    for m in (model, train):
        m.zero_grad(set_to_none=True)
    assert_runs_match(run_module(model, (x,), {}), run_module(train, (x,), {}))

