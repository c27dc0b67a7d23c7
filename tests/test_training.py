"""§3 compile_training: the compiled module against eager (outputs, gradients
of inputs and parameters, buffers, inputs afterwards), on the calls that
differ from the export's example, and the backward autocast check."""
import copy
import warnings

import cases
import pytest
import torch
from torch.export import Dim

import predispatch
from predispatch.testing.eager import assert_matches_eager, assert_runs_match, fresh_inputs, run_module
from predispatch.downstream.training import CallNotSupportedError


def compiled(module, args, kwargs=None, **export_kwargs):
    ep = predispatch.export_predispatch(copy.deepcopy(module), *fresh_inputs(args, kwargs, False),
                                        **export_kwargs)
    return predispatch.compile_training(ep)


def run_compiled(train, args, kwargs=None, **run_kwargs):
    """``run_module`` of the compiled module (its state is named as the eager module's)."""
    return run_module(train, args, kwargs, **run_kwargs)


def assert_compiled_matches_eager(module, args, kwargs=None, *, export_args=None, grad_modes=(True, False),
                                  inputs_require_grad=True, **export_kwargs):
    """Compile a program exported with ``export_args`` (default: ``args``) and
    run it on ``args`` against eager, under each grad mode."""
    for grad_mode in grad_modes:
        train = compiled(module, export_args or args, kwargs, **export_kwargs)
        expected = run_module(copy.deepcopy(module), args, kwargs, grad_mode=grad_mode,
                              inputs_require_grad=inputs_require_grad)
        got = run_compiled(train, args, kwargs, grad_mode=grad_mode, inputs_require_grad=inputs_require_grad)
        assert_runs_match(expected, got, what=f"[grad_mode={grad_mode}] ")


# --- bug 1: an input mutated in grad mode keeps the autograd history eager gives it


class MutatesInputWithParameter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.tensor([2.0, 3.0]))

    def forward(self, x):
        x.mul_(self.w)
        return (x * self.w).sum()


@pytest.mark.parametrize("input_kind", ["non_leaf", "plain"])
def test_input_mutated_in_grad_mode_keeps_its_history(input_kind):
    eager, train = MutatesInputWithParameter(), compiled(MutatesInputWithParameter(), (torch.ones(2),))

    def run(module, w):
        base = torch.tensor([1.0, 2.0], requires_grad=True)
        x = base * 1 if input_kind == "non_leaf" else base.detach().clone()
        out = module(x)
        (out + 3 * x.sum()).backward()  # reads x after the call's in-place update
        return x.detach(), base.grad, w.grad

    for got, expected in zip(run(train, train.w), run(eager, eager.w)):
        torch.testing.assert_close(got, expected)


def test_input_mutated_in_grad_mode_matches_eager():
    assert_compiled_matches_eager(cases.InputMutatedWithGrad(), (torch.randn(3), torch.randn(3)),
                                  inputs_require_grad=False)


# --- bug 2: dynamic shapes are honoured, sizes outside the program refused


class ScaleByBatch(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.lin(x) * x.shape[0]


def test_dynamic_batch_at_another_size_matches_eager():
    batch = Dim("batch", min=2, max=16)
    assert_compiled_matches_eager(ScaleByBatch(), (torch.randn(6, 3),), export_args=(torch.randn(4, 3),),
                                  dynamic_shapes=({0: batch},))


def test_sizes_the_program_refuses_are_refused():
    train = compiled(ScaleByBatch(), (torch.randn(4, 3),), dynamic_shapes=({0: Dim("batch", min=2, max=16)},))
    with pytest.raises(CallNotSupportedError, match=r"shape\[1\]"):
        train(torch.randn(4, 5))      # a static size
    with pytest.raises(CallNotSupportedError, match="<= 16"):
        train(torch.randn(17, 3))     # outside the dynamic range
    static = compiled(ScaleByBatch(), (torch.randn(4, 3),))
    with pytest.raises(CallNotSupportedError, match=r"shape\[0\]"):
        static(torch.randn(6, 3))


# --- bug 3: non-tensor inputs are checked, not replaced by the example's


class NonTensorInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)

    def forward(self, x, scale: int, train_head: bool):
        with torch.set_grad_enabled(train_head):
            h = self.lin(x)
        return h * scale + x


