"""Hugging Face transformers' architectures, each built from a tiny config,
exported and compared with eager in train mode and under bf16 CPU autocast.

    python tools/transformers_sweep.py                          # every model type (hours on one core)
    python tools/transformers_sweep.py --only llama,bert --modes train
    python tools/transformers_sweep.py --limit 20 --json tf.json
    python tools/transformers_sweep.py --only detr,ibert --data-dependent specialize
    python tools/transformers_sweep.py --lane 0/2 --json a.json & python tools/transformers_sweep.py --lane 1/2 --json b.json
    python tools/transformers_sweep.py --summarize a.json,b.json   # the two lanes' records, one table

Every model type transformers registers with a model class (``MODEL_MAPPING``
and the task mappings), in this order: those with a causal LM head, a masked
LM head, a sequence-to-sequence LM head, then the rest. The model class is
the first of ``*ForCausalLM``, ``*ForMaskedLM``, ``*ForConditionalGeneration``
(seq2seq), the base ``*Model``. Its config is the config class's defaults
shrunk (no weights downloaded; transformers' own test configs are not
installed with it): every width 32, 2 layers, 4 heads (2 key/value heads),
feed-forward 64, vocabulary 128 (special token ids folded into it), 4
experts, lists of stage depths 1, per-layer lists (``layer_types``) of two
entries, images 32x32 (patches of 8), nested
configs (text, vision, audio, encoder, decoder, backbone) alike; layer drop
off (a branch on a random draw, refused by default: ``--data-dependent``);
dropout as the config has it (``assert_matches_eager`` seeds eager and the program
alike), ``use_cache=False``. The input is made from the forward's
parameters: ``input_ids`` (2x8, the second sequence padded by 2) with its
``attention_mask``, ``decoder_input_ids`` (2x4) for an encoder-decoder,
``pixel_values``, ``input_values`` (audio) or ``input_features``.

Modes: ``train`` (``model.train()``) and ``bf16`` (train mode, the forward
inside ``torch.autocast("cpu", torch.bfloat16)``: a region of the program).

Each case ends as ``passed``, ``roundoff`` (bf16 mode only: differs from
eager only where both are within bf16 round-off of the computation's scale:
every differing tensor's largest difference is under 2**-7 times the largest
magnitude of eager's outputs and gradients of that kind, e.g. a gradient
that is zero in exact arithmetic and a few ulps of the others' scale in
either run), ``refused`` (an ``ExportError``: its first line), ``failed``
(differs from eager, or a raw non-``ExportError`` exception: its type and
message), ``skipped`` (the config or model cannot be built, no input is
known for it, or eager fails on it) or ``timeout``. For every case that is
refused or fails, ``torch.export.export`` (non-strict) is tried on the same
module and input, and the record says whether it exports or the error it
raises, so that the refusals torch.export shares are told apart from ours.
The re-export check (G7) is off unless ``--reexport``: it doubles a case's
time.

``--data-dependent specialize`` exports with ``data_dependent="specialize"``
(no re-export check: a specialized program's re-export is not graph for
graph) and, where the example passes, calls the program on a fresh input
(another seed): it matches eager, or the program's check says the input
takes another branch (never a silently wrong result); for models with a
known input that takes another branch (``OTHER_BRANCH``), that input must
raise the check's error.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import inspect
import json
import logging
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

import predispatch
from predispatch.testing.eager import assert_matches_eager, assert_runs_match, run_module

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools.sweep_common
from tools.sweep_common import (  # noqa: E402
    FAILED, PASSED, REFUSED, SKIPPED, TIMEOUT, CaseTimeout, Result, eager_runs, first_line, print_table,
    time_limit, timed_out, write_json)

ROUNDOFF = "roundoff"
STATUSES = (PASSED, ROUNDOFF, REFUSED, FAILED, TIMEOUT, SKIPPED)
MODES = ("train", "bf16")
BATCH, SEQ, DECODER_SEQ, VOCAB, WIDTH, FFN, IMAGE, PATCH = 2, 8, 4, 128, 32, 64, 32, 8
BF16_EPS = 2.0 ** -7

# config attribute -> its tiny value (wherever the config or a nested one has it as an int)
TINY = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "embedding_size",
                     "word_embed_proj_dim", "emb_dim", "projection_dim", "text_embed_dim", "vision_embed_dim"), WIDTH),
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers", "decoder_num_hidden_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads", "decoder_num_attention_heads"), 4),
    **dict.fromkeys(("num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num"), 2),
    **dict.fromkeys(("head_dim", "d_kv", "kv_channels", "attention_head_size"), WIDTH // 4),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_intermediate_size",
                     "ffn_hidden_size"), FFN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "top_k", "moe_top_k"), 2),
    **dict.fromkeys(("vocab_size", "n_words", "src_vocab_size", "tgt_vocab_size"), VOCAB),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "mamba_d_head", "mamba_d_state",
                     "ssm_state_size", "state_size", "d_state"), 8),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank", "qk_head_dim"), 16),  # qk_head_dim: nope + rope
    "first_k_dense_replace": 1,  # of 2 layers: one dense, one mixture of experts
    "num_kv_shared_layers": 0,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8,  # Gemma 3n/4 per-layer inputs
    **dict.fromkeys(("rotary_dim", "time_step_rank"), 4),
    "mamba_n_heads": 8,
    "subsampling_conv_channels": 8,  # x 8 = the inner width 64 (expand 2 x 32)
    "image_size": IMAGE,
    "patch_size": PATCH,
}
CAPPED = {"max_position_embeddings": 512, "n_positions": 512, "max_source_positions": 512,
          "max_target_positions": 512}
# what a model's default config lacks to build
CONFIG_KWARGS = {"dbrx": {"attn_config": {"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0}},
                 "reformer": {"is_decoder": True, "axial_pos_embds_dim": [16, 16], "axial_pos_shape": [2, 4],
                              "local_attn_chunk_length": 4, "lsh_attn_chunk_length": 4, "num_buckets": 2}}
# speech models whose input_features are (batch, time, mel bins), not (batch, mel bins, time)
TIME_MAJOR_FEATURES = {"canary", "parakeet_ctc", "parakeet_encoder", "lasr_ctc", "lasr_encoder"}
HEADS = ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
         "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_MAPPING_NAMES")


@dataclasses.dataclass(frozen=True)
class Case:
    model: str  # transformers' model type ("llama", "bert", ...)
    mode: str  # "train" | "bf16"
    source: str = "transformers"

    @property
    def name(self) -> str:
        return f"{self.model}:{self.mode}"


class Autocast(torch.nn.Module):
    """The model's forward under bf16 CPU autocast (a region of the program)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(**inputs)


