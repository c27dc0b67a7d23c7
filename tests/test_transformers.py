"""Real Hugging Face transformers models, built from tiny configs, exported in
train mode.

Each test has the three checks of this area: equivalence with eager
(``assert_matches_eager``: outputs, input and parameter gradients, parameters
and buffers after, under grad mode on and off, and G7: re-exporting
``ep.module()`` gives the same graph), then structural facts read from the
program: G1 (no mutable op, nothing written back), G2 (truthful composites
such as ``aten.linear`` kept, no ``*_backward`` op) and G3 (exactly the
grad/autocast regions the model's source has, nested as in the source, each
holding the code of the module that opened it).

Region structure is asserted only on blocks the test puts in itself
(:func:`decorate_method` on a submodule): which blocks a model's source
happens to hold changes between transformers releases (5.24 dropped the
Llama-family rotary embedding's ``@torch.no_grad()``). A block the source
also has is nested in ours with the same state, so it is no region (G3) and
the asserted tree holds on either version.

Models are built from configs (no weights are downloaded) with a fixed seed
and every dropout probability 0.0, so eager and the program are
deterministic; ``test_dropout_in_train_mode_draws_the_same_masks`` is the one
exception and relies on the seed both runs share. Models return
``ModelOutput`` objects, which transformers registers as pytrees, so they are
exported as they are; ``Autocast`` wraps a model only to run it under an
ambient bf16 autocast.

Tolerances: torch.testing.assert_close's defaults (dtype-aware: 1.3e-6 / 1e-5
for float32, 1.6e-2 / 1e-5 for bfloat16). The program calls the same aten
kernels in the same order as eager (the kept composites run their eager
implementation), so outputs and gradients agree bit for bit on CPU, even under
bf16 autocast; looser tolerances would only hide a real divergence.
"""
import types

import pytest
import torch

from predispatch.ir.autograd_function_op import AUTOGRAD_FUNCTION
from predispatch.testing.eager import assert_matches_eager
from predispatch.testing.invariants import all_graph_modules

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 128, 2, 8
aten = torch.ops.aten
HOPS = (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast)
BF16 = ("cpu", torch.bfloat16, True, True)
OFF_BF16 = ("cpu", torch.bfloat16, False, True)  # an autocast-off block made with that dtype


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models make thousands of tiny kernel calls; on a busy 2-core
    machine a second OpenMP thread only adds stalls (this file: 63 s with one
    thread against 101 s with two, measured back to back)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --- models and inputs -------------------------------------------------------

def build(model_class, config):
    torch.manual_seed(0)
    model = model_class(config).train()
    assert model.training
    return model


def text_inputs(**extra):
    """Token ids and a mask that pads the end of the second sequence."""
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask, **extra}


def decoder_config(config_class, **kw):
    """A tiny Llama-style decoder: grouped-query attention, rotary embeddings."""
    return config_class(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        attention_dropout=0.0, use_cache=False, attn_implementation="sdpa",
                        bos_token_id=0, eos_token_id=1, pad_token_id=2, **kw)


class Autocast(torch.nn.Module):
    """Runs ``model`` under bf16 autocast, so its ``maybe_autocast(enabled=False)``
    blocks (which transformers elides when autocast is off) are really entered."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(**inputs)


def decorate_method(module, block, name="forward"):
    """Decorate ``module``'s method ``name`` with ``block`` (``torch.no_grad()``,
    an autocast), as ``@block`` on the method in the source would: a method
    of this instance only (a deepcopy of the model binds it to the copy)."""
    setattr(module, name, types.MethodType(block(getattr(type(module), name)), module))


def decorate_all(model, class_name, block, name="forward"):
    """``decorate_method`` on every submodule of class ``class_name``; their paths."""
    paths = {path for path, m in model.named_modules() if type(m).__name__ == class_name}
    for path in paths:
        decorate_method(model.get_submodule(path), block, name)
    return paths


def no_grad_rotary(model):
    """The rotary embedding computes cos/sin once for all layers; its forward
    under no_grad, whatever the release has."""
    (path,) = [p for p, m in model.named_modules() if p.endswith("rotary_emb")]
    decorate_method(model.get_submodule(path), torch.no_grad())
    return model


# --- reading the program -----------------------------------------------------

def region_tree(gm, depth=0):
    """[(depth, region submodule name, hop args)] in graph order, nested ones below."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in HOPS:
            sub = next(a for a in node.args if isinstance(a, torch.fx.Node))
            out.append((depth, sub.target, tuple(node.args[: node.args.index(sub)])))
            out += region_tree(getattr(gm, sub.target), depth + 1)
    return out


def region(ep, name):
    """The submodule of the region called ``name``, wherever it is nested."""
    return next(m for path, m in ep.graph_module.named_modules() if path.split(".")[-1] == name)