def test_non_tensor_inputs_other_than_the_exported_ones_are_refused():
    args = (torch.randn(3, 2), 2, False)
    assert_compiled_matches_eager(NonTensorInputs(), args)
    train = compiled(NonTensorInputs(), args)
    with pytest.raises(CallNotSupportedError, match="equal to 2, but got 5"):
        train(torch.randn(3, 2), 5, False)
    with pytest.raises(CallNotSupportedError, match="equal to False, but got True"):
        train(torch.randn(3, 2), 2, True)
    with pytest.raises(CallNotSupportedError, match="equal to 2, but got 2.0"):
        train(torch.randn(3, 2), 2.0, False)  # equal in Python, but not the exported int


# --- bug 7: the forward honours the autocast state it is called under


class TwoLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.b(self.a(x).relu())


def test_forward_called_under_ambient_autocast_matches_eager():
    torch.manual_seed(0)
    module, x = TwoLinear(), torch.randn(3, 4)
    train = compiled(module, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected, got = module(x), train(x)
        torch.autograd.backward([expected.float().sum(), got.float().sum()])
    assert got.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(got, expected)
    for name, p in module.named_parameters():
        torch.testing.assert_close(train.get_parameter(name).grad, p.grad)
    # and the other way round: compiled under autocast, called outside it
    with torch.autocast("cpu", dtype=torch.bfloat16):
        train = compiled(module, (x,))
    assert train(x).dtype == module(x).dtype == torch.float32


class CastsLogits(TwoLinear):
    """``.float()`` of a float32 tensor is a no-op at export: not in the program."""

    def forward(self, x):
        return super().forward(x).float()


@pytest.mark.parametrize("export_under, call_under", [(False, True), (True, False)])
def test_a_call_under_another_autocast_than_a_skipped_cast_was_traced_for_is_refused(export_under, call_under):
    """Under autocast the logits are bf16, and eager's ``.float()`` casts them:
    a program exported without it would return bf16, silently (and the other
    way round). Refused as ep.module() refuses it, naming the cast's line."""
    module, x = CastsLogits(), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=export_under):
        train = compiled(module, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=call_under):
        with pytest.raises(CallNotSupportedError, match=r"cannot take this call: .*exported under"):
            train(x)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=export_under):  # as exported: eager's result
        assert train(x).dtype == module(x).dtype == torch.float32
        torch.testing.assert_close(train(x), module(x))


def test_a_skipped_cast_names_its_line():
    module, x = CastsLogits(), torch.randn(3, 4)
    train = compiled(module, (x,))
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            CallNotSupportedError, match=r"cast at .*test_training.py:\d+ in forward: return super\(\).forward\(x\).float\(\)"
                                         r" was traced for a float32 tensor; this call gives it bfloat16"):
        train(x)


# --- bug 14: a difference that cannot change the backward is not reported


class AllUnderAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4, bias=False)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return self.lin(x)