# --- the model and its input ---------------------------------------------------

def model_types() -> list[str]:
    """Every model type with a model class, causal LMs first, then masked LMs, seq2seq LMs, the rest."""
    from transformers.models.auto import modeling_auto
    order = {}
    for rank, mapping in enumerate(HEADS):
        for name in getattr(modeling_auto, mapping):
            order.setdefault(name, rank)
    for mapping in dir(modeling_auto):
        if mapping.startswith("MODEL_FOR") and mapping.endswith("MAPPING_NAMES"):
            for name in getattr(modeling_auto, mapping):
                order.setdefault(name, len(HEADS))
    return sorted(order, key=lambda name: (order[name], name))


def model_class(model_type: str):
    import transformers
    from transformers.models.auto import modeling_auto
    for mapping in HEADS:
        name = getattr(modeling_auto, mapping).get(model_type)
        if isinstance(name, (tuple, list)):
            name = name[0]
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    raise LookupError(f"no model class for {model_type!r}")


def _sub_configs(config):
    from transformers import PretrainedConfig
    for value in vars(config).values():
        if isinstance(value, PretrainedConfig):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, PretrainedConfig))


def _tiny_value(name: str, value):
    if name in TINY and isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return min(value, TINY[name]) if name in ("num_experts_per_tok", "top_k", "moe_top_k") else TINY[name]
    if name in CAPPED and isinstance(value, int) and value > CAPPED[name]:
        return CAPPED[name]
    if name in ("depths", "num_layers") and isinstance(value, (list, tuple)) and all(isinstance(v, int) for v in value):
        return [1] * len(value)
    if name in ("hidden_sizes", "embed_dims", "hidden_dims") and isinstance(value, (list, tuple)):
        return [16 * 2 ** i for i in range(len(value))]
    if name in ("num_heads", "num_attention_heads") and isinstance(value, (list, tuple)):
        return [2] * len(value)
    if name.endswith(("_token_id", "_token_index")) and isinstance(value, int) and value >= VOCAB:
        return 3 + value % (VOCAB - 3)
    if name == "use_cache":
        return False
    if name in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop") and value:
        return 0.0  # a branch on a random draw: refused by default, as torch.export fails on it
    return value


