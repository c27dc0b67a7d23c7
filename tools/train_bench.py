"""The training step, five ways: eager, torch.compile(model), torch.compile(ep.module()),
compile_training(ep) and compile_training(ep, backend="inductor") (issue 39).

    python tools/bench.py --train                      # everything (some 30 minutes on 2 cores)
    python tools/bench.py --train --only llama --dtypes fp32 --no-first-step
    python tools/bench.py --train --only resnet --ways "eager,compile_training(ep)" --no-first-step
    python tools/train_bench.py --json /tmp/train.json  # the same, directly
    python tools/bench.py --train --device cuda --dtypes bf16,fp16 --no-first-step   # on a GPU

One step: the loss from the forward (inputs with labels), its backward, an
SGD update, gradients set to None. The models: transformers BERT
(BertForMaskedLM), GPT-2 (GPT2LMHeadModel) and Llama (LlamaForCausalLM) at
hidden 256, 4 layers, 4 heads, train mode (BERT's and GPT-2's dropout 0.1),
``use_cache=False``, a batch of 4 x 128 tokens with labels; on torch >= 2.14
(timm's wheels) also timm's ViT (64 x 64 images in 8-pixel patches, width
256, 4 blocks) and a ResNet (basic blocks 1-1-1-1, BatchNorm updating its
statistics), a batch of 8 with labels. Each in fp32 and under
``torch.autocast("cpu", torch.bfloat16)`` (the forward under it, the
backward outside, as one trains with it: the programs are exported under
it, as they are called, with ``backward_pass_autocast="off"``, the state
their backward runs in; a program exported outside autocast and called
under it is refused where a ``.float()`` of the logits was a no-op when
traced).

How it measures (one thread, glibc's malloc keeping the memory it frees:
``GLIBC_TUNABLES`` with high mmap and trim thresholds, set for every way by
re-running the bench with them; ``--system-malloc`` keeps glibc's
defaults). Under the defaults, a tensor over 32 MiB (a vocabulary's logits
and their gradient, 60 MiB) is mapped afresh unless a freed block is at
hand, and its 15,000 page faults cost more than the op writing it: which
way's step finds one depends on what the step before it, of another way,
freed, and one way's median moves by 10-15% between runs. A caching
allocator (jemalloc or TCMalloc, as PyTorch's CPU performance guide
recommends) does what the tunables do.

* the steady step: in one process per model and dtype, each way with its
  own copy of the model and optimizer, two warm-up steps each (the
  compiles), then ``--steps`` rounds in which every way takes one step,
  its order rotating each round, ``gc.collect()`` between steps and the
  collector off during them; the median of each way's CPU time
  (``time.process_time``); the table gives eager's in ms and the others
  over eager's, ratios of one run side by side; a sixth way, inductor with
  its own random generator (``options={"fallback_random": False}``), shows
  what eager's draws cost it;
* the first step (``--no-first-step`` skips it): in a fresh process per
  way, with inductor's caches in a fresh directory and its compiles in
  process (``TORCHINDUCTOR_COMPILE_THREADS=1``): the CPU time, this
  process's and its children's (the C++ compiler), of building the
  compiled module and taking the first step; for compile_training the
  export is given apart (the program is made once, then trained);
* peak memory, in that process: after two more steps, the peak RSS of one
  step over the RSS before it (``/proc/self/clear_refs``, ``VmHWM``), the
  memory the earlier steps freed handed back first (``malloc_trim``).

The targets (issue 39), checked at the end: compile_training's default
step <= 1.0x eager's; backend="inductor" <= 1.0x the faster of the two
torch.compile ways, its first step no slower than theirs. On CUDA
(``--device cuda``): the models and inputs on the GPU, the forward under
``torch.autocast("cuda", ...)`` (``--dtypes fp16`` too), a step's time
wall-clock once the GPU has finished it, the peak the CUDA allocator's. A command, not a
test: it prints numbers and exits 0 unless the harness breaks.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import gc
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

import predispatch  # noqa: E402

WAYS = ("eager", "torch.compile(model)", "torch.compile(ep.module())", "compile_training(ep)",
        "compile_training(ep, inductor)")
# steady steps only: inductor with its own random generator, what eager's draws cost it
OWN_DRAWS = "compile_training(ep, inductor, its draws)"
MODELS = ("bert", "gpt2", "llama", "vit", "resnet")
DTYPES = ("fp32", "bf16")
LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
DEVICE = "cpu"  # --device: where the models train (set once, by main)
CHILD_TAG = "TRAIN_BENCH_CHILD "


# --------------------------------------------------------------------------
# Models: a module returning the loss, and its keyword inputs


class Loss(torch.nn.Module):
    """The model's loss as its one output (what every way trains)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        out = self.model(**inputs)
        return out.loss if hasattr(out, "loss") else out