def test_ambient_autocast_that_changes_nothing_in_the_backward_is_not_reported():
    torch.manual_seed(0)
    module, x = AllUnderAutocast(), torch.randn(3, 4)
    train = compiled(module, (x,))  # on_backward_autocast_mismatch="error"
    assert train.backward_check.sensitive_ops  # its mm has an autocast kernel, but bf16 inputs already
    out, expected = train(x), module(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.autograd.backward([out.float().sum(), expected.float().sum()])
    torch.testing.assert_close(train.lin.weight.grad, module.lin.weight.grad)


# --- bug 15: every backward is checked, not only the first after a forward


def test_every_backward_is_checked():
    module = cases.AutocastBlocks()
    train = compiled(module, (torch.randn(3, 4),), backward_pass_autocast="off")
    out = train(torch.randn(3, 4)).float().sum()
    out.backward(retain_graph=True)  # as assumed
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(predispatch.BackwardAutocastMismatchError):
        out.backward(retain_graph=True)
    params = list(train.parameters())
    torch.autograd.grad(out, params, retain_graph=True)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(predispatch.BackwardAutocastMismatchError):
        torch.autograd.grad(out, params)


# --- bug 16: backward_pass_autocast values are validated; a self-disabling one is no autocast


@pytest.mark.parametrize("entry, allowed", [
    ({"device_type": "bogus"}, "'device_type' must be one of"),
    ({"device_type": "cpu", "enabled": "no"}, "'enabled' must be True or False"),
    ({"device_type": "cpu", "dtype": "bfloat16"}, "'dtype' must be a torch.dtype"),
    ({"device_type": "cpu", "cache_enabled": 1}, "'cache_enabled' must be True, False or None"),
])
def test_backward_pass_autocast_values_are_validated(entry, allowed):
    with pytest.raises(ValueError, match=allowed):
        predispatch.export_predispatch(cases.AutocastBlocks(), (torch.randn(3, 4),),
                                       backward_pass_autocast=[entry])


def test_an_autocast_that_disables_itself_is_no_autocast():
    torch.manual_seed(0)
    module, x = cases.AutocastBlocks(), torch.randn(3, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "CPU Autocast only supports ..., disabling autocast"
        train = compiled(module, (x,), backward_pass_autocast=[{"device_type": "cpu", "dtype": torch.float32}])
    assert train.backward_check.assumed == {}
    expected, got = run_module(copy.deepcopy(module), (x,), None), run_compiled(train, (x,))  # no mismatch
    assert_runs_match(expected, got)


# --- bug 20: keyword arguments in any order


class KeywordOnly(torch.nn.Module):
    def forward(self, x, *, a, b):
        return x * a + b


def test_keyword_arguments_in_another_order():
    x, a, b = torch.randn(3), torch.randn(3), torch.randn(3)
    train = compiled(KeywordOnly(), (x,), {"a": a, "b": b})
    torch.testing.assert_close(train(x, b=b, a=a), KeywordOnly()(x, a=a, b=b))
    expected = run_module(KeywordOnly(), (x,), {"b": b, "a": a})
    got = run_compiled(train, (x,), {"b": b, "a": a})
    assert_runs_match(expected, got)


class DecaysAfterUse(torch.nn.Module):
    """A weight used, then updated under no_grad (weight decay after the use)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        y = x @ self.w
        with torch.no_grad():
            self.w.mul_(0.99)
        return y


def test_inputs_are_traced_requiring_grad_only_when_they_do():
    """With x not requiring grad, the backward needs x only, not the weight
    the forward then updates: traced as requiring grad, x made AOTAutograd
    save the weight and the trace failed."""
    assert_compiled_matches_eager(DecaysAfterUse(), (torch.randn(4, 4),), inputs_require_grad=False)
    assert_compiled_matches_eager(DecaysAfterUse(), (torch.randn(4, 4),), grad_modes=(False,))


class _Noisy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        return x * self.w + torch.randn_like(x)


def test_the_backward_draws_no_random_numbers():
    """torch's partitioner leaves a dead copy of randn_like in the backward:
    run, the next step's noise would differ from eager's under one seed."""
    def two_steps(module):
        torch.manual_seed(0)
        module(torch.zeros(3)).sum().backward()
        return module(torch.zeros(3)).detach()

    train = predispatch.compile_training(predispatch.export_predispatch(_Noisy(), (torch.zeros(3),)))
    torch.testing.assert_close(two_steps(train), two_steps(_Noisy()))


def test_a_copy_trains_its_own_parameters():
    ep = predispatch.export_predispatch(torch.nn.Linear(3, 2), (torch.randn(1, 3),))
    train = predispatch.compile_training(ep)
    twin = copy.deepcopy(train)
    with torch.no_grad():
        for p in twin.parameters():
            p.zero_()
    x = torch.randn(1, 3)
    assert torch.equal(twin(x), torch.zeros(1, 2))
    twin(x).sum().backward()
    assert all(p.grad is not None for p in twin.parameters())
    assert all(p.grad is None for p in train.parameters())


# --- a drop-in for the module: its state's names and order, state dicts, optimizers


def _llama(tied=False):
    """A tiny Llama whose rotary embedding runs under no_grad (a region)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, use_cache=False, attn_implementation="sdpa",
        tie_word_embeddings=tied, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    rotary = model.model.rotary_emb
    rotary.forward = torch.no_grad()(type(rotary).forward).__get__(rotary)
    return model


class _LlamaLoss(torch.nn.Module):
    """The model and its loss, as a training step calls them."""

    def __init__(self, tied=False):
        super().__init__()
        self.llama = _llama(tied)

    def forward(self, input_ids, labels):
        return self.llama(input_ids=input_ids, labels=labels, use_cache=False).loss


def _tokens(seed):
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed))
    return ids, ids.roll(-1, dims=1)


