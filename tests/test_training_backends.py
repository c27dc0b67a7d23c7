"""§3 compile_training's backends (issue 39): "inductor" and a torch.compile-style
callable keep what the default guarantees, against eager: outputs, gradients
of inputs and parameters (inductor's within its numerics), buffer and input
writes, torch's generator after the call (eager's draws), the backward's
autocast check, a program's dynamic sizes without a new compile, ``None``
for a gradient nothing reaches; a sharded program's step on each rank; five
steps of a Llama as torch.compile takes them. Bad options are refused.

Inductor's compiles take seconds: one module carries most of the cases."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import predispatch
from predispatch import _torch
from predispatch.downstream.training import CompileError
from predispatch.testing.eager import assert_runs_match, run_module

BF16 = {"rtol": 2e-2, "atol": 2e-2}  # an autocast region: bf16 kernels fused otherwise


class ClampStraightThrough(torch.autograd.Function):
    """A custom backward: the gradient passes the clamp unchanged, halved."""

    @staticmethod
    def forward(ctx, x):
        return x.clamp(-1, 1)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5


class EveryGuarantee(torch.nn.Module):
    """A no_grad region writing two buffers and an input, an autocast region,
    dropout, a custom autograd.Function, and a second output from a head that
    a loss over the first never reaches."""

    def __init__(self):
        super().__init__()
        self.inner, self.outer, self.side = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(8, 2)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("mean", torch.zeros(8))

    def forward(self, x, seen):
        with torch.no_grad():
            self.calls.add_(1)
            self.mean.mul_(0.9).add_(x.mean(0), alpha=0.1)
            seen.add_(x.sum(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.inner(x)
        h = ClampStraightThrough.apply(F.dropout(h.float(), 0.25, training=True))
        return self.outer(h), self.side(h.detach())


def _inputs(batch: int):
    torch.manual_seed(batch)
    return torch.randn(batch, 8), torch.zeros(8)


def _reset(train, module):
    """The compiled module from the eager module's state again, no gradients (one
    compiled module serves several cases)."""
    train.load_state_dict(module.state_dict())
    train.zero_grad(set_to_none=True)
    return train


@pytest.fixture(scope="module")
def inductor_program():
    """EveryGuarantee, exported with a dynamic batch and compiled by inductor."""
    torch.manual_seed(0)
    module = EveryGuarantee()
    ep = predispatch.export_predispatch(copy.deepcopy(module), _inputs(4),
                                        dynamic_shapes=({0: Dim("batch", min=2, max=32)}, None))
    return module, predispatch.compile_training(ep, backend="inductor")


@pytest.mark.parametrize("grad_mode", [True, False])
def test_inductor_matches_eager(inductor_program, grad_mode):
    module, train = inductor_program
    expected = run_module(copy.deepcopy(module), _inputs(6), None, grad_mode=grad_mode)
    got = run_module(_reset(train, module), _inputs(6), None, grad_mode=grad_mode)
    assert_runs_match(expected, got, **BF16)  # eager's draws: the generator's state is compared exactly


def test_inductor_compiles_a_dynamic_size_once(inductor_program, monkeypatch):
    module, train = inductor_program
    run_module(train, _inputs(5), None)  # the kind of call (inputs requiring grad) compiled once
    compiled = []
    compile_graph = _torch.inductor.compile_graph
    monkeypatch.setattr(_torch.inductor, "compile_graph", lambda *a, **k: compiled.append(1) or compile_graph(*a, **k))
    for batch in (9, 32, 2):
        assert_runs_match(run_module(copy.deepcopy(module), _inputs(batch), None),
                          run_module(_reset(train, module), _inputs(batch), None), **BF16, what=f"[batch {batch}] ")
    assert not compiled, f"inductor compiled {len(compiled)} graph(s) for sizes inside the program's range"


def test_inductor_leaves_an_unreached_gradient_none(inductor_program):
    module, train = inductor_program
    _reset(train, module)
    out, side = train(torch.randn(3, 8, requires_grad=True), torch.zeros(8))
    out.sum().backward()  # side's head is not in the loss: eager leaves its gradient None
    assert train.side.weight.grad is None and train.side.bias.grad is None
    assert train.outer.weight.grad is not None


def test_inductor_checks_the_backwards_autocast(inductor_program):
    module, train = inductor_program
    out, _ = train(torch.randn(3, 8, requires_grad=True), torch.zeros(8))
    with torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(predispatch.BackwardAutocastMismatchError, match="traced assuming no autocast"):
        out.sum().backward()


class MutatesInputWithParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([2.0, 3.0]))

    def forward(self, x):
        x.mul_(self.w)  # w's gradient needs x as it was before
        return (x * self.w).sum()


def test_inductor_saves_an_input_it_mutates_as_it_was():
    """Inductor drops the trace's copy of the input (a no-op to it), so the
    backward would read the input the forward writes (torch.compile(module)
    fails on this module: autograd finds the saved input's version changed)."""
    ep = predispatch.export_predispatch(MutatesInputWithParameter(), (torch.ones(2),))
    train = predispatch.compile_training(ep, backend="inductor")
    eager = MutatesInputWithParameter()
    for module in (eager, train):
        x = torch.tensor([1.0, 2.0])
        module(x).backward()
        torch.testing.assert_close(x, torch.tensor([2.0, 6.0]))
    torch.testing.assert_close(train.w.grad, eager.w.grad)


# --- a torch.compile-style callable


class ScaleByBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) * x.shape[0]