LAYER_COUNTS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers")


def _per_layer(value, layers) -> bool:
    return isinstance(value, (list, tuple)) and isinstance(layers, int) and layers > 2 and len(value) == layers


def _two_layers(value):
    """The first layer's entry and the first that differs from it (a pattern's full-attention layer)."""
    return type(value)([value[0], next((v for v in value if v != value[0]), value[-1])])


def shrink(config, seen=None):
    """``config`` and its nested configs with the tiny sizes, in place. A
    list with an entry per layer (``layer_types``...) keeps its first and
    the first that differs (a sliding-window pattern's full-attention layer)."""
    seen = seen if seen is not None else set()
    if id(config) in seen:
        return config
    seen.add(id(config))
    layers = next((getattr(config, n) for n in LAYER_COUNTS if isinstance(getattr(config, n, None), int)), None)
    for name, value in list(vars(config).items()):
        tiny = _two_layers(value) if _per_layer(value, layers) else _tiny_value(name, value)
        if tiny is not value:
            try:
                setattr(config, name, tiny)
            except Exception:  # a read-only property of the config
                pass
    if getattr(config, "kv_lora_rank", None) and getattr(config, "num_key_value_heads", None):
        config.num_key_value_heads = config.num_attention_heads  # latent attention: a key and value per head
    for sub in _sub_configs(config):
        shrink(sub, seen)
    return config


def tiny_config(model_type: str):
    from transformers import CONFIG_MAPPING
    kwargs = CONFIG_KWARGS.get(model_type, {})
    try:  # a backbone from transformers' own classes, not timm's, and no weights downloaded
        config = CONFIG_MAPPING[model_type](use_timm_backbone=False, use_pretrained_backbone=False, **kwargs)
    except Exception:
        config = CONFIG_MAPPING[model_type](**kwargs)
    return shrink(config)


def _ids(shape, vocab, seed):
    return torch.randint(3, max(vocab, 4), shape, generator=torch.Generator().manual_seed(seed))


def _vision_config(config):
    return getattr(config, "vision_config", None) or config


def _image_size(config) -> int:
    size = getattr(_vision_config(config), "image_size", IMAGE)
    return size[0] if isinstance(size, (list, tuple)) else int(size)


def make_inputs(model, config, seed: int = 0) -> dict:
    """The forward's main input (and the masks and decoder ids that go with it)."""
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    g = torch.Generator().manual_seed(seed)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", VOCAB) or VOCAB
    inputs = {}
    if main == "input_ids" or ("input_ids" in params and main not in params):
        inputs["input_ids"] = _ids((BATCH, SEQ), vocab, seed)
        if "attention_mask" in params:
            inputs["attention_mask"] = torch.ones(BATCH, SEQ, dtype=torch.long)
            inputs["attention_mask"][1, -2:] = 0
    elif main == "pixel_values":
        channels = getattr(_vision_config(config), "num_channels", 3)
        size = _image_size(config)
        inputs["pixel_values"] = torch.randn(BATCH, channels, size, size, generator=g)
    elif main == "input_values":
        inputs["input_values"] = torch.randn(BATCH, 4000, generator=g)
    elif main == "input_features":
        audio = getattr(config, "encoder_config", None) or config
        bins = getattr(audio, "num_mel_bins", None) or getattr(audio, "feature_size", 80)
        shape = (BATCH, 64, bins) if config.model_type in TIME_MAJOR_FEATURES else (BATCH, bins, 64)
        inputs["input_features"] = torch.randn(*shape, generator=g)
    else:
        raise LookupError(f"no input known for {main!r}")
    if "global_attention_mask" in params and "input_ids" in inputs:  # Longformer, LED: none global
        inputs["global_attention_mask"] = torch.zeros_like(inputs["input_ids"])
    if getattr(config, "is_encoder_decoder", False) and "decoder_input_ids" in params:
        inputs["decoder_input_ids"] = _ids((BATCH, DECODER_SEQ), vocab, seed + 100)
    if "use_cache" in params:
        inputs["use_cache"] = False
    return inputs


