"""Bare grad-mode switches (G3): ``torch.set_grad_enabled(b)`` called as a
function and ``torch._C._set_grad_enabled(b)``. A switch opens a region that
runs to the next switch, to the end of the block around it, or to the end of
the forward; a switch to the mode already in force opens nothing; a forward
that ends in another mode leaves its caller in it, as eager does.

Each case is compared with eager (outputs, which require grad, gradients,
parameters, buffers and inputs afterwards, and the grad mode the call leaves
its caller in) under grad mode on and off."""
import copy

import pytest
import torch

import predispatch
from predispatch.ir.program_meta import program_meta
from predispatch.testing.eager import assert_matches_eager, assert_runs_match, fresh_inputs, run_module
from predispatch.testing import GraphTestCase
from predispatch.testing.structure import assert_same_program


def region_tree(ep):
    return [(r.depth, r.name, r.args) for r in predispatch.regions(ep)]


class _Frozen(torch.nn.Module):
    """Older training code: a frozen backbone under a switch, the head in the caller's... or not."""

    def __init__(self):
        super().__init__()
        self.backbone = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 4)


class SwitchedOffToTheEnd(_Frozen):
    def forward(self, x):
        y = self.head(x)
        torch.set_grad_enabled(False)  # never switched back: the caller is left under no_grad
        return y + self.backbone(x)


class CSwitchRestored(_Frozen):
    """torch's own export-pass tests are written this way."""

    def forward(self, x):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        y = self.backbone(x)
        torch._C._set_grad_enabled(prev)
        return self.head(y) + x


class CSwitchedOnToTheEnd(_Frozen):
    def forward(self, x):
        torch._C._set_grad_enabled(False)
        y = self.backbone(x)
        torch._C._set_grad_enabled(True)  # on, even for a caller under no_grad, and left on
        return self.head(y) * x


class SwitchesInARow(_Frozen):
    def forward(self, x):
        torch.set_grad_enabled(False)
        a = self.backbone(x)
        torch.set_grad_enabled(False)  # the mode in force: no region
        b = self.backbone(a)
        torch.set_grad_enabled(True)
        c = self.head(b) + x
        torch.set_grad_enabled(False)
        d = self.head(c)
        torch.set_grad_enabled(True)
        return c * 2, d


class SwitchInsideNoGrad(_Frozen):
    def forward(self, x):
        with torch.no_grad():
            a = self.backbone(x)
            torch.set_grad_enabled(True)  # runs to the end of the block
            b = self.head(a) * x
            torch.set_grad_enabled(True)  # in force already
            c = b * 2
        return a + b + c + self.head(x)  # the caller's mode again


class SwitchInsideEnableGrad(_Frozen):
    def forward(self, x):
        with torch.enable_grad():
            torch._C._set_grad_enabled(False)
            a = self.backbone(x)
            torch._C._set_grad_enabled(True)
            b = self.head(a)
        return b + self.head(x)


class SwitchInsideAutocast(_Frozen):
    """autocast's exit leaves grad mode alone: the switch made inside runs on
    after the block, to the next switch."""

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = self.head(x)
            torch.set_grad_enabled(False)
            b = self.backbone(x)
        c = self.backbone(b.float())  # still under no_grad
        torch.set_grad_enabled(True)
        return a.float() + c, self.head(c)


