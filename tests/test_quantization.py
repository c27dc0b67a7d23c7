"""§6 PT2E quantization through regions, with torchao's X86InductorQuantizer.

For each model: every quantizable op (linear, conv), inside regions (nested
ones too) as at the top level, reads observed inputs after ``prepare_pt2e``
and dequantized ones after ``convert_pt2e``; the regions are the program's
(same names, kinds, modes, nesting); and the quantized output is as close to
the floating-point one as that of the same model without the regions (the
model's code with the ``with`` blocks taken out). torchao's own
``prepare_pt2e`` on the same program runs, and observes the top level only.

Tolerances: a quantized model differs from the float one by its
quantization error; the regions may not add to it. Where a region changes no
value (no_grad), the quantized outputs with and without it are equal bit for
bit; where it does (bf16 autocast), the error relative to the float output
may be at most 1.25x that without the region, plus bf16's own resolution.
"""
import contextlib
import copy
import sys

import pytest
import torch
from torch import nn

import predispatch

pytest.importorskip("torchao")
from torchao.quantization.pt2e import FakeQuantizeBase, ObserverBase  # noqa: E402
from torchao.quantization.pt2e.quantize_pt2e import prepare_pt2e as torchao_prepare_pt2e  # noqa: E402
from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (  # noqa: E402
    X86InductorQuantizer,
    get_default_x86_inductor_quantization_config,
)

aten = torch.ops.aten
QUANTIZABLE = (aten.linear.default, aten.conv2d.default)
DEQUANTIZE = (torch.ops.quantized_decomposed.dequantize_per_tensor.default,
              torch.ops.quantized_decomposed.dequantize_per_channel.default)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def quantizer(is_qat=False):
    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config(is_qat=is_qat))


def block(regions: bool, make):
    return make() if regions else contextlib.nullcontext()


def no_grad(regions):
    return block(regions, torch.no_grad)


def autocast(regions):
    return block(regions, lambda: torch.autocast("cpu", dtype=torch.bfloat16))


# --- reading a prepared or converted module ----------------------------------

def region_layout(gm):
    return [(r.depth, r.name, r.kind, r.args) for r in predispatch.regions(gm)]


def outer_values(gm):
    """Each region submodule's placeholder -> the value the call passes it."""
    outer = {}
    for r in predispatch.regions(gm):
        placeholders = [n for n in r.submodule.graph.nodes if n.op == "placeholder"]
        outer.update(zip(placeholders, r.inputs))
    return outer


def producer(node, outer):
    while node in outer:
        node = outer[node]
    return node


def quantizable_ops(gm):
    """(region depth, node) of every linear and conv, in every graph module."""
    depth = {id(gm): 0, **{id(r.submodule): r.depth + 1 for r in predispatch.regions(gm)}}
    return [(depth[id(m)], n) for m in gm.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.op == "call_function" and n.target in QUANTIZABLE]


def owner_of(gm, node):
    return next(m for m in gm.modules() if isinstance(m, torch.fx.GraphModule) and node.graph is m.graph)


def observer_of(gm, node, outer):
    """The observer (or fake quantizer) module whose output ``node`` is, if
    any (a fake quantizer of a bf16 value: cast back to bf16)."""
    node = producer(node, outer)
    if node.target is aten._to_copy.default:
        node = producer(node.args[0], outer)
    if node.op != "call_module":
        return None
    module = owner_of(gm, node).get_submodule(node.target)
    return module if isinstance(module, (ObserverBase, FakeQuantizeBase)) else None


def observed_inputs(gm):
    """Per quantizable op: (depth, observers of its input and weight)."""
    outer = outer_values(gm)
    return [(depth, [observer_of(gm, a, outer) for a in n.args[:2]]) for depth, n in quantizable_ops(gm)]


def observers_in_regions(gm):
    """Observer calls placed inside region submodules (at any depth)."""
    return sum(1 for r in predispatch.regions(gm) for n in r.submodule.graph.nodes
               if n.op == "call_module"
               and isinstance(r.submodule.get_submodule(n.target), (ObserverBase, FakeQuantizeBase)))


