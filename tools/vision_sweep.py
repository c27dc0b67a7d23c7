"""Vision models (torchvision's classification models, timm's families, an EMA
teacher), exported and compared with eager, in train and eval mode and under
bf16 CPU autocast.

    python tools/vision_sweep.py                          # everything (hours on one core)
    python tools/vision_sweep.py --source timm --limit 10 # the first ten timm models
    python tools/vision_sweep.py --only resnet18,vit_tiny_patch16_224 --modes train
    python tools/vision_sweep.py --json sweep.json        # the per-case records too

Needs torchvision and timm (``pip install -e '.[vision]'``; torch >= 2.14).
Models are built with random weights (``weights=None`` / ``pretrained=False``,
nothing is downloaded), ten classes, the smallest input each accepts (most
64x64, batch 2), and where the constructor allows, dropout and stochastic
depth on (timm's ``drop_rate`` / ``drop_path_rate``, torchvision's
``dropout`` / ``stochastic_depth_prob``) so that the random draws are
compared too: :func:`predispatch.testing.eager.assert_matches_eager` seeds
eager and the program alike, and checks outputs, which require grad,
gradients of the input and the parameters, parameters and buffers after the
call (BatchNorm's running statistics in train mode), under grad mode on and
off, and that re-exporting ``ep.module()`` gives the same graph.

Modes: ``train`` and ``eval`` (``module.train()`` / ``.eval()`` before the
export), ``bf16`` (train mode, the forward inside
``torch.autocast("cpu", torch.bfloat16)``: a region of the program).
The EMA teachers (``--source ema``) are the mean-teacher / DINO pattern: a
student and a copy of it whose forward updates the copy's parameters in
place by an exponential moving average under ``torch.no_grad()`` and runs the
teacher there.

Each case ends as ``passed``, ``refused`` (an ``ExportError``: the reason is
its first line), ``failed`` (the program differs from eager, or the export
raised something else: the difference), or ``skipped`` (larger than
``--max-params``, or eager itself does not run the model on the input), or
``timeout`` (over ``--timeout`` seconds).
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import re
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

import predispatch
from predispatch.testing.eager import assert_matches_eager

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools.sweep_common
from tools.sweep_common import (  # noqa: E402
    FAILED, PASSED, REFUSED, SKIPPED, TIMEOUT, Result, eager_runs, first_line, print_table,
    time_limit, timed_out, write_json)

MODES = ("train", "eval", "bf16")
BATCH, SIZE, CLASSES, DROP = 2, 64, 10, 0.1

# torchvision: the input side a model needs where 64 is too small, and the
# constructor arguments that make it smaller or switch on its random draws
TORCHVISION_SIZE = {"inception_v3": 75, "maxvit_t": 224}
TORCHVISION_KWARGS = {
    "vit_": {"image_size": 32},  # the patch grid: 2x2 (vit_h_14: 28, below)
    "vit_h_14": {"image_size": 28},
    "maxvit_t": {"input_size": (224, 224)},  # (maxvit and swin set stochastic_depth_prob themselves)
    "efficientnet": {"dropout": DROP, "stochastic_depth_prob": DROP},
    "convnext": {"stochastic_depth_prob": DROP},
    "mobilenet_v3": {"dropout": DROP},
    "mobilenet_v2": {"dropout": DROP},
    "mnasnet": {"dropout": DROP},
    "squeezenet": {"dropout": DROP},
    "alexnet": {"dropout": DROP},
    "vgg": {"dropout": DROP},
    "googlenet": {"dropout": DROP, "aux_logits": True, "init_weights": True},
    "inception_v3": {"dropout": DROP, "aux_logits": False, "init_weights": True},  # aux: 299x299 inputs
    "densenet": {"drop_rate": DROP},
}

# timm: one or two small variants of each family; kwargs beyond the common ones
TIMM_MODELS = {
    # CNNs with BatchNorm
    "resnet18": {}, "resnet10t": {}, "seresnext26d_32x4d": {}, "resnest14d": {},
    "regnetx_002": {}, "regnety_002": {}, "densenet121": {}, "dla34": {}, "cspresnet50": {},
    "dpn48b": {}, "res2net50_14w_8s": {}, "ese_vovnet19b_dw": {}, "rexnet_100": {},
    "hrnet_w18_small": {}, "repvgg_a0": {}, "mobileone_s0": {}, "ghostnet_050": {},
    "lcnet_050": {}, "hgnetv2_b0": {}, "inception_v3": {"_size": 75}, "xception41": {},
    "selecsls42b": {}, "tresnet_m": {}, "nf_resnet26": {}, "darknet17": {},
    # EfficientNet / MobileNet (stochastic depth, hard-swish, squeeze-excite)
    "efficientnet_b0": {}, "tinynet_e": {}, "mobilenetv3_small_050": {},
    "mobilenetv3_large_100": {}, "mobilenetv4_conv_small": {}, "fbnetv3_b": {},
    "mnasnet_small": {}, "efficientvit_b0": {}, "repvit_m0_9": {}, "fastvit_t8": {},
    # ConvNeXt and other modern convnets
    "convnext_atto": {}, "convnextv2_atto": {}, "edgenext_xx_small": {}, "inception_next_atto": {},
    "starnet_s050": {}, "poolformer_s12": {}, "mambaout_femto": {},
    # ViTs and hybrids
    "vit_tiny_patch16_224": {"img_size": 64}, "deit_tiny_distilled_patch16_224": {"img_size": 64},
    "eva02_tiny_patch14_224": {"img_size": 56, "_size": 56}, "cait_xxs24_224": {"img_size": 64},
    "xcit_nano_12_p16_224": {"img_size": 64}, "pit_ti_224": {"img_size": 64},
    "convit_tiny": {"img_size": 64}, "mixer_s16_224": {"img_size": 64}, "resmlp_12_224": {"img_size": 64},
    "gmlp_ti16_224": {"img_size": 64}, "levit_128s": {"img_size": 64}, "mobilevit_xxs": {},
    "pvt_v2_b0": {}, "twins_svt_small": {}, "tiny_vit_5m_224": {},
    "efficientformer_l1": {"_size": 224}, "efficientformerv2_s0": {"img_size": 64},  # l1: a 7x7 attention bias
    "coatnet_nano_rw_224": {"img_size": 64}, "crossvit_tiny_240": {"img_size": 240, "_size": 240},
    # Swin and other windowed attention
    "swin_tiny_patch4_window7_224": {"img_size": 112, "_size": 112},
    "swinv2_cr_tiny_224": {"img_size": 112, "_size": 112},
    "davit_tiny": {}, "focalnet_tiny_srf": {}, "gcvit_xxtiny": {"img_size": 64},
    "hiera_tiny_224": {"img_size": 64}, "mvitv2_tiny": {"img_size": 64},
    "maxvit_pico_rw_256": {"img_size": 64},
    # recurrent
    "sequencer2d_s": {},
}


@dataclasses.dataclass(frozen=True)
class Case:
    source: str  # "torchvision" | "timm" | "ema"
    model: str
    mode: str  # "train" | "eval" | "bf16"

    @property
    def name(self) -> str:
        return f"{self.source}:{self.model}:{self.mode}"


class Autocast(torch.nn.Module):
    """The model's forward under bf16 CPU autocast (a region of the program)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.model(x)


