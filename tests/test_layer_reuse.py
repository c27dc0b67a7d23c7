"""Layer reuse (predispatch/trace/layer_reuse.py): repeated layers traced once.

For each case: the program with reuse on is the program with reuse off, node
for node (op, arguments, value metadata, module stack, stack trace, torch
function, up to node names), it matches eager, and the report says which
calls were stamped: layers whose graph depends on anything outside the key
(their index, a per-layer constant, a buffer they update, a host random
draw, a region inside) are traced, never stamped.
"""
import collections
import random

import pytest

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


def assert_stamped_from_the_first(block):
    """Four layers of ``block``: the first traced, three stamped from it, the
    program the one without reuse (:func:`export_both`), and eager's results."""
    torch.manual_seed(0)
    module = Stack(block)
    _, report = export_both(module, _x())
    assert (report.templates, report.stamped) == (1, 3)
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())


def test_same_layers_are_stamped_and_match_eager():
    assert_stamped_from_the_first(Block)


class TwoPasses(Stack):
    """The layers run twice over (a looped model: transformers' Dory)."""

    def forward(self, x):
        x = x * self.scale
        for _ in range(2):
            for layer in self.layers:
                x = layer(x)
        return x * 2


def test_layers_called_again_are_stamped_with_their_modules_named_as_traced():
    """A second call of a layer is keyed ``layers.1@1``, the modules inside it
    ``layers.1.norm@1``: stamped from the first layer's second call, each
    node's module stack names them as the trace does (transformers' Dory
    differed here: ``layers.0.norm@1`` under ``layers.1@1``)."""
    torch.manual_seed(0)
    module = TwoPasses(Block)
    reused, report = export_both(module, _x())
    assert report.stamped == 6
    keys = {k for node in reused.graph.nodes for k in node.meta.get("nn_module_stack", {})}
    assert keys == {"L__self__"} | {f"L__self__layers.{i}{inner}{call}" for i in range(4)
                                    for inner in ("", ".norm", ".lin") for call in ("", "@1")}
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


def test_per_layer_constant_is_stamped_in_its_place():
    """The first layer is traced (the ops its torch calls dispatch show where
    the constant goes); the later ones are stamped with their own constant there."""
    torch.manual_seed(0)
    module = Stack(ByConstant)
    ep, report = export_both(module, _x())
    assert (report.templates, report.stamped) == (1, 3)
    scales = [n.args[1] for n in ep.graph.nodes if n.target == torch.ops.aten.mul.Tensor and type(n.args[1]) is float]
    assert scales == [1.0, 2.0, 3.0, 4.0]
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())


class Counting(Block):
    def __init__(self, width=8, index=0):
        super().__init__(width, index)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        self.seen.add_(1)
        return x + self.lin(self.norm(x))


def test_buffer_update_is_stamped():
    """Each stamped layer updates its own buffer, in the mode the template's
    update was made in (here grad mode: written back with grad)."""
    assert_stamped_from_the_first(Counting)


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


class Viewing(Block):
    """Makes a view of its output: a later update of the output replays it."""

    def forward(self, x):
        out = x + self.lin(self.norm(x))
        return out * out.view(-1).mean()  # "out" is not returned: its product is


class ViewingOutput(Block):
    def forward(self, x):
        out = x + self.lin(self.norm(x))
        out.view(-1)  # a view of the output, which a later update of it replays
        return out


class MutatedAfter(nn.Module):
    """The output of a stamped layer is updated in place afterwards."""

    def __init__(self, block=Block):
        super().__init__()
        self.layers = nn.ModuleList(block() for _ in range(3))

    def forward(self, x):
        outs = [layer(x) for layer in self.layers]
        with torch.no_grad():
            outs[-1].mul_(2)
        return sum(outs)


def test_stamped_output_mutated_later():
    """An update of a stamped layer's output is the update of a new value;
    where the layer made views of it, which the update replays in the trace
    without reuse, the trace is made again without reuse."""
    for block, stamped in ((Block, 2), (Viewing, 2), (ViewingOutput, 0)):
        torch.manual_seed(0)
        module = MutatedAfter(block)
        _, report = export_both(module, _x())
        assert report.stamped == stamped, block
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