class Classifier(torch.nn.Module):
    """A timm model with its cross-entropy loss."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, pixel_values, labels):
        return torch.nn.functional.cross_entropy(self.model(pixel_values), labels)


def language_model(kind: str):
    from transformers import (BertConfig, BertForMaskedLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                              LlamaForCausalLM)

    if kind == "bert":
        model = BertForMaskedLM(BertConfig(hidden_size=256, num_attention_heads=4, intermediate_size=1024,
                                           num_hidden_layers=4))
    elif kind == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=256, n_head=4, n_layer=4, use_cache=False))
    else:
        model = LlamaForCausalLM(LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                                             intermediate_size=1024, num_hidden_layers=4, use_cache=False))
    ids = torch.randint(0, 1000, (4, 128))
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    if kind != "bert":
        inputs["use_cache"] = False
    return Loss(model), inputs


def vision_model(kind: str):
    from timm.models.resnet import BasicBlock, ResNet
    from timm.models.vision_transformer import VisionTransformer

    if kind == "vit":
        model = VisionTransformer(img_size=64, patch_size=8, embed_dim=256, depth=4, num_heads=4, num_classes=10)
    else:
        model = ResNet(BasicBlock, [1, 1, 1, 1], num_classes=10)
    return Classifier(model), {"pixel_values": torch.randn(8, 3, 64, 64), "labels": torch.randint(0, 10, (8,))}


def build(kind: str):
    torch.manual_seed(0)
    model, inputs = language_model(kind) if kind in ("bert", "gpt2", "llama") else vision_model(kind)
    return model.train().to(DEVICE), {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def timm_installed() -> bool:
    try:
        import timm  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------
# The ways to train, and one step


def autocast_for(dtype: str):
    if dtype in LOW_PRECISION:
        return torch.autocast(DEVICE, dtype=LOW_PRECISION[dtype])
    return torch.autocast(DEVICE, enabled=False)


def export(model, inputs, dtype: str):
    """The program, exported under the autocast it is called under, its
    backward assumed to run outside autocast (as one trains with autocast)."""
    with autocast_for(dtype):
        return predispatch.export_predispatch(model, (), inputs, backward_pass_autocast="off")


def make_way(way: str, model, inputs, dtype: str):
    """(the module to train, seconds spent exporting it first)."""
    if way == "eager":
        return model, 0.0
    if way == "torch.compile(model)":
        return torch.compile(model), 0.0
    start = time.process_time()
    ep = export(model, inputs, dtype)
    exported = time.process_time() - start
    if way == "torch.compile(ep.module())":
        return torch.compile(ep.module()), exported
    with autocast_for(dtype):  # compiled at once for the calls it will take (under autocast too)
        if way == "compile_training(ep)":
            return predispatch.compile_training(ep), exported
        if way == OWN_DRAWS:
            return predispatch.compile_training(ep, backend="inductor", options={"fallback_random": False}), exported
        return predispatch.compile_training(ep, backend="inductor"), exported


class Trainer:
    """One way of training: its module, its optimizer, one step at a time."""

    def __init__(self, way: str, model, inputs, dtype: str):
        self.module, self.export_seconds = make_way(way, model, inputs, dtype)
        self.inputs, self.dtype = inputs, dtype
        self.optimizer = torch.optim.SGD(self.module.parameters(), lr=1e-4)

    def step(self) -> float:
        with autocast_for(self.dtype):
            loss = self.module(**self.inputs)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.item()


def cpu_seconds() -> float:
    """This process's CPU time and its waited-for children's (inductor's C++ compiles);
    on CUDA, wall-clock seconds once the device has finished its work."""
    if DEVICE == "cuda":
        return step_clock()
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def step_clock() -> float:
    """One thread's CPU time on the CPU; on CUDA, wall-clock time after the queued kernels ran."""
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.process_time()


# --------------------------------------------------------------------------
# Measuring


def steady_steps(kind: str, dtype: str, steps: int, ways: tuple = (*WAYS, OWN_DRAWS)) -> tuple[dict, dict]:
    """Median CPU seconds per step of each way, interleaved in this process;
    and the error of each way that could not train."""
    model, inputs = build(kind)
    trainers, errors = {}, {}
    for way in ways:
        try:
            trainers[way] = Trainer(way, copy.deepcopy(model), inputs, dtype)
            for _ in range(2):
                trainers[way].step()
        except Exception as e:  # reported; the other ways are still measured
            trainers.pop(way, None)
            errors[way] = summarize(e)
    ways = list(trainers)
    times = {way: [] for way in ways}
    for i in range(steps):
        for way in ways[i % len(ways):] + ways[:i % len(ways)]:
            gc.collect()
            gc.disable()
            start = step_clock()
            trainers[way].step()
            times[way].append(step_clock() - start)
            gc.enable()
    return {way: statistics.median(t) for way, t in times.items()}, errors


def summarize(e: BaseException) -> str:
    first = str(e).strip().splitlines()
    return f"{type(e).__name__}: {first[0][:200] if first else ''}"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def step_peak_mib(trainer: Trainer) -> float | None:
    """Peak RSS of one step over the RSS before it, with the memory freed
    by the steps before handed back to the system first (``malloc_trim``):
    else a step reusing what an earlier one freed shows no growth. On CUDA,
    the peak of the caching allocator's memory over what it held before."""
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        trainer.step()
        torch.cuda.synchronize()
        return max(0, torch.cuda.max_memory_allocated() - before) / 2**20
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    before = _status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    trainer.step()
    return max(0, _status_kib("VmHWM") - before) / 1024


def first_step(kind: str, dtype: str, way: str) -> dict:
    """In this (fresh) process: the first step's CPU seconds, compile
    included, the export apart, then one step's peak memory."""
    model, inputs = build(kind)
    start = cpu_seconds()
    trainer = Trainer(way, model, inputs, dtype)
    trainer.step()
    seconds = cpu_seconds() - start - trainer.export_seconds
    for _ in range(2):
        trainer.step()
    return {"first_s": seconds, "export_s": trainer.export_seconds, "peak_mib": step_peak_mib(trainer)}


def first_step_in_subprocess(kind: str, dtype: str, way: str, timeout: float = 1800) -> dict:
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TORCHINDUCTOR_COMPILE_THREADS": "1",
               "PYTHONPATH": str(REPO)}
        try:
            proc = subprocess.run([sys.executable, __file__, "--device", DEVICE, "--child", f"{kind}:{dtype}:{way}"],
                                  env=env,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": "timeout"}
    for line in proc.stdout.splitlines():
        if line.startswith(CHILD_TAG):
            return json.loads(line[len(CHILD_TAG):])
    return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:200]}