def ops(gm):
    """Targets called in ``gm`` and in every region below it."""
    return {n.target for m in all_graph_modules(gm) for n in m.graph.nodes if n.op == "call_function"}


def own_ops(gm):
    """Targets called in ``gm`` itself, not inside its regions."""
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


def source_modules(gm):
    """The module paths (innermost nn_module_stack entry) of ``gm``'s op nodes."""
    return {list(n.meta["nn_module_stack"].values())[-1][0]
            for n in gm.graph.nodes if n.op == "call_function" and n.meta.get("nn_module_stack")}


def check_program(ep, model, inputs, *, kept=(aten.linear.default,)):
    """Facts every model here shares."""
    targets = ops(ep.graph_module)
    for op in targets:  # G1
        assert not getattr(op, "_schema", None) or not op._schema.is_mutable, f"mutable op {op}"
        assert not str(op).endswith("_backward"), f"G2: {op} is below autograd"
    assert {s.kind.name for s in ep.graph_signature.output_specs} == {"USER_OUTPUT"}, \
        "nothing is mutated in these models, so nothing may be written back"
    assert set(kept) <= targets, f"G2: composites not kept: {set(kept) - targets}"
    assert set(ep.graph_signature.parameters) == {
        name for name, _ in model.named_parameters(remove_duplicate=False)}
    assert type(ep.module()(**inputs)) is type(model(**inputs)), "the ModelOutput class survives"


# --- encoders ----------------------------------------------------------------

def test_bert_masked_lm():
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model, inputs = build(transformers.BertForMaskedLM, config), text_inputs()
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default,
                                           aten.scaled_dot_product_attention.default))
    assert region_tree(ep.graph_module) == []


def test_distilbert_masked_lm():
    config = transformers.DistilBertConfig(
        vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, qa_dropout=0.0, seq_classif_dropout=0.0,
        attn_implementation="sdpa")
    model, inputs = build(transformers.DistilBertForMaskedLM, config), text_inputs()
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default,
                                           aten.scaled_dot_product_attention.default))
    assert region_tree(ep.graph_module) == []


def test_vit_model_gives_pixel_values_their_gradient():
    config = transformers.ViTConfig(
        image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, attn_implementation="sdpa")
    model = build(transformers.ViTModel, config)
    inputs = {"pixel_values": torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(0))}
    ep = assert_matches_eager(model, (), inputs)  # pixel_values requires grad: its gradient is compared
    check_program(ep, model, inputs, kept=(aten.conv2d.default, aten.linear.default,
                                           aten.layer_norm.default))
    assert region_tree(ep.graph_module) == []
    pixels = inputs["pixel_values"].clone().requires_grad_()
    out = ep.module()(pixel_values=pixels)
    assert set(out.keys()) == {"last_hidden_state", "pooler_output"}
    out.pooler_output.sum().backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0


# --- decoders ----------------------------------------------------------------

def gpt2_config(**kw):
    return transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0, **kw)


def test_gpt2_lm_head_keeps_its_tied_weights_tied():
    model = build(transformers.GPT2LMHeadModel, gpt2_config(attn_implementation="sdpa"))
    inputs = text_inputs(use_cache=False)
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default,
                                           aten.scaled_dot_product_attention.default))
    assert aten.addmm.default in ops(ep.graph_module)  # GPT-2's Conv1D calls torch.addmm
    assert region_tree(ep.graph_module) == []
    # the gradient comparison above already needs the tie: eager sums both uses into one .grad
    program = ep.module()
    assert program.lm_head.weight is program.transformer.wte.weight


def test_gpt2_upcast_attention_under_autocast():
    """reorder_and_upcast_attn computes q @ k in float32 with autocast off
    (transformers' own maybe_autocast(enabled=False) block, nested in ours):
    one autocast_off region per layer, nested in the wrapper's bf16 region."""
    model = build(transformers.GPT2LMHeadModel, gpt2_config(
        attn_implementation="eager", reorder_and_upcast_attn=True))
    decorate_all(model, "GPT2Attention", torch.autocast("cpu", OFF_BF16[1], enabled=False),
                 "_upcast_and_reordered_attn")
    model = Autocast(model)
    inputs = text_inputs(use_cache=False)
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default))
    assert region_tree(ep.graph_module) == [(0, "autocast_bfloat16_0", BF16),
                                            (1, "autocast_off_1", OFF_BF16), (1, "autocast_off_2", OFF_BF16)]
    for layer, name in enumerate(["autocast_off_1", "autocast_off_2"]):
        off = region(ep, name)
        assert aten.baddbmm.default in own_ops(off)
        assert source_modules(off) == {f"model.transformer.h.{layer}.attn"}
    assert aten.baddbmm.default not in own_ops(ep.graph_module.autocast_bfloat16_0)


LLAMA_LIKE = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
}


