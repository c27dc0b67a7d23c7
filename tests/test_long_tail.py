"""The long tail of real models (issue 31): internal errors said as
ExportError, ``torch.vmap`` in the forward, buffers rebound to a tensor of
another shape or dtype.

Each construct has a minimal module compared with eager (outputs, gradients,
buffers after the call), the real model that met it where it is installed
(transformers' wav2vec2-conformer, timm's ConViT), and a test of what stays
refused, refused with a message naming the construct and the line.
"""
import pytest
import torch

import predispatch
from predispatch.testing.eager import assert_matches_eager

# ---------------------------------------------------------------- no raw torch error


class ReadsADataPointer(torch.nn.Module):
    """Runs in eager; a traced tensor has no data pointer: torch raises inside the trace."""

    def forward(self, x):
        y = x * 2
        return y + y.data_ptr() % 1


class RaisesItsOwnError(torch.nn.Module):
    def forward(self, x):
        if x.shape[0] == 3:
            raise KeyError("the model's own error")
        return x


def test_a_torch_error_inside_the_trace_is_an_export_error_naming_the_call_and_line():
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(ReadsADataPointer(), (torch.randn(3),))
    message = str(info.value)
    assert "data_ptr" in message and "return y + y.data_ptr() % 1" in message
    assert "test_long_tail.py" in message and "Cannot access data pointer" in message
    assert isinstance(info.value.__cause__, RuntimeError)
    assert not isinstance(info.value.__cause__, predispatch.ExportError)


def test_an_internal_error_in_a_later_stage_is_an_export_error(monkeypatch):
    import operator

    from predispatch.passes import regions

    monkeypatch.setattr(regions, "replace_blocks_with_regions", operator.itemgetter(0))  # a TypeError, in C
    with pytest.raises(predispatch.ExportError, match="the regions stage failed on it") as info:
        predispatch.export_predispatch(RaisesItsOwnError(), (torch.randn(2),))
    assert isinstance(info.value.__cause__, TypeError)
    # no line of the module's code was running: said so, with where it was raised
    assert str(info.value).startswith("the module at no line of its code (raised in ")
    assert "pipeline.py" in str(info.value)


class TakesNoneAndNumbers(torch.nn.Module):
    def forward(self, x, options, scale=None, offset=1):
        y = x * (2 if scale is None else scale) + offset
        return y if options["mask"] is None else y * options["mask"]


@pytest.mark.parametrize("options", [{"mask": None}, {"mask": None, "extra": None}])
def test_none_and_numbers_among_the_inputs(options):
    # a None leaf in the inputs (transformers' added_cond_kwargs={"resolution": None}) once made the
    # output-view search read None as a traced input, an internal TypeError
    ep = assert_matches_eager(TakesNoneAndNumbers(), (torch.randn(3), options), {"scale": None, "offset": 3})
    assert torch.equal(ep.module()(torch.ones(3), options, scale=None, offset=3), torch.full((3,), 5.0))


def test_the_models_own_exception_surfaces_as_it_is():
    with pytest.raises(KeyError, match="the model's own error") as info:
        predispatch.export_predispatch(RaisesItsOwnError(), (torch.randn(3),))
    assert not isinstance(info.value, predispatch.ExportError)


def test_a_refusal_is_not_wrapped_again():
    class Seeds(torch.nn.Module):
        def forward(self, x):
            torch.seed()  # a seed of the moment: refused
            return x * 2

    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(Seeds(), (torch.randn(3),))
    assert "torch failed while tracing" not in str(info.value)
    assert info.value.__cause__ is None


# ---------------------------------------------------------------- torch.vmap


