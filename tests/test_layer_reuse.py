"""Layer reuse (predispatch/trace/layer_reuse.py): repeated layers traced once.

For each case: the program with reuse on is the program with reuse off, node
for node (op, arguments, value metadata, module stack, stack trace, torch
function, up to node names), it matches eager, and the report says which
calls were stamped: layers whose graph depends on anything outside the key
(their index, a per-layer constant, a buffer they update, a host random
draw, a region inside) are traced, never stamped.
"""
import random

import torch
import torch.nn as nn

import predispatch
from predispatch.trace import layer_reuse
from predispatch.testing import assert_same_program
from predispatch.testing.eager import assert_matches_eager


def export_both(module, args):
    """(program with reuse, its report); asserts it is the program without."""
    with layer_reuse.reuse_layers(False):
        plain = predispatch.export_predispatch(module, args)
    with layer_reuse.reuse_layers(True):
        reused = predispatch.export_predispatch(module, args)
        report = layer_reuse.last_report
    assert_same_program(plain, reused)
    return reused, report


class Block(nn.Module):
    def __init__(self, width=8, index=0):
        super().__init__()
        self.index = index
        self.norm = nn.LayerNorm(width)
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return x + self.lin(self.norm(x)).relu()


class Stack(nn.Module):
    def __init__(self, block, n=4, width=8):
        super().__init__()
        self.layers = nn.ModuleList(block(width, i) for i in range(n))
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x):
        x = x * self.scale  # every layer's input requires grad (else the first's key differs)
        for layer in self.layers:
            x = layer(x)
        return x * 2


def _x():
    return (torch.randn(2, 3, 8),)


def test_same_layers_are_stamped_and_match_eager():
    torch.manual_seed(0)
    module = Stack(Block)
    _, report = export_both(module, _x())
    assert (report.templates, report.stamped) == (1, 3)
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())


class ByIndex(Block):
    """Every other layer doubles: its graph depends on its index."""

    def forward(self, x):
        y = self.lin(self.norm(x))
        if self.index % 2:
            y = y * 2
        return x + y


def test_layer_index_in_python_is_traced_per_kind():
    torch.manual_seed(0)
    _, report = export_both(Stack(ByIndex, n=5), _x())
    assert (report.templates, report.stamped) == (2, 3)


class ByConstant(Block):
    def forward(self, x):
        return x + self.lin(self.norm(x)) * (self.index + 1.0)


def test_per_layer_constant_is_never_stamped():
    torch.manual_seed(0)
    _, report = export_both(Stack(ByConstant), _x())
    assert report.stamped == 0


class Counting(Block):
    def __init__(self, width=8, index=0):
        super().__init__(width, index)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)
        return x + self.lin(self.norm(x))


def test_buffer_update_is_traced():
    torch.manual_seed(0)
    module = Stack(Counting)
    _, report = export_both(module, _x())
    assert report.stamped == 0
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())


class WithRegion(Block):
    def forward(self, x):
        with torch.no_grad():
            scale = x.abs().mean()
        return x + self.lin(self.norm(x)) * scale


def test_region_inside_is_traced():
    torch.manual_seed(0)
    _, report = export_both(Stack(WithRegion), _x())
    assert report.stamped == 0


class LayerDrop(Block):
    def forward(self, x):
        if random.random() < 0.0:  # never true, but a draw: eager's state moves
            return x
        return x + self.lin(self.norm(x))


def test_host_random_draw_is_traced_and_drawn_once_per_call():
    torch.manual_seed(0)
    module = Stack(LayerDrop)
    random.seed(0)
    with layer_reuse.reuse_layers(False):
        predispatch.export_predispatch(module, _x())
    expected = random.random()
    random.seed(0)
    _, report = export_both(module, _x())  # exports twice
    random.seed(0)
    with layer_reuse.reuse_layers(True):
        predispatch.export_predispatch(module, _x())
    assert random.random() == expected
    assert report.stamped == 0