class _TopLevelState(torch.nn.Module):
    """State at the top level and in nested modules, a buffer before the
    parameters, a non-persistent buffer, an EMA under no_grad."""

    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros(()))
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.register_buffer("mask", torch.ones(4), persistent=False)
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.BatchNorm1d(4))

    def forward(self, x):
        with torch.no_grad():
            self.steps.add_(1)
        return self.block(x * self.scale * self.mask)


DROP_IN_CASES = {
    "top-level state": (_TopLevelState, lambda: (torch.randn(3, 4),)),
    "EMA": (cases.EMA, lambda: (torch.randn(2, 4),)),
    "llama": (_LlamaLoss, lambda: _tokens(0)),
    "llama, tied embeddings": (lambda: _LlamaLoss(tied=True), lambda: _tokens(0)),
}


@pytest.mark.parametrize("name", sorted(DROP_IN_CASES))
def test_compiled_module_has_the_modules_state_names_and_order(name):
    make, args = DROP_IN_CASES[name]
    model = make()
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), args()))

    def names(items):
        return [n for n, _ in items]

    assert names(train.named_parameters()) == names(model.named_parameters())
    assert names(train.named_buffers()) == names(model.named_buffers())
    assert list(train.state_dict()) == list(model.state_dict())
    assert [p.shape for p in train.parameters()] == [p.shape for p in model.parameters()]


@pytest.mark.parametrize("name", sorted(DROP_IN_CASES))
def test_state_dicts_load_both_ways(name):
    """The compiled module takes the eager module's state dict and the other
    way round, strictly; the next call computes with the loaded values."""
    make, make_args = DROP_IN_CASES[name]
    model, other, args = make(), make(), make_args()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), args))
    train.load_state_dict(other.state_dict())
    for key, value in other.state_dict().items():
        torch.testing.assert_close(train.state_dict()[key], value)
    assert_runs_match(run_module(copy.deepcopy(other), args, None), run_compiled(train, args))
    model.load_state_dict(train.state_dict())
    for key, value in train.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value)


def test_state_loaded_by_assignment_is_the_state_computed_with():
    """``load_state_dict(assign=True)`` replaces the tensors, also the
    top-level ones: the program is traced again over the new ones."""
    model, other = _TopLevelState(), _TopLevelState()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), (torch.randn(3, 4),)))
    x = torch.randn(3, 4)
    train(x)
    before = list(train.parameters())
    train.load_state_dict(copy.deepcopy(other.state_dict()), assign=True)
    assert not any(p is q for p, q in zip(train.parameters(), before))
    assert_runs_match(run_module(copy.deepcopy(other), (x,), None), run_compiled(train, (x,)))


@pytest.mark.parametrize("make_optimizer", [
    lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
], ids=["sgd-momentum", "adamw"])
def test_an_optimizer_over_its_parameters_trains_as_eager(make_optimizer):
    """Five steps on a Llama (a no_grad region inside) on one batch, eager
    and compiled from the same start: the same losses and parameters after
    each step. Tolerances: the compiled backward sums gradients in another
    order than eager's (1e-7 apart), which AdamW's normalization can make
    1e-5 apart in a weight after a step; a real divergence is a step's size
    (1e-2)."""
    model = _LlamaLoss()
    train = predispatch.compile_training(predispatch.export_predispatch(copy.deepcopy(model), _tokens(0)))
    eager_opt, train_opt = make_optimizer(model.parameters()), make_optimizer(train.parameters())
    for step in range(5):
        losses = []
        for module, opt in ((model, eager_opt), (train, train_opt)):
            opt.zero_grad()
            loss = module(*_tokens(0))
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-5)
        for (name, p), (train_name, q) in zip(model.named_parameters(), train.named_parameters(), strict=True):
            assert name == train_name
            torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-4, msg=lambda m: f"step {step}, {name}: {m}")
        if step == 0:
            first = losses[0]
    assert losses[0] < 0.9 * first  # it trained