def measure(kind: str, dtype: str, opts) -> dict:
    result = {"model": kind, "dtype": dtype}
    result["step_s"], result["errors"] = steady_steps(kind, dtype, opts.steps, opts.ways)
    if not opts.no_first_step:
        result["first"] = {way: first_step_in_subprocess(kind, dtype, way) for way in WAYS if way in opts.ways}
    print_result(result, flush=True)
    return result


# --------------------------------------------------------------------------
# Reporting


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    """Markdown: eager's step in ms, each way's step over eager's, the first
    step in s (the export apart), a step's peak memory in MiB."""
    head = ["model", "dtype", "eager ms"] + [f"{w} ×" for w in (*WAYS[1:], OWN_DRAWS)] + \
        [f"first step s: {w}" for w in WAYS] + ["export s"] + [f"peak MiB: {w}" for w in WAYS]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in results:
        step = r.get("step_s", {})
        eager = step.get("eager")
        ratios = [_fmt(step[w] / eager if eager and w in step else None, ".2f") for w in (*WAYS[1:], OWN_DRAWS)]
        first = r.get("first", {})
        firsts = [_fmt(first.get(w, {}).get("first_s"), ".1f") for w in WAYS]
        export_s = first.get("compile_training(ep)", {}).get("export_s")
        peaks = [_fmt(first.get(w, {}).get("peak_mib"), ".0f") for w in WAYS]
        rows.append("| " + " | ".join([r["model"], r["dtype"], _fmt(eager and eager * 1e3, ".0f"), *ratios, *firsts,
                                       _fmt(export_s, ".1f"), *peaks]) + " |")
    return "\n".join(rows)


def targets(results: list[dict]) -> list[str]:
    lines = []
    for r in results:
        step, first = r.get("step_s", {}), r.get("first", {})
        name = f"{r['model']} {r['dtype']}"
        if "eager" in step and "compile_training(ep)" in step:
            ratio = step["compile_training(ep)"] / step["eager"]
            lines.append(f"[{'ok' if ratio <= 1.0 else 'MISS'}] {name}: compile_training(ep) {ratio:.2f}x eager (<= 1.0)")
        theirs = [step[w] for w in WAYS[1:3] if w in step]
        if theirs and "compile_training(ep, inductor)" in step:
            ratio = step["compile_training(ep, inductor)"] / min(theirs)
            lines.append(f"[{'ok' if ratio <= 1.0 else 'MISS'}] {name}: inductor {ratio:.2f}x the faster torch.compile "
                         "(<= 1.0)")
        firsts = [first.get(w, {}).get("first_s") for w in WAYS[1:3]]
        ours = first.get("compile_training(ep, inductor)", {}).get("first_s")
        if ours is not None and all(f is not None for f in firsts):
            ok = ours <= min(firsts)
            lines.append(f"[{'ok' if ok else 'MISS'}] {name}: inductor's first step {ours:.1f} s, torch.compile's "
                         f"{min(firsts):.1f} s (no slower; the export, "
                         f"{first['compile_training(ep, inductor)'].get('export_s', 0):.1f} s, apart)")
    return lines


