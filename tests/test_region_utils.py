"""Region utilities: walk every region; inline them for consumers that cannot
handle higher-order ops."""
import copy

import torch

import cases
import predispatch
from predispatch.testing.invariants import all_graph_modules

HOPS = (torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast)


def test_regions_walks_nested_regions():
    ep = predispatch.export_predispatch(cases.NestedGrad(), (torch.randn(3),))
    found = [(r.depth, r.name, r.kind, r.args) for r in predispatch.regions(ep)]
    assert found == [(0, "no_grad_0", "grad", (False,)), (1, "enable_grad_1", "grad", (True,)),
                     (2, "no_grad_2", "grad", (False,))]
    inner = list(predispatch.regions(ep))[2]
    assert inner.owner is list(predispatch.regions(ep))[1].submodule
    assert all(isinstance(i, torch.fx.Node) for i in inner.inputs)
    assert list(predispatch.regions(ep.graph_module)) == list(predispatch.regions(ep))


def test_regions_let_a_matcher_see_inside():
    ep = predispatch.export_predispatch(cases.NoGradInsideAutocast(), (torch.randn(2, 4),))
    linears = [(r.name, n.name) for r in predispatch.regions(ep) for n in r.submodule.graph.nodes
               if n.target is torch.ops.aten.linear.default]
    assert [name for name, _ in linears] == ["autocast_bfloat16_0", "no_grad_1"]


def test_inline_regions_removes_every_region_and_keeps_values():
    module, x = cases.NoGradInsideAutocast(), torch.randn(2, 4)
    ep = predispatch.export_predispatch(module, (x,))
    flat = predispatch.inline_regions(ep)
    assert not [n for m in all_graph_modules(flat.graph_module) for n in m.graph.nodes if n.target in HOPS]
    assert list(predispatch.regions(flat)) == []
    assert isinstance(flat, torch.export.ExportedProgram)
    # same values when run under the mode the regions set (autocast here) ...
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(flat.module()(x), module(x))
    # ... but the modes themselves are gone, as the docstring says
    assert "LOST" in predispatch.inline_regions.__doc__
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert flat.module()(x).requires_grad  # the inner no_grad is gone


def test_inline_regions_keeps_mutations_in_the_signature():
    ep = predispatch.export_predispatch(cases.EMA(), (torch.randn(2, 4),))
    flat = predispatch.inline_regions(ep)
    kinds = sorted(s.kind.name for s in flat.graph_signature.output_specs)
    assert kinds == ["BUFFER_MUTATION", "PARAMETER_MUTATION", "USER_OUTPUT"]
    flat_module, module = copy.deepcopy(flat.module()), copy.deepcopy(ep.module())
    with torch.no_grad():
        torch.testing.assert_close(flat_module(torch.ones(2, 4)), module(torch.ones(2, 4)))
    torch.testing.assert_close(flat_module.shadow, module.shadow)


class _DecayThenLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():  # the graph's first op is this region
            self.lin.weight.mul_(0.5)
        return self.lin(x)


def test_inline_regions_keeps_the_program_record():
    """The record (write-back modes, autocast policy) lived on the region's
    node: the inlined program keeps it, and writes the weight back as eager."""
    module, x = _DecayThenLinear(), torch.randn(2, 4)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,), backward_pass_autocast="off",
                                        on_backward_autocast_mismatch="warn")
    flat = predispatch.inline_regions(ep)
    assert predispatch.autocast_policy(flat) == predispatch.autocast_policy(ep)
    torch.testing.assert_close(flat.module()(x), module(x))


class _CastAfterAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
        return y.float()


def test_inlined_autocast_regions_run_and_their_values_say_so():
    """Inlined, the linear computes in float32: its node's value says so, and
    the guard of ``.float()`` (its input was bfloat16 when traced) is gone,
    so the program runs with and without an ambient autocast."""
    module, x = _CastAfterAutocast(), torch.randn(2, 4)
    flat = predispatch.inline_regions(predispatch.export_predispatch(module, (x,)))
    linear = next(n for n in flat.graph_module.graph.nodes if n.target is torch.ops.aten.linear.default)
    assert linear.meta["val"].dtype == torch.float32
    torch.testing.assert_close(flat.module()(x), torch.nn.functional.linear(x, module.lin.weight, module.lin.bias))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(flat.module()(x), module(x))


class _LinearInEachRegion(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            y = self.a(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            z = self.b(y)
        return z.float() + y


def test_a_source_matcher_does_not_take_a_region_result_for_the_op_inside():
    """torch's get_source_partitions (what PT2E quantizers match with) puts a
    node in a module's partition by its module stack: a region's results
    carry the stack of the code that opened the region, not that of the op
    that computed them, so a Linear's partition holds linears only (torchao's
    X86InductorQuantizer raised "getitem is not an aten linear operator")."""
    from torch.fx.passes.utils.source_matcher_utils import get_source_partitions

    ep = predispatch.export_predispatch(_LinearInEachRegion(), (torch.randn(2, 4),))
    for gm in (ep.graph_module, ep.module()):
        found = [n for m in all_graph_modules(gm)
                 for partitions in get_source_partitions(m.graph, [torch.nn.Linear]).values()
                 for p in partitions for n in p.nodes]
        assert {n.target for n in found} == {torch.ops.aten.linear.default}
        assert len(found) == 2  # one in each region
        results = [n for n in gm.graph.nodes if n.op == "call_function" and n.args
                   and isinstance(n.args[0], torch.fx.Node) and n.args[0].target in HOPS]
        assert len(results) == 2
        assert all(r.meta["nn_module_stack"] == r.args[0].meta["nn_module_stack"] for r in results)


class _EMAWithoutNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(4))

    def forward(self, x):
        self.mean.mul_(0.9).add_(0.1 * x.mean(0))
        return x - self.mean


def test_every_node_of_the_program_module_has_a_value():
    """Passes read ``meta["val"]`` (a quantizer asks whether an argument is a
    tensor): the snapshot ``ep.module()`` reads before a mutation in grad
    mode has one too."""
    ep = predispatch.export_predispatch(_EMAWithoutNoGrad(), (torch.randn(2, 4),))
    module = ep.module()
    computed = [n for n in module.graph.nodes if n.op == "call_function" and n.users]
    assert any(n.target.__name__ == "read_before_mutation" for n in computed)
    assert all(isinstance(n.meta.get("val"), torch.Tensor) for n in computed)