# --- a gradient eager never computes is None, not zeros: the compiled backward
# gets no gradient for an output nothing backpropagates through (an output left
# out of the loss; a parameter's or input's new value written back under no_grad)


class EMATeacher(torch.nn.Module):
    """A student trained against a teacher that follows it as an EMA, updated
    and read under no_grad only (the teacher's new value is a
    PARAMETER_MUTATION whose gradient nothing computes); beside it a frozen
    layer and an unused one."""

    def __init__(self, teacher_in_loss=False):
        super().__init__()
        self.student, self.teacher = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.frozen, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.teacher_in_loss = teacher_in_loss

    def forward(self, x):
        with torch.no_grad():
            for t, s in zip(self.teacher.parameters(), self.student.parameters()):
                t.mul_(0.99).add_(s, alpha=0.01)
            target = self.teacher(x)
        loss = torch.nn.functional.mse_loss(self.frozen(self.student(x)), target)
        # read in grad mode after its update, the teacher gets a gradient after all
        return loss + self.teacher(x).mean() if self.teacher_in_loss else loss


class DecaysInput(torch.nn.Module):
    """An input updated under no_grad, and not otherwise used."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x, y):
        with torch.no_grad():
            x.mul_(0.5)
        return self.lin(y)


@pytest.mark.parametrize("make, args", [
    (EMATeacher, lambda: (torch.randn(2, 4),)),
    (lambda: EMATeacher(teacher_in_loss=True), lambda: (torch.randn(2, 4),)),
    (DecaysInput, lambda: (torch.randn(3), torch.randn(2, 3))),
], ids=["ema-teacher", "ema-teacher-in-loss", "input-decayed"])
def test_state_updated_under_no_grad_gets_the_gradient_eager_gives(make, args):
    """None where eager leaves .grad at None (the teacher's, the decayed
    input's), a real gradient where it has one, and zeros in neither."""
    torch.manual_seed(0)
    assert_compiled_matches_eager(make(), args(), grad_modes=(True,))


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.shared = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)

    def forward(self, x, y):
        return self.a(self.shared(x)), self.b(y) * 2, self.shared(y)


def _grads_of_a_loss_over(module, outputs: list[int], args):
    """The gradients of inputs and parameters after a backward of the sum of
    the chosen outputs only (None where there is none)."""
    args, _ = fresh_inputs(args, None, True)
    out = module(*args)
    sum(out[i].sum() for i in outputs).backward()
    return {**{f"input {i}": x.grad for i, x in enumerate(args)},
            **{n: p.grad for n, p in module.named_parameters()}}


@pytest.mark.parametrize("outputs", [[0], [1], [0, 2], [0, 1, 2]])
def test_outputs_left_out_of_the_loss_give_no_gradient(outputs):
    torch.manual_seed(0)
    module, args = TwoHeads(), (torch.randn(2, 3), torch.randn(2, 3))
    train = compiled(module, args)
    expected = _grads_of_a_loss_over(copy.deepcopy(module), outputs, args)
    got = _grads_of_a_loss_over(train, outputs, args)
    assert expected.keys() == got.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, msg=lambda m: f"gradient of {name}: {m}")


def test_adamw_leaves_a_teacher_without_gradient_alone():
    """An optimizer skips a parameter without a gradient: AdamW's weight
    decay must not shrink the EMA teacher, as it does not in eager."""
    torch.manual_seed(0)
    model, x = EMATeacher(), torch.randn(2, 4)
    train = compiled(model, (x,))
    opts = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.5) for m in (model, train)]
    for _ in range(3):
        for module, opt in zip((model, train), opts):
            opt.zero_grad()
            module(x).backward()
            opt.step()
    for (name, p), q in zip(model.named_parameters(), train.parameters(), strict=True):
        torch.testing.assert_close(q, p, msg=lambda m: f"{name}: {m}")