class VmapsAForwardComputation(torch.nn.Module):
    """A vmapped function reading a parameter, a captured input and a grad block."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, y):
        def per_row(a, b):
            with torch.no_grad():
                scale = b.abs() + 1
            return (a * b).sum() + self.lin(a).sin() * scale

        return self.lin(torch.vmap(per_row, in_dims=(0, None))(x, y)) + torch.vmap(torch.outer)(x, x).sum(-1)


def _ops(ep) -> set:
    return {n.target for m in ep.graph_module.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function"}


def test_vmap_in_the_forward_is_traced_as_plain_ops():
    ep = assert_matches_eager(VmapsAForwardComputation(), (torch.randn(3, 4), torch.randn(4)))
    assert all(getattr(op, "namespace", "aten") in ("aten", "higher_order") or op.__module__ == "_operator"
               for op in _ops(ep)), _ops(ep)
    assert "vmap" not in ep.graph_module.code and "batch_dim" not in ep.graph_module.code


def test_transformers_vmapped_mask_matches_eager():
    masking_utils = pytest.importorskip("transformers.masking_utils")

    class SlidingWindowScores(torch.nn.Module):
        def forward(self, scores, attention_mask):
            mask = masking_utils.sdpa_mask(
                batch_size=scores.shape[0], q_length=scores.shape[-2], kv_length=scores.shape[-1],
                mask_function=masking_utils.and_masks(masking_utils.causal_mask_function,
                                                      masking_utils.sliding_window_overlay(3)),
                attention_mask=attention_mask, use_vmap=True, allow_is_causal_skip=False)
            return scores.masked_fill(~mask, -1e4).softmax(-1)

    attention_mask = torch.ones(2, 6, dtype=torch.bool)
    attention_mask[1, 4:] = False
    assert_matches_eager(SlidingWindowScores(), (torch.randn(2, 1, 6, 6), attention_mask))


def test_t5gemma2_with_its_vmapped_sliding_window_mask():
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "T5Gemma2Model"):
        pytest.skip("transformers without T5Gemma2")
    text = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, head_dim=8, max_position_embeddings=64, sliding_window=4,
                layer_types=["sliding_attention"], query_pre_attn_scalar=8)
    vision = dict(model_type="siglip_vision_model", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, image_size=16, patch_size=8)
    encoder = transformers.T5Gemma2EncoderConfig(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                                 boi_token_index=60, eoi_token_index=61, image_token_index=62)
    config = transformers.T5Gemma2Config(encoder=encoder, decoder=transformers.T5Gemma2DecoderConfig(**text),
                                         image_token_index=62)
    torch.manual_seed(0)

    class Hidden(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = transformers.T5Gemma2Model(config)

        def forward(self, input_ids, attention_mask, decoder_input_ids):
            out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                             decoder_input_ids=decoder_input_ids, use_cache=False)
            return out.last_hidden_state, out.encoder_last_hidden_state

    attention_mask = torch.ones(2, 8, dtype=torch.long)
    attention_mask[1, 6:] = 0
    args = (torch.randint(3, 50, (2, 8)), attention_mask, torch.randint(3, 50, (2, 5)))
    assert_matches_eager(Hidden(), args, inputs_require_grad=False, grad_modes=(True,), check_reexport=False)


class UpdatesACapturedBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("seen", torch.zeros(4))

    def forward(self, x):
        def per_row(a):
            self.seen.add_(1)
            return a * 2
        return torch.vmap(per_row)(x)


class UpdatesItsOwnTemporary(torch.nn.Module):
    def forward(self, x):
        def per_row(a):
            t = a * 2
            t.add_(1)
            return t
        return torch.vmap(per_row)(x)


class Squares(torch.autograd.Function):
    @staticmethod
    def forward(x):
        return x * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad

    @staticmethod
    def vmap(info, in_dims, x):
        return Squares.apply(x), in_dims[0]


class CallsAFunctionInsideVmap(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, 4))

    def forward(self, x):
        return torch.vmap(lambda a: Squares.apply(a * self.w))(x)


class DifferentiatesInsideVmap(torch.nn.Module):
    def forward(self, x):
        return torch.vmap(torch.func.grad(lambda a: a.sin().sum()))(x)


def test_an_update_of_its_own_temporary_inside_vmap_is_traced():
    assert_matches_eager(UpdatesItsOwnTemporary(), (torch.randn(3, 4),))



@pytest.mark.parametrize("module, construct, code", [
    (UpdatesACapturedBuffer(), r"in-place update \(aten.add_.Tensor\) inside a vmapped function", "self.seen.add_(1)"),
    (CallsAFunctionInsideVmap(), "autograd.Function Squares called inside a vmapped function",
     "Squares.apply("),
    (DifferentiatesInsideVmap(), "torch.func transform", "torch.func.grad("),
], ids=["captured update", "autograd.Function", "autograd inside"])
def test_what_vmap_cannot_hold_is_refused(module, construct, code):
    with pytest.raises(predispatch.ExportError, match=construct) as info:
        predispatch.export_predispatch(module, (torch.randn(3, 4),))
    assert code in str(info.value) and "test_long_tail.py" in str(info.value)


# ---------------------------------------------------------------- rebound buffers


class ExtendsACache(torch.nn.Module):
    """``self.pe = ...`` of another shape when the input is longer than the
    cache (wav2vec2-conformer's relative positions, ConViT's indices)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.arange(4.0).reshape(1, 4))
        self.lin = torch.nn.Linear(6, 4)

    def forward(self, x):
        if self.pe.shape[1] < x.shape[1]:
            self.pe = torch.arange(float(x.shape[1])).reshape(1, -1) * 0.5
        return self.lin(x.transpose(-1, -2) * self.pe[:, :x.shape[1]]).sum(-1)