def llama_like(name):
    config_class, model_class, extra = LLAMA_LIKE[name]
    return build(model_class, decoder_config(config_class, **extra)), text_inputs(use_cache=False)


@pytest.mark.parametrize("name", sorted(LLAMA_LIKE))
def test_llama_like_models_as_released(name):
    """The models unchanged: equal to eager, and every region the program
    has holds code of the module that opened it (which ones the source has
    is the release's business)."""
    model, inputs = llama_like(name)
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default,
                                           aten.scaled_dot_product_attention.default))
    for _depth, sub, _args in region_tree(ep.graph_module):
        assert source_modules(region(ep, sub)) == {"model.rotary_emb"}


@pytest.mark.parametrize("name", sorted(LLAMA_LIKE))
def test_rotary_embedding_is_a_no_grad_region(name):
    """The rotary embedding's forward decorated @torch.no_grad(): one
    no_grad region (the model computes cos/sin once, for all layers) holding
    exactly the rotary module's code."""
    model, inputs = llama_like(name)
    ep = assert_matches_eager(no_grad_rotary(model), (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default,
                                           aten.scaled_dot_product_attention.default))
    assert region_tree(ep.graph_module) == [(0, "no_grad_0", (False,))]
    rotary = ep.graph_module.no_grad_0
    assert source_modules(rotary) == {"model.rotary_emb"}
    assert {aten.cos.default, aten.sin.default} <= own_ops(rotary)
    assert not {aten.cos.default, aten.sin.default} & own_ops(ep.graph_module)


def test_llama_under_autocast_nests_the_rotary_no_grad():
    model, inputs = llama_like("llama")
    model = Autocast(no_grad_rotary(model))
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs)
    assert region_tree(ep.graph_module) == [(0, "autocast_bfloat16_0", BF16), (1, "no_grad_1", (False,))]
    assert source_modules(ep.graph_module.autocast_bfloat16_0.no_grad_1) == {"model.model.rotary_emb"}


def test_llama_with_a_dynamic_batch():
    model, inputs = llama_like("llama")
    batch = torch.export.Dim("batch", min=1, max=16)
    dynamic = {k: {0: batch} if isinstance(v, torch.Tensor) else None for k, v in inputs.items()}
    ep = assert_matches_eager(model, (), inputs, dynamic_shapes=dynamic)
    assert len(ep.range_constraints) == 1
    for rows in ([1], [0, 1, 0, 1, 1]):
        other = {k: v[rows] if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
        torch.testing.assert_close(ep.module()(**other).logits, model(**other).logits)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_nemotron_layer_norm_1p_opens_autocast_off_regions(autocast):
    """NemotronLayerNorm1P computes its layer norm in float32, its forward
    under ``torch.autocast("cpu", torch.bfloat16, enabled=False)`` (transformers' own
    ``maybe_autocast(enabled=False)``, elided unless autocast is on, is then
    nested in it: no region of its own): under the bf16 wrapper, each of the
    2 * 2 + 1 layer norms is its own autocast_off region holding that
    layer norm's code, beside the rotary embedding's no_grad region. Without the
    wrapper they are top-level regions (the program may be called under
    autocast)."""
    model = no_grad_rotary(build(transformers.NemotronForCausalLM, decoder_config(
        transformers.NemotronConfig, hidden_dropout=0.0, partial_rotary_factor=0.5)))
    norms = decorate_all(model, "NemotronLayerNorm1P", torch.autocast("cpu", OFF_BF16[1], enabled=False))
    assert len(norms) == 5
    inputs = text_inputs(use_cache=False)
    model = Autocast(model) if autocast else model
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default))
    if autocast:
        norms = {f"model.{p}" for p in norms}
        assert region_tree(ep.graph_module) == [
            (0, "autocast_bfloat16_0", BF16), (1, "no_grad_1", (False,)),
            *[(1, f"autocast_off_{i}", OFF_BF16) for i in range(2, 7)]]
        assert aten.layer_norm.default not in own_ops(ep.graph_module.autocast_bfloat16_0)
    else:
        assert region_tree(ep.graph_module) == [
            (0, "no_grad_0", (False,)), *[(0, f"autocast_off_{i}", OFF_BF16) for i in range(1, 6)]]
        assert aten.layer_norm.default not in own_ops(ep.graph_module)
    offs = [region(ep, name) for _, name, _ in region_tree(ep.graph_module) if "off" in name]
    assert all(aten.layer_norm.default in own_ops(off) for off in offs)
    assert set().union(*map(source_modules, offs)) == norms


# --- encoder-decoders ----------------------------------------------------------

def seq2seq_inputs():
    return text_inputs(decoder_input_ids=text_inputs()["input_ids"][:, :6], use_cache=False)


