"""Sharded modules (issue 19): each rank's program over its local shards.

Structure on torch's fake process group (one process, world size 4: the
collectives do nothing, the graphs are each rank's); numbers on 2 gloo CPU
processes (tensor parallel, parallel styles, a Llama's TP plan, FSDP2) and on
4 (FSDP x TP on a 2 x 2 mesh), each rank's program against the sharded eager
module on that rank (outputs, input and local parameter gradients, buffers,
compile_training).
"""
from __future__ import annotations

import operator
import os
import socket
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel, parallelize_module)
from torch.testing._internal.distributed.fake_pg import FakeStore

import predispatch
from predispatch.ir.autograd_function_op import AUTOGRAD_FUNCTION
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
    torch.manual_seed(0)
    return parallelize_module(NormMLP(), mesh, {
        "norm": SequenceParallel(), "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1))})


class PreNormBlock(torch.nn.Module):
    """A pre-norm residual block around the MLP (a transformer block's half)."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.mlp = MLP()

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def prepared_block(mesh, use_local_output: bool) -> PreNormBlock:
    """Sequence parallel as torchtitan plans it: the norm on sequence shards,
    ``PrepareModuleInput`` gathering the MLP's input (``Shard(1)`` ->
    ``Replicate``, handed on as a local tensor or as a DTensor), the row-wise
    output reduce-scattered back to sequence shards."""
    torch.manual_seed(0)
    return parallelize_module(PreNormBlock(), mesh, {
        "norm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                  use_local_output=use_local_output),
        "mlp.up": ColwiseParallel(), "mlp.down": RowwiseParallel(output_layouts=Shard(1))})


class ScaledMLP(MLP):
    def forward(self, x, *, scale):
        return super().forward(x) * scale


def prepared_mlp(mesh, use_local_output: bool = True) -> ScaledMLP:
    """``PrepareModuleInput`` / ``PrepareModuleOutput`` on the module itself:
    its batch-sharded input gathered, its keyword input made a Replicate
    DTensor, its Replicate DTensor output scattered back to batch shards."""
    torch.manual_seed(0)
    module = parallelize_module(ScaledMLP(), mesh, {
        "up": ColwiseParallel(), "down": RowwiseParallel(use_local_output=False)})
    parallelize_module(module, mesh, PrepareModuleInput(
        input_layouts=Shard(0), desired_input_layouts=Replicate(),
        input_kwarg_layouts={"scale": Replicate()}, desired_input_kwarg_layouts={"scale": Replicate()}))
    return parallelize_module(module, mesh, PrepareModuleOutput(
        output_layouts=Replicate(), desired_output_layouts=Shard(0), use_local_output=use_local_output))


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


def collectives_by_boundary(ep) -> str:
    """Each boundary op of the program in order, the value it moves, and the
    collectives of its forward and of its backward: where shards move."""
    def value(n: torch.fx.Node) -> str:
        while n.target is operator.getitem:
            n = n.args[0]
        return n.name if n.op == "placeholder" else "a boundary's output" if n.target is AUTOGRAD_FUNCTION \
            else str(n.target).split(".")[-2]

    def collectives(g: torch.fx.Graph) -> str:
        found = [str(n.target).split(".")[-2] for n in g.nodes if n.op == "call_function"
                 and getattr(n.target, "namespace", None) == "_c10d_functional"
                 and n.target is not _c10d.wait_tensor.default]
        return " + ".join(found) or "local"

    return "\n".join(
        f"{value(n.args[2])}: {collectives(getattr(g, n.args[0].target).graph)}; "
        f"backward: {collectives(getattr(g, n.args[1].target).graph)}"
        for g in all_graphs(ep.graph_module) for n in g.graph.nodes
        if n.op == "call_function" and n.target is AUTOGRAD_FUNCTION)


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

    def test_prepare_module_input_gathers_the_sequence_for_the_mlp(self):
        """The MLP's input arrives as a DTensor: the gradient reaching the
        gather is the column-wise linear's partial sum, reduce-scattered."""
        ep = predispatch.export_predispatch(prepared_block(self.mesh, use_local_output=False),
                                            (torch.randn(2, 1, 8),))
        assert_invariants(ep)
        self.assertGraphExpectedInline(ep, """\
def forward(p_norm_weight: f32[8], p_norm_bias: f32[8], p_mlp_up_weight: f32[4, 8], p_mlp_up_bias: f32[4], p_mlp_down_weight: f32[8, 4], p_mlp_down_bias: f32[8], b_mlp_seen: f32[], x: f32[2, 1, 8]):
    layer_norm = aten.layer_norm.default(x, [8], p_norm_weight, p_norm_bias, 1e-05, False)
    redistribute_0 = predispatch_autograd_function(self.redistribute_0_fwd, self.redistribute_0_bwd, layer_norm, name='Redistribute', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem = redistribute_0[0]
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, b_mlp_seen)
    getitem_1 = no_grad_0[0]
    linear = aten.linear.default(getitem, p_mlp_up_weight, p_mlp_up_bias)
    relu = aten.relu.default(linear)
    redistribute_1 = predispatch_autograd_function(self.redistribute_1_fwd, self.redistribute_1_bwd, p_mlp_down_bias, name='Redistribute', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem_2 = redistribute_1[0]
    linear_1 = aten.linear.default(relu, p_mlp_down_weight, getitem_2)
    redistribute_2 = predispatch_autograd_function(self.redistribute_2_fwd, self.redistribute_2_bwd, linear_1, name='Redistribute', num_outputs=1, grad_outputs=[0], grad_inputs=[0])
    getitem_3 = redistribute_2[0]
    mul = aten.mul.Tensor(getitem_3, 2)
    add = aten.add.Tensor(x, mul)
    return (getitem_1, add)
def redistribute_0_fwd(layer_norm: f32[2, 1, 8]):
    all_gather_into_tensor = _c10d_functional.all_gather_into_tensor.default(layer_norm, 4, '0')
    wait_tensor = _c10d_functional.wait_tensor.default(all_gather_into_tensor)
    split = aten.split.Tensor(wait_tensor, 2)
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2]
    getitem_3 = split[3]
    cat = aten.cat.default([getitem, getitem_1, getitem_2, getitem_3], 1)
    return (cat,)
def redistribute_0_bwd(grad: f32[2, 4, 8]):
    split = aten.split.Tensor(grad, 1, 1)
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2]
    getitem_3 = split[3]
    cat = aten.cat.default([getitem, getitem_1, getitem_2, getitem_3])
    reduce_scatter_tensor = _c10d_functional.reduce_scatter_tensor.default(cat, 'sum', 4, '0')
    wait_tensor = _c10d_functional.wait_tensor.default(reduce_scatter_tensor)
    return (wait_tensor,)
def no_grad_0(b_mlp_seen: f32[]):
    add = aten.add.Tensor(b_mlp_seen, 1)
    return (add,)
def redistribute_1_fwd(p_mlp_down_bias: f32[8]):
    div = aten.div.Tensor(p_mlp_down_bias, 4)
    return (div,)
def redistribute_1_bwd(grad: f32[8]):
    clone = aten.clone.default(grad)
    return (clone,)
def redistribute_2_fwd(linear_1: f32[2, 4, 8]):
    split = aten.split.Tensor(linear_1, 1, 1)
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2]
    getitem_3 = split[3]
    cat = aten.cat.default([getitem, getitem_1, getitem_2, getitem_3])
    reduce_scatter_tensor = _c10d_functional.reduce_scatter_tensor.default(cat, 'sum', 4, '0')
    wait_tensor = _c10d_functional.wait_tensor.default(reduce_scatter_tensor)
    return (wait_tensor,)
def redistribute_2_bwd(grad: f32[2, 1, 8]):
    all_gather_into_tensor = _c10d_functional.all_gather_into_tensor.default(grad, 4, '0')
    wait_tensor = _c10d_functional.wait_tensor.default(all_gather_into_tensor)
    split = aten.split.Tensor(wait_tensor, 2)
    getitem = split[0]
    getitem_1 = split[1]
    getitem_2 = split[2]
    getitem_3 = split[3]
    cat = aten.cat.default([getitem, getitem_1, getitem_2, getitem_3], 1)
    return (cat,)
inputs:
    p_norm_weight: PARAMETER -> norm.weight
    p_norm_bias: PARAMETER -> norm.bias
    p_mlp_up_weight: PARAMETER -> mlp.up.weight
    p_mlp_up_bias: PARAMETER -> mlp.up.bias
    p_mlp_down_weight: PARAMETER -> mlp.down.weight
    p_mlp_down_bias: PARAMETER -> mlp.down.bias
    b_mlp_seen: BUFFER -> mlp.seen
    x: USER_INPUT
outputs:
    getitem_1: BUFFER_MUTATION -> mlp.seen
    add: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
""")

    def test_prepare_module_input_with_local_output(self):
        """The MLP's input arrives as a local tensor, made a DTensor again by
        the column-wise linear: its gradient all-reduced there, the gather's
        backward a local chunk (eager's collectives, the same sums)."""
        ep = predispatch.export_predispatch(prepared_block(self.mesh, use_local_output=True),
                                            (torch.randn(2, 1, 8),))
        assert_invariants(ep)
        self.assertExpectedInline(collectives_by_boundary(ep), """\
layer_norm: all_gather_into_tensor; backward: local
a boundary's output: local; backward: all_reduce
p_mlp_down_bias: local; backward: local
linear: reduce_scatter_tensor; backward: all_gather_into_tensor""")

    def test_prepare_module_input_and_output_on_the_module_itself(self):
        """Parallel styles on the exported module run inside the lowering too:
        the batch gathered in front, the keyword input a Replicate DTensor (no
        move), the output scattered back to the batch shards."""
        ep = predispatch.export_predispatch(prepared_mlp(self.mesh), (torch.randn(2, 8),),
                                            {"scale": torch.randn(8)})
        assert_invariants(ep)
        self.assertExpectedInline(collectives_by_boundary(ep), """\
x: all_gather_into_tensor; backward: reduce_scatter_tensor
p_down_bias: local; backward: local
linear: all_reduce; backward: local
mul: local; backward: all_gather_into_tensor""")

    def test_prepare_module_output_returning_a_dtensor_is_refused(self):
        module = prepared_mlp(self.mesh, use_local_output=False)
        with pytest.raises(predispatch.ExportError, match=r"test_sharding.py.*through its PrepareModuleOutput\) "
                           r"returns a DTensor.*use_local_output=True"):
            predispatch.export_predispatch(module, (torch.randn(2, 8),), {"scale": torch.randn(8)})

    def test_prepare_module_input_all_to_all_is_refused_naming_the_style(self):
        class Resharded(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = torch.nn.Identity()

            def forward(self, x):
                return self.inner(x) * 2

        module = parallelize_module(Resharded(), self.mesh, {"inner": PrepareModuleInput(
            input_layouts=Shard(1), desired_input_layouts=Shard(0), use_local_output=True)})
        with pytest.raises(predispatch.ExportError, match=r"PrepareModuleInput's DTensor.redistribute at "
                           r".*test_sharding.py:\d+ in forward: return self.inner\(x\).*S\(1\) -> S\(0\)"):
            predispatch.export_predispatch(module, (torch.randn(4, 4, 8),))

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


def _compared(module, args, kwargs=None, *, seed: int, training: bool = False) -> dict:
    """The module exported on this rank, its program (or compile_training of
    it) against the module: :func:`_max_differences`."""
    kwargs = kwargs or {}
    ep = predispatch.export_predispatch(module, args, kwargs)
    program = predispatch.compile_training(ep) if training else ep.module()
    return _max_differences(module, program, args, kwargs, seed=seed)


def _two_ranks_cases(rank: int, world: int) -> dict:
    """Case -> differences, on a 1-D mesh of the 2 ranks."""
    mesh = init_device_mesh("cpu", (world,))
    results = {}
    torch.manual_seed(1)
    x = torch.randn(3, 8)
    module = tensor_parallel_mlp(mesh)
    results["mlp"] = _compared(module, (x,), seed=2)
    results["mlp compile_training"] = _compared(module, (x,), seed=3, training=True)
    torch.manual_seed(8)
    x = torch.randn(2, 4, 8).chunk(world, 1)[rank].contiguous()  # this rank's sequence shard
    results["sequence parallel"] = _compared(sequence_parallel_mlp(mesh), (x,), seed=9)
    for local in (False, True):
        results[f"PrepareModuleInput use_local_output={local}"] = _compared(
            prepared_block(mesh, use_local_output=local), (x,), seed=12)
    torch.manual_seed(13)
    x = torch.randn(4, 8).chunk(world, 0)[rank].contiguous()  # this rank's batch shard
    results["PrepareModuleInput/Output on the module"] = _compared(
        prepared_mlp(mesh), (x,), {"scale": torch.randn(8)}, seed=14)
    model, _plan = tiny_llama(mesh, world)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(15))
    results["llama tensor parallel"] = _compared(model, (ids,), {"use_cache": False}, seed=16)
    torch.manual_seed(6 + rank)  # each rank its own batch, as in data parallel training
    x = torch.randn(3, 8)
    for reshard in (True, False):
        module = fully_sharded_blocks(mesh, reshard_after_forward=reshard)
        results[f"fully_shard reshard_after_forward={reshard}"] = _compared(module, (x,), seed=7)
    results["fully_shard compile_training"] = _compared(module, (x,), seed=11, training=True)
    return results


def _four_ranks_cases(rank: int, world: int) -> dict:
    """Case -> differences, FSDP x TP on a 2 x 2 mesh: an MLP, and a 1-layer
    Llama with its TP plan on "tp" and fully_shard per decoder layer and at
    the root on "dp"."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh.get_coordinate()[0]
    results = {}
    torch.manual_seed(10 + dp_rank)  # one batch per data-parallel rank
    x = torch.randn(3, 8)
    module = fsdp_times_tp_mlp(mesh)
    results["mlp"] = _compared(module, (x,), seed=2)
    results["mlp compile_training"] = _compared(module, (x,), seed=3, training=True)
    model, _plan = tiny_llama(mesh["tp"], 2)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(4 + dp_rank))
    results["llama"] = _compared(model, (ids,), {"use_cache": False}, seed=5)
    return results


def _rank_main(rank: int, world: int, port: int, out_dir: str, cases) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.save(cases(rank, world), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _on_gloo_ranks(world: int, cases) -> list:
    """``cases(rank, world)`` on ``world`` gloo CPU processes, one process
    group for all of them; each rank's results."""
    with tempfile.TemporaryDirectory() as out_dir:
        mp.start_processes(_rank_main, args=(world, _free_port(), out_dir, cases), nprocs=world,
                           start_method=_start_method())
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def _start_method() -> str:
    """forkserver where the platform has it: one clean process imports
    torch, predispatch, this module and the Llama model code once, and the
    ranks are forked from it (4 processes importing them on 2 cores take
    ~10 s; forked from the test process, they would inherit its state, its
    process-group names among it). spawn elsewhere."""
    if "forkserver" not in mp.get_all_start_methods():
        return "spawn"
    mp.get_context("forkserver").set_forkserver_preload([__name__, "transformers.models.llama.modeling_llama"])
    return "forkserver"


def _assert_each_rank_matches(ranks: list, case: str) -> None:
    for rank, results in enumerate(ranks):
        differences = results[case]
        assert any(k.startswith("grad ") for k in differences)
        worst = {k: d for k, d in differences.items() if d > 1e-5}
        assert not worst, f"rank {rank}, {case}: {worst}"


@pytest.fixture(scope="module")
def two_gloo_ranks():
    return _on_gloo_ranks(2, _two_ranks_cases)


@pytest.fixture(scope="module")
def four_gloo_ranks():
    return _on_gloo_ranks(4, _four_ranks_cases)


@pytest.mark.parametrize("case", [
    "mlp", "mlp compile_training", "sequence parallel", "PrepareModuleInput use_local_output=False",
    "PrepareModuleInput use_local_output=True", "PrepareModuleInput/Output on the module",
    "llama tensor parallel", "fully_shard reshard_after_forward=True",
    "fully_shard reshard_after_forward=False", "fully_shard compile_training"])
def test_each_of_2_ranks_matches_its_sharded_eager_module(two_gloo_ranks, case):
    _assert_each_rank_matches(two_gloo_ranks, case)


@pytest.mark.parametrize("case", ["mlp", "mlp compile_training", "llama"])
def test_fsdp_times_tensor_parallel_on_4_gloo_ranks(four_gloo_ranks, case):
    _assert_each_rank_matches(four_gloo_ranks, case)
