"""Benchmark export_predispatch against torch.export.export and a fake-forward floor.

The floor is one forward pass on fake tensors; torch.export runs non-strict.
predispatch is measured with layer reuse (the default) and without it
("pd-noreuse": every layer traced; see predispatch.trace.layer_reuse).

    python tools/bench.py                    # everything (takes a while)
    python tools/bench.py --quick            # a small subset, < 2 minutes
    python tools/bench.py --only bert,gpt2   # chosen cases
    python tools/bench.py --repeat 5 --json /tmp/bench.json
    python tools/bench.py --calls --only bert-L12-train,llama-L12-train   # Python calls, not time
    python tools/bench.py --train --only llama --dtypes fp32   # a training step, five ways (tools/train_bench.py)

Cases (see CASES): transformers BERT, GPT-2 and Llama built from configs
(hidden 768, 12 heads, 2 layers, train mode, dropout 0, use_cache=False),
the same Llama at 8 and 32 layers, modules running 25/50/100 small no_grad or
autocast blocks, the Llama-3-70B shape on meta weights (80 layers), and BERT,
GPT-2 and Llama at 4 layers with attention mask and labels, static
(``*-L4``) and with batch and sequence length dynamic (``*-L4-dyn``); the
train/eval mode cases, Qwen3-Next and Qwen3.5, a diffusers U-Net and timm's
ResNet-50 (``resnet50-train``, ``resnet50-eval``) for issue 42.

How it measures:

* export time: exporters interleaved (their order rotates each repeat),
  ``--repeat`` times, min and median; ``torch.set_num_threads(1)``; the fake
  tensor dispatch cache is cleared and ``gc.collect()`` runs before each timed
  call, outside the timed region; a tiny warm-up export per exporter first.
* peak memory: in a fresh subprocess per (case, exporter): warm-up, build the
  model, reset the peak RSS (``/proc/self/clear_refs``), export, report
  VmHWM - VmRSS before the export; then the tracemalloc peak of a second
  export (Python objects only). The meta 70B case is measured entirely in
  fresh subprocesses (time and memory), one per exporter and repeat.
* run time: ``ep.module()`` forward+backward vs eager forward+backward,
  interleaved, median over ``--iters`` steps (real models and region modules).

``--calls`` counts instead of timing, for the train/eval cases (``*-L4-*``,
``*-L12-*``; all of them without ``--only``): CPU times on a 2-core machine
shared with other jobs move by a third between runs, the number of Python
function calls an export makes does not. In a fresh process per case, the
case's model and the same model at 1 layer (ResNet: at 4 blocks, its
smallest) are exported once by each exporter, uncounted; then one export of
each with each exporter is counted (``sys.setprofile`` call events), the
fake tensor dispatch cache cleared and ``gc.collect()`` run before each. The
table gives the calls at the case's size, predispatch/torch.export in calls,
the calls per extra layer of each, how many of predispatch's per-layer calls
are torch.export's front end (calls into torch from the predispatch
functions that hand work to its machinery; see tools/call_counts.py), and
the floor: the ratio if a stamped layer cost predispatch only those
front-end calls.

This is a command, not a test: it prints numbers and target checks and
exits 0 unless the harness itself breaks.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

import predispatch  # noqa: E402
from predispatch.program import region_runtime  # noqa: E402
from predispatch.trace import layer_reuse  # noqa: E402
from tools import call_counts  # noqa: E402

CHILD_TAG = "BENCH_CHILD "
EXPORTERS = ("torch", "predispatch", "pd-noreuse", "floor")  # pd-noreuse: layer reuse off
REAL_SEQ = (2, 64)  # batch, sequence length of the real models' input_ids


# --------------------------------------------------------------------------
# Models


class LogitsOf(nn.Module):
    """A transformers model returning one tensor (so every exporter and the
    run-time loss see the same thing)."""

    def __init__(self, model: nn.Module, field: str):
        super().__init__()
        self.model, self.field = model, field

    def forward(self, input_ids):
        return getattr(self.model(input_ids=input_ids), self.field)


def bert(layers: int = 2):
    from transformers import BertConfig, BertModel

    config = BertConfig(hidden_size=768, num_attention_heads=12, intermediate_size=3072,
                        num_hidden_layers=layers, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0, use_cache=False)
    return _real(LogitsOf(BertModel(config, add_pooling_layer=False), "last_hidden_state"),
                 config.vocab_size)


def gpt2(layers: int = 2):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_embd=768, n_head=12, n_layer=layers, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False)
    return _real(LogitsOf(GPT2LMHeadModel(config), "logits"), config.vocab_size)


def llama_config(layers: int, **shape):
    from transformers import LlamaConfig

    shape = {"hidden_size": 768, "num_attention_heads": 12, "num_key_value_heads": 12,
             "intermediate_size": 2048, "vocab_size": 32000, **shape}
    return LlamaConfig(num_hidden_layers=layers, attention_dropout=0.0, use_cache=False, **shape)


def llama(layers: int = 2):
    from transformers import LlamaForCausalLM

    config = llama_config(layers)
    return _real(LogitsOf(LlamaForCausalLM(config), "logits"), config.vocab_size)


LLAMA3_70B = {"hidden_size": 8192, "num_attention_heads": 64, "num_key_value_heads": 8,
              "intermediate_size": 28672, "vocab_size": 128256,
              "max_position_embeddings": 8192, "rope_theta": 500000.0}


def llama3_70b_meta():
    """The Llama-3-70B shape with meta weights and meta inputs (no memory)."""
    from transformers import LlamaForCausalLM

    config = llama_config(80, **LLAMA3_70B)
    with torch.device("meta"):
        model = LogitsOf(LlamaForCausalLM(config), "logits").train()
        input_ids = torch.zeros(1, 128, dtype=torch.long)
    return model, (input_ids,)


def _real(model: nn.Module, vocab: int):
    torch.manual_seed(0)
    return model.train(), (torch.randint(0, vocab, REAL_SEQ),)


class RegionStack(nn.Module):
    """``n`` small no_grad or autocast blocks, each followed by a grad-mode op."""

    def __init__(self, n: int, kind: str, width: int = 16):
        super().__init__()
        self.n, self.kind = n, kind
        self.scale = nn.Parameter(torch.full((width,), 0.5))
        self.weight = nn.Parameter(torch.eye(width) + 0.01 * torch.randn(width, width))

    def forward(self, x):
        for _ in range(self.n):
            if self.kind == "no_grad":
                with torch.no_grad():
                    x = x * 2
            else:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    x = (x @ self.weight).float()
            x = torch.tanh(x * self.scale)
        return x


def region_stack(n: int, kind: str):
    torch.manual_seed(0)
    return RegionStack(n, kind).train(), (torch.randn(8, 16),)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    group: str  # "real" | "layered" | "regions" | "meta" | "masked" | "dynamic"
    build: Callable[[], tuple]
    layers: int = 0
    regions: int = 0
    isolated: bool = False  # every measurement in a fresh subprocess
    quick: bool = False


CASES = [
    Case("bert", "real", lambda: bert(2), layers=2),
    Case("gpt2", "real", lambda: gpt2(2), layers=2),
    Case("llama", "real", lambda: llama(2), layers=2, quick=True),
    Case("llama-L8", "layered", lambda: llama(8), layers=8),
    Case("llama-L32", "layered", lambda: llama(32), layers=32),
    *(Case(f"{kind}-{n}", "regions", lambda n=n, kind=kind: region_stack(n, kind), regions=n,
           quick=kind == "no_grad")
      for kind in ("no_grad", "autocast") for n in (25, 50, 100)),
    Case("llama3-70b-meta", "meta", llama3_70b_meta, layers=80, isolated=True),
]


# --------------------------------------------------------------------------
# Language models with attention mask and labels (issue 18): 4 layers, 2 x 128
# tokens, static and with batch and sequence length symbolic (torch.export.Dim,
# both exporters get the same dynamic_shapes). Export time only; the floor is
# a fake forward at the example's static shape.


@dataclasses.dataclass(frozen=True)
class ExportInputs:
    """Keyword example inputs and the dynamic_shapes every exporter gets."""
    kwargs: dict
    dynamic_shapes: dict | None = None


def export_arguments(args) -> tuple[tuple, dict, dict | None]:
    """(args, kwargs, dynamic_shapes) of a case's inputs."""
    if isinstance(args, ExportInputs):
        return (), args.kwargs, args.dynamic_shapes
    return args, {}, None