class EmaTeacher(torch.nn.Module):
    """A student and its EMA teacher (mean teacher, DINO, timm's ModelEma):
    the teacher's parameters are updated in place from the student's under
    ``no_grad``, then the teacher runs there; the loss pulls the student's
    prediction towards the teacher's."""

    def __init__(self, student, momentum: float = 0.9, update: str = "data"):
        super().__init__()
        self.student, self.teacher, self.momentum, self.update = student, copy.deepcopy(student), momentum, update
        for p in self.teacher.parameters():
            p.requires_grad_(False)

    def _update_teacher(self):
        teacher, student = list(self.teacher.parameters()), list(self.student.parameters())
        if self.update == "foreach":  # timm's ModelEmaV3
            torch._foreach_lerp_(teacher, [p.detach() for p in student], 1.0 - self.momentum)
            return
        for t, s in zip(teacher, student):  # DINO / mean teacher
            t.data.mul_(self.momentum).add_((1 - self.momentum) * s.detach().data)

    def forward(self, x):
        student = self.student(x)
        with torch.no_grad():
            self._update_teacher()
            teacher = self.teacher(x).softmax(-1)
        loss = -(teacher * student.log_softmax(-1)).sum(-1).mean()
        return loss, student, teacher


def torchvision_names() -> list[str]:
    """Every classification model, the smallest of each family first
    (resnet18, vgg11, ... then resnet34, vgg13, ...): a --limit run sees
    every family."""
    import torchvision
    names = torchvision.models.list_models(module=torchvision.models)
    size = {name: count_params(Case("torchvision", name, "eval")) for name in names}
    family = lambda name: re.match(r"[a-z]+(_v\d)?", name).group(0)  # noqa: E731
    rank = {name: sum(family(other) == family(name) and (size[other], other) < (size[name], name)
                      for other in names) for name in names}
    return sorted(names, key=lambda name: (rank[name], size[name]))


def _torchvision_kwargs(name: str) -> dict:
    kwargs = {"weights": None, "num_classes": CLASSES}
    for prefix, extra in TORCHVISION_KWARGS.items():
        if name.startswith(prefix):
            kwargs.update(extra)
    return kwargs


def build_torchvision(name: str):
    import torchvision
    kwargs = _torchvision_kwargs(name)
    size = kwargs.get("image_size", TORCHVISION_SIZE.get(name, SIZE))
    return torchvision.models.get_model(name, **kwargs), size