class CastsACache(torch.nn.Module):
    """``self.pe = self.pe.to(x.dtype)`` (wav2vec2-conformer under autocast)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("pe", torch.arange(6.0).reshape(1, 6))
        self.w = torch.nn.Parameter(torch.ones(6, dtype=torch.float64))

    def forward(self, x):
        if self.pe.dtype != x.dtype:
            self.pe = self.pe.to(x.dtype)
        return x * self.pe * self.w


def test_a_buffer_rebound_to_another_shape_is_a_storage_swap():
    ep = assert_matches_eager(ExtendsACache(), (torch.randn(2, 6, 4),))
    assert [s.target for s in ep.graph_signature.output_specs if s.kind.name == "BUFFER_MUTATION"] == ["pe"]
    module = ep.module()
    module(torch.randn(2, 6, 4))
    assert module.pe.shape == (1, 6)


def test_a_buffer_rebound_to_another_dtype_takes_it():
    ep = assert_matches_eager(CastsACache(), (torch.randn(2, 6, dtype=torch.float64),))
    # exported again, ep.module() rebinds it too (issue 40)
    again = assert_matches_eager(ep.module(), (torch.randn(2, 6, dtype=torch.float64),))
    for program in (ep, again):
        module = program.module()
        module(torch.randn(2, 6, dtype=torch.float64))
        assert module.pe.dtype == torch.float64


class RebindsACacheToItsInputThenWritesIt(torch.nn.Module):
    """``self.b = x; self.b.mul_(2)``: eager writes the caller's ``x`` through the buffer."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3, 4))

    def forward(self, x):
        self.b = x
        self.b.mul_(2)
        return x + 0


def test_a_buffer_rebound_to_an_input_then_written_writes_the_input_back():
    ep = assert_matches_eager(RebindsACacheToItsInputThenWritesIt(), (torch.randn(3, 4),),
                              inputs_require_grad=True, inputs_with_history=True)
    written = {s.kind.name: s.target for s in ep.graph_signature.output_specs if s.kind.name.endswith("_MUTATION")}
    assert written == {"BUFFER_MUTATION": "b", "USER_INPUT_MUTATION": "x"}


def test_a_buffer_rebound_to_a_tensor_with_a_history_is_refused():
    class RebindsToAParameter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(2))
            self.w = torch.nn.Parameter(torch.ones(3))

        def forward(self, x):
            self.b = self.w * 2
            return x * self.b

    with pytest.raises(predispatch.ExportError, match=r"buffer 'b' .*self\.b = self\.w \* 2.*requires grad"):
        predispatch.export_predispatch(RebindsToAParameter(), (torch.randn(3),))


def test_a_buffer_rebound_to_its_own_bytes_as_another_dtype_is_refused():
    class ReinterpretsAnInput(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.ones(3))

        def forward(self, x):
            self.b = x.view(torch.int32)
            return x * 2

    with pytest.raises(predispatch.ExportError, match="buffer 'b' rebound to a tensor of another dtype that shares"):
        predispatch.export_predispatch(ReinterpretsAnInput(), (torch.randn(3),))

    class Reinterprets(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.ones(4))

        def forward(self, x):
            self.b = self.b.view(torch.int32)
            return x * 2

    with pytest.raises(predispatch.ExportError, match=r"buffer 'b' at .*self\.b = self\.b\.view\(torch\.int32\).* a view of its own memory"):
        predispatch.export_predispatch(Reinterprets(), (torch.randn(3),))


def _wav2vec2_conformer(max_source_positions: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2ConformerConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, position_embeddings_type="relative",
        max_source_positions=max_source_positions, conformer_conv_depthwise_kernel_size=3,
        hidden_dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        layerdrop=0.0, mask_time_prob=0.0)
    torch.manual_seed(0)
    return transformers.Wav2Vec2ConformerModel(config)


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_wav2vec2_conformer_extends_its_relative_positions(train):
    # 160 samples -> 15 frames, longer than the 4 positions cached: `self.pe = self.extend_pe(...)`
    model = _wav2vec2_conformer(max_source_positions=4).train(train)
    ep = assert_matches_eager(model, (torch.randn(2, 160),), inputs_require_grad=False,
                              grad_modes=(True,) if train else (True, False))
    assert "encoder.embed_positions.pe" in [s.target for s in ep.graph_signature.output_specs]