class AutocastInsideASwitch(_Frozen):
    def forward(self, x):
        torch.set_grad_enabled(False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            a = self.backbone(x)
            torch.set_grad_enabled(True)  # on past the autocast block's end
            b = self.head(x)
        return a.float() + b.float() * x


class _Decorated(_Frozen):
    @torch.no_grad()
    def frozen(self, x):
        y = self.backbone(x)
        torch.set_grad_enabled(True)  # inside the decorated call only
        return self.head(y)

    @torch.enable_grad()
    def trained(self, x):
        return self.head(x) * 3


class MixedWithDecorators(_Decorated):
    def forward(self, x):
        a = self.frozen(x)
        torch.set_grad_enabled(False)
        b = self.trained(x)  # enable_grad inside the no_grad the switch opened
        c = self.backbone(x)
        return a + b + c


class _Counted(torch.nn.Module):
    """Mutations inside a switched region: buffers, inputs, a parameter."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("seen", torch.zeros(()))
        self.register_buffer("running", torch.zeros(4))


class MutatesInsideSwitches(_Counted):
    def forward(self, x, state):
        torch.set_grad_enabled(False)
        self.seen.add_(1)
        self.running.mul_(0.9).add_(0.1 * x.mean(0))
        self.lin.weight.mul_(0.999)  # decay of a parameter: no history
        state.add_(x.sum(0))  # an input updated under no_grad
        torch.set_grad_enabled(True)
        y = self.lin(x) + self.running
        self.seen.add_(y.sum())  # a buffer updated with grad on, even under a no_grad caller
        return y


class SwitchedOnAndUpdatesItsInput(_Counted):
    def forward(self, x):
        torch.set_grad_enabled(True)
        x.add_(self.lin.bias * 2)  # the caller's input gets this history, whatever its mode
        return x * 2


class UpdatedUnderASwitchKeepsItsHistory(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        torch.set_grad_enabled(False)
        y.add_(1)  # out of autograd's sight: y keeps x * 2's history
        torch.set_grad_enabled(True)
        return y * y


class UpdatedAfterASwitchOn(_Frozen):
    def forward(self, x):
        torch.set_grad_enabled(False)
        y = self.backbone(x)
        torch.set_grad_enabled(True)
        y.mul_(self.head.weight[0])  # y gets a history here, under a no_grad caller too
        return y


class SwitchedOnAroundALibraryBlock(_Frozen):
    def forward(self, x):
        t = x * 1
        torch.set_grad_enabled(True)
        torch.nn.init.constant_(t, 0.5)  # its own no_grad block, which the trace does not see
        return self.head(t) + x


class SwitchedInAHelper(torch.nn.Module):
    def forward(self, x):
        def freeze():
            torch.set_grad_enabled(False)
        a = x * 2
        freeze()
        b = x * 3
        torch.set_grad_enabled(True)
        return a + b


# Refused before as "never restores" (tests/test_errors.py had them):
class GradModeTurnedOn(torch.nn.Module):
    def forward(self, x):
        torch.set_grad_enabled(True)  # a no-op while tracing, not for a caller under no_grad
        return x * 2


class GradModeSetByAnExpression(torch.nn.Module):
    frozen = False

    def forward(self, x):
        torch.set_grad_enabled(not self.frozen)  # True, whatever the caller's mode
        return x * 2


class SwitchedBackInsideABlockToTheModeReadThere(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            prev = torch.is_grad_enabled()  # False, whatever the caller's mode
            torch._C._set_grad_enabled(True)
            y = x * 2
            torch._C._set_grad_enabled(prev)
            z = x * 3
        return y + z


# Refused before as "a mode ... passed where its origin cannot be traced": torch's
# decorator enters, for each call, a clone() of the decorating object
class DecoratedInTheForwardAfterARead(_Frozen):
    def forward(self, x):
        prev = torch.is_grad_enabled()

        @torch.set_grad_enabled(False)
        def frozen(y):
            return self.backbone(y)

        y = frozen(x)
        torch.set_grad_enabled(False)
        z = self.head(x)
        torch.set_grad_enabled(prev)
        return self.head(y) + z


class DecoratedMethodAfterARead(_Frozen):
    @torch.set_grad_enabled(False)
    def frozen(self, x):
        return self.backbone(x)

    def forward(self, x):
        prev = torch.is_grad_enabled()  # noqa: F841 -- read only
        return self.head(self.frozen(x)) + self.frozen(x * 2)


class DecoratedWithTheModeReadInsideNoGrad(_Frozen):
    def forward(self, x):
        with torch.no_grad():
            off = torch.is_grad_enabled()  # False, whatever the caller's mode

            @torch.set_grad_enabled(off)
            def frozen(y):
                return self.backbone(y)

        with torch.enable_grad():
            y = frozen(x)  # off, inside enable_grad
        return self.head(y)


class DecoratedWithTheCallersMode(_Frozen):
    def forward(self, x):
        prev = torch.is_grad_enabled()

        @torch.set_grad_enabled(prev)
        def head(y):
            return self.head(y)

        with torch.no_grad():
            y = head(x)
        return self.backbone(x) + y


def test_a_decorator_given_the_callers_mode_stays_refused():
    """Where the function is decorated: its mode is the caller's, unknown until run time."""
    with pytest.raises(predispatch.ExportError, match="the caller's grad mode"):
        predispatch.export_predispatch(DecoratedWithTheCallersMode(), (torch.randn(2, 4),))


@pytest.mark.parametrize("module, args", [
    (DecoratedInTheForwardAfterARead(), (torch.randn(2, 4),)),
    (DecoratedMethodAfterARead(), (torch.randn(2, 4),)),
    (DecoratedWithTheModeReadInsideNoGrad(), (torch.randn(2, 4),)),
    (GradModeTurnedOn(), (torch.randn(3),)),
    (GradModeSetByAnExpression(), (torch.randn(3),)),
    (SwitchedBackInsideABlockToTheModeReadThere(), (torch.randn(3),)),
    (UpdatedUnderASwitchKeepsItsHistory(), (torch.randn(3),)),
    (UpdatedAfterASwitchOn(), (torch.randn(2, 4),)),
    (SwitchedOnAroundALibraryBlock(), (torch.randn(2, 4),)),
    (SwitchedInAHelper(), (torch.randn(3),)),
    (SwitchedOffToTheEnd(), (torch.randn(2, 4),)),
    (CSwitchRestored(), (torch.randn(2, 4),)),
    (CSwitchedOnToTheEnd(), (torch.randn(2, 4),)),
    (SwitchesInARow(), (torch.randn(2, 4),)),
    (SwitchInsideNoGrad(), (torch.randn(2, 4),)),
    (SwitchInsideEnableGrad(), (torch.randn(2, 4),)),
    (SwitchInsideAutocast(), (torch.randn(2, 4),)),
    (AutocastInsideASwitch(), (torch.randn(2, 4),)),
    (MixedWithDecorators(), (torch.randn(2, 4),)),
    (MutatesInsideSwitches(), (torch.randn(2, 4), torch.randn(4))),
], ids=lambda v: type(v).__name__ if isinstance(v, torch.nn.Module) else "")
def test_matches_eager(module, args):
    assert_matches_eager(module, args)


def test_an_input_updated_after_a_switch_on():
    assert_matches_eager(SwitchedOnAndUpdatesItsInput(), (torch.randn(2, 4),), inputs_require_grad=False)


def test_regions_run_from_switch_to_switch():
    ep = predispatch.export_predispatch(SwitchesInARow(), (torch.randn(2, 4),))
    assert region_tree(ep) == [(0, "no_grad_0", (False,)), (0, "enable_grad_1", (True,)),
                               (0, "no_grad_2", (False,)), (0, "enable_grad_3", (True,))]


def test_a_switch_to_the_mode_in_force_opens_nothing():
    ep = predispatch.export_predispatch(SwitchInsideNoGrad(), (torch.randn(2, 4),))
    assert region_tree(ep) == [(0, "no_grad_0", (False,)), (1, "enable_grad_1", (True,))]


def test_a_switch_restored_to_the_callers_mode_opens_one_region():
    ep = predispatch.export_predispatch(CSwitchRestored(), (torch.randn(2, 4),))
    assert region_tree(ep) == [(0, "no_grad_0", (False,))]
    assert "grad_mode_after" not in program_meta(ep)


def test_a_switch_inside_autocast_runs_past_its_end():
    ep = predispatch.export_predispatch(SwitchInsideAutocast(), (torch.randn(2, 4),))
    assert [(d, args) for d, _, args in region_tree(ep)] == [
        (0, ("cpu", torch.bfloat16, True, True)), (1, (False,)), (0, (False,)), (0, (True,))]


@pytest.mark.parametrize("module, after", [(SwitchedOffToTheEnd(), False), (CSwitchedOnToTheEnd(), True)],
                         ids=["off", "on"])
@pytest.mark.parametrize("ambient", [True, False])
def test_the_caller_is_left_in_the_mode_the_forward_ends_in(module, after, ambient):
    ep = predispatch.export_predispatch(module, (torch.randn(2, 4),))
    assert torch.is_grad_enabled()  # the export itself leaves it alone
    with torch.set_grad_enabled(ambient):
        module(torch.randn(2, 4))
        assert torch.is_grad_enabled() is after  # eager
        torch.set_grad_enabled(ambient)
        ep.module()(torch.randn(2, 4))
        assert torch.is_grad_enabled() is after


class _Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.frozen = torch.nn.Linear(4, 4)
        self.trained = torch.nn.Linear(4, 4)

    def forward(self, x):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        y = self.frozen(x)
        torch._C._set_grad_enabled(prev)
        return self.trained(y) + x


class _Stack(torch.nn.Module):
    def __init__(self, layer=_Layer, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(layer() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _LeavesGradOff(_Layer):
    def forward(self, x):
        torch.set_grad_enabled(False)
        return self.trained(self.frozen(x)) + x


@pytest.mark.parametrize("layer", [_Layer, _LeavesGradOff])
def test_a_repeated_layer_that_switches_gets_a_region_per_call(layer):
    """Layer reuse stamps no switch: each layer's region is its own."""
    ep = assert_matches_eager(_Stack(layer), (torch.randn(2, 4),))
    grad_regions = [r for r in predispatch.regions(ep) if r.kind == "grad"]
    assert len(grad_regions) == (3 if layer is _Layer else 1)
    with predispatch.reuse_layers(False):
        traced = predispatch.export_predispatch(_Stack(layer), (torch.randn(2, 4),))
    assert_same_program(ep, traced)


def test_save_and_load(tmp_path):
    module = CSwitchedOnToTheEnd()
    ep = predispatch.export_predispatch(module, (torch.randn(2, 4),))
    path = tmp_path / "switched.pt2"
    torch.export.save(ep, path)
    plain = torch.export.load(path)
    assert region_tree(plain) == region_tree(ep)
    loaded = predispatch.load(path)
    x = torch.randn(2, 4)
    for grad_mode in (True, False):
        eager = run_module(copy.deepcopy(module), (x,), None, grad_mode=grad_mode)
        exported = run_module(copy.deepcopy(loaded.module()), (x,), None, grad_mode=grad_mode)
        assert_runs_match(eager, exported)


@pytest.mark.parametrize("module", [SwitchedOffToTheEnd(), CSwitchedOnToTheEnd(), SwitchesInARow()],
                         ids=lambda m: type(m).__name__)
@pytest.mark.parametrize("ambient", [True, False])
def test_compile_training(module, ambient):
    x = torch.randn(2, 4)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,))
    train = predispatch.compile_training(ep)
    results = []
    for m in (copy.deepcopy(module), train):
        (inp,), _ = fresh_inputs((x,), None, True)
        with torch.set_grad_enabled(ambient):
            out = m(inp)
            after = torch.is_grad_enabled()
        outs = [o for o in (out if isinstance(out, tuple) else (out,))]
        loss = sum(o.sum() for o in outs if o.requires_grad)
        if torch.is_tensor(loss):
            loss.backward()
        results.append((after, [o.detach() for o in outs], [o.requires_grad for o in outs], inp.grad,
                        {n: p.grad for n, p in m.named_parameters()}))
    (a_after, a_out, a_req, a_grad, a_pgrads), (b_after, b_out, b_req, b_grad, b_pgrads) = results
    assert a_after == b_after and a_req == b_req
    torch.testing.assert_close(b_out, a_out)
    torch.testing.assert_close(b_grad, a_grad)
    torch.testing.assert_close(b_pgrads, a_pgrads)


class RaisesUnderASwitch(_Frozen):
    """An index out of range raises inside a region at run time: i = 5 in the
    with block, i = 3 after the switch."""

    def forward(self, x, i):
        with torch.no_grad():
            a = x * 2
            torch.set_grad_enabled(True)
            b = self.head(x)[:, i]  # the with block's end restores the caller's mode, raising or not
        torch.set_grad_enabled(False)
        y = self.backbone(x)[i]  # eager leaves the caller under no_grad when this raises
        torch.set_grad_enabled(True)
        return y + a[0] + b[0]


def _mode_left_by_a_failing_call(f, ambient: bool, i: int) -> bool:
    with torch.set_grad_enabled(ambient):
        with pytest.raises(IndexError):
            f(torch.randn(3, 4), torch.tensor(i))
        return torch.is_grad_enabled()


def test_an_exception_restores_what_eager_restores(tmp_path):
    """G7: a block's region restores its mode when an exception leaves it, a
    switch's region does not, as in eager; through save and load too."""
    module = RaisesUnderASwitch()
    ep = predispatch.export_predispatch(module, (torch.randn(3, 4), torch.tensor(1)))
    torch.export.save(ep, tmp_path / "raises.pt2")
    programs = [ep.module(), copy.deepcopy(ep.module()), predispatch.load(tmp_path / "raises.pt2").module()]
    left = []
    for ambient in (True, False):
        for i in (5, 3):
            expected = _mode_left_by_a_failing_call(module, ambient, i)
            left.append(expected)
            for program in programs:
                assert _mode_left_by_a_failing_call(program, ambient, i) == expected, (ambient, i)
    assert left == [True, False, False, False]  # the case raises where it should


class SwitchesInItsForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        torch.set_grad_enabled(True)  # apply() restores the mode around forward, in eager too
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


class SwitchesInItsBackward(SwitchesInItsForward):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        torch.set_grad_enabled(False)
        return g * 2


class _Applies(torch.nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function.apply(x) + 1


def test_a_switch_in_a_functions_forward_ends_with_it():
    ep = assert_matches_eager(_Applies(SwitchesInItsForward), (torch.randn(3),))
    assert "grad_mode_after" not in program_meta(ep)


def test_a_switch_left_in_force_by_a_functions_backward_is_refused():
    with pytest.raises(predispatch.ExportError, match="switch left in force at the end of an autograd.Function"):
        predispatch.export_predispatch(_Applies(SwitchesInItsBackward), (torch.randn(3),))


class FrozenBackboneThenHead(_Frozen):
    """The expect test's case: a switch inside autocast runs past its end; the
    forward ends under a switch, which the caller is left in."""

    def forward(self, x):
        prev = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            feats = self.backbone(x)
            torch.set_grad_enabled(True)
            out = self.head(x)
        out = out.float() + feats.float()
        torch._C._set_grad_enabled(prev)  # the caller's mode: no region
        y = out * 2
        torch.set_grad_enabled(False)
        return y, out.sum()


class TestGraph(GraphTestCase):
    def test_regions_of_bare_switches(self):
        ep = assert_matches_eager(FrozenBackboneThenHead(), (torch.randn(2, 4),))
        self.assertGraphExpectedInline(ep, """\
def forward(p_backbone_weight: f32[4, 4], p_backbone_bias: f32[4], p_head_weight: f32[4, 4], p_head_bias: f32[4], x: f32[2, 4]):
    no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, x, p_backbone_weight, p_backbone_bias, p_head_weight, p_head_bias)
    getitem = no_grad_0[0]
    getitem_1 = no_grad_0[1]
    enable_grad_3 = wrap_with_set_grad_enabled(True, self.enable_grad_3, getitem_1, getitem)
    getitem_2 = enable_grad_3[0]
    mul = aten.mul.Tensor(getitem_2, 2)
    no_grad_4 = wrap_with_set_grad_enabled(False, self.no_grad_4, getitem_2)
    getitem_3 = no_grad_4[0]
    return (mul, getitem_3)
def no_grad_0(x: f32[2, 4], p_backbone_weight: f32[4, 4], p_backbone_bias: f32[4], p_head_weight: f32[4, 4], p_head_bias: f32[4]):
    autocast_bfloat16_1 = wrap_with_autocast('cpu', torch.bfloat16, True, True, self.autocast_bfloat16_1, x, p_backbone_weight, p_backbone_bias, p_head_weight, p_head_bias)
    getitem = autocast_bfloat16_1[0]
    getitem_1 = autocast_bfloat16_1[1]
    return (getitem, getitem_1)
def no_grad_0.autocast_bfloat16_1(x: f32[2, 4], p_backbone_weight: f32[4, 4], p_backbone_bias: f32[4], p_head_weight: f32[4, 4], p_head_bias: f32[4]):
    linear = aten.linear.default(x, p_backbone_weight, p_backbone_bias)
    enable_grad_2 = wrap_with_set_grad_enabled(True, self.enable_grad_2, x, p_head_weight, p_head_bias)
    getitem = enable_grad_2[0]
    return (linear, getitem)
def no_grad_0.autocast_bfloat16_1.enable_grad_2(x: f32[2, 4], p_head_weight: f32[4, 4], p_head_bias: f32[4]):
    linear = aten.linear.default(x, p_head_weight, p_head_bias)
    return (linear,)
def enable_grad_3(getitem_1: bf16[2, 4], getitem: bf16[2, 4]):
    _assert_tensor_metadata = aten._assert_tensor_metadata.default(getitem_1, None, None, torch.bfloat16, device=device(type='cpu'), layout=torch.strided)
    _to_copy = aten._to_copy.default(getitem_1, dtype=torch.float32)
    _assert_tensor_metadata_1 = aten._assert_tensor_metadata.default(getitem, None, None, torch.bfloat16, device=device(type='cpu'), layout=torch.strided)
    _to_copy_1 = aten._to_copy.default(getitem, dtype=torch.float32)
    add = aten.add.Tensor(_to_copy, _to_copy_1)
    return (add,)
def no_grad_4(getitem_2: f32[2, 4]):
    sum = aten.sum.default(getitem_2)
    return (sum,)
inputs:
    p_backbone_weight: PARAMETER -> backbone.weight
    p_backbone_bias: PARAMETER -> backbone.bias
    p_head_weight: PARAMETER -> head.weight
    p_head_bias: PARAMETER -> head.bias
    x: USER_INPUT
outputs:
    mul: USER_OUTPUT
    getitem_3: USER_OUTPUT
autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
leaves the caller in grad mode: off
""")
