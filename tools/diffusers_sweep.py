"""diffusers' models from tiny configs, each in train and eval mode, against eager.

    python tools/diffusers_sweep.py                 # every case (about 5 minutes on one core)
    python tools/diffusers_sweep.py ltx,kandinsky3  # some of them

Needs diffusers (the bench extra, ``pip install -c constraints.txt -e '.[bench]'``).
Each case builds a model class of ``diffusers`` (0.42.1) at a tiny size, from
the class's own constructor arguments (diffusers' test configs are not
installed), and runs ``predispatch.testing.assert_matches_eager`` on it:
outputs, gradients of inputs and parameters, buffers, in grad mode and under
no_grad, and the program exported again (G7). Every floating input requires
grad, as the kit makes them: a float attention mask too (LTX-Video's and
Kandinsky 3's, which found trace/run_time_layouts.py's case). A case ends
passed, refused (an ``ExportError``, its first line), failed (differs from
eager, or another exception), skipped (not built, or eager does not run it)
or timeout (120 s of CPU), as ``sweep_common`` prints them.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import sweep_common as common  # noqa: E402

import diffusers as D  # noqa: E402
from diffusers.models import embeddings as E  # noqa: E402,F401

import predispatch  # noqa: E402
from predispatch.testing import assert_matches_eager  # noqa: E402

LIMIT_S = 120


# ---------------------------------------------------------------- the cases: (model, args, kwargs)


def unet2d():
    m = D.UNet2DModel(sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
                      down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
                      norm_num_groups=8, attention_head_dim=8)
    return m, (torch.randn(2, 3, 16, 16), torch.tensor([3, 7])), {}
def unet2dcond():
    m = D.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8)
    return m, (torch.randn(2, 4, 16, 16), torch.tensor([10, 20]), torch.randn(2, 5, 16)), {}
def vae():
    m = D.AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8,
        layers_per_block=1)
    return m, (torch.randn(2, 3, 16, 16),), {"sample_posterior": False}
def vq():
    m = D.VQModel(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
        up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"), block_out_channels=(8, 16), latent_channels=4,
        norm_num_groups=8, layers_per_block=1, num_vq_embeddings=16, vq_embed_dim=4)
    return m, (torch.randn(2, 3, 16, 16),), {}
def tiny_ae():
    m = D.AutoencoderTiny(encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8), num_encoder_blocks=(1, 1),
                          num_decoder_blocks=(1, 1), latent_channels=4)
    return m, (torch.randn(2, 3, 16, 16),), {}
def dit():
    m = D.DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, num_layers=2,
                                sample_size=8, patch_size=2, num_embeds_ada_norm=10, norm_num_groups=4)
    return m, (torch.randn(2, 4, 8, 8),), {"timestep": torch.tensor([1, 2]), "class_labels": torch.tensor([0, 3])}
def pixart():
    m = D.PixArtTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2,
                                   sample_size=8, patch_size=2, cross_attention_dim=16, caption_channels=12, norm_num_groups=4)
    return m, (torch.randn(2, 4, 8, 8),), {"encoder_hidden_states": torch.randn(2, 5, 12), "timestep": torch.tensor([1, 2]),
                                           "added_cond_kwargs": {"resolution": None, "aspect_ratio": None}}
def sd3():
    m = D.SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
                                joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)
    return m, (torch.randn(2, 4, 8, 8),), {"encoder_hidden_states": torch.randn(2, 5, 16), "pooled_projections": torch.randn(2, 12),
                                           "timestep": torch.tensor([1, 2])}
def flux():
    m = D.FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=12, axes_dims_rope=(2, 2, 4))
    return m, (torch.randn(1, 16, 8),), {"encoder_hidden_states": torch.randn(1, 5, 16), "pooled_projections": torch.randn(1, 12),
            "timestep": torch.tensor([0.5]), "img_ids": torch.randn(16, 3), "txt_ids": torch.randn(5, 3)}
def unet1d():
    m = D.UNet1DModel(sample_size=32, in_channels=2, out_channels=2, block_out_channels=(8, 32, 32),
                      down_block_types=("DownBlock1DNoSkip", "DownBlock1D", "AttnDownBlock1D"),
                      up_block_types=("AttnUpBlock1D", "UpBlock1D", "UpBlock1DNoSkip"), mid_block_type="UNetMidBlock1D",
                      extra_in_channels=16, layers_per_block=1, time_embedding_type="fourier", use_timestep_embedding=False,
                      flip_sin_to_cos=True)
    return m, (torch.randn(2, 2, 32), torch.tensor([3, 7])), {}
def controlnet():
    m = D.ControlNetModel(in_channels=4, block_out_channels=(16, 32), layers_per_block=1, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                          cross_attention_dim=16, attention_head_dim=8, norm_num_groups=8, conditioning_embedding_out_channels=(8, 8))
    return m, (torch.randn(2, 4, 16, 16), torch.tensor([10, 20]), torch.randn(2, 5, 16), torch.randn(2, 3, 32, 32)), {}

#@@NEW@@
R = torch.randn
T = torch.tensor

def unet3d():
    m = D.UNet3DConditionModel(in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
        cross_attention_dim=16, attention_head_dim=8)
    return m, (R(1, 4, 2, 8, 8), T([10]), R(1, 5, 16)), {}
def svd_unet():
    m = D.UNetSpatioTemporalConditionModel(in_channels=8, out_channels=4,
        down_block_types=("CrossAttnDownBlockSpatioTemporal", "DownBlockSpatioTemporal"),
        up_block_types=("UpBlockSpatioTemporal", "CrossAttnUpBlockSpatioTemporal"), block_out_channels=(32, 32),
        addition_time_embed_dim=4, projection_class_embeddings_input_dim=12, layers_per_block=1, cross_attention_dim=16,
        num_attention_heads=(2, 2), num_frames=2)
    return m, (R(1, 2, 8, 8, 8), T([10.0]), R(1, 1, 16), R(1, 3)), {}
def unet_motion():
    m = D.UNetMotionModel(in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        up_block_types=("UpBlockMotion", "CrossAttnUpBlockMotion"), block_out_channels=(32, 32), layers_per_block=1,
        norm_num_groups=32, cross_attention_dim=16, num_attention_heads=2, motion_num_attention_heads=2, motion_max_seq_length=32,
        use_motion_mid_block=False)
    return m, (R(1, 4, 2, 8, 8), T([10]), R(2, 5, 16)), {}  # encoder states per frame (B*F)
def i2vgenxl():
    m = D.I2VGenXLUNet(in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock3D", "DownBlock3D"),
        up_block_types=("UpBlock3D", "CrossAttnUpBlock3D"), block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
        cross_attention_dim=16, attention_head_dim=8, num_attention_heads=2)
    return m, (R(1, 4, 2, 8, 8), T([10])), {"fps": T([8]), "image_latents": R(1, 4, 2, 8, 8), "image_embeddings": R(1, 16),
                                         "encoder_hidden_states": R(1, 5, 16)}
def uvit2d():
    m = D.UVit2DModel(hidden_size=32, cond_embed_dim=16, micro_cond_encode_dim=4, micro_cond_embed_dim=20, encoder_hidden_size=16,
        vocab_size=40, codebook_size=32, in_channels=16, block_out_channels=32, num_res_blocks=1, block_num_heads=2,
        num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, sample_size=4)
    return m, (torch.randint(0, 32, (1, 4, 4)), R(1, 5, 16), R(1, 16), R(1, 5)), {}
def hunyuandit():
    m = D.HunyuanDiT2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8, hidden_size=16,
        num_layers=2, cross_attention_dim=16, cross_attention_dim_t5=16, pooled_projection_dim=16, text_len=5, text_len_t5=6)
    rope = E.get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4), use_real=True)
    return m, (R(1, 4, 8, 8), T([10.0])), {"encoder_hidden_states": R(1, 5, 16), "text_embedding_mask": torch.ones(1, 5, dtype=torch.long),
        "encoder_hidden_states_t5": R(1, 6, 16), "text_embedding_mask_t5": torch.ones(1, 6, dtype=torch.long),
        "image_meta_size": T([[8., 8, 8, 8, 0, 0]]), "style": T([0]), "image_rotary_emb": rope}
def lumina_next():
    m = D.LuminaNextDiT2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_attention_heads=2,
        num_kv_heads=1, multiple_of=16, cross_attention_dim=16)
    rope = E.get_2d_rotary_pos_embed_lumina(16, 8, 8)
    return m, (R(1, 4, 8, 8), T([0.5]), R(1, 5, 16), torch.ones(1, 5, dtype=torch.long), rope), {"cross_attention_kwargs": {}}
def lumina2():
    m = D.Lumina2Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, hidden_size=32, num_layers=1, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(32, 32, 32), cap_feat_dim=16)
    return m, (R(1, 4, 8, 8), T([0.5]), R(1, 5, 16), torch.ones(1, 5, dtype=torch.bool)), {}
def cogvideox():
    m = D.CogVideoXTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4, time_embed_dim=8,
        text_embed_dim=16, num_layers=1, sample_width=8, sample_height=8, sample_frames=5, patch_size=2, max_text_seq_length=5)
    return m, (R(1, 2, 4, 8, 8), R(1, 5, 16), T([10])), {}
def allegro():
    m = D.AllegroTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        num_layers=1, cross_attention_dim=16, sample_height=8, sample_width=8, sample_frames=2, caption_channels=16)
    return m, (R(1, 4, 2, 8, 8), R(1, 5, 16), T([10])), {}
def ltx():
    m = D.LTXVideoTransformer3DModel(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, num_layers=1, caption_channels=16)
    return m, (R(1, 32, 8), R(1, 5, 16), T([10]), torch.ones(1, 5)), {"num_frames": 2, "height": 4, "width": 4}
def mochi():
    m = D.MochiTransformer3DModel(patch_size=2, num_attention_heads=2, attention_head_dim=8, num_layers=1, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=16, time_embed_dim=16, max_sequence_length=5)
    return m, (R(1, 4, 2, 8, 8), R(1, 5, 16), T([10]), torch.ones(1, 5)), {}
def wan():
    m = D.WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    return m, (R(1, 4, 2, 8, 8), T([10]), R(1, 5, 16)), {}
def skyreels():
    m = D.SkyReelsV2Transformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4,
        out_channels=4, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=1, rope_max_seq_len=32)
    return m, (R(1, 4, 2, 8, 8), T([10]), R(1, 5, 16)), {}
def sana():
    m = D.SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16, sample_size=8)
    return m, (R(1, 4, 8, 8), R(1, 5, 16), T([10])), {}
def auraflow():
    m = D.AuraFlowTransformer2DModel(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, out_channels=4,
        pos_embed_max_size=64)
    return m, (R(1, 4, 8, 8), R(1, 5, 16), T([10])), {}
def stable_audio():
    m = D.StableAudioDiTModel(sample_size=8, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        num_key_value_attention_heads=1, out_channels=4, cross_attention_dim=16, time_proj_dim=8, global_states_input_dim=16,
        cross_attention_input_dim=16)
    rope = E.get_1d_rotary_pos_embed(4, 9, use_real=True, repeat_interleave_real=False)
    return m, (R(1, 4, 8), T([10])), {"encoder_hidden_states": R(1, 5, 16), "global_hidden_states": R(1, 1, 16),
                                      "rotary_embedding": rope}
def prior():
    m = D.PriorTransformer(num_attention_heads=2, attention_head_dim=8, num_layers=1, embedding_dim=16, num_embeddings=5,
                           additional_embeddings=4)
    return m, (R(1, 16), T([10]), R(1, 16)), {"encoder_hidden_states": R(1, 5, 16), "attention_mask": torch.ones(1, 5, dtype=torch.bool)}
def t2i_adapter():
    m = D.T2IAdapter(in_channels=3, channels=[8, 16], num_res_blocks=1, downscale_factor=2, adapter_type="full_adapter")
    return m, (R(1, 3, 16, 16),), {}
def t2i_light():
    m = D.T2IAdapter(in_channels=3, channels=[8, 16], num_res_blocks=1, downscale_factor=2, adapter_type="light_adapter")
    return m, (R(1, 3, 16, 16),), {}
def vae_temporal():
    m = D.AutoencoderKLTemporalDecoder(block_out_channels=(32,), latent_channels=4)
    return m, (R(2, 3, 8, 8),), {"num_frames": 2}
def vae_cogvideox():
    m = D.AutoencoderKLCogVideoX(down_block_types=("CogVideoXDownBlock3D",) * 2, up_block_types=("CogVideoXUpBlock3D",) * 2,
        block_out_channels=(8, 16), latent_channels=4, layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=2)
    return m, (R(1, 3, 5, 16, 16),), {}
def vae_wan():
    m = D.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, attn_scales=[], temperal_downsample=[True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return m, (R(1, 3, 5, 16, 16),), {}
def consistency_vae():
    m = D.ConsistencyDecoderVAE(latent_channels=4, encoder_block_out_channels=(8, 16),
        encoder_down_block_types=("DownEncoderBlock2D",) * 2, encoder_layers_per_block=1, encoder_norm_num_groups=8,
        decoder_block_out_channels=(16, 32), decoder_down_block_types=("ResnetDownsampleBlock2D",) * 2,
        decoder_up_block_types=("ResnetUpsampleBlock2D",) * 2, decoder_layers_per_block=1, decoder_norm_num_groups=8,
        decoder_num_train_timesteps=1024)
    return m, (R(1, 3, 16, 16),), {}
def kandinsky3():
    m = D.Kandinsky3UNet(in_channels=4, time_embedding_dim=16, groups=4, attention_head_dim=8, layers_per_block=2,
        block_out_channels=(16, 32), cross_attention_dim=16, encoder_hid_dim=16)
    return m, (R(1, 4, 8, 8), T([10])), {"encoder_hidden_states": R(1, 5, 16), "encoder_attention_mask": torch.ones(1, 5)}
def stable_cascade():
    m = D.StableCascadeUNet(in_channels=4, out_channels=4, timestep_ratio_embedding_dim=8, conditioning_dim=16,
        block_out_channels=(16, 32), num_attention_heads=(2, 2), down_num_layers_per_block=(1, 1), up_num_layers_per_block=(1, 1),
        clip_text_pooled_in_channels=16, clip_seq=1, switch_level=[False])
    return m, (R(1, 4, 8, 8), T([0.5]), R(1, 1, 16)), {}
def hunyuan_video():
    m = D.HunyuanVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=2, text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(2, 2, 4))
    return m, (R(1, 4, 2, 8, 8), T([10]), R(1, 5, 16), torch.ones(1, 5, dtype=torch.bool), R(1, 8)), {"guidance": T([3.5])}
def cogview3():
    m = D.CogView3PlusTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        out_channels=4, text_embed_dim=16, time_embed_dim=16, condition_dim=4, pos_embed_max_size=8, sample_size=8)
    return m, (R(1, 4, 8, 8), R(1, 5, 16), T([10]), T([[8., 8]]), T([[8., 8]]), T([[0., 0]])), {}
def cogview4():
    m = D.CogView4Transformer2DModel(patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, text_embed_dim=16, time_embed_dim=16, condition_dim=4, pos_embed_max_size=8, sample_size=8,
        rope_axes_dim=(4, 4))
    return m, (R(1, 4, 8, 8), R(1, 5, 16), T([10]), T([[8., 8]]), T([[8., 8]]), T([[0., 0]])), {}
def chroma():
    m = D.ChromaTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4), approximator_num_channels=8,
        approximator_hidden_dim=16, approximator_layers=1)
    return m, (R(1, 16, 8),), {"encoder_hidden_states": R(1, 5, 16), "timestep": T([0.5]), "img_ids": R(16, 3), "txt_ids": R(5, 3)}
def qwenimage():
    m = D.QwenImageTransformer2DModel(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=(2, 2, 4))
    return m, (R(1, 16, 16),), {"encoder_hidden_states": R(1, 5, 16), "encoder_hidden_states_mask": torch.ones(1, 5),
        "timestep": T([0.5]), "img_shapes": [(1, 4, 4)]}
def latte():
    m = D.LatteTransformer3DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=1,
        cross_attention_dim=16, sample_size=8, patch_size=2, norm_type="ada_norm_single", caption_channels=16, video_length=2)
    return m, (R(1, 4, 2, 8, 8),), {"timestep": T([10]), "encoder_hidden_states": R(1, 5, 16)}
def transformer2d():
    m = D.Transformer2DModel(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=4, cross_attention_dim=16)
    return m, (R(1, 8, 4, 4),), {"encoder_hidden_states": R(1, 5, 16)}
def transformer2d_vq():
    m = D.Transformer2DModel(num_attention_heads=2, attention_head_dim=4, num_vector_embeds=9, sample_size=4, cross_attention_dim=16,
                             num_embeds_ada_norm=10, norm_type="ada_norm")
    return m, (torch.randint(0, 8, (1, 16)),), {"encoder_hidden_states": R(1, 5, 16), "timestep": T(3)}
def transformer_temporal():
    m = D.TransformerTemporalModel(num_attention_heads=2, attention_head_dim=4, in_channels=8, norm_num_groups=4)
    return m, (R(2, 8, 4, 4),), {"num_frames": 2}
def vae_dc():
    m = D.AutoencoderDC(in_channels=3, latent_channels=4, attention_head_dim=8, encoder_block_types=("ResBlock", "EfficientViTBlock"),
        decoder_block_types=("ResBlock", "EfficientViTBlock"), encoder_block_out_channels=(8, 16), decoder_block_out_channels=(8, 16),
        encoder_layers_per_block=(1, 1), decoder_layers_per_block=(1, 1), encoder_qkv_multiscales=((), (5,)),
        decoder_qkv_multiscales=((), (5,)), decoder_norm_types="rms_norm", decoder_act_fns="silu")
    return m, (R(1, 3, 16, 16),), {}
def vae_asym():
    m = D.AsymmetricAutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2, down_block_out_channels=(8, 16),
        up_block_types=("UpDecoderBlock2D",) * 2, up_block_out_channels=(8, 16), latent_channels=4, norm_num_groups=8)
    return m, (R(1, 3, 16, 16),), {}
def vae_oobleck():
    m = D.AutoencoderOobleck(encoder_hidden_size=8, downsampling_ratios=[2, 2], channel_multiples=[1, 2], decoder_channels=8,
        decoder_input_channels=4, audio_channels=2)
    return m, (R(1, 2, 16),), {}

NEW = [unet3d, svd_unet, unet_motion, i2vgenxl, uvit2d, hunyuandit, lumina_next, lumina2, cogvideox, allegro, ltx, mochi, wan,
       skyreels, sana, auraflow, stable_audio, prior, t2i_adapter, t2i_light, vae_temporal, vae_cogvideox, vae_wan, consistency_vae,
       kandinsky3, stable_cascade, hunyuan_video, cogview3, cogview4, chroma, qwenimage, latte, transformer2d, transformer2d_vq,
       transformer_temporal, vae_dc, vae_asym, vae_oobleck]

def unet2dcond_sdxl():
    m = D.UNet2DConditionModel(sample_size=16, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=16, attention_head_dim=(2, 4), norm_num_groups=8, use_linear_projection=True,
        transformer_layers_per_block=(1, 2), addition_embed_type="text_time", addition_time_embed_dim=4,
        projection_class_embeddings_input_dim=8 + 6 * 4)
    return m, (R(2, 4, 16, 16), T([10, 20]), R(2, 5, 16)), {"added_cond_kwargs": {"text_embeds": R(2, 8), "time_ids": R(2, 6)}}
def audioldm2_unet():
    m = D.AudioLDM2UNet2DConditionModel(in_channels=4, out_channels=4, down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), block_out_channels=(16, 32), layers_per_block=1, norm_num_groups=8,
        cross_attention_dim=16, attention_head_dim=8)
    return m, (R(1, 4, 8, 8), T([10]), R(1, 5, 16)), {}
def controlnet_xs():
    m = D.UNetControlNetXSModel(down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(16, 32), norm_num_groups=8, cross_attention_dim=16, num_attention_heads=2,
        ctrl_conditioning_embedding_out_channels=(8, 8), ctrl_block_out_channels=(4, 8), ctrl_num_attention_heads=1,
        ctrl_max_norm_num_groups=4)
    return m, (R(1, 4, 8, 8), T([10]), R(1, 5, 16)), {"controlnet_cond": R(1, 3, 16, 16)}
def sd3_controlnet():
    m = D.SD3ControlNetModel(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=12, out_channels=4, pos_embed_max_size=16)
    return m, (R(1, 4, 8, 8), R(1, 4, 8, 8)), {"encoder_hidden_states": R(1, 5, 16), "pooled_projections": R(1, 12),
                                            "timestep": T([1])}
def flux_controlnet():
    m = D.FluxControlNetModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=12, axes_dims_rope=[2, 2, 4])
    return m, (R(1, 16, 8), R(1, 16, 8)), {"encoder_hidden_states": R(1, 5, 16), "pooled_projections": R(1, 12),
            "timestep": T([0.5]), "img_ids": R(16, 3), "txt_ids": R(5, 3)}
def hunyuandit_controlnet():
    m = D.HunyuanDiT2DControlNetModel(conditioning_channels=4, num_attention_heads=2, attention_head_dim=8, in_channels=4,
        patch_size=2, sample_size=8, hidden_size=16, transformer_num_layers=4, cross_attention_dim=16, cross_attention_dim_t5=16,
        pooled_projection_dim=16, text_len=5, text_len_t5=6)
    rope = E.get_2d_rotary_pos_embed(8, ((0, 0), (4, 4)), (4, 4), use_real=True)
    return m, (R(1, 4, 8, 8), T([10.0]), R(1, 4, 8, 8)), {"encoder_hidden_states": R(1, 5, 16),
        "text_embedding_mask": torch.ones(1, 5, dtype=torch.long), "encoder_hidden_states_t5": R(1, 6, 16),
        "text_embedding_mask_t5": torch.ones(1, 6, dtype=torch.long), "image_meta_size": T([[8., 8, 8, 8, 0, 0]]),
        "style": T([0]), "image_rotary_emb": rope}
def sana_controlnet():
    m = D.SanaControlNetModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16, sample_size=8)
    return m, (R(1, 4, 8, 8), R(1, 5, 16), T([10]), R(1, 4, 8, 8)), {}
def t5film():
    m = D.T5FilmDecoder(input_dims=8, targets_length=8, d_model=16, num_layers=1, num_heads=2, d_kv=8, d_ff=32, dropout_rate=0.1)
    return m, ([(R(1, 5, 16), torch.ones(1, 5, dtype=torch.bool))], R(1, 8, 8), T([0.3])), {}
def sparse_controlnet():
    m = D.SparseControlNetModel(in_channels=4, conditioning_channels=4, down_block_types=("CrossAttnDownBlockMotion", "DownBlockMotion"),
        block_out_channels=(32, 32), layers_per_block=1, norm_num_groups=32, cross_attention_dim=16, attention_head_dim=8,
        conditioning_embedding_out_channels=(8, 8), motion_max_seq_length=32, motion_num_attention_heads=2)
    return m, (R(1, 4, 2, 8, 8), T([10]), R(2, 5, 16), R(1, 4, 2, 8, 8)), {"conditioning_mask": torch.ones(1, 1, 2, 8, 8)}
def cosmos():
    m = D.CosmosTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=12, num_layers=1,
        text_embed_dim=16, adaln_lora_dim=8, max_size=(4, 8, 8), patch_size=(1, 2, 2))
    return m, (R(1, 4, 2, 8, 8), T([0.5]), R(1, 5, 16)), {"padding_mask": torch.zeros(1, 1, 8, 8), "fps": 24}
def flux2():
    m = D.Flux2Transformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=8, axes_dims_rope=(2, 2, 2, 2))
    return m, (R(1, 16, 8),), {"encoder_hidden_states": R(1, 5, 16), "timestep": T([0.5]), "img_ids": R(1, 16, 4),
                              "txt_ids": R(1, 5, 4), "guidance": T([3.5])}
def sana_video():
    m = D.SanaVideoTransformer3DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_cross_attention_heads=2, cross_attention_head_dim=8, cross_attention_dim=16, caption_channels=16, sample_size=8,
        rope_max_seq_len=32)
    return m, (R(1, 4, 2, 8, 8), R(1, 5, 16), T([10])), {}
def wan_vace():
    m = D.WanVACETransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, rope_max_seq_len=32, vace_layers=[0], vace_in_channels=8)
    return m, (R(1, 4, 2, 8, 8), T([10]), R(1, 5, 16)), {"control_hidden_states": R(1, 8, 2, 8, 8),
                                                       "control_hidden_states_scale": T([1.0])}
def hunyuan_image():
    m = D.HunyuanImageTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, patch_size=(1, 1), text_embed_dim=16, rope_axes_dim=(4, 4))
    return m, (R(1, 4, 4, 4), T([10.0]), R(1, 5, 16), torch.ones(1, 5)), {}
def bria():
    m = D.BriaTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, axes_dims_rope=[2, 2, 4])
    return m, (R(1, 16, 8),), {"encoder_hidden_states": R(1, 5, 16), "timestep": T([0.5]), "img_ids": R(16, 3), "txt_ids": R(5, 3)}
def clip_image_proj():
    return D.CLIPImageProjection(hidden_size=16), (R(2, 16),), {}
def stable_audio_proj():
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel
    m = StableAudioProjectionModel(16, 16, 0.0, 10.0)
    return m, (), {"text_hidden_states": R(1, 5, 16), "start_seconds": T([0.0]), "end_seconds": T([5.0])}
def vae_mochi():
    m = D.AutoencoderKLMochi(encoder_block_out_channels=(32, 32), decoder_block_out_channels=(32, 32), latent_channels=4,
        layers_per_block=(1, 1, 1), temporal_expansions=(1,), spatial_expansions=(2,), add_attention_block=(False, False, False),
        latents_mean=(0.0,) * 4, latents_std=(1.0,) * 4)
    return m, (R(1, 3, 3, 16, 16),), {}
def vae_hunyuan_video():
    m = D.AutoencoderKLHunyuanVideo(latent_channels=4, down_block_types=("HunyuanVideoDownBlock3D",) * 3,
        up_block_types=("HunyuanVideoUpBlock3D",) * 3, block_out_channels=(8, 8, 16), layers_per_block=1, norm_num_groups=4,
        spatial_compression_ratio=4, temporal_compression_ratio=4)
    return m, (R(1, 3, 5, 16, 16),), {}
def vae_ltx():
    m = D.AutoencoderKLLTXVideo(latent_channels=8, block_out_channels=(8, 16), down_block_types=("LTXVideoDownBlock3D",) * 2,
        decoder_block_out_channels=(8, 16), layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        spatio_temporal_scaling=(True, False), decoder_spatio_temporal_scaling=(True, False),
        decoder_inject_noise=(False, False, False), downsample_type=("conv", "conv"), upsample_residual=(False, False),
        upsample_factor=(1, 1), patch_size=2, patch_size_t=1)
    return m, (R(1, 3, 3, 16, 16),), {}
def vae_allegro():
    m = D.AutoencoderKLAllegro(down_block_types=("AllegroDownBlock3D",) * 2, up_block_types=("AllegroUpBlock3D",) * 2,
        block_out_channels=(8, 16), temporal_downsample_blocks=(True, False), temporal_upsample_blocks=(False, True),
        latent_channels=4, layers_per_block=1, norm_num_groups=4, temporal_compression_ratio=2, sample_size=16)
    return m, (R(1, 3, 4, 16, 16),), {}
def vae_qwenimage():
    m = D.AutoencoderKLQwenImage(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return m, (R(1, 3, 5, 16, 16),), {}
def vae_magvit():
    m = D.AutoencoderKLMagvit(latent_channels=4, block_out_channels=[8, 16], down_block_types=["SpatialDownBlock3D", "SpatialTemporalDownBlock3D"],
        up_block_types=["SpatialUpBlock3D", "SpatialTemporalUpBlock3D"], layers_per_block=1, norm_num_groups=4)
    return m, (R(1, 3, 5, 16, 16),), {}

NEW2 = [unet2dcond_sdxl, audioldm2_unet, controlnet_xs, sd3_controlnet, flux_controlnet, hunyuandit_controlnet, sana_controlnet,
        t5film, sparse_controlnet, cosmos, flux2, sana_video, wan_vace, hunyuan_image, bria, clip_image_proj, stable_audio_proj,
        vae_mochi, vae_hunyuan_video, vae_ltx, vae_allegro, vae_qwenimage, vae_magvit]

def hidream():
    m = D.HiDreamImageTransformer2DModel(patch_size=2, in_channels=4, num_layers=1, num_single_layers=1, attention_head_dim=8,
        num_attention_heads=2, caption_channels=[16, 16], text_emb_dim=16, num_routed_experts=2, num_activated_experts=1,
        axes_dims_rope=(4, 2, 2), max_resolution=(8, 8), llama_layers=[0, 1])
    return m, (R(1, 4, 8, 8),), {"timesteps": T([10]), "encoder_hidden_states_t5": R(1, 5, 16),
        "encoder_hidden_states_llama3": R(2, 1, 5, 16), "pooled_embeds": R(1, 16)}
NEW3 = [hidream]
#@@NEW4@@

#@@RUNNER@@
CASES = [unet2d, unet2dcond, vae, vq, tiny_ae, dit, pixart, sd3, flux, unet1d, controlnet, *NEW, *NEW2, *NEW3]


# ---------------------------------------------------------------- running them


@dataclass(frozen=True)
class Case:
    model: str
    mode: str
    source: str = "diffusers"

    @property
    def name(self) -> str:
        return f"{self.model}-{self.mode}"


def run(build, mode: str) -> common.Result:
    case, start = Case(build.__name__, mode), time.process_time()

    def result(status, detail=""):
        return common.Result(case, status, detail, time.process_time() - start)

    try:
        with common.time_limit(LIMIT_S):
            torch.manual_seed(0)
            try:
                model, args, kwargs = build()
            except Exception as e:
                return result(common.SKIPPED, "not built: " + common.first_line(e))
            model.train(mode == "train")
            why = common.eager_runs(model, args, kwargs)
            if why:
                return result(common.SKIPPED, why)
            assert_matches_eager(model, args, kwargs, rtol=1e-4, atol=1e-5)
            return result(common.PASSED)
    except common.CaseTimeout as e:
        return result(common.TIMEOUT, str(e))
    except predispatch.ExportError as e:
        return result(common.TIMEOUT if common.timed_out() else common.REFUSED, common.first_line(e))
    except Exception as e:
        return result(common.TIMEOUT if common.timed_out() else common.FAILED, common.first_line(e))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("only", nargs="?", default="", help="comma-separated case names (default: all)")
    opts = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    only = {n for n in opts.only.split(",") if n}
    unknown = only - {b.__name__ for b in CASES}
    if unknown:
        parser.error(f"unknown case(s) {sorted(unknown)}; the cases: {', '.join(b.__name__ for b in CASES)}")
    start, results = time.time(), []
    for build in CASES:
        if only and build.__name__ not in only:
            continue
        for mode in ("train", "eval"):
            results.append(run(build, mode))
            r = results[-1]
            print(f"{r.case.name:28s} {r.status:8s} {r.seconds:5.1f}s {r.detail[:160]}", flush=True)
    common.print_table(results, time.time() - start)


if __name__ == "__main__":
    main()