def test_a_callable_backend_compiles_the_forward_then_the_backward():
    graphs = []

    def backend(gm, example_inputs):  # as torch.compile calls a backend
        graphs.append(gm)
        return gm.forward

    module = ScaleByBatch()
    ep = predispatch.export_predispatch(copy.deepcopy(module), (torch.randn(4, 3),),
                                        dynamic_shapes=({0: Dim("batch", min=2, max=16)},))
    train = predispatch.compile_training(ep, backend=backend)
    assert len(graphs) == 2 and "tangents_1" in graphs[1].code  # the forward graph, then the backward's
    for batch in (6, 9):
        x = torch.randn(batch, 3)
        train.zero_grad(set_to_none=True)
        assert_runs_match(run_module(copy.deepcopy(module), (x,), None), run_module(train, (x,), None))
    assert len(graphs) == 4, "a second size inside the dynamic range was compiled again"


def test_a_backend_that_fails_raises_compile_error():
    def broken(gm, example_inputs):
        raise RuntimeError("no kernel for this")

    ep = predispatch.export_predispatch(torch.nn.Linear(3, 1), (torch.randn(4, 3),))
    with pytest.raises(CompileError, match=r"backend=broken\) could not compile the program: "
                                           r"RuntimeError: no kernel for this") as caught:
        predispatch.compile_training(ep, backend=broken)
    assert isinstance(caught.value, predispatch.ExportError)


def test_a_backward_that_fails_raises_its_own_error():
    # AOTAutograd frees what the call saved before its compiled backward runs: the
    # failure is the kernel's, not "freed by an earlier backward" (a cuDNN error
    # on a GPU was reported so)
    def backend(gm, example_inputs):
        if "tangents_1" not in gm.code:
            return gm.forward

        def backward(*args):
            raise RuntimeError("the backward's kernel failed")
        return backward

    train = predispatch.compile_training(
        predispatch.export_predispatch(torch.nn.Linear(3, 1), (torch.randn(4, 3),)), backend=backend)
    for _ in range(2):  # the first step's backward, and a later step's
        with pytest.raises(RuntimeError, match="the backward's kernel failed"):
            train(torch.randn(4, 3)).sum().backward()


@pytest.mark.parametrize("backend, options, message", [
    ("tvm", None, "unknown backend 'tvm'; use one of 'eager', 'inductor', or a callable"),
    ("eager", {"fallback_random": False}, "options are inductor's config, for backend='inductor' only"),
    ("inductor", {"no_such_option": 1}, r"unknown inductor option\(s\) \['no_such_option'\]"),
    ("inductor", ["fallback_random"], "options must be a dict"),
])
def test_bad_backends_and_options_are_refused(backend, options, message):
    ep = predispatch.export_predispatch(torch.nn.Linear(3, 1), (torch.randn(4, 3),))
    with pytest.raises(ValueError, match=message):
        predispatch.compile_training(ep, backend=backend, options=options)