class Autocast(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x).last_hidden_state.float()


def test_wav2vec2_conformer_under_autocast_casts_its_relative_positions():
    # the cache is long enough; under bf16 autocast it is rebound to a bf16 copy
    model = Autocast(_wav2vec2_conformer(max_source_positions=64).eval())
    ep = assert_matches_eager(model, (torch.randn(2, 160),), inputs_require_grad=False, grad_modes=(True,))
    module = ep.module()
    module(torch.randn(2, 160))
    assert dict(module.named_buffers())["model.encoder.embed_positions.pe"].dtype == torch.bfloat16


@pytest.mark.parametrize("train", [True, False], ids=["train", "eval"])
def test_timm_convit_computes_its_relative_indices(train):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model("convit_tiny", pretrained=False, img_size=32, patch_size=8, embed_dim=16,
                              num_heads=2, depth=2, num_classes=3, local_up_to_layer=1).train(train)
    ep = assert_matches_eager(model, (torch.randn(2, 3, 32, 32),), grad_modes=(True,))
    assert "blocks.0.attn.rel_indices" in [s.target for s in ep.graph_signature.output_specs]


# ---------------------------------------------------------------- a layout picked at run time


class AttendsWithAMask(torch.nn.Module):
    """diffusers' attention (LTX-Video, Kandinsky 3): heads permuted in, attention with an additive
    float mask, heads permuted out and flattened."""

    def forward(self, q, k, v, mask):
        q, k, v = (x.permute(0, 2, 1, 3) for x in (q, k, v))
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return o.permute(0, 2, 1, 3).flatten(2, 3)


ATTENTION_INPUTS = (torch.randn(1, 6, 2, 8), torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8), torch.zeros(1, 2, 1, 5))


def test_a_view_of_a_layout_the_run_time_kernel_picks_is_a_reshape():
    # traced (no input requires grad), attention's fused kernel lays its output out so that the
    # flatten is a view; called with a mask that requires grad, its math kernel's contiguous output
    # is not viewable so: the program failed where eager runs, ep.module() and compile_training alike
    ep = assert_matches_eager(AttendsWithAMask(), ATTENTION_INPUTS)  # every input requiring grad
    assert torch.ops.aten.reshape.default in {n.target for n in ep.graph.nodes}
    args = [x.clone().requires_grad_() for x in ATTENTION_INPUTS]
    train = predispatch.compile_training(ep)
    train(*args).sum().backward()
    expected = [x.clone().requires_grad_() for x in ATTENTION_INPUTS]
    AttendsWithAMask()(*expected).sum().backward()
    for got, want in zip(args, expected):
        torch.testing.assert_close(got.grad, want.grad)