def test_a_node_made_under_one_of_two_getters_of_one_name_is_placed_by_the_getter_recorded():
    """A node's ``torch_fn`` names its function by name and count only:
    ``Tensor.shape``'s and ``Tensor.dtype``'s getters are both ``__get__``,
    and a count both ranges of the call hold is ambiguous (a dynamic Llama's
    first layer was not a template for it, and its second was traced too);
    the function the node was made under, recorded while tracing, decides."""
    shape_get, dtype_get = torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__
    graph = torch.fx.Graph()
    node = graph.call_function(torch.ops.aten.sym_size.int, (graph.placeholder("x"), 1))
    node.meta["torch_fn"] = ("__get___14", f"{type(shape_get).__name__}.__get__")
    before, after = {shape_get: 7, dtype_get: 10}, {shape_get: 16, dtype_get: 16}
    assert layer_reuse._torch_fn_offsets([node], before, after, {}) is None
    assert layer_reuse._torch_fn_offsets([node], before, after, {node: shape_get}) == {node: (shape_get, 7)}
    assert layer_reuse._torch_fn_offsets([node], before, after, {node: dtype_get}) == {node: (dtype_get, 4)}


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
    and the inputs' sequence lengths one symbol (``s70 == s53``), after its
    key was written with both; the keys are written again once the shape env
    knows it, so the later three layers are stamped from the first, and the
    program is the one without reuse. (With the keys as first written, the
    second layer was traced too. Before that, none was: the check that the
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
    assert (report.templates, report.stamped) == (1, 3)
    ids = torch.randint(0, 64, (3, 11))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    torch.testing.assert_close(reused.module()(**inputs).loss, model(**inputs).loss)


# --- train mode: layers that draw random numbers, write their own values, update their state

class TrainBlock(nn.Module):
    """A layer as training runs it: dropout, an in-place write of its own
    intermediate or output, or a BatchNorm updating its running statistics."""

    def __init__(self, kind, width=8):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "masked":
            y.masked_fill_(y > 0.5, 0.0)  # its own intermediate, in grad mode
        elif self.kind == "output written":
            y.mul_(2)
            return y
        elif self.kind == "batch norm":
            y = self.bn(y)  # running statistics updated, hidden from autograd
        return self.drop(y) + x


class TrainStack(nn.Module):
    def __init__(self, kind, n=4, width=8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(TrainBlock(kind, width) for _ in range(n))

    def forward(self, x):
        x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return x


def _same_draws(ep, module, args, seed=5):
    """``ep.module()`` under a fixed seed draws what eager draws."""
    torch.manual_seed(seed)
    got = ep.module()(*args)
    torch.manual_seed(seed)
    want = module(*args)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kind", ["dropout", "masked", "output written", "batch norm"])
def test_train_mode_layers_are_stamped(kind):
    """Each stamped layer has its own random ops, in the order eager draws
    them; what a layer writes in grad mode or updates in its state is noted
    as the template's trace noted it (node for node the program without reuse)."""
    torch.manual_seed(0)
    module, args = TrainStack(kind).train(), (torch.randn(6, 8),)
    ep, report = export_both(module, args)
    assert (report.templates, report.stamped) == (1, 3)
    _same_draws(ep, module, args)
    for layer in module.layers:
        layer.drop.p = 0.0  # deterministic: compared with eager, buffers and gradients too
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, args)


def test_transformers_bert_in_train_mode_is_stamped():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig(hidden_size=32, num_attention_heads=4, intermediate_size=64,
                                       num_hidden_layers=4, vocab_size=64)).train()  # dropout 0.1
    ids = torch.randint(0, 64, (2, 8))
    ep, report = export_both(model, (ids,))
    assert (report.templates, report.stamped) == (1, 3)
    torch.manual_seed(5)
    got = ep.module()(ids).logits
    torch.manual_seed(5)
    assert torch.equal(got, model(ids).logits)


def test_transformers_resnet_in_train_mode_is_stamped():
    from transformers import ResNetConfig, ResNetModel

    torch.manual_seed(0)
    model = ResNetModel(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[3, 3],
                                     layer_type="basic")).train()
    args = (torch.randn(2, 3, 16, 16),)
    _, report = export_both(model, args)
    assert report.stamped == 3  # the later blocks of each stage (a stage's first one has its own shapes)
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(model, args)


# --- per-layer constants: stochastic depth's rates

def _drop_path(x, p, training):
    """Stochastic depth as timm and torchvision write it: a per-sample keep
    mask drawn with the layer's own rate."""
    if p == 0.0 or not training:
        return x
    keep = 1.0 - p
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask.div_(keep)