def build(case: Case, seed: int = 0):
    """(module in the case's mode, its input)."""
    config = tiny_config(case.model)
    cls = model_class(case.model)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = cls(config).train()
    inputs = make_inputs(model, config, seed)
    return (Autocast(model) if case.mode == "bf16" else model), inputs, config


# --- a case --------------------------------------------------------------------

def _max_abs(tensors) -> float:
    return max((t.detach().abs().float().max().item() for t in tensors
                if isinstance(t, torch.Tensor) and t.is_floating_point() and t.numel()), default=0.0)


def within_roundoff(model, inputs, ep) -> str:
    """'' if eager and ``ep`` differ only by bf16 round-off of the computation's
    scale, with grad mode on: each differing tensor's largest difference
    under ``BF16_EPS`` times eager's largest magnitude among the tensors of
    its kind (outputs, gradients, parameters and buffers after), else the
    first difference beyond."""
    from predispatch.testing.eager import _fresh_module  # the testing kit's copy of ep.module()
    eager, program = run_module(copy.deepcopy(model), (), inputs), run_module(_fresh_module(ep), (), inputs)
    kinds = {"outputs": (eager.outputs, program.outputs),
             "gradients": ([*eager.input_grads, *eager.param_grads.values()],
                           [*program.input_grads, *(program.param_grads.get(n) for n in eager.param_grads)]),
             "state after": ([*eager.params.values(), *eager.buffers.values()],
                             [*(program.params.get(n) for n in eager.params),
                              *(program.buffers.get(n) for n in eager.buffers)])}
    for kind, (mine, theirs) in kinds.items():
        scale = _max_abs(mine)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            if not isinstance(a, torch.Tensor) or not a.is_floating_point():
                continue
            if not isinstance(b, torch.Tensor) or a.shape != b.shape:
                return f"{kind} {i}: {type(b).__name__} in the program"
            diff = (a.float() - b.float()).abs().nan_to_num(float("inf")).max().item() if a.numel() else 0.0
            if diff > BF16_EPS * scale:
                return f"{kind} {i}: differs by {diff:.3g} > 2**-7 x {scale:.3g}"
    return ""


