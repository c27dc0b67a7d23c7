"""Modules that cannot be exported soundly raise ExportError naming the
construct and the user's source line; bad options raise ValueError."""
import dataclasses
import inspect

import pytest
import torch

import predispatch


def line_of(fn, text):
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(src) if text in line)


class DataDependentBranch(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x * 2
        return x


class GradModeFromARead(torch.nn.Module):
    train_backbone = False

    def forward(self, x):
        prev = torch.is_grad_enabled()
        use = torch.is_grad_enabled() and self.train_backbone  # depends on the caller's mode
        torch.set_grad_enabled(use)
        y = x * 2
        torch.set_grad_enabled(prev)
        return y


class CallersModeRestoredInsideABlock(torch.nn.Module):
    def forward(self, x):
        caller = torch.is_grad_enabled()
        with torch.no_grad():
            y = x * 2
            torch.set_grad_enabled(caller)  # the rest of the block runs in the caller's mode
            z = x * 3
        return y + z


class GradModeNegatedRead(torch.nn.Module):
    def forward(self, x):
        prev = torch.is_grad_enabled()
        torch.set_grad_enabled(not prev)  # on for a caller under no_grad
        y = x * 2
        torch.set_grad_enabled(prev)
        return y


class GradModeCopiedRead(torch.nn.Module):
    def forward(self, x):
        prev = torch.is_grad_enabled()
        copy = prev
        with torch.enable_grad():
            torch.set_grad_enabled(False)
            y = x * 2
            torch.set_grad_enabled(copy)  # the caller's mode, not True, inside enable_grad
            z = y * 3
        return z


class BlockSetToTheCallersMode(torch.nn.Module):
    def forward(self, x):
        prev = torch.is_grad_enabled()
        with torch.no_grad():
            with torch.set_grad_enabled(prev):
                y = x * 2
        return y


class StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class CustomBackward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return StraightThrough.apply(self.lin(x))


class ReentrantCheckpoint(torch.nn.Module):
    """Its Function's backward recomputes the forward: traced inline, in grad
    mode (its forward runs under no_grad, which would cut the gradient)."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(
            lambda t: self.drop(self.lin(t)), x, use_reentrant=True) * 2


class MutatesPlainTensorAttribute(torch.nn.Module):
    def __init__(self, by_input=True):
        super().__init__()
        self.total = torch.zeros(2, 4)  # not a buffer: a constant to the program
        self.by_input = by_input

    def forward(self, x):
        self.total.add_(x if self.by_input else 1.0)
        return x + self.total


_GLOBAL_TOTAL = torch.zeros(2, 4)


class MutatesGlobalTensor(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            _GLOBAL_TOTAL.add_(x)
        return x * 2


class ReseedsTorchAnew(torch.nn.Module):
    def forward(self, x):
        torch.seed()
        return x * torch.rand(2, 4)


class SetsAutocastByCall(torch.nn.Module):
    def forward(self, x):
        torch.set_autocast_enabled("cpu", True)
        y = x @ x.T
        torch.set_autocast_enabled("cpu", False)
        return y


class GradientPenalty(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x).sum()
        (g,) = torch.autograd.grad(y, self.lin.weight, create_graph=True)
        return y + g.square().sum()


class JacobianInForward(torch.nn.Module):
    def forward(self, x):
        return torch.func.jacrev(torch.sin)(x)


class AssignsData(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        self.lin.weight.data = self.lin.weight.data.double()  # another dtype: refused
        return self.lin(x)


class RandomIntegersInPlace(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        y.random_(0, 10)  # aten.random.from: "from" is a Python keyword
        return y


class DetachesInputInPlace(torch.nn.Module):
    def forward(self, x):
        x.detach_()  # the caller's tensor loses its history
        return x * 2


class UnsetsRequiresGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        self.b.requires_grad_(False)  # a buffer: nothing changes, exported
        self.w.requires_grad_(False)  # the module's parameter stops requiring grad
        return x * self.w * self.b


class BufferViewOfAnother(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(3, 4))
        self.register_buffer("row", self.b[1])

    def forward(self, x):
        self.row.add_(1)  # eager's self.b sees it
        return x + self.b


class ForeachOfOneBufferTwice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.ones(3))

    def forward(self, x):
        torch._foreach_mul_([self.b, self.b], 2.0)  # eager: b * 4
        return x * self.b


class SetsABufferToNothing(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.randn(3, 4))

    def forward(self, x):
        self.b.set_()  # new empty memory
        return x * 2


class LegacyConstructorConstant(torch.nn.Module):
    """torch.Tensor([...]) in the forward (torch's test_autograd test_setitem's
    LongTensor index): its tensor is made outside the traced calls."""

    def forward(self, x):
        return x * torch.Tensor([1.0, 2.0, 3.0])


class FunctionClosingOverABuffer(torch.nn.Module):
    """An autograd.Function's forward reaching a buffer through its closure,
    not through apply()'s inputs: read, or written."""

    def __init__(self, writes: bool):
        super().__init__()
        self.register_buffer("b", torch.ones(3))
        self.writes = writes

    def forward(self, x):
        b, writes = self.b, self.writes

        class Scale(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                if writes:
                    b.add_(1)
                    return t * 2
                return t * b

            @staticmethod
            def backward(ctx, g):
                return g * 2

        return Scale.apply(x) + self.b


class NumpyLayerDrop(torch.nn.Module):
    def forward(self, x):
        import numpy as np

        if np.random.random() < 0.5:
            return x
        return x * 2


class PythonRandomScale(torch.nn.Module):
    def forward(self, x):
        import random

        return x * random.uniform(0.5, 1.5)


class RegistersStateInForward(torch.nn.Module):
    """Eager's module gains a buffer (or parameter) on the first call."""

    def __init__(self, kind="buffer"):
        super().__init__()
        self.kind = kind
        self.register_buffer("later", None)

    def forward(self, x):
        if self.kind == "buffer":
            self.register_buffer("cache", x.detach() * 2)
        elif self.kind == "placeholder":
            self.register_buffer("later", x.detach() * 2)
        else:
            self.scale = torch.nn.Parameter(torch.ones(3))
        return x * 2


class WritesAViewASetLeftBehind(torch.nn.Module):
    """Eager writes ``s`` through the view; the trace followed ``v0`` to the bias."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("s", torch.zeros(4))

    def forward(self, x):
        v0 = (self.lin.bias * 2).detach()
        v0.set_(self.s)
        v1 = v0.view(-1)
        v0.set_(self.lin.bias.detach())
        v1.add_(1)
        return x * 2


class CustomBackwardThatCannotRun(torch.nn.Module):
    """Under no_grad the Function's backward never runs, so tracing its
    forward is sound."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            y = StraightThrough.apply(self.lin(x))
        return self.lin(x + y)


@pytest.mark.parametrize("module, args, construct, code", [
    (AssignsData(), (torch.randn(2, 4),), "assigning Tensor.data", "self.lin.weight.data ="),
    (ReseedsTorchAnew(), (torch.randn(2, 4),), "seed drawn anew on each call", "torch.seed()"),
    (GradientPenalty(), (torch.randn(2, 4),), "autograd run inside the traced code",
     "torch.autograd.grad(y"),
    (JacobianInForward(), (torch.randn(4),), "torch.func transform", "torch.func.jacrev(torch.sin)"),
    (SetsAutocastByCall(), (torch.randn(2, 4),), "autocast mode set by a function call",
     'torch.set_autocast_enabled("cpu", True)'),
    (MutatesPlainTensorAttribute(), (torch.randn(2, 4),), "neither a parameter, a buffer nor",
     "self.total.add_("),
    (MutatesPlainTensorAttribute(by_input=False), (torch.randn(2, 4),),
     "neither a parameter, a buffer nor", "self.total.add_("),
    (MutatesGlobalTensor(), (torch.randn(2, 4),), "neither a parameter, a buffer nor",
     "_GLOBAL_TOTAL.add_(x)"),
    (RandomIntegersInPlace(), (torch.randn(3),), "cannot name this op", "y.random_(0, 10)"),
    (BufferViewOfAnother(), (torch.randn(3, 4),), "shares memory with 'b'", "self.row.add_(1)"),
    (ForeachOfOneBufferTwice(), (torch.randn(3),), "is given one tensor (or memory) twice",
     "torch._foreach_mul_([self.b, self.b], 2.0)"),
    (SetsABufferToNothing(), (torch.randn(3),), "set_() with no source", "self.b.set_()"),
    (FunctionClosingOverABuffer(writes=False), (torch.randn(3),), "through its closure", "return t * b"),
    (LegacyConstructorConstant(), (torch.randn(3),), "made by a legacy constructor",
     "torch.Tensor([1.0, 2.0, 3.0])"),
    (FunctionClosingOverABuffer(writes=True), (torch.randn(3),), "through its",
     "return Scale.apply(x) + self.b"),
    (DetachesInputInPlace(), (torch.randn(3),), "detach_() on a parameter, buffer or input", "x.detach_()"),
    (UnsetsRequiresGrad(), (torch.randn(3),), "requires_grad set to False", "self.w.requires_grad_(False)"),
    (NumpyLayerDrop(), (torch.randn(3),), "random numbers drawn with numpy.random",
     "np.random.random()"),
    (PythonRandomScale(), (torch.randn(3),), "random numbers drawn with Python's random",
     "random.uniform("),
    (DataDependentBranch(), (torch.randn(3),), "data-dependent Python control flow", "if x.sum() > 0"),
    (GradModeFromARead(), (torch.randn(3),), "computed from torch.is_grad_enabled()",
     "torch.set_grad_enabled(use)"),
    (CallersModeRestoredInsideABlock(), (torch.randn(3),), "inside another grad block",
     "torch.set_grad_enabled(caller)"),
    (GradModeNegatedRead(), (torch.randn(3),), "computed from torch.is_grad_enabled()",
     "torch.set_grad_enabled(not prev)"),
    (GradModeCopiedRead(), (torch.randn(3),), "computed from torch.is_grad_enabled()",
     "torch.set_grad_enabled(copy)"),
    (BlockSetToTheCallersMode(), (torch.randn(3),), "inside another grad block",
     "with torch.set_grad_enabled(prev)"),
    (RegistersStateInForward(), (torch.randn(3),), "a buffer the forward registers",
     'self.register_buffer("cache"'),
    (RegistersStateInForward("placeholder"), (torch.randn(3),), "a buffer the forward registers",
     'self.register_buffer("later"'),
    (RegistersStateInForward("parameter"), (torch.randn(3),), "a parameter the forward registers",
     "self.scale = torch.nn.Parameter"),
    (WritesAViewASetLeftBehind(), (torch.randn(3),), "swapped after the view was taken", "v1.add_(1)"),
])
def test_unsound_constructs_name_themselves_and_the_line(module, args, construct, code):
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(module, args)
    message = str(info.value)
    assert construct in message
    assert f"{__file__}:{line_of(type(module).forward, code)}" in message, message
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("kwargs, match", [
    ({"backward_pass_autocast": "sometimes"}, "same_as_forward"),
    ({"backward_pass_autocast": ["cpu"]}, "dicts"),
    ({"backward_pass_autocast": [{"device": "cpu"}]}, "device_type"),
    ({"on_backward_autocast_mismatch": "ignore"}, "do_nothing"),
])
def test_bad_options_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        predispatch.export_predispatch(torch.nn.Linear(2, 2), (torch.randn(1, 2),), **kwargs)


@pytest.mark.parametrize("module", [CustomBackward(), CustomBackwardThatCannotRun(), ReentrantCheckpoint()],
                         ids=["captured", "no_grad", "reentrant_checkpoint"])
def test_custom_backwards_are_kept_or_traced_through(module):
    """A Function's backward is kept (predispatch_autograd_function, see
    test_autograd_functions.py); under no_grad it never runs, and reentrant
    checkpointing's recomputes the forward: both traced through."""
    from predispatch.testing.eager import assert_matches_eager

    assert_matches_eager(module, (torch.randn(2, 4),))


@torch.library.custom_op("predispatch_test::ste_round", mutates_args=())
def ste_round(x: torch.Tensor) -> torch.Tensor:
    return torch.round(x)


ste_round.register_fake(lambda x: torch.empty_like(x))
ste_round.register_autograd(lambda ctx, grad: grad)


class CustomOpBackward(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return ste_round(self.lin(x))


def test_a_custom_op_with_register_autograd_keeps_its_backward():
    from predispatch.testing.eager import assert_matches_eager

    ep = assert_matches_eager(CustomOpBackward(), (torch.randn(2, 4),))
    targets = [n.target for n in ep.graph_module.graph.nodes if n.op == "call_function"]
    assert torch.ops.predispatch_test.ste_round.default in targets


class UnreadLayerDrop(torch.nn.Module):
    """MusicGen's layer drop: a draw per layer, read only in training with
    layerdrop > 0 (``uniform(0, 1) < 0.0`` holds for no draw)."""

    def __init__(self, layerdrop=0.0):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        self.layerdrop = layerdrop

    def forward(self, x):
        import random

        for layer in self.layers:
            p = random.uniform(0, 1)
            if self.training and p < self.layerdrop:
                continue
            x = layer(x)
        return x


class SeededPermutation(torch.nn.Module):
    """BigBird seeds numpy before drawing: the same draws every call."""

    def forward(self, x):
        import numpy as np

        np.random.seed(0)
        return x[:, torch.tensor(np.random.permutation(4))] * 2


@pytest.mark.parametrize("module", [UnreadLayerDrop().train(), UnreadLayerDrop().eval(),
                                    SeededPermutation()], ids=["train", "eval", "seeded"])
def test_host_draws_that_cannot_change_the_program_export(module):
    from predispatch.testing.eager import assert_matches_eager

    assert_matches_eager(module, (torch.randn(2, 4),))


def test_a_host_draw_read_in_training_is_refused():
    with pytest.raises(predispatch.ExportError, match="random.uniform"):
        predispatch.export_predispatch(UnreadLayerDrop(0.5).train(), (torch.randn(2, 4),))


def test_a_module_backward_hook_is_refused_naming_it():
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())

    def triple(mod, grad_input, grad_output):
        return tuple(g * 3 if g is not None else None for g in grad_input)

    module[0].register_full_backward_hook(triple)
    with pytest.raises(predispatch.ExportError, match=r"backward hook on submodule '0' \(.*triple"):
        predispatch.export_predispatch(module, (torch.randn(2, 4),))


def test_a_torch_module_exported_as_it_is_names_its_own_line():
    """No user frame: the error names the torch.nn code (BatchNorm with
    momentum=None reads num_batches_tracked's value)."""
    with pytest.raises(predispatch.ExportError, match=r"nn/modules/batchnorm\.py:\d+ in forward"):
        predispatch.export_predispatch(torch.nn.BatchNorm1d(4, momentum=None), (torch.randn(3, 4),))


_liar_lib = torch.library.Library("predispatch_liar", "DEF")
_liar_lib.define("maybe_same(Tensor x) -> Tensor")  # says: a new tensor
_liar_lib.impl("maybe_same", lambda x: x, "CompositeImplicitAutograd")  # returns its input


class _UsesALiar(torch.nn.Module):
    def forward(self, x):
        y = torch.ops.predispatch_liar.maybe_same(x)
        y.add_(1)  # eager: x too
        return x * 2


def test_a_kept_custom_op_returning_an_alias_is_refused():
    """Kept whole, the liar's output would be a new tensor to the program (x
    left unchanged, the output off by 2); decomposed (the default for a
    non-aten op), the alias is traced and the program matches eager."""
    from predispatch.testing.eager import assert_matches_eager

    keep = predispatch.OpPolicy.default().keep(torch.ops.predispatch_liar.maybe_same.default)
    with pytest.raises(predispatch.ExportError, match="returned an alias of its input") as info:
        predispatch.export_predispatch(_UsesALiar(), (torch.zeros(2),), op_policy=keep)
    assert f"{__file__}:{line_of(_UsesALiar.forward, 'maybe_same(x)')}" in str(info.value)
    assert_matches_eager(_UsesALiar(), (torch.zeros(2),), inputs_require_grad=False)


_liar_lib.define("same_kernel(Tensor x) -> Tensor")  # says: a new tensor; a kernel, not a composite
_liar_lib.impl("same_kernel", lambda x: x, "CPU")
_liar_lib.define("calls_a_liar(Tensor x) -> Tensor")  # a composite calling it
_liar_lib.impl("calls_a_liar", lambda x: torch.ops.predispatch_liar.same_kernel(x), "CompositeImplicitAutograd")
torch.library.register_fake("predispatch_liar::same_kernel", lambda x: x, lib=_liar_lib)


class _UsesAKernelLiar(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return self.op(x) * 2


@pytest.mark.parametrize("op, advice", [
    ("same_kernel", r"declare the alias in its schema \(Tensor\(a\) -> Tensor\(a\)\), or return a clone"),
    ("calls_a_liar", r"where it is decomposed, an op it calls returns the alias: declare the alias in that op's")])
def test_a_custom_op_returning_an_alias_is_refused_with_advice_that_applies(op, advice):
    """torch's export test test_custom_op_auto_functionalize: the refusal
    told to decompose an op that was decomposed already, or was no composite."""
    with pytest.raises(predispatch.ExportError, match=advice):
        predispatch.export_predispatch(_UsesAKernelLiar(getattr(torch.ops.predispatch_liar, op)), (torch.zeros(2),))


_liar_lib.define("first_row(Tensor(a) x) -> Tensor(a)")  # says: an alias, which functionalization refuses
_liar_lib.impl("first_row", lambda x: x[0], "CompositeExplicitAutograd")


class _UsesAnAliasingOp(torch.nn.Module):
    def forward(self, x):
        return torch.ops.predispatch_liar.first_row(x) * 2


def test_a_custom_op_declaring_an_alias_is_refused_naming_the_users_line():
    """Refused where functionalization raises, inside a context manager: the
    line named is the user's call, not contextlib's exit."""
    with pytest.raises(predispatch.ExportError, match="returns an alias of its input") as info:
        predispatch.export_predispatch(_UsesAnAliasingOp(), (torch.zeros(2, 3),))
    assert f"{__file__}:{line_of(_UsesAnAliasingOp.forward, 'first_row(x)')}" in str(info.value)


# ---------------------------------------------------------------- outputs a program cannot return


class _Box:
    def __init__(self, t):
        self.t = t


@dataclasses.dataclass
class _Pair:
    first: torch.Tensor
    second: torch.Tensor


class _Returns(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "a plain class":
            return _Box(x * 2)
        if self.how == "nested":
            return {"a": [x, _Box(x)]}
        return _Pair(x * 2, {"inner": _Pair(x + 1, x.sin())})


@pytest.mark.parametrize("how, where", [("a plain class", "the output of"), ("nested", "the output['a'][1] of")])
def test_an_output_torch_cannot_flatten_is_named_with_its_type_and_what_to_do(how, where):
    with pytest.raises(predispatch.ExportError) as info:
        predispatch.export_predispatch(_Returns(how), (torch.randn(3),))
    message = str(info.value)
    assert f"{where} _Returns.forward ({__file__}:" in message, message
    assert "test_errors._Box, which a program cannot return" in message
    assert "return those instead" in message and "internal" not in message


def test_a_dataclass_output_is_returned_as_the_dataclass():
    """Registered as torch.export.register_dataclass would (nested too)."""
    from predispatch.testing.eager import assert_matches_eager

    ep = assert_matches_eager(_Returns("dataclass"), (torch.randn(3),))
    out = ep.module()(torch.randn(3))
    assert isinstance(out, _Pair) and isinstance(out.second["inner"], _Pair)


class _KeylessOutput:
    """diffusers' ``BaseOutput``: a type registered without keys (no ``flatten_with_keys_fn``)."""

    def __init__(self, sample):
        self.sample = sample


torch.utils._pytree.register_pytree_node(
    _KeylessOutput, lambda o: ([o.sample], None), lambda leaves, _: _KeylessOutput(leaves[0]))


class _ReturnsKeyless(torch.nn.Module):
    def forward(self, x):
        return _KeylessOutput(x.sin()), x.cos()


def test_an_output_of_a_type_registered_without_keys_is_exported_as_torch_export_does():
    """torch.export flattens outputs without their paths; so does the check
    of what a program can return (a diffusers U-Net returned its output and
    the export failed inside torch's flattening)."""
    from predispatch.testing.eager import assert_matches_eager

    ep = assert_matches_eager(_ReturnsKeyless(), (torch.randn(3),))
    out = ep.module()(torch.randn(3))
    assert isinstance(out[0], _KeylessOutput)


def test_a_transformers_cache_output_says_use_cache_false():
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16)
    model = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(predispatch.ExportError, match=r"is a transformers\.cache_utils\.DynamicCache, which a "
                                                      r"program cannot return.*pass use_cache=False"):
        predispatch.export_predispatch(model, (torch.randint(0, 32, (1, 5)),))


# ---------------------------------------------------------------- said once, in user terms


class _WrongWidth(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 3)

    def forward(self, x):
        return self.lin(x)


def test_a_shape_error_is_an_export_error_without_torch_s_log_on_stderr():
    """torch's fake tensor logger would print the failed kernel's traceback at
    ERROR level on stderr before the ExportError, which says it already."""
    import logging

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.seen = []

        def emit(self, record):
            self.seen.append(record)

    records, logger = Records(), logging.getLogger("torch._subclasses.fake_tensor")
    logger.addHandler(records)
    try:
        with pytest.raises(predispatch.ExportError, match=r"same reduction dim") as info:
            predispatch.export_predispatch(_WrongWidth(), (torch.randn(2, 4),))
    finally:
        logger.removeHandler(records)
    assert f"{__file__}:{line_of(_WrongWidth.forward, 'self.lin(x)')}" in str(info.value)
    assert not [r for r in records.seen if r.levelno >= logging.ERROR], [r.getMessage() for r in records.seen]


def test_loading_a_file_that_is_not_a_saved_program_says_so(tmp_path):
    text, state = tmp_path / "notes.pt2", tmp_path / "weights.pt"
    text.write_text("not a program")
    torch.save({"w": torch.ones(2)}, state)
    with pytest.raises(ValueError, match=r"notes\.pt2'\): the file is not a program saved with "
                                         r"torch\.export\.save \(that is a zip archive; this file is not one\)"):
        predispatch.load(text)
    with pytest.raises(ValueError, match=r"weights\.pt'\): the file is not a program .* it is a torch\.save file"):
        predispatch.load(state)


class CallsASubclassMethod(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from torch.testing._internal.two_tensor import TwoTensor

        self.p = torch.nn.Parameter(TwoTensor(torch.ones(3), torch.ones(3) * 2))

    def forward(self, x):
        return x + (self.p * 2).get_elem_a()  # TwoTensor's own method: eager's tensor has it


def test_a_tensor_subclass_method_the_trace_lacks_is_an_export_error_naming_it():
    # torch's test_subclass_nested_attr_access: a raw AttributeError before
    with pytest.raises(predispatch.ExportError, match=r"tensor attribute 'get_elem_a' at .* tensor subclass") as info:
        predispatch.export_predispatch(CallsASubclassMethod(), (torch.randn(3),))
    assert f"{__file__}:{line_of(CallsASubclassMethod.forward, 'get_elem_a')}" in str(info.value)


class ReadsANestedSubclassAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        from torch.testing._internal.custom_tensor import ConstantExtraMetadataTensor

        self.p = torch.nn.Parameter(ConstantExtraMetadataTensor(ConstantExtraMetadataTensor(torch.ones(3, 4))))

    def forward(self, x):
        return (x + self.p).elem.elem  # the subclass's own attribute, of a tensor its torch function made


def test_a_tensor_subclass_attribute_of_a_result_it_made_is_an_export_error_naming_it():
    # torch's test_subclass_nested_attr_access_complicated_metadata: a raw AttributeError before
    with pytest.raises(predispatch.ExportError, match=r"tensor attribute 'elem' at .* tensor subclass") as info:
        predispatch.export_predispatch(ReadsANestedSubclassAttribute(), (torch.randn(3, 4),))
    assert f"{__file__}:{line_of(ReadsANestedSubclassAttribute.forward, 'elem.elem')}" in str(info.value)


class CallsATorchScriptModule(torch.nn.Module):
    def __init__(self, make):
        super().__init__()
        self.sub = make(torch.nn.Linear(3, 3))

    def forward(self, x):
        return self.sub(x).sin()  # TorchScript's interpreter runs it


@pytest.mark.parametrize("make", [torch.jit.script, lambda m: torch.jit.trace(m, torch.randn(2, 3))],
                         ids=["script", "trace"])
def test_a_torchscript_module_called_in_the_forward_is_refused_naming_the_line(make):
    # a message blaming legacy constructors (no parameters) or TorchScript's own error (parameters) before
    with pytest.raises(predispatch.ExportError, match=r"a call at .* TorchScript module") as info:
        predispatch.export_predispatch(CallsATorchScriptModule(make), (torch.randn(2, 3),))
    assert f"{__file__}:{line_of(CallsATorchScriptModule.forward, 'self.sub(x)')}" in str(info.value)

