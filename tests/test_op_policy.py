"""§2 OpPolicy: the policy decides what the tracer keeps, and says why."""
import pytest
import torch

import predispatch
from predispatch.testing.eager import assert_matches_eager
from predispatch.testing.invariants import all_graph_modules

_lib = torch.library.Library("pdtest", "DEF")
_lib.define("scaled_add(Tensor x, Tensor y, float alpha) -> Tensor")
_lib.impl("scaled_add", lambda x, y, alpha: x + alpha * y, "CompositeImplicitAutograd")
SCALED_ADD = torch.ops.pdtest.scaled_add.default


class UsesCustomComposite(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, y):
        return torch.ops.pdtest.scaled_add(self.lin(x), y, 0.5).relu()


def targets(ep):
    return {n.target for m in all_graph_modules(ep.graph_module) for n in m.graph.nodes
            if n.op == "call_function"}


def test_non_aten_composite_is_decomposed_by_default():
    ep = assert_matches_eager(UsesCustomComposite(), (torch.randn(2, 3), torch.randn(2, 3)))
    assert SCALED_ADD not in targets(ep)
    assert torch.ops.aten.linear.default in targets(ep)


def test_non_aten_composite_is_kept_when_the_policy_keeps_it():
    policy = predispatch.OpPolicy.default().keep(SCALED_ADD)
    ep = assert_matches_eager(UsesCustomComposite(), (torch.randn(2, 3), torch.randn(2, 3)),
                              op_policy=policy)
    assert SCALED_ADD in targets(ep)


def test_decomposing_a_truthful_aten_composite():
    policy = predispatch.OpPolicy.default().decompose(torch.ops.aten.linear.default)
    ep = assert_matches_eager(UsesCustomComposite(), (torch.randn(2, 3), torch.randn(2, 3)),
                              op_policy=policy)
    assert torch.ops.aten.linear.default not in targets(ep)


@pytest.mark.parametrize("liar", [torch.ops.aten.reshape.default,      # schema alias
                                  torch.ops.aten.dropout.default,      # tagged
                                  torch.ops.aten.type_as.default])     # found by the audit
def test_keeping_a_liar_is_refused(liar):
    with pytest.raises(ValueError, match="cannot keep"):
        predispatch.OpPolicy.default().keep(liar)


def test_explain():
    policy = predispatch.OpPolicy.default()
    assert "kept" in policy.explain(torch.ops.aten.linear.default)
    assert "decomposed" in policy.explain(torch.ops.aten.type_as.default)
    assert "audit" in policy.explain(torch.ops.aten.type_as.default)
    assert "tagged" in policy.explain(torch.ops.aten.dropout.default)
    assert "non-aten" in policy.explain(SCALED_ADD)
    assert "kept by this policy" in policy.keep(SCALED_ADD).explain(SCALED_ADD)
    assert "not a CompositeImplicitAutograd" in policy.explain(torch.ops.aten.mm.default)


def test_policies_are_values():
    base = predispatch.OpPolicy.default()
    kept = base.keep(SCALED_ADD)
    assert base != kept and base.should_decompose(SCALED_ADD) and not kept.should_decompose(SCALED_ADD)
    assert kept.decompose(SCALED_ADD).should_decompose(SCALED_ADD)


def test_bad_policy_argument():
    with pytest.raises(ValueError, match="OpPolicy"):
        predispatch.export_predispatch(UsesCustomComposite(), (torch.randn(2, 3), torch.randn(2, 3)),
                                       op_policy="keep everything")


def test_a_packet_means_each_of_its_overloads():
    policy = predispatch.OpPolicy.default()
    aten = torch.ops.aten
    # aten.to has no .default; each overload aliases its input, so keeping is refused.
    with pytest.raises(ValueError, match=r"cannot keep aten::to\.\w+"):
        policy.keep(aten.to)
    assert policy.decompose(aten.to).decomposed == {aten.to.device, aten.to.dtype,
                                                    aten.to.other, aten.to.dtype_layout}
    assert policy.explain(aten.to).count("decomposed") == 4
    # linear.out is not a composite: keeping the packet keeps linear, refuses nothing.
    assert not policy.keep(aten.linear).should_decompose(aten.linear.default)
    assert policy.decompose(aten.linear).should_decompose(aten.linear.default)
    assert policy.explain(aten.linear).splitlines() == [
        policy.explain(aten.linear.default), policy.explain(aten.linear.out)]
    # aten.add.default is a TorchScript-only overload the dispatcher does not know.
    assert "aten::add.Tensor: traced as itself" in policy.explain(aten.add)
    assert aten.add.default not in policy.keep(aten.add).kept


@pytest.mark.parametrize("method", ["keep", "decompose", "explain"])
@pytest.mark.parametrize("bad, message", [
    (torch.ops.aten.add.default, "TorchScript-only overload .* choose one of .*aten.add.Tensor"),
    ("aten::linear", "expected an op overload .* or a packet"),
    (torch.add, "expected an op overload .* or a packet"),
])
def test_bad_op_arguments_name_what_is_accepted(method, bad, message):
    with pytest.raises(ValueError, match=message):
        getattr(predispatch.OpPolicy.default(), method)(bad)


class _DropoutUnderAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
        self.drop = torch.nn.Dropout(0.1)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.b(self.drop(self.a(x)))


class _DropoutOffAliases(torch.nn.Module):
    def forward(self, x):
        y = torch.nn.functional.dropout(x, 0.5, training=False)  # x itself, in eager
        y.add_(1)
        return y * 2


def test_dropout_decomposes_as_eager_runs_it():
    """A liar decomposed the way eager computes it (its C++ composite), not
    by torch's Python decomposition: a bf16 dropout's gradients round as in
    eager, bit for bit, and dropout with training=False returns its input."""
    ep = assert_matches_eager(_DropoutUnderAutocast(), (torch.randn(8, 16),), rtol=0, atol=0)
    assert torch.ops.aten.native_dropout.default not in targets(ep)
    ep = assert_matches_eager(_DropoutOffAliases(), (torch.randn(4),), inputs_require_grad=False)
    assert [s.kind.name for s in ep.graph_signature.output_specs] == ["USER_INPUT_MUTATION", "USER_OUTPUT"]