def dequantized_inputs(gm):
    outer = outer_values(gm)
    return [(depth, [producer(a, outer).target in DEQUANTIZE for a in n.args[:2]])
            for depth, n in quantizable_ops(gm)]


def relative_error(got, expected):
    got, expected = got.float(), expected.float()
    return ((got - expected).norm() / expected.norm()).item()


# --- the flow ------------------------------------------------------------------

def quantize(model, example, calibration, prepare=predispatch.prepare_pt2e):
    """Export, prepare, calibrate, convert: (prepared, converted)."""
    ep = predispatch.export_predispatch(copy.deepcopy(model), example)
    prepared = prepare(ep.module(), quantizer())
    with torch.no_grad():
        for batch in calibration:
            prepared(*batch)
    layout = region_layout(prepared)
    converted = predispatch.convert_pt2e(copy.deepcopy(prepared))
    assert region_layout(ep.module()) == layout == region_layout(converted)
    return prepared, converted


def check_quantized(model, example, calibration, test_batch):
    """Everything quantizable inside and outside regions observed, then
    dequantized; returns (relative error of the quantized output, observer
    calls inside regions, quantizable ops inside regions)."""
    prepared, converted = quantize(model, example, calibration)
    observed = observed_inputs(prepared)
    assert observed and all(all(obs) for _, obs in observed), observed
    assert all(all(dq) for _, dq in dequantized_inputs(converted))
    with torch.no_grad():
        expected, got = copy.deepcopy(model)(*test_batch), converted(*test_batch)
    in_regions = sum(1 for depth, _ in observed if depth > 0)
    return relative_error(got, expected), observers_in_regions(prepared), in_regions, got


# --- a Linear in a no_grad region and one in an autocast region -----------------

class LinearsInRegions(nn.Module):
    def __init__(self, regions=True):
        super().__init__()
        self.regions = regions
        self.top, self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = self.top(x).relu()
        with no_grad(self.regions):
            y = self.a(x)  # x crosses into the region and is read at the top level too
        with autocast(self.regions):
            z = self.b(h + y)
        return z.float() + h


def calibration_batches(shape, n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(*shape, generator=gen),) for _ in range(n)]


def test_linears_in_no_grad_and_autocast_regions_are_quantized():
    torch.manual_seed(0)
    model = LinearsInRegions().eval()
    plain = copy.deepcopy(model)
    plain.regions = False
    batches = calibration_batches((8, 16))
    error, observers, in_regions, _ = check_quantized(model, batches[0], batches, batches[-1])
    plain_error, plain_observers, _, _ = check_quantized(plain, batches[0], batches, batches[-1])
    assert in_regions == 2 and observers >= 1
    assert error <= 1.25 * plain_error + 4e-3, (error, plain_error)


def test_a_value_crossing_a_region_boundary_has_one_observer():
    """x feeds the top-level linear and the one in the no_grad region: one
    observer, so one scale and zero point, on both sides; converted, both
    dequantize the same quantized value (torchao gives each use its own
    dequantize)."""
    torch.manual_seed(0)
    model = LinearsInRegions().eval()
    batches = calibration_batches((8, 16))
    prepared, converted = quantize(model, batches[0], batches)
    (_, (top_x, _)), (_, (region_x, _)) = observed_inputs(prepared)[:2]
    assert top_x is region_x
    outer = outer_values(converted)
    dequantized = [producer(n.args[0], outer) for _, n in quantizable_ops(converted)[:2]]
    assert all(dq.target in DEQUANTIZE for dq in dequantized)
    top, in_region = [producer(dq.args[0], outer) for dq in dequantized]
    assert top is in_region and top.target is torch.ops.quantized_decomposed.quantize_per_tensor.default


