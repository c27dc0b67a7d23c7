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


def test_the_models_own_exception_surfaces_as_it_is():
    with pytest.raises(KeyError, match="the model's own error") as info:
        predispatch.export_predispatch(RaisesItsOwnError(), (torch.randn(3),))
    assert not isinstance(info.value, predispatch.ExportError)


def test_a_refusal_is_not_wrapped_again():
    class Seeds(torch.nn.Module):
        def forward(self, x):
            torch.manual_seed(0)
            return x * 2

    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(Seeds(), (torch.randn(3),))
    assert "torch failed while tracing" not in str(info.value)
    assert info.value.__cause__ is None


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
    # (re-exporting ep.module() is refused: see the next test)
    ep = assert_matches_eager(CastsACache(), (torch.randn(2, 6, dtype=torch.float64),), check_reexport=False)
    module = ep.module()
    module(torch.randn(2, 6, dtype=torch.float64))
    assert module.pe.dtype == torch.float64
    ep = predispatch.export_predispatch(CastsACache(), (torch.randn(2, 6, dtype=torch.float64),))
    with pytest.raises(predispatch.ExportError, match="rebinds a buffer to a tensor of another dtype"):
        predispatch.export_predispatch(ep.module(), (torch.randn(2, 6, dtype=torch.float64),))


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
    ep = assert_matches_eager(model, (torch.randn(2, 160),), inputs_require_grad=False, grad_modes=(True,),
                              check_reexport=False)
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