# --- one tensor, one input; one node per call (a probe's findings, session 42)


class _Counts(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self.register_buffer("s", t)

    def forward(self, x):
        self.s.add_(1)
        return x + self.s


class SharedBuffer(torch.nn.Module):
    """One tensor registered as a buffer by two submodules; one of them updates it."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        t = torch.zeros(4)
        self.first, self.second = _Counts(t), _Counts(t)

    def forward(self, x):
        return self.first(x * self.w).sum()


class EMAWithHistory(torch.nn.Module):
    """A buffer updated in grad mode from a value with a history (no
    ``no_grad``), not read by the loss: in eager its history chains the steps."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4))
        self.register_buffer("ema", torch.zeros(()))

    def forward(self, x):
        h = x * self.w
        self.ema.mul_(0.9).add_(h.mean(), alpha=0.1)
        return h.sum()


@pytest.mark.parametrize("make", [SharedBuffer, EMAWithHistory], ids=["shared-buffer", "ema-with-history"])
def test_steps_that_carry_state_match_eager(make):
    torch.manual_seed(0)
    module, x = make(), torch.randn(6, 4)
    eager, train = copy.deepcopy(module), compiled(module, (x,))
    if make is SharedBuffer:
        assert train.second.s is train.first.s
    for step in range(3):
        assert_runs_match(run_module(eager, (x,), {}), run_compiled(train, (x,)), what=f"[step {step}] ")


def _two_losses_one_after_the_other(module, x, **backward_kwargs):
    a, b, _ = module(x, x)
    a.sum().backward(**backward_kwargs)
    b.sum().backward()
    return [p.grad for p in module.parameters()]


def test_two_losses_of_one_call_given_backward_one_after_the_other():
    """One call is one node: the first backward frees it for both outputs.
    With ``retain_graph=True`` the gradients are eager's; without, the error
    says what happened, where torch's says the graph was run twice."""
    torch.manual_seed(0)
    module, x = TwoHeads(), torch.randn(2, 3)
    expected = _two_losses_one_after_the_other(copy.deepcopy(module), x)
    got = _two_losses_one_after_the_other(compiled(module, (x, x)), x, retain_graph=True)
    for e, g in zip(expected, got, strict=True):
        torch.testing.assert_close(g, e)
    with pytest.raises(RuntimeError, match="share one backward.*sum of the losses.*retain_graph=True"):
        _two_losses_one_after_the_other(compiled(module, (x, x)), x)


class LSTMOnFeatures(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = torch.nn.LSTM(3, 2)

    def forward(self, x):
        return self.rnn(x)[0]


def test_an_lstm_on_inputs_that_do_not_require_grad_trains_as_eager():
    """torch's lstm decomposition took mkldnn's inference kernel where the
    input does not require grad (the weights do): the compiled forward
    failed on the workspace it does not save."""
    torch.manual_seed(0)
    module, x = LSTMOnFeatures(), torch.randn(4, 1, 3)
    eager, train = copy.deepcopy(module), compiled(module, (x,))
    for step in range(2):
        assert_runs_match(run_module(eager, (x,), {}, inputs_require_grad=False),
                          run_compiled(train, (x,), inputs_require_grad=False), what=f"[step {step}] ")


class LinearBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.lin(x))


@pytest.mark.parametrize("exported_training", [True, False], ids=["train", "eval"])
def test_the_mode_is_the_exported_one(exported_training):
    """The graphs compute as the module did when exported (BatchNorm's batch
    statistics or its running ones): switching to the other mode is refused,
    where it ran the exported mode's graphs silently."""
    module, x = LinearBatchNorm().train(exported_training), torch.randn(8, 4)
    train = compiled(module, (x,))
    assert train.training is exported_training
    train.train(exported_training)  # a loop's model.train() (or .eval()) in the exported mode
    assert_runs_match(run_module(copy.deepcopy(module), (x,), {}), run_compiled(train, (x,)))
    other = "eval" if exported_training else "train"
    with pytest.raises(NotImplementedError, match=f"exported with the module in .* mode.*cannot switch to {other}"):
        train.train(not exported_training)
    assert train.training is exported_training


class Recurrent(torch.nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.rnn = layer(3, 4, num_layers=2, dropout=0.5, bidirectional=True, batch_first=True)

    def forward(self, x):
        return self.rnn(x)[0]


@pytest.mark.parametrize("layer", [torch.nn.RNN, torch.nn.GRU, torch.nn.LSTM])
def test_dropout_between_recurrent_layers_draws_as_eager(layer):
    """torch's decomposition of a multi-layer RNN dropped its inter-layer
    dropout; the masks, and the generator's state after them, are eager's."""
    torch.manual_seed(0)
    module, x = Recurrent(layer), torch.randn(2, 3, 3)
    eager, train = copy.deepcopy(module), compiled(module, (x,))
    for step in range(2):
        expected, next_draw = run_module(eager, (x,), {}, seed=step), torch.rand(3)
        got = run_compiled(train, (x,), seed=step)
        assert_runs_match(expected, got, what=f"[step {step}] ")
        assert torch.equal(torch.rand(3), next_draw)


class WritesSecond(cases.TimesWeightTimes):
    def forward(self, x, y):
        y.mul_(2)
        return x * self.w


@pytest.mark.parametrize("make, example", [
    (cases.TimesWeightTimes, lambda t: (t, t)),  # one tensor twice: the trace reads one for both
    (WritesSecond, lambda t: (t, t[1])),  # a view of another, written: the program writes through both
], ids=["repeated", "view-written"])
def test_inputs_sharing_memory_unlike_the_export_are_refused(make, example):
    """As ``ep.module()`` refuses them; a call sharing memory as the export's did matches eager."""
    torch.manual_seed(0)
    module = make()
    train = compiled(module, example(torch.randn(6, 4)))
    with torch.no_grad():
        same = example(torch.randn(6, 4))
    assert_runs_match(run_module(copy.deepcopy(module), same, {}, inputs_require_grad=False),
                      run_compiled(train, same, inputs_require_grad=False))
    apart = tuple(torch.randn(x.shape) for x in same)
    with pytest.raises(CallNotSupportedError, match="(two tensors|share memory otherwise)"):
        train(*apart)


class RelaysInput(torch.nn.Module):
    def __init__(self, relayout, write: bool):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(8))
        self.relayout, self.write = relayout, write

    def forward(self, x):
        self.relayout(x)
        if self.write:
            x.mul_(2)
        return x.sum() * self.w


@pytest.mark.parametrize("relayout", [
    torch.Tensor.t_, lambda x: x.transpose_(0, 1), lambda x: x.unsqueeze_(0),
    lambda x: x.as_strided_((2, 16), (16, 1)),
], ids=["t_", "transpose_", "unsqueeze_", "as_strided_"])
@pytest.mark.parametrize("write", [False, True], ids=["relaid", "relaid-and-written"])
def test_an_input_relaid_in_place_is_left_relaid_for_the_caller(relayout, write):
    """As eager and ``ep.module()`` leave it (the caller's tensor kept its old shape)."""
    assert_compiled_matches_eager(RelaysInput(relayout, write), (torch.randn(4, 8),), inputs_require_grad=False)


class NormUnderTwoNames(torch.nn.Module):
    """A BatchNorm held under two names (``self.final_norm = self.blocks[-1].norm``):
    the program reads its statistics under one name and writes them back
    under the other; the read its backward saves must be a snapshot."""

    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm1d(4)
        self.alias = self.bn

    def forward(self, x):
        return self.bn(x)


def test_a_norm_under_two_names_trains_as_eager():
    torch.manual_seed(0)
    module, x = NormUnderTwoNames(), torch.randn(3, 4)
    assert_matches_eager(module, (x,))
    eager, train = copy.deepcopy(module), compiled(module, (x,))
    for step in range(2):
        assert_runs_match(run_module(eager, (x,), {}), run_compiled(train, (x,)), what=f"[step {step}] ")