def masked_lm(kind: str, dynamic: bool, layers: int = 4, dropout: float = 0.0):
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel,
                              LlamaForCausalLM)

    torch.manual_seed(0)
    if kind == "bert":
        model = BertForMaskedLM(BertConfig(
            hidden_size=768, num_attention_heads=12, intermediate_size=3072,
            num_hidden_layers=layers, hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout))
    elif kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=768, n_head=12, n_layer=layers, resid_pdrop=dropout,
                                           embd_pdrop=dropout, attn_pdrop=dropout, use_cache=False))
    else:
        model = LlamaForCausalLM(llama_config(layers))  # Llama has no dropout to turn on
    ids = torch.randint(0, 1000, (2, 128))
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    batch, seq = torch.export.Dim("batch", min=1, max=64), torch.export.Dim("seq", min=2, max=512)
    shapes = {name: {0: batch, 1: seq} for name in kwargs} if dynamic else None
    return model.train(), ExportInputs(kwargs, shapes)


CASES += [Case(f"{kind}-L4{'-dyn' if dynamic else ''}", "dynamic" if dynamic else "masked",
               lambda kind=kind, dynamic=dynamic: masked_lm(kind, dynamic), layers=4,
               quick=kind == "llama" and dynamic)
          for dynamic in (False, True) for kind in ("bert", "gpt2", "llama")]


# --------------------------------------------------------------------------
# Train and eval mode (issue 29): BERT, GPT-2, Llama, a ViT and a CNN at 4 and
# 12 layers, in train mode (with the dropout they have, 0.1) and in eval mode,
# the 4-layer ones with dynamic shapes too. Export time, and the layers stamped.