def test_t5_conditional_generation():
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, attn_implementation="sdpa")
    model, inputs = build(transformers.T5ForConditionalGeneration, config), seq2seq_inputs()
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs)
    assert region_tree(ep.graph_module) == []
    out = ep.module()(**inputs)
    assert set(out.keys()) == {"logits", "encoder_last_hidden_state"}
    assert out.logits.shape == (BATCH, 6, VOCAB)


def test_bart_conditional_generation_keeps_shared_embeddings_tied():
    config = transformers.BartConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, classifier_dropout=0.0,
        encoder_layerdrop=0.0, decoder_layerdrop=0.0, use_cache=False, attn_implementation="sdpa")
    model, inputs = build(transformers.BartForConditionalGeneration, config), seq2seq_inputs()
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default,
                                           aten.scaled_dot_product_attention.default))
    assert region_tree(ep.graph_module) == []
    program = ep.module()
    assert program.lm_head.weight is program.model.shared.weight
    assert "final_logits_bias" in ep.graph_signature.buffers


# --- a custom autograd.Function in the model ----------------------------------

def function_calls(ep):
    """(path of the graph holding it, Function name, its backward subgraph) of
    every autograd Function op, nested ones included."""
    return [(path, node.kwargs["name"], getattr(m, node.args[1].target))
            for path, m in ep.graph_module.named_modules() if isinstance(m, torch.fx.GraphModule)
            for node in m.graph.nodes if node.target is AUTOGRAD_FUNCTION]


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16"])
def test_bloom_keeps_its_gelu_function_backward(autocast):
    """BLOOM's MLP calls ``GeLUFunction`` (a tanh GELU with a hand-written
    backward): each call is one op carrying the Function's forward and
    backward, the backward recomputing tanh as the source does (the
    derivative of the forward would read ``tanh_backward``)."""
    config = transformers.BloomConfig(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4,
                                      hidden_dropout=0.0, attention_dropout=0.0, use_cache=False)
    model, inputs = build(transformers.BloomForCausalLM, config), text_inputs()
    model = Autocast(model) if autocast else model
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs, kept=(aten.linear.default, aten.layer_norm.default))
    calls = function_calls(ep)
    assert [(path, name) for path, name, _ in calls] == [
        ("autocast_bfloat16_0" if autocast else "", "GeLUFunction")] * config.n_layer
    for _, _, backward in calls:
        assert aten.tanh.default in ops(backward) and aten.tanh_backward.default not in ops(backward)


# --- dropout that really drops --------------------------------------------------

def test_dropout_in_train_mode_draws_the_same_masks():
    """With p > 0 in train mode, the program's dropout draws from the global
    generator as eager does, so under the seed both runs share it gives the
    same outputs and gradients."""
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.1,
        attention_probs_dropout_prob=0.1, attn_implementation="eager")
    model, inputs = build(transformers.BertForMaskedLM, config), text_inputs()
    ep = assert_matches_eager(model, (), inputs)
    check_program(ep, model, inputs)
    assert aten.bernoulli.p in ops(ep.graph_module)  # eager's composite: x * bernoulli mask / (1-p)
    torch.manual_seed(1)
    first = ep.module()(**inputs).logits
    assert not torch.equal(first, ep.module()(**inputs).logits), "dropout is not a no-op"


@pytest.mark.parametrize("model_type", ["qwen3_next"])
def test_linear_attention_layers_are_stamped_and_match_eager(model_type):
    """Qwen3-Next interleaves chunked linear-attention layers (a triangular
    solve written row by row into a tensor of the layer's, a loop over
    64-token chunks) with full-attention ones: with two chunks and four
    layers of each kind alternating as its config does, every layer after
    the first of its kind is stamped, the program is the one traced without
    reuse, and it matches eager (train mode, gradients included). Qwen3.5's
    layers are its code again (transformers' modular copy): the sweep
    (tools/transformers_sweep.py) runs it."""
    import sys
    from pathlib import Path

    import predispatch
    from predispatch.testing import assert_same_program
    from predispatch.trace import layer_reuse

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    from transformers_sweep import model_class, tiny_config

    torch.manual_seed(0)
    config = tiny_config(model_type)
    text = getattr(config, "text_config", config)
    text.num_hidden_layers = 4
    text.layer_types = ["linear_attention", "full_attention"] * 2
    model = model_class(model_type)(text if model_type == "qwen3_5" else config).train()
    ids = torch.randint(0, text.vocab_size, (1, 128))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    # the program with reuse checked against eager in grad mode (the re-export and no_grad run
    # are other tests' to check), then against the one traced without reuse
    reused = assert_matches_eager(model, (), inputs, grad_modes=(True,), check_reexport=False)
    report = layer_reuse.last_report
    assert (report.templates, report.stamped) == (2, 2)
    with layer_reuse.reuse_layers(False):
        plain = predispatch.export_predispatch(model, (), inputs)
    assert_same_program(plain, reused)
