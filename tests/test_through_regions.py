"""``through_regions``: a whole-graph pass on ``ep.module()`` with its regions
inlined, the regions put back. What it does with the pass's nodes is checked
here with small passes; tests/test_quantization.py runs torchao's through it."""
import copy

import pytest
import torch

import cases
import predispatch
from predispatch.testing.eager import assert_runs_match, run_module
from predispatch.downstream.through_regions import PLACE, through_regions

aten = torch.ops.aten
CASES = {
    "nested grad": (cases.NestedGrad, (torch.randn(3),)),
    "no_grad inside autocast": (cases.NoGradInsideAutocast, (torch.randn(2, 4),)),
    "autocast blocks": (cases.AutocastBlocks, (torch.randn(2, 4),)),
    "EMA": (cases.EMA, (torch.randn(2, 4),)),
    "seed (keep_history)": (cases.Seed, (torch.randn(3),)),
}


def layout(gm):
    """Each graph module by region path, with the ops it calls."""
    path = {id(gm): ()}
    for r in predispatch.regions(gm):
        path[id(r.submodule)] = path[id(r.owner)] + ((r.name, r.kind, r.args),)
    return {path[id(m)]: [str(n.target) for n in m.graph.nodes if n.op == "call_function"
                          and n.target.__module__ != "_operator"]
            for m in gm.modules() if id(m) in path}


def owner_path(gm, node):
    for r in predispatch.regions(gm):
        if node.graph is r.submodule.graph:
            return owner_path(gm, r.node) + (r.name,)
    return ()


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_pass_that_changes_nothing_gives_the_program_back(name):
    """Every op in the region (and at the depth) it was in, the same
    regions, and the module runs as eager: outputs, gradients, state."""
    make, args = CASES[name]
    torch.manual_seed(0)
    module = make()
    program = predispatch.export_predispatch(copy.deepcopy(module), args).module()
    expected = layout(program)
    result = through_regions(program, lambda gm: gm)
    assert layout(result) == expected
    assert_runs_match(run_module(copy.deepcopy(module), args, None), run_module(result, args, None))


def _scale_after_each_linear(gm):
    for node in list(gm.graph.nodes):
        if node.target is aten.linear.default:
            with gm.graph.inserting_after(node):
                scaled = gm.graph.call_function(aten.mul.Tensor, (node, 2.0))
            node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
    gm.recompile()
    return gm


def test_a_node_the_pass_adds_goes_where_its_input_is():
    """A node reading a linear inside a region (nested in another) is placed
    in that region, and runs in its mode (no gradient through the no_grad one)."""
    torch.manual_seed(0)
    module, x = cases.NoGradInsideAutocast(), torch.randn(2, 4)
    program = predispatch.export_predispatch(copy.deepcopy(module), (x,)).module()
    result = through_regions(program, _scale_after_each_linear)
    muls = [n for m in result.modules() if isinstance(m, torch.fx.GraphModule)
            for n in m.graph.nodes if n.target is aten.mul.Tensor and n.args[1] == 2.0]
    assert sorted(owner_path(result, n) for n in muls) == [("autocast_bfloat16_0",),
                                                           ("autocast_bfloat16_0", "no_grad_1")]
    assert [(r.name, r.depth) for r in predispatch.regions(result)] == [("autocast_bfloat16_0", 0), ("no_grad_1", 1)]
    doubled = copy.deepcopy(module)
    doubled.lin.register_forward_hook(lambda _module, _args, out: out * 2.0)
    torch.testing.assert_close(result(x), doubled(x))


class _TwoRegions(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            a = x.sin()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b = x.cos()
        return a + b.float()


def _add_sin_and_cos(gm):
    sin = next(n for n in gm.graph.nodes if n.target is aten.sin.default)
    cos = next(n for n in gm.graph.nodes if n.target is aten.cos.default)
    output = gm.graph.output_node()
    with gm.graph.inserting_before(output):
        both = gm.graph.call_function(aten.mul.Tensor, (sin, cos))
    output.args = (tuple(output.args[0]) + (both,),)
    gm.recompile()
    return gm


def test_a_node_reading_two_regions_goes_to_the_level_they_share():
    program = predispatch.export_predispatch(_TwoRegions(), (torch.randn(3),)).module()
    graph = program.graph
    graph._codegen = torch.fx.graph.CodeGen()  # a plain tuple output
    program.recompile()
    result = through_regions(program, _add_sin_and_cos)
    (mul,) = [n for n in result.graph.nodes if n.target is aten.mul.Tensor]
    assert owner_path(result, mul) == ()
    x = torch.randn(3, requires_grad=True)
    y = x.detach().clone().requires_grad_()
    *_, got = result(x)
    expected = y.sin().detach() * y.cos()  # the sin from the no_grad region: no gradient through it
    got.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(x.grad, y.grad)


class _TwoOpsUnderNoGrad(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            y = x.sin().cos()
        return y + x


def _top_level_node_between(gm):
    """A node placed at the top level that reads the region's sin and feeds its cos."""
    sin = next(n for n in gm.graph.nodes if n.target is aten.sin.default)
    cos = next(n for n in gm.graph.nodes if n.target is aten.cos.default)
    with gm.graph.inserting_after(sin):
        outside = gm.graph.call_function(aten.mul.Tensor, (sin, 2.0))
    outside.meta[PLACE] = ()
    cos.replace_input_with(sin, outside)
    return gm


def test_a_region_that_cannot_be_outlined_again_is_an_error():
    program = predispatch.export_predispatch(_TwoOpsUnderNoGrad(), (torch.randn(3),)).module()
    with pytest.raises(RuntimeError, match="mul.*region no_grad_0 .*cannot be outlined again"):
        through_regions(program, _top_level_node_between)