class _Classifier(torch.nn.Module):
    """A timm model with its loss: the loss in the graph, as in the language models."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        logits = self.model(pixel_values)
        return torch.nn.functional.cross_entropy(logits, labels), logits


VISION_DEPTHS = {4: (1, 1, 1, 1), 12: (2, 3, 5, 2)}  # ResNet's four stages (ResNet-26's proportions at 12)


def vision(kind: str, dynamic: bool, layers: int, dropout: float):
    """timm's ViT (hidden 768, 12 heads, 64 x 64 images in 16-pixel patches)
    or ResNet (basic blocks in four stages, BatchNorm updating its running
    statistics in train mode), with dropout and stochastic depth (per-layer
    rates rising to ``dropout``) in train mode, classifying with labels."""
    from timm.models.resnet import BasicBlock, ResNet
    from timm.models.vision_transformer import VisionTransformer

    torch.manual_seed(0)
    if kind == "vit":
        model = VisionTransformer(img_size=64, patch_size=16, embed_dim=768, depth=layers, num_heads=12,
                                  num_classes=10, drop_rate=dropout, proj_drop_rate=dropout,
                                  attn_drop_rate=dropout, drop_path_rate=dropout)
    else:
        model = ResNet(BasicBlock, VISION_DEPTHS[layers], num_classes=10, drop_rate=dropout,
                       drop_path_rate=dropout)
    kwargs = {"pixel_values": torch.randn(2, 3, 64, 64), "labels": torch.randint(0, 10, (2,))}
    batch = torch.export.Dim("batch", min=2, max=64)
    shapes = {name: {0: batch} for name in kwargs} if dynamic else None
    return _Classifier(model), ExportInputs(kwargs, shapes)


def timm_installed() -> bool:
    """The vision cases need timm, which has wheels for torch 2.14 and later only."""
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


def mode_case(kind: str, layers: int, mode: str, dynamic: bool):
    dropout = 0.1 if mode == "train" else 0.0
    model, inputs = (masked_lm(kind, dynamic, layers, dropout) if kind in ("bert", "gpt2", "llama")
                     else vision(kind, dynamic, layers, dropout))
    return model.train(mode == "train"), inputs


MODE_MODELS = ("bert", "gpt2", "llama", "vit", "resnet")
CASES += [Case(f"{kind}-L{layers}-{mode}{'-dyn' if dynamic else ''}", "modes",
               lambda kind=kind, layers=layers, mode=mode, dynamic=dynamic: mode_case(kind, layers, mode, dynamic),
               layers=layers, quick=kind == "bert" and layers == 4 and not dynamic)
          for kind in MODE_MODELS for layers in (4, 12) for dynamic in ((False, True) if layers == 4 else (False,))
          for mode in ("train", "eval")]
# --------------------------------------------------------------------------
# Long scans and a U-Net (issue 42): Qwen3-Next and Qwen3.5 at 8 layers (three
# chunked linear-attention layers to one full-attention layer, as their
# configs interleave them; 1 x 512 tokens, eight 64-token chunks per
# linear-attention layer; eval mode, their MoE's routing included), and
# diffusers' UNet2DConditionModel (three levels of distinct widths, cross
# attention, train mode). Export time, and the layers stamped.


def linear_attention_lm(model_type: str, layers: int = 8, tokens: int = 512):
    from transformers_sweep import model_class, tiny_config

    torch.manual_seed(0)
    config = tiny_config(model_type)
    text = getattr(config, "text_config", config)
    text.num_hidden_layers = layers
    text.layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    model = model_class(model_type)(text if model_type == "qwen3_5" else config)
    ids = torch.randint(0, text.vocab_size, (1, tokens))
    return model.eval(), ExportInputs({"input_ids": ids, "attention_mask": torch.ones_like(ids)})


def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    model = UNet2DConditionModel(
        sample_size=32, in_channels=4, out_channels=4, layers_per_block=2, block_out_channels=(32, 64, 64),
        down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=32,
        attention_head_dim=8, norm_num_groups=16)
    return model.train(), (torch.randn(2, 4, 32, 32), torch.tensor([10, 20]), torch.randn(2, 8, 32))


def diffusers_installed() -> bool:
    """The U-Net case needs diffusers (``pip install -e .[bench]``)."""
    try:
        import diffusers  # noqa: F401
    except ImportError:
        return False
    return True


CASES += [Case(f"{kind}-L8", "scans", lambda kind=kind: linear_attention_lm(kind), layers=8)
          for kind in ("qwen3_next", "qwen3_5")]
CASES += [Case("unet", "scans", unet)]


def resnet50(mode: str):
    """timm's ResNet-50 at its real depth (16 bottleneck blocks, 3-4-6-3), 2 x 3 x 64 x 64,
    drop path 0.1 in train mode (issue 42's CNN target)."""
    import timm

    torch.manual_seed(0)
    model = timm.create_model("resnet50", pretrained=False, drop_path_rate=0.1 if mode == "train" else 0.0)
    return model.train(mode == "train"), (torch.randn(2, 3, 64, 64),)


CASES += [Case(f"resnet50-{mode}", "scans", lambda mode=mode: resnet50(mode), layers=16) for mode in ("train", "eval")]

CASE_BY_NAME = {c.name: c for c in CASES}
LLAMA_SERIES = ("llama", "llama-L8", "llama-L32")  # the Llama at 2, 8, 32 layers


# --------------------------------------------------------------------------
# Exporters


def export_torch(model, args):
    args, kwargs, dynamic_shapes = export_arguments(args)
    return torch.export.export(model, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)


def export_pd(model, args):
    args, kwargs, dynamic_shapes = export_arguments(args)
    return predispatch.export_predispatch(model, args, kwargs, dynamic_shapes=dynamic_shapes)


def export_pd_without_reuse(model, args):
    """Every layer traced (predispatch.trace.layer_reuse off)."""
    with predispatch.reuse_layers(False):
        return export_pd(model, args)


def fake_forward(model, args):
    """The floor: fakify the parameters, buffers and inputs, run one forward."""
    args, kwargs, _ = export_arguments(args)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    fake_state = {name: mode.from_tensor(t) for name, t in state.items()}
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    with mode:
        return torch.func.functional_call(model, fake_state, fake_args, fake_kwargs)


EXPORT_FNS = {"torch": export_torch, "predispatch": export_pd, "pd-noreuse": export_pd_without_reuse,
              "floor": fake_forward}


def clear_caches() -> None:
    if hasattr(FakeTensorMode, "cache_clear"):
        FakeTensorMode.cache_clear()
    gc.collect()


def timed(fn, *args, clock=time.perf_counter) -> float:
    """Seconds for one call; the result is dropped and collected outside the clock."""
    clear_caches()
    start = clock()
    result = fn(*args)
    seconds = clock() - start
    del result
    gc.collect()
    return seconds


def warm_up(exporters=EXPORTERS) -> None:
    """Pay lazy imports and first-call costs before anything is timed."""
    tiny = llama_config(1, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=64, vocab_size=64)
    from transformers import LlamaForCausalLM

    models = [(LogitsOf(LlamaForCausalLM(tiny), "logits").train(), (torch.randint(0, 64, (2, 8)),)),
              region_stack(2, "no_grad"), region_stack(2, "autocast")]
    ids = torch.randint(0, 64, (2, 8))  # and with dynamic shapes (sympy, the ShapeEnv)
    seq = {0: torch.export.Dim("b", max=64), 1: torch.export.Dim("s", max=64)}
    models.append((LlamaForCausalLM(tiny).train(), ExportInputs(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids},
        {"input_ids": seq, "attention_mask": seq, "labels": seq})))
    for name in exporters:
        for model, args in models:
            EXPORT_FNS[name](model, args)
    clear_caches()


# --------------------------------------------------------------------------
# Memory (Linux /proc)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_delta(fn, *args) -> tuple[float, float]:
    """(seconds, peak RSS MiB above the RSS before the call)."""
    clear_caches()
    before = _status_kib("VmRSS")
    reset = reset_peak_rss()
    start = time.perf_counter()
    result = fn(*args)
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") if reset else _maxrss_kib()
    del result
    return seconds, max(0, peak - before) / 1024


def heap_peak(fn, *args) -> float:
    """Peak MiB of Python allocations (tracemalloc) during one call: finer than
    RSS, which the allocator's reuse of freed memory blurs; blind to C++ objects."""
    import tracemalloc

    clear_caches()
    tracemalloc.start()
    try:
        result = fn(*args)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del result
    return peak / 2**20


def _maxrss_kib() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def child_main(spec: str) -> None:
    """Subprocess entry: one exporter on one case, in a fresh interpreter
    (or, exporter "calls", the case's call counts: see measure_calls)."""
    case_name, exporter = spec.split(":")
    try:
        if exporter == "calls":
            print(CHILD_TAG + json.dumps(measure_calls(CASE_BY_NAME[case_name]).to_json()), flush=True)
            return
        warm_up((exporter,))
        model, args = CASE_BY_NAME[case_name].build()
        seconds, peak = peak_delta(EXPORT_FNS[exporter], model, args)
        out = {"seconds": seconds, "peak_mib": peak,
               "heap_mib": heap_peak(EXPORT_FNS[exporter], model, args)}
    except Exception as e:
        out = {"error": summarize(e)}
    print(CHILD_TAG + json.dumps(out), flush=True)


