"""Tools that take an ExportedProgram keep working on ours (the contract:
``run_decompositions``, ``torch.export.unflatten``, save and load,
``torch.compile``, AOTInductor, ONNX; PT2E quantization is
tests/test_quantization.py), compared with eager: outputs, gradients,
parameters and buffers after the call. design/downstream.md's table
names the test for each tool."""
import copy
import json
import subprocess
import sys

import pytest
import torch

import cases
import predispatch
from predispatch.testing.eager import assert_runs_match, run_module


def _check_against_eager(module, args, runnable, grad_mode=True):
    eager = run_module(copy.deepcopy(module), args, None, grad_mode=grad_mode)
    mine = run_module(runnable, args, None, grad_mode=grad_mode)
    assert_runs_match(eager, mine)


@pytest.mark.parametrize("case, args", [
    (cases.EMA, (torch.randn(2, 4),)),  # a parameter and a buffer updated under no_grad
    (cases.Seed, (torch.randn(3),)),
])
def test_run_decompositions_keeps_eager_write_backs(case, args):
    """Outputs and states after the call; not gradients: torch's
    run_decompositions traces below autograd and inlines the regions, so a
    no_grad block no longer cuts gradients (EMA's shadow would pass one)."""
    torch.manual_seed(0)
    module = case()
    ep = predispatch.export_predispatch(copy.deepcopy(module), args)
    decomposed = ep.run_decompositions()
    assert isinstance(decomposed, predispatch.PredispatchProgram)
    assert predispatch.autocast_policy(decomposed) == predispatch.autocast_policy(ep)
    _check_against_eager(module, args, copy.deepcopy(decomposed.module()), grad_mode=False)


@pytest.mark.parametrize("case, args", [
    (cases.Seed, (torch.randn(3),)),
    (cases.AutocastBlocks, (torch.randn(2, 4),)),
    (cases.BatchNormNet, (torch.randn(4, 3),)),
])
def test_unflatten_places_regions_in_their_modules(case, args):
    """torch.export.unflatten places each node by its module stack: the
    region's submodule and call carry the stack of the code that opened it.
    Its write-backs are ours, as ep.module()'s: BatchNorm's running
    statistics, which its backward saved, are written back hidden from
    autograd (torch's copy_ failed the backward's version check)."""
    torch.manual_seed(0)
    module = case()
    ep = predispatch.export_predispatch(copy.deepcopy(module), args)
    _check_against_eager(module, args, torch.export.unflatten(ep))


@pytest.mark.parametrize("case, args, dynamic_shapes", [
    (cases.AutocastBlocks, (torch.randn(2, 4),), None),
    (cases.EMA, (torch.randn(2, 4),), None),
    (cases.AliasingOutputs, (torch.randn(3, 4),), None),
    (cases.DynamicBatch, (torch.randn(4, 4),), ({0: torch.export.Dim("batch")},)),
])
def test_torch_compile_of_the_program_module(case, args, dynamic_shapes):
    """Dynamo traces torch's own region calls (it does not know our faster
    ones) and puts the run-time code's op entry points in its graph as calls:
    one graph, no break; a failed trace must not leave autocast state behind."""
    torch.manual_seed(0)
    module = case()

    def export():
        return predispatch.export_predispatch(copy.deepcopy(module), args,
                                              dynamic_shapes=dynamic_shapes).module()

    explained = torch._dynamo.explain(export())(*copy.deepcopy(args))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    program = export()
    assert "aten_" in program.code  # the run-time code, not a regenerated copy
    program.compile(backend="aot_eager")
    _check_against_eager(module, args, program)
    assert not torch.is_autocast_enabled("cpu")
    if dynamic_shapes:
        for p in program.parameters():
            p.grad = None
        _check_against_eager(module, (torch.randn(7, 4),), program)


def test_a_copy_of_the_program_module_compiles_as_one_graph():
    """Region submodules of ep.module() are plain GraphModules: a deepcopy
    (or a recompile) of a lazy one is lazy again, which dynamo cannot inline
    (a graph break per region, an error with fullgraph=True)."""
    torch.manual_seed(0)
    module, args = cases.AutocastBlocks(), (torch.randn(2, 4),)
    program = copy.deepcopy(predispatch.export_predispatch(copy.deepcopy(module), args).module())
    program.compile(backend="aot_eager", fullgraph=True)
    _check_against_eager(module, args, program)


class _SizedByTheBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x, state):
        y = self.lin(x)
        with torch.no_grad():
            state.add_(y)
        return y.new_zeros(x.shape[0], 1) + y * 2


def test_run_decompositions_of_a_dynamic_program_keeps_the_record():
    """With dynamic shapes the first op node is a ``sym_size``, which
    run_decompositions makes anew: the record sits on a tensor op instead, so
    the policy and the write-back modes survive (an input that requires grad,
    updated under no_grad, is written back under no_grad)."""
    batch = torch.export.Dim("batch", min=2)
    ep = predispatch.export_predispatch(_SizedByTheBatch(), (torch.randn(3, 4), torch.zeros(3, 4)),
                                        dynamic_shapes=({0: batch}, {0: batch}),
                                        backward_pass_autocast="off", on_backward_autocast_mismatch="warn")
    decomposed = ep.run_decompositions()
    assert predispatch.autocast_policy(decomposed) == predispatch.autocast_policy(ep)
    x, state = torch.randn(5, 4, requires_grad=True), torch.zeros(5, 4, requires_grad=True)
    decomposed.module()(x, state).sum().backward()
    assert x.grad is not None