class ViewsAConvolutionsOutputWithMinusOne(torch.nn.Module):
    """timm's coatnet/maxvit attention (maxxvit.py): a 1x1 convolution's qkv, whose layout the
    run-time kernel picks (channels last, as its input), viewed with a -1."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Conv2d(8, 24, 1)

    def forward(self, x):
        return self.qkv(x).view(2, 2, 12, -1)


def test_a_view_with_minus_one_of_a_run_time_layout_exported_again_is_the_same_graph():
    # G7 (a helper's timm sweep, coatnet_nano_rw_224): the program's reshape kept the -1, and
    # exported again decomposed into a view of the inferred size, made a reshape of 16
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    ep = assert_matches_eager(ViewsAConvolutionsOutputWithMinusOne(), (x,))
    assert torch.ops.aten.reshape.default in {n.target for n in ep.graph.nodes}


# ---------------------------------------------------------------- no inputs


class TakesNoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(5))
        self.register_buffer("calls", torch.zeros(()))

    def forward(self):
        self.calls += 1
        return torch.arange(5.0) * self.w, torch.signal.windows.hann(4)


def test_a_module_called_without_inputs():
    # op_db's factories (arange, eye, signal.windows.*): ep.module() looked for the last input
    # to put its input checks after, and found none (IndexError)
    ep = assert_matches_eager(TakesNoInputs(), ())
    train = predispatch.compile_training(ep)
    train()[0].sum().backward()
    assert torch.equal(dict(train.named_parameters())["w"].grad, torch.arange(5.0))


# ---------------------------------------------------------------- torch.nn modules refused, said plainly


def test_a_lazy_module_not_yet_called_is_refused_saying_what_to_do():
    with pytest.raises(predispatch.ExportError, match=r"weight of LazyLinear is not initialized yet.*call the module once"):
        predispatch.export_predispatch(torch.nn.Sequential(torch.nn.LazyLinear(3)), (torch.randn(2, 4),))
    module = torch.nn.Sequential(torch.nn.LazyLinear(3))
    module(torch.randn(2, 4))  # its first call gives it its shapes: then it exports
    assert_matches_eager(module, (torch.randn(2, 4),))


def test_an_op_without_a_kernel_for_its_shape_is_refused_naming_torchs_line():
    # a torch.nn module exported as it is: its own code's line, the op, and why
    args = (torch.randn(50, 3, 15).log_softmax(2), torch.randint(1, 15, (3, 30)), torch.tensor([50, 50, 50]),
            torch.tensor([30, 25, 20]))
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(torch.nn.CTCLoss(), args)
    message = str(info.value)
    assert "aten._ctc_loss" in message and "functional.py" in message and "no fake kernel for its output" in message


# ---------------------------------------------------------------- requires_grad of a tensor the forward made


class BranchesOnAViewsRequiresGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        with torch.no_grad():
            frozen = self.w * 1
        scale = 2 if self.w.reshape(-1).requires_grad else 1  # a view of a parameter: True, as eager's
        shift = 3 if frozen.requires_grad else 0  # made under no_grad: False
        return x * self.w * scale + shift


def test_a_tensor_made_in_the_forward_requires_grad_as_eagers_does():
    # above autograd, a traced view of a parameter read requires_grad False, and the program took
    # the other branch; torch's LinearCrossEntropyLoss so baked "no weight gradient" into its op
    ep = assert_matches_eager(BranchesOnAViewsRequiresGrad(), (torch.randn(3),))
    assert torch.equal(ep.module()(torch.ones(3)), torch.full((3,), 2.0))
    if hasattr(torch.nn, "LinearCrossEntropyLoss"):
        torch.manual_seed(0)
        loss = torch.nn.LinearCrossEntropyLoss(5, 4, options=torch.nn.LinearCrossEntropyOptions())
        assert_matches_eager(loss, (torch.randn(8, 5), torch.randint(0, 4, (8,))), inputs_require_grad=False)


class FactoryOverwritten(torch.nn.Module):
    def forward(self, x):
        c = torch.ones(1, 2, 3)
        c.copy_(torch.ones(1, 2, 3) * 2)
        return c, x + 1


def test_a_factory_tensor_copy__overwrites_leaves_no_node_a_re_export_drops():
    """Was G7 (torch's test_autograd inference-mode copy_ test): the
    ``ones`` that ``copy_`` overwrites stayed as a dead node, which
    exporting ``ep.module()`` again does not make."""
    ep = assert_matches_eager(FactoryOverwritten(), (torch.ones(1, 2, 3),))
    assert [n.target for n in ep.graph.nodes].count(torch.ops.aten.ones.default) == 1


class Profiled(torch.nn.Module):
    def forward(self, x):
        with torch.profiler.record_function("block"):
            return x.sin()


def test_profiling_marks_are_dropped_as_torch_export_drops_them(tmp_path):
    """torch's export test test_profiling_code: the record_function ops stayed
    in the program with their C++ profiler object, and deepcopy, save,
    run_decompositions and a re-export failed on it."""
    ep = assert_matches_eager(Profiled(), (torch.randn(5, 5),))
    assert not [n for n in ep.graph.nodes if "profiler" in str(n.target)]
    torch.export.save(ep, tmp_path / "p.pt2")
    x = torch.randn(5, 5)
    assert torch.equal(torch.export.load(tmp_path / "p.pt2").module()(x), x.sin())
    ep.run_decompositions()


class RetainsGrad(torch.nn.Module):
    def forward(self, x):
        a = x.clone()
        a.retain_grad()
        a.mul_(2)
        b = a[1:]
        b.retain_grad()
        return a.sum() + b.sum()


def test_retain_grad_of_an_intermediate_is_no_op_of_the_program():
    """torch's test_autograd test_retain_grad_inplace: the traced tensor
    does not require grad, and torch's retain_grad raised; eager's keeps the
    intermediate's .grad, which changes no output or gradient."""
    assert_matches_eager(RetainsGrad(), (torch.randn(3),), grad_modes=(True,))