class RatedBlock(nn.Module):
    """A layer whose graph has its own float constant: a drop-path rate, a
    dropout probability, a distance's norm order (set per layer)."""

    def __init__(self, kind, rate, width=8):
        super().__init__()
        self.kind, self.rate = kind, rate
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        y = self.lin(x)
        if self.kind == "drop path":
            return x + _drop_path(y, self.rate, self.training)
        if self.kind == "dropout":
            return x + nn.functional.dropout(y, self.rate, self.training)
        return x + torch.cdist(y, y, self.rate) @ y  # composite: p=2 dispatches other ops


class RatedStack(nn.Module):
    def __init__(self, kind, rates, width=8):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.layers = nn.ModuleList(RatedBlock(kind, r, width) for r in rates)

    def forward(self, x):
        x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return x


def test_per_layer_drop_rates_are_stamped():
    """The first layer that draws is traced; the ops its torch calls dispatch
    show where the rate goes in the graph; later layers are stamped with their
    own rate there, drawing what eager draws."""
    torch.manual_seed(0)
    rates = [0.0, 0.05, 0.1, 0.15, 0.2, 0.25]  # the first layer draws nothing: its own template
    module, args = RatedStack("drop path", rates).train(), (torch.randn(6, 8),)
    ep, report = export_both(module, args)
    assert (report.templates, report.stamped) == (2, 4)
    bernoulli = [n.args[1] for n in ep.graph.nodes if n.target == torch.ops.aten.bernoulli.p]
    assert bernoulli == [1.0 - r for r in rates[1:]]
    _same_draws(ep, module, args)


class CoincidingRate(nn.Module):
    """A per-layer rate whose first value is also a constant of the layer's own."""

    def __init__(self, rate, width=8):
        super().__init__()
        self.rate = rate
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        y = self.lin(x)
        return x * self.rate + y * 0.5


def test_per_layer_constant_equal_to_another_constant_is_not_guessed():
    """The first layer's rate 0.5 is also the constant 0.5 of another op: which
    graph float is the rate cannot be read from one call, so the second layer
    is traced too (and the two show it); the rest are stamped."""
    torch.manual_seed(0)
    module = RatedStack("drop path", [])  # its scale first: every layer's input requires grad
    module.layers = nn.ModuleList(CoincidingRate(r) for r in (0.5, 0.7, 0.9, 1.1))
    ep, report = export_both(module, (torch.randn(3, 8),))
    assert (report.templates, report.stamped) == (2, 2)
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, (torch.randn(3, 8),))


def test_per_layer_constants_decomposed_otherwise_are_traced():
    """dropout(p) puts 1 - p in the graph through a decomposition other than
    the one its dispatch shows; cdist at p=2 decomposes otherwise than at p=1:
    those layers are traced (cdist at p=3 and 4 dispatches what p=1 does: stamped)."""
    torch.manual_seed(0)
    module, args = RatedStack("dropout", [0.1, 0.2, 0.3, 0.4]).train(), (torch.randn(6, 8),)
    ep, report = export_both(module, args)
    assert report.stamped == 0
    _same_draws(ep, module, args)
    module, args = RatedStack("distance", [1.0, 3.0, 2.0, 4.0]), (torch.randn(30, 8),)
    _, report = export_both(module, args)
    assert report.stamped == 2  # p=3 and p=4 dispatch what p=1 does
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, args)


class _Instantier(collections.OrderedDict):
    """transformers' ``ACT2FN``: each lookup makes a new module of the class stored."""

    def __getitem__(self, key):
        return super().__getitem__(key)()


_ACTIVATIONS = _Instantier(silu=nn.SiLU, prelu=nn.PReLU)  # a PReLU made has a parameter


class LooksUpItsActivation(Block):
    def forward(self, x):
        return x + _ACTIVATIONS["silu"](self.lin(self.norm(x)))


def test_a_layer_reading_a_dict_that_makes_a_module_per_lookup_is_stamped():
    """Saving the Python state the layer reaches reads the dict's items as
    stored: reading them through its ``__getitem__`` made a PReLU, whose new
    parameter the replay saw as a tensor from outside the layer (every
    linear-attention layer of Qwen3-Next was traced)."""
    assert_stamped_from_the_first(LooksUpItsActivation)


@torch.library.custom_op("predispatch_test::scaled", mutates_args=())
def _scaled(x: torch.Tensor, factor: float) -> torch.Tensor:
    return x * factor


@_scaled.register_fake
def _(x, factor):
    return torch.empty_like(x)


def _scaled_setup(ctx, inputs, output):
    ctx.factor = inputs[1]


