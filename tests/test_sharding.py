"""Sharded modules (issue 19): each rank's program over its local shards.

Structure on torch's fake process group (one process, world size 4: the
collectives do nothing, the graphs are each rank's); numbers on 2 gloo CPU
processes, each rank's program against the sharded eager module on that rank
(outputs, input and local parameter gradients, buffers, compile_training).
"""
from __future__ import annotations

import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.testing._internal.distributed.fake_pg import FakeStore

import predispatch
from predispatch.autograd_function_op import AUTOGRAD_FUNCTION
from predispatch.testing import GraphTestCase, assert_invariants

_c10d = torch.ops._c10d_functional


class MLP(torch.nn.Module):
    """A column-wise then a row-wise linear, a buffer updated under no_grad."""

    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x):
        with torch.no_grad():
            self.seen.add_(1)
        return self.down(torch.relu(self.up(x))) * 2


def tensor_parallel_mlp(mesh) -> MLP:
    torch.manual_seed(0)
    return parallelize_module(MLP(), mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


class NormMLP(torch.nn.Module):
    """A pre-norm residual MLP, for sequence parallelism."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.up = torch.nn.Linear(8, 16)
        self.down = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


def sequence_parallel_mlp(mesh) -> NormMLP:
    """The norm on sequence shards, gathered for the column-wise linear, the
    row-wise one's output reduce-scattered back to sequence shards."""
    from torch.distributed.tensor.parallel import SequenceParallel

    torch.manual_seed(0)
    return parallelize_module(NormMLP(), mesh, {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))})


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x).relu()


class Blocks(torch.nn.Module):
    """Two blocks and a head, the input scaled under no_grad."""

    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = Block(), Block(), torch.nn.Linear(8, 4)

    def forward(self, x):
        with torch.no_grad():
            x = x * 0.5
        return self.head(self.second(self.first(x)))


def fully_sharded_blocks(mesh, reshard_after_forward: bool = True, **options) -> Blocks:
    """``fully_shard`` on each block, then on the root (which keeps the head)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Blocks()
    for block in (model.first, model.second, model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, **options)
    return model


def fsdp_times_tp_mlp(mesh) -> MLP:
    """Tensor parallel on the mesh's "tp" dimension, fully_shard on its "dp" one."""
    from torch.distributed.fsdp import fully_shard

    module = tensor_parallel_mlp(mesh["tp"])
    fully_shard(module, mesh=mesh["dp"])
    return module


def tiny_llama(mesh, world: int):
    """A transformers Llama with the tensor-parallel plan its config declares."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=world, max_position_embeddings=32)
    model = LlamaForCausalLM(config)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {path: styles[style]() for path, style in model.config.base_model_tp_plan.items()}
    parallelize_module(model.model, mesh, plan)
    return model, plan


def all_graphs(gm: torch.fx.GraphModule):
    yield gm
    for sub in gm.children():
        if isinstance(sub, torch.fx.GraphModule):
            yield from all_graphs(sub)


def backward_graphs(gm: torch.fx.GraphModule) -> set:
    """The graphs that are an exported autograd.Function's backward."""
    return {getattr(g, n.args[1].target).graph for g in all_graphs(gm) for n in g.graph.nodes
            if n.op == "call_function" and n.target is AUTOGRAD_FUNCTION}


def collective_nodes(gm):
    return [n for g in all_graphs(gm) for n in g.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional"
            and n.target is not _c10d.wait_tensor.default]