def torch_export_says(model, inputs, timeout: int) -> str:
    """What ``torch.export.export`` (non-strict) does on the same case: 'exports' or its error."""
    logging.disable(logging.ERROR)  # torch.export logs the graph it stopped in
    try:
        with time_limit(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.export.export(copy.deepcopy(model), (), copy.deepcopy(inputs), strict=False)
        return "exports"
    except CaseTimeout:
        return "timeout"
    except Exception as e:
        return first_line(e)[:200]
    finally:
        logging.disable(logging.NOTSET)


def _specialize_checks(model, inputs, ep, case: Case) -> dict:
    """A fresh input through the specialized program, and an input taking another branch."""
    from predispatch.ir.assumptions import assumptions
    out = {"assumptions": sorted({a.code for a in assumptions(ep)})}
    fresh = make_inputs(model.model if case.mode == "bf16" else model, build_config_of(model), seed=1)
    out["fresh"] = _fresh_outcome(model, fresh, ep)
    other = OTHER_BRANCH.get(case.model)
    if other:
        try:
            ep.module()(**other(fresh))
            out["other_branch"] = "ran: no check fired"
        except Exception as e:
            out["other_branch"] = "clear error" if "data-dependent branch" in str(e) else "raw: " + first_line(e)
    return out


def build_config_of(model):
    return (model.model if isinstance(model, Autocast) else model).config


def _fresh_outcome(model, fresh, ep) -> str:
    try:
        assert_matches_eager(model, (), fresh, export=lambda *a, **k: ep, check_reexport=False)
        return "matches eager"
    except RuntimeError as e:
        if "data-dependent branch" in str(e):
            return "takes another branch: clear error"
        return "raw: " + first_line(e)
    except AssertionError as e:
        return "differs: " + first_line(e)


def _pixels_with_inf(inputs):
    inputs = dict(inputs)
    inputs["pixel_values"] = inputs["pixel_values"].clone()
    inputs["pixel_values"][0, 0, 0, 0] = float("inf")
    return inputs


def _global_attention(inputs):
    inputs = dict(inputs, global_attention_mask=inputs["global_attention_mask"].clone())
    inputs["global_attention_mask"][0, 0] = 1
    return inputs


def _decoder_pad_token(inputs):
    """FSMT: ``if not padding_mask.any():`` on the decoder's ids (its pad token: 1)."""
    inputs = dict(inputs, decoder_input_ids=inputs["decoder_input_ids"].clone())
    inputs["decoder_input_ids"][0, -1] = 1
    return inputs


# an input that takes another branch than the sweep's example does, where one is known
OTHER_BRANCH = {"detr": _pixels_with_inf, "table-transformer": _pixels_with_inf, "deformable_detr": _pixels_with_inf,
                "longformer": _global_attention, "led": _global_attention, "fsmt": _decoder_pad_token}


def run_case(case: Case, *, timeout: int, max_params: int, data_dependent: str, reexport: bool,
             show_traceback=False) -> Result:
    try:
        model, inputs, _ = build(case)
    except Exception as e:
        return Result(case, SKIPPED, "build: " + first_line(e))
    params = sum(p.numel() for p in model.parameters())
    if params > max_params:
        return Result(case, SKIPPED, f"{params / 1e6:.1f}M parameters > --max-params", params=params)
    why_not = eager_runs(model, (), inputs)
    if why_not:
        return Result(case, SKIPPED, why_not, params=params)
    result = _export_and_compare(case, model, inputs, timeout, data_dependent, reexport, show_traceback)
    result.params = params
    if result.status in (REFUSED, FAILED):
        result.extra["torch_export"] = torch_export_says(model, inputs, timeout)
    return result


def _export_and_compare(case, model, inputs, timeout, data_dependent, reexport, show_traceback) -> Result:
    programs = []
    export_kwargs = {"data_dependent": data_dependent} if data_dependent != "refuse" else {}

    def export(*args, **kwargs):
        programs.append(predispatch.export_predispatch(*args, **kwargs))
        return programs[-1]

    try:
        with time_limit(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ep = assert_matches_eager(model, (), inputs, export=export,
                                      check_reexport=reexport and data_dependent == "refuse", **export_kwargs)
            extra = _specialize_checks(model, inputs, ep, case) if data_dependent != "refuse" else {}
    except CaseTimeout as e:  # fx's interpreter appends the node it was running to the message
        return Result(case, TIMEOUT, str(e).strip().splitlines()[0])
    except Exception as e:
        if timed_out():  # the alarm's CaseTimeout, caught and raised again as another error
            return Result(case, TIMEOUT, f"over {timeout} s ({first_line(e)})")
        if isinstance(e, predispatch.ExportError):
            return Result(case, REFUSED, first_line(e))
        if show_traceback:
            traceback.print_exc()
        # round-off only where the numbers differ (assert_runs_match's "[grad_mode=...]"), not G1/G3/G7
        if isinstance(e, AssertionError) and case.mode == "bf16" and programs and str(e).startswith("[grad_mode="):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                beyond = within_roundoff(model, inputs, programs[0])
            if not beyond:
                return Result(case, ROUNDOFF, first_line(e))
        return Result(case, FAILED, first_line(e))
    return Result(case, PASSED, extra=extra)


# --- the sweep -----------------------------------------------------------------

def summarize(results: list[Result]) -> None:
    """Counts by status, and by reason (the first line's start) for those that do not pass."""
    print_table(results, sum(r.seconds for r in results), STATUSES)
    print("\nby reason:")
    reasons = {}
    for r in results:
        if r.status in (PASSED, SKIPPED):
            continue
        shared = r.extra.get("torch_export")
        key = (r.status, r.detail.split(":")[0], "torch.export not tried" if shared is None
               else "torch.export exports" if shared == "exports" else "torch.export fails too")
        reasons.setdefault(key, []).append(r.case.name)
    for (status, kind, shared), names in sorted(reasons.items(), key=lambda kv: -len(kv[1])):
        print(f"{len(names):4d} {status:8s} {kind:40s} {shared:22s} {', '.join(names[:6])}")


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: train,bf16")
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--skip", default="", help="comma-separated model types not to run")
    parser.add_argument("--limit", type=int, default=0, help="at most this many model types")
    parser.add_argument("--start", type=int, default=0, help="begin at this model type in the order")
    parser.add_argument("--lane", default="0/1", help="k/n: every n-th model type from the k-th (parallel runs)")
    parser.add_argument("--reexport", action="store_true", help="also check re-exporting ep.module() (G7)")
    parser.add_argument("--max-params", type=float, default=20e6, help="skip larger models (default 20e6)")
    parser.add_argument("--timeout", type=int, default=60, help="seconds a case may take (default 60)")
    parser.add_argument("--data-dependent", default="refuse", choices=("refuse", "specialize"))
    parser.add_argument("--json", default="", help="write the per-case records here (after each case)")
    parser.add_argument("--summarize", default="", help="comma-separated JSON files: print their summary, run nothing")
    parser.add_argument("--traceback", action="store_true", help="print each failure's traceback")
    return parser.parse_args(argv)


def cases(options):
    only = list(filter(None, options.only.split(",")))
    skip = set(filter(None, options.skip.split(",")))
    types = [t for t in model_types() if t not in skip]
    if only:
        types = [t for t in only if t in types]
    types = types[options.start:]
    if options.limit:
        types = types[:options.limit]
    lane, lanes = map(int, options.lane.split("/"))
    types = types[lane::lanes]
    modes = options.modes.split(",")
    language_models = set(language_model_types())
    first = [Case(t, mode) for t in types if t in language_models for mode in modes]
    return first + [Case(t, mode) for mode in modes for t in types if t not in language_models]


def language_model_types() -> list[str]:
    """The model types with a causal, masked or seq2seq LM head."""
    from transformers.models.auto import modeling_auto
    return [t for mapping in HEADS[:-1] for t in getattr(modeling_auto, mapping)]


def load(paths: list[str]) -> list[Result]:
    """The records of earlier runs (``--json``), merged: a case's last record wins."""
    found = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["cases"]:
                extra = {k: v for k, v in r.items()
                         if k not in ("source", "model", "mode", "status", "detail", "seconds", "params")}
                found[(r["model"], r["mode"])] = Result(Case(r["model"], r["mode"]), r["status"], r["detail"],
                                                        r["seconds"], r["params"], extra)
    return list(found.values())


def main(argv=None) -> int:
    options = parse(argv)
    if options.summarize:
        summarize(load(options.summarize.split(",")))
        return 0
    torch.set_num_threads(1)
    results, start = [], time.perf_counter()
    for case in cases(options):
        began = time.perf_counter()
        try:
            result = run_case(case, timeout=options.timeout, max_params=int(options.max_params),
                              data_dependent=options.data_dependent, reexport=options.reexport,
                              show_traceback=options.traceback)
        except Exception as e:  # the harness itself
            result = Result(case, SKIPPED, "harness: " + first_line(e))
        result.seconds = time.perf_counter() - began
        results.append(result)
        extra = "".join(f" [{k}: {v}]" for k, v in result.extra.items())
        print(f"{result.status:8s} {case.name} ({result.seconds:.0f} s) {result.detail}{extra}", flush=True)
        if options.json:  # after each case: an interrupted sweep keeps what it found
            write_json(options.json, results, time.perf_counter() - start, data_dependent=options.data_dependent)
        gc.collect()
    summarize(results)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