def in_subprocess(case: Case, exporter: str, timeout: float = 3600) -> dict:
    try:
        proc = subprocess.run([sys.executable, __file__, "--child", f"{case.name}:{exporter}"],
                              capture_output=True, text=True, cwd=REPO, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"child timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"child exited {proc.returncode}: " + " | ".join(tail)}


# --------------------------------------------------------------------------
# Measurements


@dataclasses.dataclass
class Result:
    case: Case
    times: dict = dataclasses.field(default_factory=lambda: {e: [] for e in EXPORTERS})
    peak_mib: dict = dataclasses.field(default_factory=dict)  # RSS delta
    heap_mib: dict = dataclasses.field(default_factory=dict)  # tracemalloc peak
    errors: dict = dataclasses.field(default_factory=dict)
    run: dict = dataclasses.field(default_factory=dict)  # eager_ms, ep_ms, match
    reuse: dict = dataclasses.field(default_factory=dict)  # layer reuse's report of predispatch's export

    def median(self, exporter):
        ts = self.times[exporter]
        return statistics.median(ts) if ts and exporter not in self.errors else None

    def minimum(self, exporter):
        ts = self.times[exporter]
        return min(ts) if ts and exporter not in self.errors else None

    @classmethod
    def from_json(cls, d: dict) -> "Result":
        return cls(CASE_BY_NAME[d["case"]], d["times_s"], d["peak_mib"], d.get("heap_mib", {}),
                   d["errors"], d["run"], d.get("reuse", {}))

    def to_json(self) -> dict:
        return {"case": self.case.name, "group": self.case.group, "layers": self.case.layers,
                "regions": self.case.regions, "times_s": self.times, "peak_mib": self.peak_mib,
                "heap_mib": self.heap_mib, "errors": self.errors, "run": self.run, "reuse": self.reuse}


def summarize(e: BaseException) -> str:
    frames = traceback.extract_tb(e.__traceback__)
    where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})" if frames else ""
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {first[:300]}{where}"


def rotated(seq, k):
    k %= len(seq)
    return list(seq[k:]) + list(seq[:k])


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def measure_in_process(case: Case, res: Result, repeat: int, memory: bool, iters: int,
                       clock=time.perf_counter) -> None:
    model, args = case.build()
    for r in range(repeat):
        for exporter in rotated(EXPORTERS, r):
            if exporter in res.errors:
                continue
            try:
                res.times[exporter].append(timed(EXPORT_FNS[exporter], model, args, clock=clock))
                if exporter == "predispatch":
                    res.reuse = dataclasses.asdict(layer_reuse.last_report)
            except Exception as e:
                res.errors[exporter] = summarize(e)
                res.times[exporter] = []
    if iters and "predispatch" not in res.errors:
        try:
            res.run = measure_run_time(model, args, iters)
        except Exception as e:
            res.errors["run"] = summarize(e)
    del model, args
    gc.collect()
    if memory:
        for exporter in ("torch", "predispatch"):
            out = in_subprocess(case, exporter)
            if "error" in out:
                res.errors.setdefault(f"mem:{exporter}", out["error"])
            else:
                res.peak_mib[exporter] = out["peak_mib"]
                res.heap_mib[exporter] = out["heap_mib"]


def measure_isolated(case: Case, res: Result, repeat: int) -> None:
    """Each (repeat, exporter) in a fresh subprocess: time and peak memory."""
    peaks, heaps = {e: [] for e in EXPORTERS}, {e: [] for e in EXPORTERS}
    for r in range(repeat):
        for exporter in rotated(EXPORTERS, r):
            if exporter in res.errors:
                continue
            out = in_subprocess(case, exporter)
            if "error" in out:
                res.errors[exporter] = out["error"]
                res.times[exporter] = []
                continue
            res.times[exporter].append(out["seconds"])
            peaks[exporter].append(out["peak_mib"])
            heaps[exporter].append(out["heap_mib"])
            print(f"    {case.name} {exporter}: {out['seconds']:.2f} s, peak RSS "
                  f"+{out['peak_mib']:.0f} MiB, heap peak {out['heap_mib']:.0f} MiB", flush=True)
    res.peak_mib = {e: statistics.median(p) for e, p in peaks.items() if p}
    res.heap_mib = {e: statistics.median(p) for e, p in heaps.items() if p}


def fwd_bwd_seconds(fn, params, args) -> float:
    for p in params:
        p.grad = None
    start = time.perf_counter()
    out = fn(*args)
    out.float().sum().backward()
    return time.perf_counter() - start


def torch_fwd_bwd_seconds(fn, params, args) -> float:
    """torch.export's program as users have it: with torch's own region calls."""
    with region_runtime.torch_region_runtime():
        return fwd_bwd_seconds(fn, params, args)


def measure_run_time(model, args, iters: int) -> dict:
    """ep.module() forward+backward vs eager forward+backward, interleaved; torch.export's
    own program alongside, as the reference users have today."""
    program = export_pd(model, args).module()
    torch_program = export_torch(model, args).module()
    with torch.no_grad():
        match = torch.allclose(program(*args), model(*args), atol=1e-4, rtol=1e-4)
    runners = [(name, fn, list(fn.parameters()), timer) for name, fn, timer in (
        ("eager", model, fwd_bwd_seconds), ("ep", program, fwd_bwd_seconds),
        ("torch_ep", torch_program, torch_fwd_bwd_seconds))]
    samples = {name: [] for name, *_ in runners}
    for i in range(iters + 2):  # two warm-up steps each
        for name, fn, params, timer in rotated(runners, i):
            seconds = timer(fn, params, args)
            if i >= 2:
                samples[name].append(seconds)
    ms = {name: 1e3 * statistics.median(ts) for name, ts in samples.items()}
    min_ratio = min(samples["ep"]) / min(samples["eager"])
    return {"eager_ms": ms["eager"], "ep_ms": ms["ep"], "torch_ep_ms": ms["torch_ep"],
            "ratio": ms["ep"] / ms["eager"], "min_ratio": min_ratio, "match": match}


def run_case(case: Case, opts) -> Result:
    res = Result(case)
    start = time.perf_counter()
    print(f"[{case.name}] ...", flush=True)
    if case.isolated:
        measure_isolated(case, res, opts.repeat)
    else:
        iters = opts.iters_regions if case.group == "regions" else opts.iters
        iters = iters if case.group in ("real", "regions") else 0
        memory = not opts.no_memory and not (opts.quick and case.group == "regions") \
            and case.group not in ("masked", "dynamic", "modes", "scans")  # export time only
        measure_in_process(case, res, opts.repeat, memory, iters, CLOCKS[opts.clock])
    print_case(res, time.perf_counter() - start)
    return res


# --------------------------------------------------------------------------
# Reporting