_scaled.register_autograd(lambda ctx, grad: (grad * ctx.factor, None), setup_context=_scaled_setup)


class CallsACustomOp(Block):
    def forward(self, x):
        return x + _scaled(self.lin(self.norm(x)), 0.5)


def test_a_layer_calling_a_custom_op_is_stamped():
    """The custom op's node carries ``eager_input_vals`` (its inputs as eager
    gave them, for inductor), which a stamp copies: a stamp's are alike
    (Qwen3-Next's MoE layers call transformers' ``grouped_mm_fallback``)."""
    assert_stamped_from_the_first(CallsACustomOp)


class SolvesInPlace(Block):
    """The chunked delta rule's triangular solve (Qwen3-Next's linear
    attention): rows of a tensor the layer made written in place, in grad
    mode, each from rows written before it."""

    def forward(self, x):
        attn = torch.tril(self.lin(self.norm(x)) @ x.transpose(-1, -2), -1)
        for i in range(1, attn.shape[-1]):
            row, sub = attn[..., i, :i].clone(), attn[..., :i, :i].clone()
            attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        return x + attn @ x


def test_a_layer_writing_rows_of_its_own_tensor_in_a_loop_is_stamped():
    """Each row written is a view whose base is written again after: read at
    the end of the traced call, it is replayed from the base; those replays
    are nodes of the call (they were made after the template's nodes were
    taken, and no Qwen3-Next linear-attention layer was a template)."""
    assert_stamped_from_the_first(SolvesInPlace)


class ReadsGradMode(Block):
    """diffusers' blocks: ``if torch.is_grad_enabled() and self.gradient_checkpointing``."""

    gradient_checkpointing = False

    def forward(self, x):
        if torch.is_grad_enabled() and self.gradient_checkpointing:
            raise AssertionError("not taken")
        return x + self.lin(self.norm(x))


def test_a_layer_reading_the_grad_mode_is_stamped():
    """The read leaves a marker node (the regions stage reads where the code
    read the mode); a stamp in the same grad mode copies it, with the same
    code and offset (no diffusers transformer block was a template)."""
    assert_stamped_from_the_first(ReadsGradMode)


class DropsByIndex(Block):
    """Stochastic depth as timm builds it: an ``Identity`` at rate 0 (the
    first layer), a module of its own class elsewhere."""

    def __init__(self, width=8, index=0):
        super().__init__(width, index)
        self.drop = nn.Identity() if index == 0 else nn.Dropout(0.0)

    def forward(self, x):
        return x + self.drop(self.lin(self.norm(x)).relu())


def test_a_layer_with_other_submodules_is_not_replayed_with_the_others():
    """The first layer's submodules differ (its code does too): it is traced
    as a module of its own, not replayed to be compared with the others; the
    second is the template, the last two stamped."""
    torch.manual_seed(0)
    module = Stack(DropsByIndex)
    _, report = export_both(module, _x())
    assert (report.traced, report.templates, report.stamped) == (1, 1, 2)
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())


# --- blocks of one code at other sizes (layer_sizes)

class ConvBlock(nn.Module):
    """A CNN block: its own width, at the resolution its stage runs at; in
    train mode its own drop-path rate and batch-norm statistics updates."""

    def __init__(self, width, rate=0.0, flatten=False):
        super().__init__()
        self.conv = nn.Conv2d(width, width, 3, padding=1)
        self.norm = nn.BatchNorm2d(width)
        self.rate, self.flatten = rate, flatten

    def forward(self, x):
        y = torch.relu(self.norm(self.conv(x)))
        if self.flatten:  # aten makes the shape of a view: a number from the sizes in the graph
            y = torch.flatten(y, 1).sigmoid().view_as(y)
        return x + _drop_path(y, self.rate, self.training)


class Pyramid(nn.Module):
    """Stages of two blocks each, widths doubling as the resolution halves."""

    def __init__(self, widths=(4, 8, 16, 32), rates=None, strides=(2, 2, 2, 2), **block):
        super().__init__()
        rates = rates or [0.0] * 2 * len(widths)
        chans = (3, *widths)
        self.downs = nn.ModuleList(nn.Conv2d(a, b, 3, stride=s, padding=1) for a, b, s in zip(chans, widths, strides))
        self.stages = nn.ModuleList(nn.Sequential(*(ConvBlock(w, r, **block) for r in rates[2 * i:2 * i + 2]))
                                    for i, w in enumerate(widths))

    def forward(self, x):
        for down, stage in zip(self.downs, self.stages):
            x = stage(down(x))
        return x.mean()