class _Regions(torch.nn.Module):
    """A buffer updated and a linear under no_grad, a linear under autocast
    (``dtype``), no value mutated under no_grad that is read later (no
    ``keep_history``: nothing of predispatch's own in the graph)."""

    def __init__(self, dtype=torch.bfloat16):
        super().__init__()
        self.dtype = dtype
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.seen.add_(x.shape[0])
            y = self.a(x)
        with torch.autocast("cpu", dtype=self.dtype):
            z = self.b(y + x)
        return z.float() + y


_LOAD_WITHOUT_PREDISPATCH = """
import json, sys, torch
regions, history, x = sys.argv[1:4]
ep = torch.export.load(regions)
module = ep.module()
out = module(torch.load(x))
try:
    torch.export.load(history)
    history_loads = True
except RuntimeError:
    history_loads = False
print(json.dumps({"predispatch_imported": "predispatch" in sys.modules,
                  "regions": [n.target.__name__ for m in ep.graph_module.modules()
                              if isinstance(m, torch.fx.GraphModule) for n in m.graph.nodes
                              if n.op == "call_function" and "wrap_with" in str(n.target)],
                  "out": out.tolist(), "seen": module.seen.item(), "history_loads": history_loads}))
"""


def test_a_saved_program_loads_and_runs_where_predispatch_is_not_imported(tmp_path):
    """A plain torch.export.load in a process that never imports predispatch:
    the regions come back and run as eager; a program whose graph has
    ``predispatch::keep_history`` (a tensor mutated under no_grad, then read)
    needs ``import predispatch`` (or ``predispatch.load``), which registers
    the op (tests/test_autocast_policy.py loads one with predispatch)."""
    torch.manual_seed(0)
    module, x = _Regions(), torch.randn(4, 8)
    torch.export.save(predispatch.export_predispatch(copy.deepcopy(module), (x,)), tmp_path / "regions.pt2")
    history = predispatch.export_predispatch(cases.Seed(), (torch.randn(3),))
    assert "keep_history" in history.graph_module.code
    torch.export.save(history, tmp_path / "history.pt2")
    torch.save(x, tmp_path / "x.pt")
    ran = subprocess.run([sys.executable, "-c", _LOAD_WITHOUT_PREDISPATCH, str(tmp_path / "regions.pt2"),
                          str(tmp_path / "history.pt2"), str(tmp_path / "x.pt")],
                         capture_output=True, text=True, timeout=300)
    assert ran.returncode == 0, ran.stderr[-2000:]
    got = json.loads(ran.stdout.splitlines()[-1])
    assert not got["predispatch_imported"]
    assert got["regions"] == ["wrap_with_set_grad_enabled", "wrap_with_autocast"]
    expected = module(x)
    torch.testing.assert_close(torch.tensor(got["out"]), expected.detach())
    assert got["seen"] == module.seen.item() == 4
    assert not got["history_loads"]


def test_aot_inductor_compiles_a_program_with_regions(tmp_path):
    """AOTInductor (aoti_compile_and_package, then aoti_load_package) on a
    program with a no_grad and a bf16 autocast region: the same outputs as
    eager (the compiled kernels compute the autocast region in bf16)."""
    torch.manual_seed(0)
    module, x = _Regions(), torch.randn(4, 8)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,))
    path = torch._inductor.aoti_compile_and_package(  # O0: the test checks what runs, not its speed
        ep, package_path=str(tmp_path / "m.pt2"), inductor_configs={"aot_inductor.compile_wrapper_opt_level": "O0"})
    compiled = torch._inductor.aoti_load_package(path)
    for batch in (x, torch.randn(4, 8)):
        torch.testing.assert_close(compiled(batch), module(batch).detach(), rtol=1.6e-2, atol=1e-5)


def test_onnx_export_of_a_program_with_regions_runs_in_onnxruntime(tmp_path):
    """torch.onnx.export takes the program (it decomposes it, which inlines
    the regions: the autocast region's casts are kept as ONNX Casts to its
    dtype). onnxruntime runs it as eager ran: float16 autocast, since
    onnxruntime has no bfloat16 Gemm on CPU."""
    onnx = pytest.importorskip("onnx")
    onnxruntime = pytest.importorskip("onnxruntime")
    torch.manual_seed(0)
    module, x = _Regions(torch.float16), torch.randn(4, 8)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,))
    path = tmp_path / "m.onnx"
    torch.onnx.export(ep, (x,), dynamo=True, verbose=False).save(str(path))
    model = onnx.load(str(path))
    casts = {a.i for n in model.graph.node if n.op_type == "Cast" for a in n.attribute if a.name == "to"}
    assert onnx.TensorProto.FLOAT16 in casts
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (name,) = [i.name for i in session.get_inputs()]
    for batch in (x, torch.randn(4, 8)):
        (got,) = session.run(None, {name: batch.numpy()})
        torch.testing.assert_close(torch.from_numpy(got), module(batch).detach(), rtol=1e-3, atol=1e-3)