class FakeWorld(GraphTestCase):
    """One process standing for rank 0 of 4 (torch's fake process group)."""

    def setUp(self):
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
        self.mesh = init_device_mesh("cpu", (4,))

    def tearDown(self):
        if dist.is_initialized():
            dist.destroy_process_group()

    def test_tensor_parallel_mlp_graph(self):
        ep = predispatch.export_predispatch(tensor_parallel_mlp(self.mesh), (torch.randn(3, 8),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_up_weight: f32[4, 8], p_up_bias: f32[4], p_down_weight: f32[8, 4], p_down_bias: f32[8], b_seen: f32[], x: f32[3, 8]):
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, b_seen)
    getitem = no_grad_0[0]
    redistribute_0 = predispatch_autograd_function(self.redistribute_0_fwd, self.redistribute_0_bwd, x, name='Redistribute', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem_1 = redistribute_0[0]
    linear = aten.linear.default(getitem_1, p_up_weight, p_up_bias)
    relu = aten.relu.default(linear)
    redistribute_1 = predispatch_autograd_function(self.redistribute_1_fwd, self.redistribute_1_bwd, p_down_bias, name='Redistribute', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem_2 = redistribute_1[0]
    linear_1 = aten.linear.default(relu, p_down_weight, getitem_2)
    redistribute_2 = predispatch_autograd_function(self.redistribute_2_fwd, self.redistribute_2_bwd, linear_1, name='Redistribute', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem_3 = redistribute_2[0]
    mul = aten.mul.Tensor(getitem_3, 2)
    return (getitem, mul)
def no_grad_0(b_seen: f32[]):
    add = aten.add.Tensor(b_seen, 1)
    return (add,)
def redistribute_0_fwd(x: f32[3, 8]):
    clone = aten.clone.default(x)
    return (clone,)
def redistribute_0_bwd(grad: f32[3, 8]):
    all_reduce = _c10d_functional.all_reduce.default(grad, 'sum', '0')
    wait_tensor = _c10d_functional.wait_tensor.default(all_reduce)
    return (wait_tensor,)
def redistribute_1_fwd(p_down_bias: f32[8]):
    div = aten.div.Tensor(p_down_bias, 4)
    return (div,)
def redistribute_1_bwd(grad: f32[8]):
    clone = aten.clone.default(grad)
    return (clone,)
def redistribute_2_fwd(linear_1: f32[3, 8]):
    all_reduce = _c10d_functional.all_reduce.default(linear_1, 'sum', '0')
    wait_tensor = _c10d_functional.wait_tensor.default(all_reduce)
    return (wait_tensor,)
def redistribute_2_bwd(grad: f32[3, 8]):
    clone = aten.clone.default(grad)
    return (clone,)
inputs:
    p_up_weight: PARAMETER -> up.weight
    p_up_bias: PARAMETER -> up.bias
    p_down_weight: PARAMETER -> down.weight
    p_down_bias: PARAMETER -> down.bias
    b_seen: BUFFER -> seen
    x: USER_INPUT
outputs:
    getitem: BUFFER_MUTATION -> seen
    mul: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_program_is_over_local_shards_with_placements_recorded(self):
        module = tensor_parallel_mlp(self.mesh)
        ep = predispatch.export_predispatch(module, (torch.randn(3, 8),))
        assert_invariants(ep)
        for g in all_graphs(ep.graph_module):
            for node in g.graph.nodes:
                assert not isinstance(node.meta.get("val"), DTensor), node.format_node()
        for node in collective_nodes(ep.graph_module):  # each collective is waited on, once
            assert [u.target for u in node.users] == [_c10d.wait_tensor.default], node.format_node()
        sharded = {n: p for n, p in module.named_parameters() if isinstance(p, DTensor)}
        assert [s.target for s in ep.graph_signature.input_specs if s.kind.name == "PARAMETER"] == \
            [n for n, _ in module.named_parameters()]
        for name, p in sharded.items():
            assert tuple(ep.state_dict[name].shape) == tuple(p.to_local().shape)
        layouts = predispatch.sharded_layouts(ep)
        assert set(layouts) == set(sharded)
        for name, p in sharded.items():
            rebuilt = DTensor.from_local(ep.state_dict[name], self.mesh, _placements(layouts[name]),
                                         shape=torch.Size(layouts[name].global_shape),
                                         stride=layouts[name].global_stride)
            assert rebuilt.placements == p.placements and rebuilt.shape == p.shape

    def test_save_load_and_re_export_keep_the_program(self):
        ep = predispatch.export_predispatch(tensor_parallel_mlp(self.mesh), (torch.randn(3, 8),))
        with tempfile.TemporaryDirectory() as d:
            torch.export.save(ep, os.path.join(d, "mlp.pt2"))
            loaded = predispatch.load(os.path.join(d, "mlp.pt2"))
        assert predispatch.format_program(loaded) == predispatch.format_program(ep)
        assert predispatch.sharded_layouts(loaded) == predispatch.sharded_layouts(ep)
        again = predispatch.export_predispatch(ep.module(), (torch.randn(3, 8),))  # G7
        assert predispatch.format_program(again) == predispatch.format_program(ep)

    def test_sequence_parallel_gathers_and_scatters_the_sequence(self):
        ep = predispatch.export_predispatch(sequence_parallel_mlp(self.mesh), (torch.randn(2, 1, 8),))
        assert_invariants(ep)
        backward = backward_graphs(ep.graph_module)
        fwd = [n.target for n in collective_nodes(ep.graph_module) if n.graph not in backward]
        bwd = [n.target for n in collective_nodes(ep.graph_module) if n.graph in backward]
        # the norm's output gathered for the column-wise linear (its gradient scattered back);
        # the row-wise partial sums scattered to sequence shards (their gradient gathered)
        assert sorted(fwd, key=str) == sorted([_c10d.all_gather_into_tensor.default,
                                               _c10d.reduce_scatter_tensor.default], key=str)
        assert sorted(bwd, key=str) == sorted(fwd, key=str)

    def test_llama_with_its_tensor_parallel_plan(self):
        model, plan = tiny_llama(init_device_mesh("cpu", (4,)), 4)
        ep = predispatch.export_predispatch(model, (torch.randint(0, 64, (2, 8)),), {"use_cache": False})
        assert_invariants(ep)
        backward = backward_graphs(ep.graph_module)
        fwd = [n for n in collective_nodes(ep.graph_module) if n.graph not in backward]
        bwd = [n for n in collective_nodes(ep.graph_module) if n.graph in backward]
        rowwise = sum(isinstance(s, RowwiseParallel) for s in plan.values())
        colwise = sum(isinstance(s, ColwiseParallel) for s in plan.values())
        # a row-wise linear's partial sums are all-reduced forward; a column-wise one's
        # replicated input gradient backward
        assert [n.target for n in fwd] == [_c10d.all_reduce.default] * rowwise
        assert [n.target for n in bwd] == [_c10d.all_reduce.default] * colwise
        assert {n: ep.state_dict[n].shape for n in predispatch.sharded_layouts(ep)} == {
            n: p.to_local().shape for n, p in model.named_parameters() if isinstance(p, DTensor)}

    def test_llama_local_ops_match_eager_on_the_fake_group(self):
        """On the fake group every collective gives back its input, in eager
        as in the program: what is compared is the rest, the local ops the
        lowering chose for DTensor's (the gloo test checks the collectives)."""
        model, _plan = tiny_llama(self.mesh, 4)
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4))
        ep = predispatch.export_predispatch(model, (ids,), {"use_cache": False})
        differences = _max_differences(model, ep.module(), (ids,), {"use_cache": False}, seed=5)
        assert any(k.startswith("grad ") for k in differences)
        assert not {k: d for k, d in differences.items() if d > 1e-5}

    def test_fully_shard_all_gathers_forward_and_reduce_scatters_backward(self):
        module = fully_sharded_blocks(self.mesh)
        ep = predispatch.export_predispatch(module, (torch.randn(3, 8),))
        assert_invariants(ep)
        backward = backward_graphs(ep.graph_module)
        fwd = [n.target for n in collective_nodes(ep.graph_module) if n.graph not in backward]
        bwd = [n.target for n in collective_nodes(ep.graph_module) if n.graph in backward]
        params = [n for n, _ in module.named_parameters()]
        assert fwd == [_c10d.all_gather_into_tensor.default] * len(params)
        assert bwd == [_c10d.reduce_scatter_tensor.default] * len(params)
        for g in backward:  # FSDP averages the gradients over the ranks
            scatter = next(n for n in g.nodes if n.target is _c10d.reduce_scatter_tensor.default)
            (wait,) = scatter.users
            assert [(u.target, u.args[1]) for u in wait.users] == [(torch.ops.aten.div.Tensor, 4)]
        layouts = predispatch.sharded_layouts(ep)
        assert {n: l.placements for n, l in layouts.items()} == {n: ("S(0)",) for n in params}
        assert [(r.kind, r.args) for r in predispatch.regions(ep)] == [("grad", (False,))]

    def test_fully_shard_times_tensor_parallel_on_a_2d_mesh(self):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        module = fsdp_times_tp_mlp(mesh)
        ep = predispatch.export_predispatch(module, (torch.randn(3, 8),))
        assert_invariants(ep)
        backward = backward_graphs(ep.graph_module)
        dp, tp = mesh["dp"].get_group().group_name, mesh["tp"].get_group().group_name
        fwd = [(n.target, n.args[-1]) for n in collective_nodes(ep.graph_module) if n.graph not in backward]
        bwd = [(n.target, n.args[-1]) for n in collective_nodes(ep.graph_module) if n.graph in backward]
        params = [n for n, _ in module.named_parameters()]
        # FSDP over dp: every parameter gathered forward, its gradient scattered backward;
        # TP over tp: the row-wise output reduced forward, the column-wise input's gradient backward
        assert sorted(fwd, key=str) == sorted(
            [(_c10d.all_gather_into_tensor.default, dp)] * len(params) + [(_c10d.all_reduce.default, tp)], key=str)
        assert sorted(bwd, key=str) == sorted(
            [(_c10d.reduce_scatter_tensor.default, dp)] * len(params) + [(_c10d.all_reduce.default, tp)], key=str)
        layouts = predispatch.sharded_layouts(ep)
        assert {n: (l.mesh_shape, l.mesh_dim_names) for n, l in layouts.items()} == {
            n: ((2, 2), ("dp", "tp")) for n in params}

    def test_fully_shard_with_mixed_precision_is_refused_by_module(self):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        module = fully_sharded_blocks(self.mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        with pytest.raises(predispatch.ExportError, match=r"fully_shard \(FSDP2\) on the module \(FSDPBlocks, forward at .*test_sharding.py:\d+\): a mixed-precision"):
            predispatch.export_predispatch(module, (torch.randn(3, 8),))

    def test_unlowered_redistribution_is_refused_with_its_line(self):
        class AllToAll(torch.nn.Module):
            def __init__(self, mesh):
                super().__init__()
                self.w = torch.nn.Parameter(torch.distributed.tensor.distribute_tensor(
                    torch.randn(8, 8), mesh, [Shard(0)]))

            def forward(self, x):
                return (self.w.redistribute(placements=[Shard(1)]).to_local() * x).sum()

        with pytest.raises(predispatch.ExportError, match=r"DTensor.redistribute at .*test_sharding.py.*S\(0\) -> S\(1\)"):
            predispatch.export_predispatch(AllToAll(self.mesh), (torch.randn(8, 2),))

    def test_asynchronous_collective_is_refused_with_its_line(self):
        class Async(torch.nn.Module):
            def forward(self, x):
                dist.all_reduce(x.clone(), async_op=True)
                return x * 2

        with pytest.raises(predispatch.ExportError, match=r"asynchronous collective.*test_sharding.py"):
            predispatch.export_predispatch(Async(), (torch.randn(2),))

    def test_collective_deciding_control_flow_is_refused_with_its_line(self):
        import torch.distributed._functional_collectives as funcol

        class Branches(torch.nn.Module):
            def forward(self, x):
                total = funcol.all_reduce(x, "sum", dist.group.WORLD)
                return x * 2 if total.sum() > 0 else x

        with pytest.raises(predispatch.ExportError, match=r"data-dependent.*test_sharding.py.*total.sum\(\) > 0"):
            predispatch.export_predispatch(Branches(), (torch.randn(2),))

    def test_no_process_group_is_refused(self):
        module = tensor_parallel_mlp(self.mesh)
        dist.destroy_process_group()
        with pytest.raises(predispatch.ExportError, match="no process group is initialised"):
            predispatch.export_predispatch(module, (torch.randn(3, 8),))


def _placements(layout: dict) -> list:
    out = []
    for p in layout.placements:
        out.append(Replicate() if p == "R" else Shard(int(p[2:-1])))
    return out


# --- 2 gloo CPU processes: each rank's program against its sharded eager module


def _max_differences(module, program, args, kwargs, seed: int) -> dict:
    """Largest |eager - program| of the output, of each floating input's
    gradient and each parameter's local gradient, and of each buffer after."""
    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    start = {n: local(b).clone() for n, b in module.named_buffers()}

    def run(m):
        for p in m.parameters():
            p.grad = None
        with torch.no_grad():  # both from the same state (the program may share the module's buffers)
            for n, b in m.named_buffers():
                local(b).copy_(start[n])
        inputs = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
        out = m(*inputs, **kwargs)
        out = out.logits if hasattr(out, "logits") else out
        torch.manual_seed(seed)
        (out * torch.randn(out.shape)).sum().backward()
        grads = {f"input {i}": t.grad for i, t in enumerate(inputs) if t.requires_grad}
        grads.update({f"grad {n}": local(p.grad) for n, p in m.named_parameters()})
        buffers = {f"buffer {n}": local(b).clone() for n, b in m.named_buffers()}
        return {"output": out.detach(), **grads, **buffers}

    def difference(a, b) -> float:
        if a is None or b is None:
            return 0.0 if a is b else float("inf")
        return (a - b).abs().max().item()

    eager, ours = run(module), run(program)
    assert eager.keys() == ours.keys(), (eager.keys(), ours.keys())
    return {k: difference(eager[k], ours[k]) for k in eager}


def _rank_main(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        results = {}
        torch.manual_seed(1)
        x = torch.randn(3, 8)
        module = tensor_parallel_mlp(mesh)
        ep = predispatch.export_predispatch(module, (x,))
        results["mlp"] = _max_differences(module, ep.module(), (x,), {}, seed=2)
        train = predispatch.compile_training(ep)
        results["mlp compile_training"] = _max_differences(module, train, (x,), {}, seed=3)
        torch.manual_seed(8)
        x = torch.randn(2, 4, 8).chunk(world, 1)[rank].contiguous()  # this rank's sequence shard
        module = sequence_parallel_mlp(mesh)
        ep = predispatch.export_predispatch(module, (x,))
        results["sequence parallel"] = _max_differences(module, ep.module(), (x,), {}, seed=9)
        torch.manual_seed(6 + rank)  # each rank its own batch, as in data parallel training
        x = torch.randn(3, 8)
        for reshard in (True, False):
            module = fully_sharded_blocks(mesh, reshard_after_forward=reshard)
            ep = predispatch.export_predispatch(module, (x,))
            results[f"fully_shard reshard_after_forward={reshard}"] = _max_differences(
                module, ep.module(), (x,), {}, seed=7)
        results["fully_shard compile_training"] = _max_differences(
            module, predispatch.compile_training(ep), (x,), {}, seed=11)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def two_gloo_ranks():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_rank_main, args=(2, _free_port(), out_dir), nprocs=2)
        yield [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]


@pytest.mark.parametrize("case", ["mlp", "mlp compile_training", "sequence parallel",
                                  "fully_shard reshard_after_forward=True",
                                  "fully_shard reshard_after_forward=False", "fully_shard compile_training"])
def test_each_rank_matches_its_sharded_eager_module(two_gloo_ranks, case):
    for rank, results in enumerate(two_gloo_ranks):
        differences = results[case]
        assert any(k.startswith("grad ") for k in differences)
        worst = {k: d for k, d in differences.items() if d > 1e-5}
        assert not worst, f"rank {rank}, {case}: {worst}"


def _four_ranks_main(rank: int, world: int, port: int, out_dir: str) -> None:
    """FSDP x TP on a 2 x 2 mesh: an MLP, and a Llama with its TP plan on
    "tp" and fully_shard per decoder layer and at the root on "dp"."""
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        dp_rank = mesh.get_coordinate()[0]
        results = {}
        torch.manual_seed(10 + dp_rank)  # one batch per data-parallel rank
        x = torch.randn(3, 8)
        module = fsdp_times_tp_mlp(mesh)
        ep = predispatch.export_predispatch(module, (x,))
        results["mlp"] = _max_differences(module, ep.module(), (x,), {}, seed=2)
        model, _plan = tiny_llama(mesh["tp"], 2)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(4 + dp_rank))
        ep = predispatch.export_predispatch(model, (ids,), {"use_cache": False})
        results["llama"] = _max_differences(model, ep.module(), (ids,), {"use_cache": False}, seed=5)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(os.environ.get("PREDISPATCH_GLOO_4") != "1",
                    reason="4 gloo processes take ~50 s on 2 cores: PREDISPATCH_GLOO_4=1 runs them")
def test_fsdp_times_tensor_parallel_on_4_gloo_ranks():
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_four_ranks_main, args=(4, _free_port(), out_dir), nprocs=4)
        ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(4)]
    for rank, results in enumerate(ranks):
        for case, differences in results.items():
            assert any(k.startswith("grad ") for k in differences)
            worst = {k: d for k, d in differences.items() if d > 1e-5}
            assert not worst, f"rank {rank}, {case}: {worst}"