@pytest.mark.parametrize("train", [True, False])
def test_blocks_of_other_sizes_are_stamped_from_one_template(train):
    """A stage's blocks share a key, another stage's do not (another width
    and resolution): the first two stages' first blocks are traced, which
    make a template of other sizes, and the later stages' first blocks are
    stamped from it, each node's value made at their sizes (each stage's
    second block stamped from its first): node for node the program without
    reuse, eager's results (the batch norms' running statistics included)."""
    torch.manual_seed(0)
    module, args = Pyramid().train(train), (torch.randn(2, 3, 64, 64),)
    ep, report = export_both(module, args)
    assert (report.templates, report.stamped, report.resized) == (2, 6, 2)
    widths = [n.meta["val"].shape[1] for n in ep.graph.nodes if n.target == torch.ops.aten.conv2d.default]
    assert widths == [4, 4, 4, 8, 8, 8, 16, 16, 16, 32, 32, 32]
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, args)


def test_blocks_of_other_sizes_and_drop_rates_are_stamped():
    """Each block its own drop-path rate too: the two traced show where the
    rate goes; the others are stamped at their sizes with their own rate,
    drawing what eager draws."""
    torch.manual_seed(0)
    rates = [0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4]  # not 0.5: bernoulli_'s default, which its dispatch leaves out
    module, args = Pyramid(rates=rates).train(), (torch.randn(2, 3, 64, 64),)
    ep, report = export_both(module, args)
    assert (report.templates, report.stamped, report.resized) == (2, 6, 2)
    bernoulli = [n.args[1] for n in ep.graph.nodes if n.target == torch.ops.aten.bernoulli.p]
    assert bernoulli == pytest.approx([1.0 - r for r in rates])
    _same_draws(ep, module, args)


@pytest.mark.parametrize("case", ["a size aten computes", "a size of one", "a size equal in both traced"])
def test_blocks_whose_sizes_the_template_cannot_tell_are_traced(case):
    """Stamped only where the two traced calls show the sizes are free:
    not where the graph holds a number made from a size (flatten's view),
    nor where a size becomes 1 (a kernel may take another path there), nor
    where a size that was equal in both changes (nothing showed it free).
    Such a stage's first block is traced, and with an earlier one makes
    another template; its second is stamped from it."""
    torch.manual_seed(0)
    if case == "a size aten computes":
        module, image, expected = Pyramid(flatten=True), 64, (4, 0)
    elif case == "a size of one":
        module, image, expected = Pyramid(), 16, (3, 1)  # the last stage at 1 x 1
    else:  # the first two stages at one resolution, the third at another
        module, image, expected = Pyramid(strides=(2, 1, 2, 2)), 64, (3, 1)
    module.train()
    ep, report = export_both(module, (torch.randn(2, 3, image, image),))
    assert (report.templates, report.resized) == expected
    assert report.stamped == 4 + report.resized
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, (torch.randn(2, 3, image, image),))


class NormAct(nn.Module):
    """A norm whose activation writes its output in place (timm's BatchNormAct2d)."""

    def __init__(self, width):
        super().__init__()
        self.norm = nn.BatchNorm2d(width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        return self.act(self.norm(x))


class SplitAfterNormAct(nn.Module):
    """timm's MixNet: the output of a stamped norm-activation split in two (a mixed convolution)."""

    def __init__(self, width=8):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(width, width, 1), NormAct(width)
        self.conv2, self.norm2 = nn.Conv2d(width, width, 3, padding=1, groups=width), NormAct(width)
        self.heads = nn.ModuleList(nn.Conv2d(width // 2, width, 1) for _ in range(2))

    def forward(self, x):
        y = self.norm2(self.conv2(self.norm1(self.conv1(x))))
        parts = torch.split(y, [4, 4], 1)
        return torch.cat([head(part) for head, part in zip(self.heads, parts)], 1)


@pytest.mark.parametrize("train", [True, False])
def test_an_output_written_in_place_is_stamped_as_written(train):
    """A layer's output its activation wrote in place is, in the trace, a
    written tensor: functionalization makes a later view of it again from it
    where it is read. A stamp's output is written as the template's was, so
    the program is the one without reuse (before, the stamp's output was a
    fresh tensor and the split stayed where it was called)."""
    torch.manual_seed(0)
    module, args = SplitAfterNormAct().train(train), (torch.randn(2, 8, 6, 6),)
    _, report = export_both(module, args)
    assert report.stamped == 1
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, args)