def print_result(r: dict, flush=False) -> None:
    step = r.get("step_s", {})
    parts = [f"{w} {step[w] * 1e3:.0f} ms" for w in (*WAYS, OWN_DRAWS) if w in step]
    print(f"{r['model']} {r['dtype']}: " + ", ".join(parts), flush=flush)
    for way, error in r.get("errors", {}).items():
        print(f"    {way} cannot train: {error}", flush=flush)
    for way, f in r.get("first", {}).items():
        print(f"    first step {way}: {f}", flush=flush)


def report(results: list[dict]) -> None:
    print("\n" + table(results) + "\n")
    for r in results:
        for way, error in r.get("errors", {}).items():
            print(f"{r['model']} {r['dtype']}: {way} cannot train: {error}")
    for line in targets(results):
        print(line)


# --------------------------------------------------------------------------


def _ways(text: str) -> tuple:
    ways = tuple(w.strip() for w in re.split(r",(?![^()]*\))", text) if w.strip()) or (*WAYS, OWN_DRAWS)  # not in (...)
    unknown = [w for w in ways if w not in (*WAYS, OWN_DRAWS)]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown ways {unknown}; the ways: {', '.join((*WAYS, OWN_DRAWS))}")
    return ways


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="", help="comma-separated models: " + ",".join(MODELS))
    p.add_argument("--dtypes", default=",".join(DTYPES),
                   help="fp32, bf16 (default both), fp16: the forward under autocast to it")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="where to train (cuda: wall-clock steps after synchronizing, the caching allocator's peak)")
    p.add_argument("--steps", type=int, default=8, help="interleaved rounds of steps (default 8)")
    p.add_argument("--no-first-step", action="store_true", help="skip the fresh-process first steps and memory")
    p.add_argument("--ways", default="", type=_ways,
                   help="comma-separated ways to measure (default all): " + ", ".join((*WAYS, OWN_DRAWS)))
    p.add_argument("--json", default=None, help="write all measurements to this file")
    p.add_argument("--from-json", default=None, metavar="PATH", help="print the report of a --json file again")
    p.add_argument("--system-malloc", action="store_true",
                   help="glibc's malloc defaults (not the tunables that keep freed memory)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def setup() -> None:
    if DEVICE == "cpu":
        torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    except ImportError:
        pass


# glibc's malloc keeping what it frees: no block mapped afresh per large tensor
KEEP_FREED_MEMORY = "glibc.malloc.mmap_threshold=4294967296:glibc.malloc.trim_threshold=17179869184"


def with_kept_memory(argv: list[str]) -> None:
    """Run this bench again with ``KEEP_FREED_MEMORY`` (glibc reads it at start)."""
    if os.environ.get("GLIBC_TUNABLES") != KEEP_FREED_MEMORY:
        os.environ["GLIBC_TUNABLES"] = KEEP_FREED_MEMORY
        os.execv(sys.executable, [sys.executable, __file__, *argv])


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    opts = parse_args(argv)
    global DEVICE
    DEVICE = opts.device
    if not opts.system_malloc and not opts.from_json:
        with_kept_memory(argv)
    setup()
    if opts.child:
        kind, dtype, way = opts.child.split(":", 2)
        try:
            out = first_step(kind, dtype, way)
        except Exception as e:
            out = {"error": summarize(e)}
        print(CHILD_TAG + json.dumps(out), flush=True)
        return
    if opts.from_json:
        report(json.loads(Path(opts.from_json).read_text()))
        return
    models = [m.strip() for m in opts.only.split(",") if m.strip()] or list(MODELS)
    if not timm_installed():
        print("the vision models skipped: timm is not installed (torch 2.14 and later)", flush=True)
        models = [m for m in models if m not in ("vit", "resnet")]
    dtypes = [d.strip() for d in opts.dtypes.split(",") if d.strip()]
    load = os.getloadavg()[0]
    if DEVICE == "cuda":
        print(f"on {torch.cuda.get_device_name()}: step times are wall-clock, peaks the CUDA allocator's", flush=True)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, steps {opts.steps}, "
          f"load average {load:.2f} on {os.cpu_count()} cores, "
          f"malloc: {'glibc defaults' if opts.system_malloc else 'freed memory kept'}", flush=True)
    start = time.perf_counter()
    results = [measure(kind, dtype, opts) for kind in models for dtype in dtypes]
    report(results)
    print(f"\n(total {time.perf_counter() - start:.0f} s; load average at end {os.getloadavg()[0]:.2f})")
    if opts.json:
        Path(opts.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