def test_torchao_prepare_pt2e_on_the_program_observes_the_top_level_only():
    """What torchao's own prepare_pt2e does with a program that has regions
    (design/quantization.md says so): it runs, observes the top-level linear, and leaves
    the linears inside the regions unobserved, without a warning."""
    torch.manual_seed(0)
    model = LinearsInRegions().eval()
    ep = predispatch.export_predispatch(model, (torch.randn(8, 16),))
    prepared = torchao_prepare_pt2e(ep.module(), quantizer())
    observed = [(depth, all(obs)) for depth, obs in observed_inputs(prepared)]
    assert observed == [(0, True), (1, False), (1, False)]
    assert observers_in_regions(prepared) == 0


# --- a Llama under autocast, its rotary embedding under no_grad -----------------

transformers = pytest.importorskip("transformers")
VOCAB = 128


class CausalLM(nn.Module):
    """A tiny Llama returning its logits; with ``regions``, its forward runs
    under bf16 autocast and the rotary embedding under no_grad (nested)."""

    def __init__(self, regions=True):
        super().__init__()
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False,
            attn_implementation="sdpa", bos_token_id=0, eos_token_id=1, pad_token_id=2)
        torch.manual_seed(0)
        self.model = transformers.LlamaForCausalLM(config).eval()
        self.regions = regions
        rotary = self.model.model.rotary_emb
        forward = type(rotary).forward
        rotary.forward = lambda *a, **k: self._rotary(forward, rotary, *a, **k)

    def _rotary(self, forward, rotary, *args, **kwargs):
        with no_grad(self.regions):
            return forward(rotary, *args, **kwargs)

    def forward(self, input_ids):
        with autocast(self.regions):
            return self.model(input_ids=input_ids, use_cache=False).logits.float()


def token_batches(n=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (2, 16), generator=gen),) for _ in range(n)]


def test_llama_under_autocast_is_quantized_inside_its_regions():
    model, plain = CausalLM(regions=True), CausalLM(regions=False)
    batches = token_batches()
    error, observers, in_regions, _ = check_quantized(model, batches[0], batches, batches[-1])
    plain_error, _, plain_in_regions, _ = check_quantized(plain, batches[0], batches, batches[-1])
    assert plain_in_regions == 0
    assert in_regions == 15  # every linear: 2 layers x 7, and the head
    assert observers > 0
    assert error <= 1.25 * plain_error + 4e-3, (error, plain_error)


def test_llama_regions_nest_in_the_quantized_module():
    batches = token_batches(1)
    _, converted = quantize(CausalLM(), batches[0], batches)
    assert region_layout(converted) == [(0, "autocast_bfloat16_0", "autocast", ("cpu", torch.bfloat16, True, True)),
                                        (1, "no_grad_1", "grad", (False,))]


# --- a conv net with a no_grad mean teacher and an EMA ---------------------------

class MeanTeacherNet(nn.Module):
    """A student conv net, and a teacher (its weights an EMA of the
    student's, in a real run) applied under no_grad, which also keeps an
    EMA of the teacher's logits in a buffer."""

    def __init__(self, regions=True, batch_norm=True):
        super().__init__()
        self.regions = regions
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16) if batch_norm else nn.Identity(), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(32, 10)
        self.teacher = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                     nn.Flatten(), nn.Linear(8, 10))
        self.register_buffer("teacher_mean", torch.zeros(10))

    def forward(self, x):
        logits = self.head(self.features(x))
        with no_grad(self.regions):
            target = self.teacher(x)
            self.teacher_mean.mul_(0.9).add_(0.1 * target.mean(0))
        return logits + target.detach()


def test_conv_net_with_a_no_grad_ema_is_quantized_inside_its_region():
    torch.manual_seed(0)
    model = MeanTeacherNet().eval()
    plain = copy.deepcopy(model)
    plain.regions = False
    batches = calibration_batches((4, 3, 16, 16))
    error, observers, in_regions, got = check_quantized(model, batches[0], batches, batches[-1])
    plain_error, _, _, plain_got = check_quantized(plain, batches[0], batches, batches[-1])
    assert in_regions == 2 and observers > 0
    assert error == plain_error
    assert torch.equal(got, plain_got)  # a no_grad region changes no value