# --- five steps of a Llama, as torch.compile takes them


def test_five_inductor_steps_of_a_llama_match_torch_compiles():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64,
                         num_hidden_layers=2, vocab_size=64, use_cache=False)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 8))
    inputs = {"input_ids": ids, "labels": ids, "use_cache": False}
    ep = predispatch.export_predispatch(copy.deepcopy(model), (), inputs)
    ours, theirs = predispatch.compile_training(ep, backend="inductor"), copy.deepcopy(model)
    for module in (ours, torch.compile(theirs)):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
        for _ in range(5):
            optimizer.zero_grad()
            out = module(**inputs)
            (out.loss if hasattr(out, "loss") else out).backward()
            optimizer.step()
    expected = dict(theirs.named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, expected[name].grad, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(p, expected[name], rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")


# --- a sharded program: each rank's step, its collectives kept


def _tensor_parallel_with_inductor(rank: int, world: int) -> dict:
    from test_sharding import _max_differences, tensor_parallel_mlp
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    module = tensor_parallel_mlp(mesh)
    ep = predispatch.export_predispatch(module, (x,))
    train = predispatch.compile_training(ep, backend="inductor")
    collectives = [n for gm in (train.forward_graph, train.backward_graph) for n in gm.graph.nodes
                   if "_c10d_functional" in str(n.target)]
    return {"differences": _max_differences(module, train, (x,), {}, seed=3), "collectives": len(collectives)}


def test_a_tensor_parallel_program_trains_on_each_rank_with_inductor():
    from test_sharding import _on_gloo_ranks

    for rank, result in enumerate(_on_gloo_ranks(2, _tensor_parallel_with_inductor)):
        assert result["collectives"], f"rank {rank}: no collective in the compiled graphs"
        differences = result["differences"]
        assert any(k.startswith("grad ") for k in differences)
        worst = {k: d for k, d in differences.items() if d > 1e-4}
        assert not worst, f"rank {rank}: {worst}"


@pytest.mark.parametrize("options, layout_optimization", [(None, False), ({"layout_optimization": True}, True)])
def test_inductor_on_the_cpu_keeps_its_convolutions_layout_unless_asked(monkeypatch, options, layout_optimization):
    """inductor's layout optimization (channels-last around convolutions,
    copies of their weights and gradients each step) is off on the CPU
    unless the options turn it on; eager's draws stay asked for."""
    seen = []

    def compile_training_step(flat, examples, num_outputs, hook, config, merge_equal_calls):
        seen.append(config)
        raise RuntimeError("stopped before compiling")

    monkeypatch.setattr(_torch.inductor, "compile_training_step", compile_training_step)
    model, x = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()), torch.randn(2, 3, 8, 8)
    with pytest.raises(CompileError, match="stopped before compiling"):
        predispatch.compile_training(predispatch.export_predispatch(model, (x,)), backend="inductor",
                                     options=options)(x)
    assert seen and seen[0]["layout_optimization"] is layout_optimization and seen[0]["fallback_random"] is True



# --- inductor's FX graph cache and a program's own symbolic sizes


class NormalizedGuarantee(EveryGuarantee):
    """EveryGuarantee with a batch norm after its autocast region."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.BatchNorm1d(8)

    def forward(self, x, seen):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.inner(x)
        h = ClampStraightThrough.apply(F.dropout(self.norm(h.float()), 0.25, training=True))
        return self.outer(h)


def test_a_program_of_symbolic_sizes_compiles_again_where_inductor_cached_it(tmp_path, monkeypatch):
    # a second compile (a later run of the script) found the graphs in inductor's cache, whose guards
    # named the program's own symbol (``t0 == 16*s``): NameError: name 'predispatch_dim_s..' is not defined
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    module = NormalizedGuarantee()
    for _ in range(2):
        ep = predispatch.export_predispatch(copy.deepcopy(module), _inputs(4),
                                            dynamic_shapes=({0: Dim("batch", min=2, max=32)}, None))
        train = predispatch.compile_training(ep, backend="inductor")
        assert_runs_match(run_module(copy.deepcopy(module), _inputs(6), None),
                          run_module(_reset(train, module), _inputs(6), None), **BF16)
