"""The guarantees on a CUDA device, against eager: autocast regions on
"cuda" in fp16 and bf16 (nested, with an autocast-off block), CUDA's random
generator (dropout's draws, its state after the call), buffer writes under
no_grad, BatchNorm's statistics, a custom autograd.Function, save and load, a
program called under the caller's CUDA autocast with the backward's check,
and compile_training with its eager and inductor backends (dynamic sizes
without a new compile; a Llama's steps as torch.compile takes them).

Skipped without a GPU: CI has none; a GPU machine runs them
(``pytest tests/test_cuda.py``). ``PREDISPATCH_TEST_DEVICE=cpu`` runs the
same cases on the CPU, a check of the tests themselves."""
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import predispatch
from predispatch import _torch
from predispatch.testing.eager import assert_matches_eager, assert_runs_match, run_module
from test_training_backends import ClampStraightThrough, _reset  # the CPU tests' Function and reset

DEVICE = os.environ.get("PREDISPATCH_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device")

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
TOLERANCE = {"fp16": {"rtol": 1e-2, "atol": 1e-2}, "bf16": {"rtol": 3e-2, "atol": 3e-2}}


class EveryRegion(torch.nn.Module):
    """No_grad writes to buffers and an input, a CUDA autocast region with an
    autocast-off block inside, BatchNorm, dropout and a custom Function."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype
        self.inner, self.outer = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)
        self.norm = torch.nn.BatchNorm1d(16)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(16))

    def forward(self, x, seen):
        with torch.no_grad():
            self.calls.add_(1)
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
            seen.add_(x.sum(0))
        with torch.autocast(DEVICE, dtype=self.dtype):
            h = self.inner(x)  # in the low precision
            a = torch.softmax(h, -1)  # fp32 in CUDA's autocast
            with torch.autocast(DEVICE, enabled=False):
                s = h.float().sin()
        h = ClampStraightThrough.apply(F.dropout(self.norm(h.float() + a + s), 0.25, training=True))
        return self.outer(h)


def _inputs(batch: int, seed: int = 0):
    torch.manual_seed(seed)
    return torch.randn(batch, 16, device=DEVICE), torch.zeros(16, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_regions_on_the_device_match_eager(dtype):
    ep = assert_matches_eager(EveryRegion(DTYPES[dtype]).to(DEVICE), _inputs(8), **TOLERANCE[dtype])
    code = ep.graph_module.print_readable(print_output=False)
    assert "wrap_with_autocast" in code and "wrap_with_set_grad_enabled" in code
    device = next(n for n in ep.graph.nodes if "wrap_with_autocast" in str(n.target)).args[0]
    assert device == DEVICE


def test_dropout_draws_from_the_devices_generator_as_eager():
    module = EveryRegion(torch.bfloat16).to(DEVICE)
    ep = predispatch.export_predispatch(copy.deepcopy(module), _inputs(8))
    for seed in (1, 2):
        expected = run_module(copy.deepcopy(module), _inputs(8, seed), None, seed=seed)
        got = run_module(copy.deepcopy(ep.module()), _inputs(8, seed), None, seed=seed)
        assert_runs_match(expected, got, **TOLERANCE["bf16"])  # the generators' states compared exactly
        if DEVICE == "cuda":
            assert got.cuda_rng_states_after is not None


def test_save_and_load_keep_the_device_program(tmp_path):
    module = EveryRegion(torch.float16).to(DEVICE).eval()
    ep = predispatch.export_predispatch(copy.deepcopy(module), _inputs(8))
    torch.export.save(ep, tmp_path / "program.pt2")
    loaded = torch.export.load(tmp_path / "program.pt2")
    x, seen = _inputs(8, 3)
    seen_loaded = seen.clone()
    torch.manual_seed(4)  # the same dropout draws
    out_loaded = loaded.module()(x, seen_loaded)
    torch.manual_seed(4)
    torch.testing.assert_close(out_loaded, ep.module()(x, seen))
    torch.testing.assert_close(seen_loaded, seen)


class Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.down(F.gelu(self.up(x))).float().logsumexp(-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_program_called_under_the_devices_autocast_trains_and_checks_the_backward(dtype):
    torch.manual_seed(0)
    module, x = Mlp().to(DEVICE), torch.randn(8, 16, device=DEVICE)
    with torch.autocast(DEVICE, dtype=DTYPES[dtype]):
        ep = predispatch.export_predispatch(copy.deepcopy(module), (x,), backward_pass_autocast="off")
        train = predispatch.compile_training(ep)
        ours, theirs = train(x).sum(), module(x).sum()
    ours.backward()
    theirs.backward()
    for name, p in module.named_parameters():
        torch.testing.assert_close(dict(train.named_parameters())[name].grad, p.grad, **TOLERANCE[dtype])
    plain = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(module), (x,)))
    loss = plain(x).sum()  # its backward's matmuls traced in fp32, outside autocast
    with torch.autocast(DEVICE, dtype=DTYPES[dtype]), \
            pytest.raises(predispatch.BackwardAutocastMismatchError, match=f"autocast\\('{DEVICE}'"):
        loss.backward()


@pytest.mark.parametrize("backend", ["eager", "inductor"])
def test_compile_training_matches_eager_on_the_device(backend, monkeypatch):
    torch.manual_seed(0)
    module = EveryRegion(torch.bfloat16).to(DEVICE)
    ep = predispatch.export_predispatch(copy.deepcopy(module), _inputs(8),
                                        dynamic_shapes=({0: Dim("batch", min=2, max=64)}, None))
    train = predispatch.compile_training(ep, backend=backend)
    assert_runs_match(run_module(copy.deepcopy(module), _inputs(8), None),
                      run_module(_reset(train, module), _inputs(8), None), **TOLERANCE["bf16"])
    compiled = []
    compile_graph = _torch.inductor.compile_graph
    monkeypatch.setattr(_torch.inductor, "compile_graph", lambda *a, **k: compiled.append(1) or compile_graph(*a, **k))
    for batch in (13, 64):
        assert_runs_match(run_module(copy.deepcopy(module), _inputs(batch), None),
                          run_module(_reset(train, module), _inputs(batch), None), **TOLERANCE["bf16"],
                          what=f"[batch {batch}] ")
    assert not compiled, f"inductor compiled {len(compiled)} graph(s) for sizes inside the program's range"


def test_three_inductor_steps_of_a_llama_under_bf16_autocast_match_torch_compiles():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                         num_hidden_layers=2, vocab_size=128, use_cache=False)
    model = LlamaForCausalLM(config).train().to(DEVICE)
    ids = torch.randint(0, 128, (2, 16), device=DEVICE)
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        ep = predispatch.export_predispatch(copy.deepcopy(model), (), inputs, backward_pass_autocast="off")
        ours = predispatch.compile_training(ep, backend="inductor")
    theirs = copy.deepcopy(model)
    for module in (ours, torch.compile(theirs)):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(3):
            optimizer.zero_grad()
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                out = module(**inputs)
            (out.loss if hasattr(out, "loss") else out).backward()
            optimizer.step()
    expected = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, **TOLERANCE["bf16"], msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p, expected[name], **TOLERANCE["bf16"], msg=lambda m: f"{name}: {m}")