def fmt(x, spec=".3f", none="-"):
    return none if x is None else format(x, spec)


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def print_case(res: Result, wall: float) -> None:
    for e in EXPORTERS:
        if e in res.errors:
            print(f"    {e:12s} FAILED: {res.errors[e]}")
        else:
            print(f"    {e:12s} min {fmt(res.minimum(e))} s  median {fmt(res.median(e))} s")
    te, pd, fl = (res.median(e) for e in ("torch", "predispatch", "floor"))
    print(f"    ratio predispatch/torch.export {fmt(ratio(pd, te), '.2f')}, "
          f"predispatch/floor {fmt(ratio(pd, fl), '.2f')}")
    if res.peak_mib:
        print("    peak RSS delta MiB: " + ", ".join(f"{k} {v:.0f}" for k, v in res.peak_mib.items())
              + "; heap peak MiB: " + ", ".join(f"{k} {v:.1f}" for k, v in res.heap_mib.items()))
    if res.run:
        r = res.run
        print(f"    run fwd+bwd: eager {r['eager_ms']:.3f} ms, ep.module() {r['ep_ms']:.3f} ms, "
              f"ratio {r['ratio']:.3f} (ratio of mins {r['min_ratio']:.3f}), "
              f"torch.export's ep.module() {fmt(r.get('torch_ep_ms'))} ms, "
              f"outputs match: {r['match']}")
    for k, v in res.errors.items():
        if k not in EXPORTERS:
            print(f"    {k} FAILED: {v}")
    print(f"    ({wall:.0f} s wall)", flush=True)


def markdown_table(results: list[Result]) -> str:
    head = ("| model | torch.export s | predispatch s | ratio | fake floor s | ratio to floor "
            "| s/layer (pd / torch) | peak RSS MiB (torch / pd) | heap MiB (torch / pd) |")
    rows = [head, "|" + "---|" * 9]
    for res in results:
        te, pd, fl = res.median("torch"), res.median("predispatch"), res.median("floor")
        layers = res.case.layers
        per_layer = (f"{fmt(ratio(pd, layers))} / {fmt(ratio(te, layers))}" if layers else "-")
        peak = both(res.peak_mib, ".0f")
        heap = both(res.heap_mib, ".1f")
        rows.append(f"| {res.case.name} | {fmt(te, none='FAIL')} | {fmt(pd, none='FAIL')} "
                    f"| {fmt(ratio(pd, te), '.2f')} | {fmt(fl, none='FAIL')} "
                    f"| {fmt(ratio(pd, fl), '.2f')} | {per_layer} | {peak} | {heap} |")
    return "\n".join(rows)


def both(mib: dict, spec: str) -> str:
    if not mib:
        return "-"
    return f"{fmt(mib.get('torch'), spec)} / {fmt(mib.get('predispatch'), spec)}"