class MutatedAfter(nn.Module):
    """The output of a stamped layer is updated in place afterwards."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(3))

    def forward(self, x):
        outs = [layer(x) for layer in self.layers]
        with torch.no_grad():
            outs[-1].mul_(2)
        return sum(outs)


def test_stamped_output_mutated_later_is_traced_again():
    torch.manual_seed(0)
    module = MutatedAfter()
    _, report = export_both(module, _x())
    assert report.stamped == 0  # the trace was made again without reuse
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())


def test_transformers_llama_is_stamped():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=64, vocab_size=64, num_hidden_layers=3,
                         attention_dropout=0.0, use_cache=False)
    model = LlamaForCausalLM(config).train()
    args = (torch.randint(0, 64, (2, 8)),)
    _, report = export_both(model, args)
    assert (report.templates, report.stamped) == (1, 2)


def test_option_is_validated():
    import pytest

    with pytest.raises(ValueError, match="True or False"):
        with layer_reuse.reuse_layers("yes"):
            pass


class RebindsByIndex(Block):
    """Layer 2 rebinds its buffer to a value every layer computes: the torch
    calls are the same, the state the module is left in is not."""

    def __init__(self, width=8, index=0):
        super().__init__(width, index)
        self.register_buffer("last", torch.zeros(width))

    def forward(self, x):
        y = self.lin(self.norm(x))
        mean = y.mean(dim=(0, 1))
        if self.index == 2:
            self.last = mean
        return x + y


def test_state_rebound_by_one_layer_is_traced():
    torch.manual_seed(0)
    module = Stack(RebindsByIndex)
    ep, report = export_both(module, _x())
    assert (report.templates, report.stamped) == (1, 2)  # layers 1 and 3 from layer 0; 2 traced
    assert [s.target for s in ep.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"] == [
        "layers.2.last"]


def test_hooked_layers_are_traced():
    torch.manual_seed(0)
    module = Stack(Block)
    seen = []
    handle = module.layers[1].lin.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    try:
        _, report = export_both(module, _x())
    finally:
        handle.remove()
    assert (report.templates, report.stamped) == (1, 2)  # layers 2 and 3 from 0; 1 traced
    assert len(seen) == 2  # once per export, with traced values, as without reuse


def test_dynamic_shapes_are_stamped():
    from predispatch.testing.eager import assert_matches_eager  # noqa: F811
    from torch.export import Dim

    torch.manual_seed(0)
    module = Stack(ByIndex, n=4)
    dims = ({0: Dim("b", min=2, max=16), 1: Dim("s", min=2, max=32)},)
    with layer_reuse.reuse_layers(False):
        plain = predispatch.export_predispatch(module, _x(), dynamic_shapes=dims)
    with layer_reuse.reuse_layers(True):
        reused = predispatch.export_predispatch(module, _x(), dynamic_shapes=dims)
        report = layer_reuse.last_report
    assert_same_program(plain, reused)
    assert (report.templates, report.stamped) == (2, 2)
    x = torch.randn(5, 7, 8)
    torch.testing.assert_close(reused.module()(x), module(x))


class ByIndexAndLeaf(Block):
    """Layer 2 doubles where its intermediate is a leaf, as a traced tensor
    is (the replay must see what the trace sees, or it would stamp it)."""

    def forward(self, x):
        y = self.lin(self.norm(x))
        if y.is_leaf and not y.requires_grad and self.index == 2:
            y = y * 2
        return x + y


def test_replay_sees_tensors_as_the_trace_does():
    torch.manual_seed(0)
    ep, report = export_both(Stack(ByIndexAndLeaf), _x())
    assert (report.templates, report.stamped) == (2, 2)


def test_dynamic_bert_is_stamped():
    """BERT with batch and sequence dynamic: the first layer makes the mask's
    and the inputs' sequence lengths one symbol, so its key differs from the
    later layers'; the third and fourth are stamped from the second, and the
    program is the one without reuse. (They were not: the check that the
    second's outputs can be made fresh popped the trace's pre-dispatch modes
    and pushed them back, after which its template read a size node made
    from a tensor of the first layer, which a copy cannot reproduce.)"""
    from torch.export import Dim
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=48, num_attention_heads=12, intermediate_size=192,
                                       num_hidden_layers=4, vocab_size=64, hidden_dropout_prob=0.0,
                                       attention_probs_dropout_prob=0.0)).train()
    ids = torch.randint(0, 64, (2, 8))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch, seq = Dim("batch", min=1, max=64), Dim("seq", min=2, max=512)
    dims = {name: {0: batch, 1: seq} for name in kwargs}
    with layer_reuse.reuse_layers(False):
        plain = predispatch.export_predispatch(model, (), kwargs, dynamic_shapes=dims)
    with layer_reuse.reuse_layers(True):
        reused = predispatch.export_predispatch(model, (), kwargs, dynamic_shapes=dims)
        report = layer_reuse.last_report
    assert_same_program(plain, reused)
    assert (report.templates, report.stamped) == (2, 2)
    ids = torch.randint(0, 64, (3, 11))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    torch.testing.assert_close(reused.module()(**inputs).loss, model(**inputs).loss)