def build_timm(name: str):
    import timm
    kwargs = {k: v for k, v in TIMM_MODELS[name].items() if not k.startswith("_")}
    size = TIMM_MODELS[name].get("_size", SIZE)
    common = {"pretrained": False, "num_classes": CLASSES, "drop_rate": DROP}
    try:
        return timm.create_model(name, **common, drop_path_rate=DROP, **kwargs), size
    except TypeError:  # a family without stochastic depth
        return timm.create_model(name, **common, **kwargs), size


EMA_STUDENTS = {"resnet18-data": ("resnet18", "data"), "vit_tiny-foreach": ("vit_tiny_patch16_224", "foreach")}


def build_ema(name: str):
    student, update = EMA_STUDENTS[name]
    model, size = build_timm(student)
    return EmaTeacher(model, update=update), size


BUILDERS = {"torchvision": build_torchvision, "timm": build_timm, "ema": build_ema}


def count_params(case: Case) -> int:
    """Parameters of the model, built on the meta device (no memory, no init)."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, _ = BUILDERS[case.source](case.model)
    except Exception:  # an initializer the meta device lacks: counted after the real build
        return 0
    return sum(p.numel() for p in model.parameters())


def build(case: Case):
    """(module in the case's mode, args)."""
    torch.manual_seed(0)
    model, size = BUILDERS[case.source](case.model)
    model.train(case.mode != "eval")
    if case.mode == "bf16":
        model = Autocast(model)
    return model, (torch.randn(BATCH, 3, size, size),)


def run_case(case: Case, *, max_params: int, timeout: int, show_traceback=False) -> Result:
    params = count_params(case)
    if params > max_params:
        return Result(case, SKIPPED, f"{params / 1e6:.0f}M parameters > --max-params", params=params)
    model, args = build(case)
    params = params or sum(p.numel() for p in model.parameters())
    if params > max_params:
        return Result(case, SKIPPED, f"{params / 1e6:.0f}M parameters > --max-params", params=params)
    why_not = eager_runs(model, args)
    if why_not:
        return Result(case, SKIPPED, why_not, params=params)
    try:
        with time_limit(timeout), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert_matches_eager(model, args)
    except Exception as e:
        if timed_out():  # CaseTimeout, or what torch's C++ made of it
            return Result(case, TIMEOUT, f"over {timeout} s of CPU time", params=params)
        if isinstance(e, predispatch.ExportError):
            return Result(case, REFUSED, first_line(e), params=params)
        if show_traceback:
            traceback.print_exc()
        return Result(case, FAILED, first_line(e), params=params)
    return Result(case, PASSED, params=params)


def _torchvision_listed() -> list[str]:
    import torchvision
    return torchvision.models.list_models(module=torchvision.models)


def cases(sources, modes, only):
    names = {"torchvision": _torchvision_listed if only else torchvision_names,  # --only: no size ranking
             "timm": lambda: list(TIMM_MODELS), "ema": lambda: list(EMA_STUDENTS)}
    for source in sources:
        models = names[source]()
        if only:  # in the order asked for
            models = sorted((m for m in models if m in only), key=only.index)
        for model in models:
            for mode in modes:
                yield Case(source, model, mode)


def parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default="torchvision,timm,ema", help="comma-separated: torchvision,timm,ema")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: train,eval,bf16")
    parser.add_argument("--only", default="", help="comma-separated model names")
    parser.add_argument("--limit", type=int, default=0, help="at most this many models")
    parser.add_argument("--max-params", type=float, default=350e6,
                        help="skip larger models (default 350e6: the comparison holds ~10 copies of the weights)")
    parser.add_argument("--timeout", type=int, default=600, help="CPU seconds a case may take (default 600)")
    parser.add_argument("--json", default="", help="write the per-case records here")
    parser.add_argument("--traceback", action="store_true", help="print each failure's traceback")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    options = parse(argv)
    try:
        import timm  # noqa: F401
        import torchvision  # noqa: F401
    except ImportError as e:
        print(f"{e}: the sweep needs torchvision and timm (pip install -e '.[vision]', torch >= 2.14)")
        return 2
    torch.set_num_threads(1)
    only = list(filter(None, options.only.split(",")))
    results, models, start = [], [], time.perf_counter()
    for case in cases(options.source.split(","), options.modes.split(","), only):
        if (case.source, case.model) not in models:
            if options.limit and len(models) >= options.limit:
                break
            models.append((case.source, case.model))
        began = time.perf_counter()
        try:
            result = run_case(case, max_params=int(options.max_params), timeout=options.timeout,
                              show_traceback=options.traceback)
        except Exception as e:  # building the model, or the harness itself
            result = Result(case, SKIPPED, "build: " + first_line(e))
        result.seconds = time.perf_counter() - began
        results.append(result)
        print(f"{result.status:8s} {case.name} ({result.seconds:.0f} s) {result.detail}", flush=True)
        if options.json:  # after each case: an interrupted sweep keeps what it found
            write_json(options.json, results, time.perf_counter() - start)
        gc.collect()
    print_table(results, time.perf_counter() - start)
    return 1 if any(r.status == FAILED for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
