"""Node stack traces: predispatch stamps them once per user torch call
(predispatch/trace/stack_traces.py) instead of letting torch capture and symbolize
the whole stack for every node. The result must be what torch's own per-node
capture gives, node for node, including inside regions."""
import contextlib

import cases
import pytest
import torch

import predispatch
import predispatch.trace.recorder.session
from predispatch.testing.invariants import all_graph_modules


def _traces(ep):
    return [(n.name, n.meta.get("stack_trace"))
            for gm in all_graph_modules(ep.graph_module) for n in gm.graph.nodes]


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_cache=False)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train(), (torch.randint(0, 64, (2, 8)),)


@pytest.mark.parametrize("build", [
    lambda: (cases.NestedGrad(), (torch.randn(3, requires_grad=True),)),
    lambda: (cases.AutocastBlocks(), (torch.randn(2, 4),)),
    lambda: (cases.NoGradInsideAutocast(), (torch.randn(2, 4),)),
    lambda: (cases.InputMutatedThroughView(), (torch.randn(4), torch.randn(4))),
    _tiny_llama,
], ids=["nested-grad", "autocast", "no-grad-in-autocast", "mutation-through-view", "llama"])
def test_stamped_stack_traces_equal_torchs_own(build, monkeypatch):
    module, args = build()
    stamped = _traces(predispatch.export_predispatch(module, args))
    monkeypatch.setattr(predispatch.trace.recorder.session, "stamping_stack_traces", contextlib.nullcontext)
    by_torch = _traces(predispatch.export_predispatch(module, args))
    assert stamped == by_torch
    assert sum(trace is not None for _, trace in stamped) >= 3


def test_stack_trace_names_the_user_line_inside_a_region():
    ep = predispatch.export_predispatch(cases.NestedGrad(), (torch.randn(3, requires_grad=True),))
    add = [n for gm in all_graph_modules(ep.graph_module) for n in gm.graph.nodes
           if n.target is torch.ops.aten.add.Tensor and n.args[1] == 1]
    assert len(add) == 1
    trace = add[0].meta["stack_trace"]
    assert "cases.py" in trace and "d = c + 1" in trace