def run_time_table(results: list[Result]) -> str:
    rows = ["| model | eager fwd+bwd ms | ep.module() fwd+bwd ms | ratio | ratio of mins "
            "| overhead us/region | torch.export's ep.module() ms | its overhead us/region "
            "| outputs match |", "|" + "---|" * 9]
    for res in results:
        if not res.run:
            continue
        r, n = res.run, res.case.regions
        torch_ms = r.get("torch_ep_ms")
        per_region = fmt(1e3 * (r["ep_ms"] - r["eager_ms"]) / n, ".2f") if n else "-"
        torch_per_region = (fmt(1e3 * (torch_ms - r["eager_ms"]) / n, ".2f")
                            if n and torch_ms is not None else "-")
        rows.append(f"| {res.case.name} | {r['eager_ms']:.3f} | {r['ep_ms']:.3f} "
                    f"| {r['ratio']:.3f} | {r['min_ratio']:.3f} | {per_region} "
                    f"| {fmt(torch_ms, '.3f')} | {torch_per_region} | {r['match']} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def slope(xs, ys) -> float:
    """Least-squares slope of ys on xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def per_unit_costs(results, names, unit_of, value_of):
    """[(unit count, value)] for the named results that have a value, sorted."""
    pts = [(unit_of(r.case), value_of(r)) for r in results if r.case.name in names]
    return sorted((u, v) for u, v in pts if v is not None)


def layer_report(results) -> list[str]:
    lines = []
    for exporter in ("predispatch", "pd-noreuse", "torch"):
        pts = per_unit_costs(results, LLAMA_SERIES, lambda c: c.layers,
                             lambda r, e=exporter: r.median(e))
        if len(pts) >= 2:
            per = ", ".join(f"L{n}: {t / n:.3f}" for n, t in pts)
            lines.append(f"  {exporter:12s} s/layer {per}; marginal "
                         f"{slope(*zip(*pts)):.3f} s/layer (slope over {len(pts)} sizes)")
    return lines


def region_costs(results, kind: str, exporter: str):
    names = [c.name for c in CASES if c.group == "regions" and c.name.startswith(kind)]
    return per_unit_costs(results, names, lambda c: c.regions, lambda r: r.median(exporter))


def linearity(pts) -> tuple[float, float, bool]:
    """(marginal cost per unit, growth, linear?): growth is the time per unit
    at the largest size over that at the smallest; linear (no superlinear
    growth) if <= 1.25. Below 1 a fixed cost is being amortized. (Increments
    between sizes would be noisier: they subtract two noisy timings.)"""
    b = slope(*zip(*pts))
    (n0, t0), (n1, t1) = pts[0], pts[-1]
    growth = (t1 / n1) / (t0 / n0)
    return b, growth, growth <= 1.25


def region_report(results) -> tuple[list[str], dict]:
    lines, worst = [], {}
    for kind in ("no_grad", "autocast"):
        for exporter in ("predispatch", "torch"):
            pts = region_costs(results, kind, exporter)
            if len(pts) < 3:
                continue
            b, growth, linear = linearity(pts)
            per = ", ".join(f"N={n}: {1e3 * t / n:.2f}" for n, t in pts)
            lines.append(f"  {kind:8s} {exporter:12s} ms/region {per}; marginal "
                         f"{1e3 * b:.2f} ms/region; ms/region at N={pts[-1][0]} / at "
                         f"N={pts[0][0]} = {growth:.2f} -> {'linear' if linear else 'superlinear'}")
            if exporter == "predispatch":
                worst[kind] = (b, linear)
    return lines, worst


def run_region_report(results) -> tuple[list[str], float | None]:
    lines, worst = [], None
    for kind in ("no_grad", "autocast"):
        names = [c.name for c in CASES if c.group == "regions" and c.name.startswith(kind)]
        for program, key in (("predispatch", "ep_ms"), ("torch.export", "torch_ep_ms")):
            pts = per_unit_costs(results, names, lambda c: c.regions,
                                 lambda r, k=key: (r.run[k] - r.run["eager_ms"])
                                 if r.run.get(k) is not None else None)
            if len(pts) < 2:
                continue
            b = 1e3 * slope(*zip(*pts))
            per = ", ".join(f"N={n}: {1e3 * d / n:.2f}" for n, d in pts)
            lines.append(f"  {kind:8s} {program:12s} run-time overhead us/region {per}; "
                         f"marginal {b:.2f} us/region")
            if program == "predispatch":
                worst = b if worst is None else max(worst, b)
    return lines, worst


def check(label: str, value, ok) -> str:
    verdict = "n/a " if value is None else ("PASS" if ok else "FAIL")
    return f"  [{verdict}] {label}"


def targets(results) -> list[str]:
    by = {r.case.name: r for r in results}
    real = [r for r in results if r.case.group == "real"]
    export_ratios = [x for x in (ratio(r.median("predispatch"), r.median("torch")) for r in real)
                     if x is not None]
    med_ratio = statistics.median(export_ratios) if export_ratios else None
    floor_ratios = {r.case.name: ratio(r.median("predispatch"), r.median("floor"))
                    for r in results if r.case.group not in ("regions", "dynamic") and not r.case.name.endswith("-dyn")}
    floor_ratios = {k: v for k, v in floor_ratios.items() if v is not None}
    worst_floor = max(floor_ratios.items(), key=lambda kv: kv[1]) if floor_ratios else None
    _, region_worst = region_report(results)
    run_ratios = [r.run["ratio"] for r in real if r.run]
    med_run = statistics.median(run_ratios) if run_ratios else None
    _, run_region = run_region_report(results)

    lines = ["Targets:"]
    lines.append(check(f"median export ratio predispatch/torch.export over real models "
                       f"= {fmt(med_ratio, '.2f')} (<= 1.0)", med_ratio,
                       med_ratio is not None and med_ratio <= 1.0))
    lines.append(check(
        "predispatch <= 4x fake floor: worst "
        + (f"{worst_floor[0]} {worst_floor[1]:.2f}x" if worst_floor else "-"),
        worst_floor, worst_floor is not None and worst_floor[1] <= 4.0))
    for kind, (b, linear) in region_worst.items():
        lines.append(check(f"{kind} regions: marginal {1e3 * b:.2f} ms/region (<= 5 ms), "
                           f"{'linear' if linear else 'superlinear'}", b, b <= 5e-3 and linear))
    l32 = by.get("llama-L32")
    if l32 is not None:
        t = ratio(l32.median("predispatch"), l32.median("torch"))
        lines.append(check(f"Llama 32 layers with layer reuse: ratio {fmt(t, '.2f')} to torch.export "
                           "(<= 0.25)", t, t is not None and t <= 0.25))
    big = by.get("llama3-70b-meta")
    if big is not None:
        f = ratio(big.median("predispatch"), big.median("floor"))
        lines.append(check(f"70B meta with layer reuse: {fmt(f, '.2f')}x one fake forward (< 1.0)", f,
                           f is not None and f < 1.0))
        t = ratio(big.median("predispatch"), big.median("torch"))
        m = ratio(big.peak_mib.get("predispatch"), big.peak_mib.get("torch"))
        lines.append(check(f"70B meta: time ratio {fmt(t, '.2f')} (<= 1.0)", t,
                           t is not None and t <= 1.0))
        lines.append(check(f"70B meta: peak memory ratio {fmt(m, '.2f')} (<= 1.0)", m,
                           m is not None and m <= 1.0))
    for mode in ("train", "eval"):
        r50 = by.get(f"resnet50-{mode}")
        if r50 is not None:
            t = ratio(r50.median("predispatch"), r50.median("torch"))
            lines.append(check(f"ResNet-50 at real depth, {mode}: ratio {fmt(t, '.2f')} to torch.export (<= 0.6)",
                               t, t is not None and t <= 0.6))
    lines.append(check(f"run time ep.module()/eager fwd+bwd, median over real models "
                       f"= {fmt(med_run, '.3f')} (<= 1.03)", med_run,
                       med_run is not None and med_run <= 1.03))
    lines.append(check(f"run-time overhead per region (marginal, worst kind) "
                       f"= {fmt(run_region, '.2f')} us (<= 15 us)", run_region,
                       run_region is not None and run_region <= 15.0))
    return lines + model_ratio_targets(results) + mode_targets(results)


def model_ratio_targets(results) -> list[str]:
    """Issue 18: dynamic shapes at torch.export's speed, and every real model."""
    def worst(groups):
        ratios = {r.case.name: ratio(r.median("predispatch"), r.median("torch"))
                  for r in results if r.case.group in groups}
        ratios = {k: v for k, v in ratios.items() if v is not None}
        return max(ratios.items(), key=lambda kv: kv[1]) if ratios else None

    lines = []
    for label, groups in (("dynamic shapes", ("dynamic",)),
                          ("every real model", ("real", "layered", "masked", "dynamic", "meta", "modes"))):
        w = worst(groups)
        lines.append(check(f"{label}: worst export ratio predispatch/torch.export "
                           + (f"{w[0]} {w[1]:.2f}" if w else "-") + " (<= 1.0)", w,
                           w is not None and w[1] <= 1.0))
    return lines


def mode_table(results: list[Result]) -> str:
    """Train and eval mode side by side: each exporter's time, the ratio, the layers stamped."""
    by = {r.case.name: r for r in results}
    rows = ["| model | layers | shapes | train: torch.export s | predispatch s | ratio | layers stamped "
            "| eval: torch.export s | predispatch s | ratio | layers stamped | train / eval (predispatch) |",
            "|" + "---|" * 12]
    for kind in MODE_MODELS:
        for layers in (4, 12):
            for dyn in ("", "-dyn"):
                pair = [by.get(f"{kind}-L{layers}-{mode}{dyn}") for mode in ("train", "eval")]
                if not any(pair):
                    continue
                cells = []
                for res in pair:
                    if res is None:
                        cells += ["-"] * 4
                        continue
                    te, pd = res.median("torch"), res.median("predispatch")
                    stamped = f"{res.reuse.get('stamped', 0)} of {layers}" if res.reuse else "-"
                    cells += [fmt(te, none="FAIL"), fmt(pd, none="FAIL"), fmt(ratio(pd, te), ".2f"), stamped]
                train_eval = ratio(*(r.median("predispatch") if r else None for r in pair))
                rows.append(f"| {kind} | {layers} | {'dynamic' if dyn else 'static'} | " + " | ".join(cells)
                            + f" | {fmt(train_eval, '.2f')} |")
    return "\n".join(rows)


def mode_targets(results: list[Result]) -> list[str]:
    """Issue 29: train mode as fast as eval mode, and well below torch.export."""
    by = {r.case.name: r for r in results}
    lines = []

    def pd_ratio(name):
        r = by.get(name)
        return ratio(r.median("predispatch"), r.median("torch")) if r else None

    for layers, bound in ((4, 0.8), (12, 0.35)):
        ratios = {k: pd_ratio(f"{k}-L{layers}-train") for k in MODE_MODELS}
        ratios = {k: v for k, v in ratios.items() if v is not None}
        if ratios:
            worst = max(ratios.items(), key=lambda kv: kv[1])
            lines.append(check(f"train mode, {layers} layers: worst ratio to torch.export {worst[0]} "
                               f"{worst[1]:.2f} (<= {bound})", worst, worst[1] <= bound))
    within = {}
    for kind in MODE_MODELS:
        for suffix in ("L4", "L12", "L4-dyn"):
            t, e = by.get(f"{kind}-{suffix}-train"), by.get(f"{kind}-{suffix}-eval")
            if t and e and (x := ratio(t.median("predispatch"), e.median("predispatch"))) is not None:
                within[f"{kind}-{suffix}"] = x
    if within:
        worst = max(within.items(), key=lambda kv: kv[1])
        lines.append(check(f"train within 10% of eval: worst {worst[0]} {worst[1]:.2f} (<= 1.10)", worst,
                           worst[1] <= 1.10))
    slopes = {}
    for kind in MODE_MODELS:
        per_mode = {}
        for mode in ("train", "eval"):
            a, b = by.get(f"{kind}-L4-{mode}"), by.get(f"{kind}-L12-{mode}")
            if a and b and a.median("predispatch") is not None and b.median("predispatch") is not None:
                per_mode[mode] = (b.median("predispatch") - a.median("predispatch")) / 8
        if len(per_mode) == 2 and per_mode["eval"] > 0:
            slopes[kind] = (per_mode["train"], per_mode["eval"])
    if slopes:
        worst = max(slopes.items(), key=lambda kv: kv[1][0] / kv[1][1])
        k, (t, e) = worst
        lines.append(check(f"marginal cost of a train-mode layer vs an eval-mode one: worst {k} "
                           f"{1e3 * t:.1f} / {1e3 * e:.1f} ms (<= 1.2x)", worst, t <= 1.2 * e))
    return lines


def report(results: list[Result]) -> None:
    print("\n## Export time (median over repeats)\n")
    print(markdown_table([r for r in results if r.case.group != "modes"]))
    if any(r.case.group == "modes" for r in results):
        print("\n## Train and eval mode (median over repeats)\n")
        print(mode_table(results))
    table = run_time_table(results)
    if table:
        print("\n## Run time (median over steps)\n")
        print(table)
    layer_lines = layer_report(results)
    if layer_lines:
        print("\nPer layer (Llama hidden 768 at 2/8/32 layers):")
        print("\n".join(layer_lines))
    region_lines, _ = region_report(results)
    if region_lines:
        print("\nPer region (export):")
        print("\n".join(region_lines))
    run_lines, _ = run_region_report(results)
    if run_lines:
        print("\nPer region (run time, ep.module() - eager):")
        print("\n".join(run_lines))
    failures = [(r.case.name, k, v) for r in results for k, v in r.errors.items()]
    if failures:
        print("\nFailures:")
        for name, what, err in failures:
            print(f"  {name} / {what}: {err}")
    print()
    print("\n".join(targets(results)))


# --------------------------------------------------------------------------
# Python call counts (--calls): what CPU time says, without the machine's load


def base_layers(kind: str) -> int:
    """The smaller model a case's per-layer calls are measured against."""
    return min(VISION_DEPTHS) if kind == "resnet" else 1  # ResNet has no 1-block model


def mode_spec(case: Case) -> tuple[str, str, bool]:
    """(model kind, mode, dynamic) of a "modes" case, from its name: ``bert-L4-train-dyn``."""
    kind, _, mode, *dyn = case.name.split("-")
    return kind, mode, bool(dyn)


@dataclasses.dataclass
class CallsResult:
    case: Case
    base: int  # layers of the base model
    calls: dict  # {exporter: {layers: CallCounts}}
    stamped: int | None = None  # layers predispatch stamped at the case's size

    def total(self, exporter: str, layers: int) -> int:
        return self.calls[exporter][layers].total

    def per_layer(self, exporter: str, field: str = "total") -> float | None:
        """Marginal calls per layer between the base and the case's size."""
        big, small, extra = self.case.layers, self.base, self.case.layers - self.base
        counts = self.calls[exporter]
        return (getattr(counts[big], field) - getattr(counts[small], field)) / extra if extra else None

    def floor(self) -> float | None:
        """predispatch/torch.export in calls if a layer cost predispatch only its front-end calls."""
        front = self.per_layer("predispatch", "front_end")
        if front is None:
            return None
        best = self.total("predispatch", self.base) + (self.case.layers - self.base) * front
        return best / self.total("torch", self.case.layers)

    def to_json(self) -> dict:
        return {"case": self.case.name, "layers": self.case.layers, "base_layers": self.base,
                "stamped": self.stamped, "calls": {e: {str(n): dataclasses.asdict(c) for n, c in by.items()}
                                                   for e, by in self.calls.items()},
                "ratio": self.total("predispatch", self.case.layers) / self.total("torch", self.case.layers),
                "per_layer": {e: self.per_layer(e) for e in self.calls},
                "pd_per_layer_front_end": self.per_layer("predispatch", "front_end"), "floor": self.floor()}

    @classmethod
    def from_json(cls, d: dict) -> "CallsResult":
        calls = {e: {int(n): call_counts.CallCounts(**c) for n, c in by.items()} for e, by in d["calls"].items()}
        return cls(CASE_BY_NAME[d["case"]], d["base_layers"], calls, d.get("stamped"))


def measure_calls(case: Case) -> CallsResult:
    """Calls of one export of the case's model and of its base model with each exporter,
    every model exported once by each first (uncounted), the caches cleared before each count
    (run in a fresh process per case: in one process, the counts shift by up to 1% with the cases run before)."""
    kind, mode, dynamic = mode_spec(case)
    res = CallsResult(case, base_layers(kind), {"torch": {}, "predispatch": {}})
    models = {n: mode_case(kind, n, mode, dynamic) for n in sorted({res.base, case.layers})}
    for model, inputs in models.values():
        export_torch(model, inputs)
        export_pd(model, inputs)
    for n, (model, inputs) in models.items():
        for exporter in res.calls:
            clear_caches()
            res.calls[exporter][n] = call_counts.count_calls(EXPORT_FNS[exporter], model, inputs)
            if exporter == "predispatch" and n == case.layers:
                res.stamped = layer_reuse.last_report.stamped
    return res


def kilo(x) -> str:
    return "-" if x is None else f"{x / 1e3:.1f}k"


def calls_table(results: list[CallsResult]) -> str:
    rows = ["| model | layers | mode | torch.export calls | predispatch calls | ratio "
            "| per-layer calls (torch / pd) | of pd's per-layer: torch.export front end | floor ratio |",
            "|" + "---|" * 9]
    for res in results:
        kind, mode, dynamic = mode_spec(res.case)
        n = res.case.layers
        te, pd = res.total("torch", n), res.total("predispatch", n)
        front, pd_layer = res.per_layer("predispatch", "front_end"), res.per_layer("predispatch")
        share = f" ({100 * front / pd_layer:.0f}%)" if front is not None and pd_layer else ""
        layers = f"{n} (base {res.base})" if res.base != 1 else str(n)
        rows.append(f"| {kind} | {layers} | {mode}{', dynamic' if dynamic else ''} | {te:,} | {pd:,} "
                    f"| {pd / te:.3f} | {kilo(res.per_layer('torch'))} / {kilo(pd_layer)} "
                    f"| {kilo(front)}{share} | {fmt(res.floor())} |")
    return "\n".join(rows)


def calls_report(results: list[CallsResult]) -> None:
    print("\n## Python calls of one export (sys.setprofile 'call' events)\n")
    print(calls_table(results))
    print("\nper-layer: (calls at the case's layers - at the base's) / the extra layers; the base is "
          "the 1-layer model (ResNet: the 4-block one, ResNet having no 1-block model). Front end: "
          "calls into torch from the predispatch functions that hand work to torch.export's machinery "
          "(tools/call_counts.py FRONT_END). Floor: (pd's calls at the base + the extra layers x pd's "
          "front-end calls per layer) / torch.export's calls, the ratio if a stamped layer cost "
          "predispatch nothing of its own.")


def calls_main(opts) -> None:
    cases = [c for c in select(opts) if c.group == "modes"]
    others = [n for n in (opts.only or "").split(",") if n.strip() and CASE_BY_NAME[n.strip()].group != "modes"]
    if others:
        sys.exit(f"--calls measures the train/eval cases only, not {others}")
    print(f"torch {torch.__version__}, Python calls, cases: {', '.join(c.name for c in cases)}", flush=True)
    start, results = time.perf_counter(), []
    for case in cases:
        case_start = time.perf_counter()
        print(f"[{case.name}] ...", flush=True)
        out = in_subprocess(case, "calls")  # fresh: the counts do not depend on the cases before
        if "error" in out:
            print(f"    FAILED: {out['error']}", flush=True)
            continue
        results.append(res := CallsResult.from_json(out))
        print(f"    predispatch stamped {res.stamped} of {case.layers} layers "
              f"({time.perf_counter() - case_start:.0f} s wall)", flush=True)
    calls_report(results)
    print(f"\n(total {time.perf_counter() - start:.0f} s)")
    if opts.json:
        Path(opts.json).write_text(json.dumps([r.to_json() for r in results], indent=1))


# --------------------------------------------------------------------------


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="a small subset, < 2 minutes: llama and the no_grad region modules, "
                   "2 repeats, fewer run-time steps, peak memory for llama only")
    p.add_argument("--repeat", type=int, default=3, help="export repeats per exporter (default 3)")
    p.add_argument("--only", default="", help="comma-separated case names: "
                   + ",".join(c.name for c in CASES))
    p.add_argument("--json", default=None, help="write all measurements to this file")
    p.add_argument("--iters", type=int, default=20, help="run-time steps, real models")
    p.add_argument("--iters-regions", type=int, default=100, help="run-time steps, region modules")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                   help="export time as wall time (default) or as this process's CPU time, which "
                   "other jobs on a loaded machine skew less (in-process cases only)")
    p.add_argument("--from-json", default=None, metavar="PATH",
                   help="print the report of a --json file again, measure nothing")
    p.add_argument("--calls", action="store_true",
                   help="count the Python calls of one export instead of timing (train/eval cases "
                   "only, each against its 1-layer model): deterministic where time is not")
    p.add_argument("--train", action="store_true",
                   help="the training step instead: eager, torch.compile, compile_training, with the options of "
                   "tools/train_bench.py (--only MODELS, --dtypes, --steps, --ways, --no-first-step, --json)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def select(opts) -> list[Case]:
    if opts.only:
        names = [n.strip() for n in opts.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in CASE_BY_NAME]
        if unknown:
            sys.exit(f"unknown case(s) {unknown}; known: {', '.join(CASE_BY_NAME)}")
        return [CASE_BY_NAME[n] for n in names]
    cases = [c for c in CASES if c.quick] if opts.quick else list(CASES)
    if not timm_installed():
        print("the vision cases skipped: timm is not installed (torch 2.14 and later)", flush=True)
        cases = [c for c in cases if not c.name.startswith(("vit-", "resnet-", "resnet50-"))]
    if not diffusers_installed():
        print("the U-Net case skipped: diffusers is not installed (pip install -e .[bench])", flush=True)
        cases = [c for c in cases if c.name != "unet"]
    return cases


def load_line(when: str) -> str:
    """Other processes on a 2-core machine skew every number: say so."""
    load = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    note = " -- machine busy, timings are noisy" if load > cores - 0.5 else ""
    return f"load average {when}: {load:.2f} on {cores} cores{note}"


def setup() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--train" in argv:  # the training step's benchmark: its own options (tools/train_bench.py)
        from tools import train_bench

        train_bench.main([a for a in argv if a != "--train"])
        return
    opts = parse_args(argv)
    setup()
    if opts.child:
        child_main(opts.child)
        return
    if opts.from_json:
        saved = json.loads(Path(opts.from_json).read_text())
        if saved and "calls" in saved[0]:
            calls_report([CallsResult.from_json(d) for d in saved])
        else:
            report([Result.from_json(d) for d in saved])
        return
    if opts.calls:
        calls_main(opts)
        return
    if opts.quick:
        opts.repeat = min(opts.repeat, 2)
        opts.iters, opts.iters_regions = min(opts.iters, 5), min(opts.iters_regions, 30)
    cases = select(opts)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, repeat {opts.repeat}, "
          f"clock {opts.clock}, "
          f"cases: {', '.join(c.name for c in cases)}", flush=True)
    print(load_line("at start"), flush=True)
    start = time.perf_counter()
    warm_up()
    results = [run_case(case, opts) for case in cases]
    report(results)
    print(f"\n(total {time.perf_counter() - start:.0f} s; {load_line('at end')})")
    if opts.json:
        Path(opts.json).write_text(json.dumps([r.to_json() for r in results], indent=1))


if __name__ == "__main__":
    main()
