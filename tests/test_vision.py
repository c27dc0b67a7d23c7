"""Vision models from torchvision and timm, a CI-sized sample of
``tools/vision_sweep.py`` (which runs every torchvision classification model
and one or two models of each timm family, in train and eval mode and under
bf16 autocast).

Each test compares the program with eager (``assert_matches_eager``: outputs,
gradients of the input and parameters, parameters and buffers after the
call, under grad mode on and off, and a stable re-export), with dropout and
stochastic depth on: both runs draw from the same seed, so the masks match
where the program draws what eager draws. Then a structural fact of the
program: BatchNorm's running statistics and the EMA teacher's parameters are
written back (``BUFFER_MUTATION`` / ``PARAMETER_MUTATION``), the teacher's
update is a no_grad region, an autocast block a bf16 region.

torchvision and timm need torch >= 2.14 (the ``vision`` extra); elsewhere the
file is skipped. Models are built with random weights (nothing downloaded),
timm's ``test_*`` configs where a family has one, at the smallest inputs.
"""
import sys
from pathlib import Path

import pytest
import torch
from torch.export.graph_signature import OutputKind

import predispatch
from predispatch.testing.eager import assert_matches_eager

torchvision = pytest.importorskip("torchvision")
timm = pytest.importorskip("timm")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools
from tools.vision_sweep import Autocast, EmaTeacher  # noqa: E402

DROP = 0.1


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Thousands of small kernels: a second OpenMP thread only adds stalls."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def timm_model(name, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=10, drop_rate=DROP, **kwargs)


def images(size=32):
    return (torch.randn(2, 3, size, size),)


def mutated(ep, kind) -> set[str]:
    return {spec.target for spec in ep.graph_signature.output_specs if spec.kind == kind}


def top_regions(ep) -> list[tuple]:
    """(kind, mode arguments) of the program's outermost regions."""
    return [(region.kind, region.args) for region in predispatch.regions(ep) if region.depth == 0]


def test_torchvision_resnet_batchnorm_in_train_mode():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(weights=None, num_classes=10).train()
    ep = assert_matches_eager(model, images())
    assert {"bn1.running_mean", "bn1.running_var", "bn1.num_batches_tracked"} <= mutated(ep, OutputKind.BUFFER_MUTATION)


def test_timm_vit_with_drop_path():
    ep = assert_matches_eager(timm_model("test_vit", drop_path_rate=DROP, img_size=32).train(), images())
    assert not mutated(ep, OutputKind.BUFFER_MUTATION)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_timm_mobilenetv3_hard_swish(mode):
    model = timm_model("mobilenetv3_small_050", drop_path_rate=DROP).train(mode == "train")
    ep = assert_matches_eager(model, images())
    assert bool(mutated(ep, OutputKind.BUFFER_MUTATION)) == (mode == "train")  # BatchNorm's statistics


def test_timm_efficientnet_stochastic_depth_under_bf16_autocast():
    model = Autocast(timm_model("test_efficientnet", drop_path_rate=DROP).train())
    ep = assert_matches_eager(model, images())
    assert top_regions(ep) == [("autocast", ("cpu", torch.bfloat16, True, True))]


@pytest.mark.parametrize("update", ["data", "foreach"])
def test_ema_teacher_updated_under_no_grad(update):
    """The mean-teacher / DINO pattern: the teacher's parameters move towards
    the student's in place under no_grad, then the teacher runs there."""
    ema = EmaTeacher(timm_model("test_resnet", drop_path_rate=DROP), update=update).train()
    ep = assert_matches_eager(ema, images())
    teacher = {f"teacher.{name}" for name, _ in ema.teacher.named_parameters()}
    assert mutated(ep, OutputKind.PARAMETER_MUTATION) == teacher
    assert ("grad", (False,)) in top_regions(ep)
