"""§3 compile_training merges equal calls (issue 39): an aten op called
twice on the same values is computed once in the step's graphs (under
autocast, the projections of an attention cast one activation once), with
eager's results; what is not equal is left alone (draws, ``empty``'s
memory, a call after a write, a value the graph returns)."""
import copy

import torch
from torch.fx.experimental.proxy_tensor import make_fx

import predispatch
from predispatch.downstream.training.equal_calls import merge_equal_calls
from predispatch.testing.eager import assert_runs_match, run_module

aten = torch.ops.aten


class Attention(torch.nn.Module):
    """Three projections of one input: under bf16 autocast, each casts it."""

    def __init__(self, width=16):
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(width, width) for _ in range(3))

    def forward(self, x):
        h = torch.nn.functional.layer_norm(x, x.shape[-1:])
        scores = (self.q(h) @ self.k(h).transpose(-1, -2)).softmax(-1)
        return (scores @ self.v(h)).float().sum()


def _casts_of(graph: torch.fx.Graph, node_name: str) -> int:
    return sum(1 for n in graph.nodes if n.target is aten._to_copy.default
               and getattr(n.args[0], "name", None) == node_name)


def test_one_activation_cast_once_for_three_projections_with_eagers_gradients():
    model, x = Attention(), torch.randn(2, 8, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ep = predispatch.export_predispatch(copy.deepcopy(model), (x,))
        train = predispatch.compile_training(ep)
        train(x)
    graph = train.forward_graph.graph
    norm = next(n for n in graph.nodes if n.target is aten.native_layer_norm.default)
    (normed,) = [u for u in norm.users if u.args[1] == 0]
    assert _casts_of(graph, normed.name) == 1  # eager casts it three times
    train.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert_runs_match(run_module(model, (x,), {}), run_module(train, (x,), {}))


def _graph(f, *args) -> torch.fx.Graph:
    return make_fx(f)(*args).graph


def _count(graph: torch.fx.Graph, target) -> int:
    return sum(1 for n in graph.nodes if n.target is target)


def test_equal_pure_calls_are_merged_and_their_users_read_the_first():
    graph = _graph(lambda x: x.sin().t() + x.sin().t() + x.sin(), torch.randn(3, 3))
    assert merge_equal_calls(graph) == 2 + 1  # two more sins, then one more t of the one sin
    assert _count(graph, aten.sin.default) == 1 and _count(graph, aten.t.default) == 1
    graph.lint()


def test_draws_and_empty_memory_are_not_merged():
    def f(x):
        return torch.bernoulli(x) + torch.bernoulli(x) + torch.empty_like(x).fill_(1) + torch.empty_like(x).fill_(1)
    graph = _graph(f, torch.rand(3))
    merge_equal_calls(graph)
    assert _count(graph, aten.bernoulli.default) == 2 and _count(graph, aten.empty_like.default) == 2


def test_a_call_after_a_write_is_not_merged_with_one_before():
    def f(x):
        a = x * 2
        x.add_(1)
        return a + x * 2
    graph = _graph(f, torch.randn(3))
    assert merge_equal_calls(graph) == 0
    assert _count(graph, aten.mul.Tensor) == 2


def test_values_the_graph_returns_keep_memory_of_their_own():
    graph = _graph(lambda x: (x.cos(), x.cos()), torch.randn(3))
    assert merge_equal_calls(graph) == 0
    assert _count(graph, aten.cos.default) == 2


def test_a_multi_output_call_whose_result_is_returned_twice_is_not_merged():
    def f(x):
        a, _, _ = torch.native_layer_norm(x, [3], None, None, 1e-5)
        b, _, _ = torch.native_layer_norm(x, [3], None, None, 1e-5)
        return a, b
    graph = _graph(f, torch.randn(2, 3))
    merge_equal_calls(graph)
    assert _count(graph, aten.native_layer_norm.default) == 2