def test_the_quantized_module_still_updates_the_ema():
    torch.manual_seed(0)
    model = MeanTeacherNet().eval()
    batches = calibration_batches((4, 3, 16, 16))
    _, converted = quantize(model, batches[0], batches)
    before = converted.teacher_mean.clone()
    converted(*batches[0])
    assert not torch.equal(converted.teacher_mean, before)


# --- QAT -------------------------------------------------------------------------

def test_qat_trains_through_regions_and_no_grad_still_cuts_gradients():
    """Fake quantization inside the no_grad region too; forward and backward
    run, the student's weights get gradients, the teacher's (used only under
    no_grad) none; a few SGD steps, then convert.

    Without BatchNorm: torchao's QAT conv-bn fusion matches the mutating
    ``aten.batch_norm`` torch.export keeps, and a predispatch program has the
    functional ``_native_batch_norm_legit_functional`` (design/quantization.md)."""
    torch.manual_seed(0)
    model = MeanTeacherNet(batch_norm=False).train()
    batches = calibration_batches((4, 3, 16, 16))
    ep = predispatch.export_predispatch(copy.deepcopy(model), batches[0])
    prepared = predispatch.prepare_qat_pt2e(ep.module(), quantizer(is_qat=True))
    assert region_layout(prepared) == region_layout(ep.module())
    observed = observed_inputs(prepared)
    assert all(all(isinstance(o, FakeQuantizeBase) for o in obs) for _, obs in observed)
    assert sum(1 for depth, _ in observed if depth > 0) == 2
    assert observers_in_regions(prepared) > 0
    optimizer = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for (x,) in batches:
        optimizer.zero_grad()
        prepared(x).square().mean().backward()
        grads = {name: p.grad for name, p in prepared.named_parameters()}
        assert all(g is not None and g.abs().sum() > 0 for n, g in grads.items() if not n.startswith("teacher"))
        assert all(g is None for n, g in grads.items() if n.startswith("teacher"))
        optimizer.step()
    with torch.no_grad():
        fake_quantized = prepared(batches[0][0])
    converted = predispatch.convert_pt2e(prepared)  # in place, as torchao's
    assert region_layout(converted) == region_layout(ep.module())
    assert all(all(dq) for _, dq in dequantized_inputs(converted))
    with torch.no_grad():
        assert relative_error(converted(batches[0][0]), fake_quantized) < 0.05


def test_qat_fake_quantizes_inside_an_autocast_region():
    model = CausalLM()
    batches = token_batches(2)
    ep = predispatch.export_predispatch(copy.deepcopy(model), batches[0])
    prepared = predispatch.prepare_qat_pt2e(ep.module(), quantizer(is_qat=True))
    assert [depth for depth, obs in observed_inputs(prepared) if all(obs)] == [1] * 15
    prepared(*batches[0]).logsumexp(-1).mean().backward()
    grads = {name: p.grad for name, p in prepared.named_parameters()}
    assert all(g is not None for g in grads.values()), [n for n, g in grads.items() if g is None]


# --- torchao missing -------------------------------------------------------------

@pytest.mark.parametrize("function", ["prepare_pt2e", "prepare_qat_pt2e", "convert_pt2e"])
def test_without_torchao_the_error_names_the_extra(monkeypatch, function):
    for name in [m for m in sys.modules if m == "torchao" or m.startswith("torchao.")]:
        monkeypatch.setitem(sys.modules, name, None)  # import fails as when not installed
    module = predispatch.export_predispatch(nn.Linear(2, 2), (torch.randn(1, 2),)).module()
    args = (module,) if function == "convert_pt2e" else (module, object())
    with pytest.raises(ImportError, match=r"pip install 'predispatch\[quant\]'"):
        getattr(predispatch, function)(*args)
