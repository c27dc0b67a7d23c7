"""G6 and §3: the backward autocast policy travels with the program, and
compile_training traces the backward under it and checks it at run time."""
import copy
import warnings

import pytest
import torch

import cases
import predispatch

BF16 = [{"device_type": "cpu", "dtype": torch.bfloat16}]


def grads_of(module, loss):
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


def loss_of(out):
    return (out.float() * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).square().sum()


def compiled_grads(ep, x, forward_ctx, backward_ctx):
    with forward_ctx():
        train = predispatch.compile_training(ep)
        out = train(x)
        loss = loss_of(out)
    with backward_ctx():
        loss.backward()
    return train, out, {n: p.grad.clone() for n, p in train.named_parameters()}


def eager_grads(module, x, forward_ctx, backward_ctx):
    with forward_ctx():
        out = module(x)
        loss = loss_of(out)
    with backward_ctx():
        loss.backward()
    return out, {n: p.grad.clone() for n, p in module.named_parameters()}


def autocast():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def plain():
    return torch.enable_grad()


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)


@pytest.mark.parametrize("policy, forward_ctx, backward_ctx", [
    ("same_as_forward", autocast, autocast),    # forward and backward under autocast
    ("off", plain, plain),                      # autocast regions inside, backward outside
    (BF16, plain, autocast),                    # forward outside autocast, backward inside
])
def test_backward_numerics_match_eager_under_the_assumption(policy, forward_ctx, backward_ctx):
    torch.manual_seed(0)
    module, x = cases.AutocastBlocks(), torch.randn(3, 4)
    ep = predispatch.export_predispatch(copy.deepcopy(module), (x,), backward_pass_autocast=policy)
    _, out, got = compiled_grads(ep, x, forward_ctx, backward_ctx)
    eager_out, expected = eager_grads(module, x, forward_ctx, backward_ctx)
    torch.testing.assert_close(out, eager_out)
    assert_same(got, expected)


def test_the_policy_changes_the_traced_backward():
    ep_off = predispatch.export_predispatch(cases.AutocastBlocks(), (torch.randn(3, 4),),
                                            backward_pass_autocast="off")
    ep_bf16 = predispatch.export_predispatch(cases.AutocastBlocks(), (torch.randn(3, 4),),
                                             backward_pass_autocast=BF16)
    casts = lambda g: sum(n.target is torch.ops.aten._to_copy.default for n in g.graph.nodes)  # noqa: E731
    off, bf16 = predispatch.compile_training(ep_off), predispatch.compile_training(ep_bf16)
    assert casts(bf16.backward_graph) > casts(off.backward_graph)


def _run_backward_under_autocast(action, module=None):
    module = module or cases.AutocastBlocks()
    ep = predispatch.export_predispatch(module, (torch.randn(3, 4),), backward_pass_autocast="off",
                                        on_backward_autocast_mismatch=action)
    train = predispatch.compile_training(ep)
    out = train(torch.randn(3, 4))
    with autocast():
        out.float().sum().backward()
    return train


def test_mismatch_error():
    with pytest.raises(predispatch.BackwardAutocastMismatchError) as info:
        _run_backward_under_autocast("error")
    message = str(info.value)
    assert "autocast('cpu', bfloat16)" in message and "no autocast" in message
    assert "on_backward_autocast_mismatch" in message and "aten.mm" in message


def test_mismatch_warn():
    with pytest.warns(predispatch.BackwardAutocastMismatchWarning, match="traced assuming no autocast"):
        train = _run_backward_under_autocast("warn")
    assert all(p.grad is not None for p in train.parameters())


def test_mismatch_do_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", predispatch.BackwardAutocastMismatchWarning)
        train = _run_backward_under_autocast("do_nothing")
    assert all(p.grad is not None for p in train.parameters())


class Elementwise(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))

    def forward(self, x):
        return (x * self.w).sin()


def test_no_false_alarm_when_autocast_cannot_change_the_backward():
    # the backward has only elementwise ops, which CPU autocast leaves alone
    train = _run_backward_under_autocast("error", Elementwise())
    assert train.backward_check.sensitive_ops == {}
    assert train.w.grad is not None


def test_same_assumption_is_not_a_mismatch():
    ep = predispatch.export_predispatch(cases.AutocastBlocks(), (torch.randn(3, 4),),
                                        backward_pass_autocast=BF16)
    train = predispatch.compile_training(ep)
    out = train(torch.randn(3, 4))
    with autocast():
        out.float().sum().backward()  # what was assumed: no error


def test_policy_is_recorded_shown_and_survives_save_and_load(tmp_path):
    ep = predispatch.export_predispatch(cases.EMA(), (torch.randn(2, 4),),
                                        backward_pass_autocast=BF16, on_backward_autocast_mismatch="warn")
    expected = predispatch.AutocastPolicy(BF16, "warn")
    assert predispatch.autocast_policy(ep) == expected
    assert "backward_pass_autocast=[{'device_type': 'cpu', 'dtype': torch.bfloat16}]" in predispatch.format_program(ep)
    path = tmp_path / "ema.pt2"
    torch.export.save(ep, path)
    assert predispatch.autocast_policy(torch.export.load(path)) == expected
    loaded = predispatch.load(path)
    assert isinstance(loaded, predispatch.PredispatchProgram)
    assert predispatch.autocast_policy(loaded) == expected
    assert predispatch.format_program(loaded) == predispatch.format_program(ep)
    # predispatch.load restores the eager-like write-back of a parameter updated under no_grad
    x = torch.randn(2, 4)
    eager = cases.EMA()
    eager.load_state_dict(ep.state_dict)
    loaded_module = loaded.module()
    loaded_module(x).sum().backward()
    eager(x).sum().backward()
    torch.testing.assert_close(loaded_module.lin.weight, eager.lin.weight)


def test_default_policy():
    ep = predispatch.export_predispatch(cases.Seed(), (torch.ones(2),))
    assert predispatch.autocast_policy(ep) == predispatch.AutocastPolicy("same_as_forward", "error")
