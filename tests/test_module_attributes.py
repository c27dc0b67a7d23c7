"""Tensors a forward holds as module attributes (issue 40): buffers rebound,
tensors that are not registered.

A rebinding (``self.b = v``, ``register_buffer``, ``_buffers[name] = v``)
gives the name a new tensor: the old one and its aliases keep their values,
and ops that read the old one (and saved it for backward) see no write.
Each module is compared with eager by ``assert_matches_eager`` (outputs and
which require grad, gradients, buffers and inputs after, under grad mode on
and off, re-export stable).
"""
import copy

import warnings

import pytest
import torch

import predispatch
from predispatch.ir.program_meta import program_meta
from predispatch.testing.eager import assert_matches_eager

# ---------------------------------------------------------------- rebinding a buffer

_GLOBAL = torch.full((3,), 7.0)


class RebindsTwice(torch.nn.Module):
    """The issue's module: eager returns 10 and leaves ``buf`` at 6."""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(3))

    def forward(self, x):
        buf = self.buf
        y = self.buf
        self.buf = buf + 3
        z = self.buf
        self.buf = buf + 5
        return x + y + z + (buf + 4)


class Rebinds(torch.nn.Module):
    """``old`` is read (and saved for backward by ``x[:3] * old``) before and
    after ``buf`` is rebound in one of many ways."""

    def __init__(self, how):
        super().__init__()
        self.register_buffer("buf", torch.ones(3))
        self.how = how

    def forward(self, x):
        old = self.buf
        y = x[:3] * old
        if self.how == "setattr":
            self.buf = old + 1
        elif self.how == "register_buffer":
            self.register_buffer("buf", old * 2)
        elif self.how == "buffers_dict":
            self._buffers["buf"] = old * 2
        elif self.how == "another_shape":
            self.buf = torch.cat([old, old])
        elif self.how == "a_view_of_the_input":
            self.buf = x[1:4]
        elif self.how == "a_global":
            self.buf = _GLOBAL
        elif self.how == "and_back":
            self.buf = old * 3
            self.buf = old
        elif self.how == "then_updated":
            self.buf = old * 3
            self.buf.add_(1)
        elif self.how == "old_updated_after":  # eager's module holds the new tensor
            self.buf = old * 3
            old.add_(1)
            return y.detach() + x[:3] + old + self.buf.sum()  # (``x * old`` saved old)
        elif self.how == "under_no_grad":
            with torch.no_grad():
                self.buf = old + x[:3]
        return y + x[:3] * old + self.buf.sum()


def test_a_rebinding_leaves_the_old_tensor_and_its_aliases_as_they_were():
    ep = assert_matches_eager(RebindsTwice(), (torch.zeros(3),))
    module = ep.module()
    assert torch.equal(module(torch.zeros(3)), torch.full((3,), 10.0))
    assert torch.equal(module.buf, torch.full((3,), 6.0))


@pytest.mark.parametrize("how", ["setattr", "register_buffer", "buffers_dict", "another_shape",
                                 "a_view_of_the_input", "a_global", "and_back", "then_updated",
                                 "old_updated_after", "under_no_grad"])
def test_every_rebinding_of_a_buffer_matches_eager(how):
    assert_matches_eager(Rebinds(how), (torch.randn(5),))


def test_a_program_exported_again_rebinds_too():
    """``ep.module()`` exported again: its write-back is a rebinding, not an
    update of a tensor ``x * buf`` saved for backward."""
    ep = assert_matches_eager(Rebinds("setattr"), (torch.randn(5),))
    assert program_meta(ep)["write_back"] == {"buf": "rebound"}
    again = assert_matches_eager(ep.module(), (torch.randn(5),))
    assert program_meta(again)["write_back"] == {"buf": "rebound"}


# ---------------------------------------------------------------- rebound under autocast


class CastsItsCacheToTheActivations(torch.nn.Module):
    """wav2vec2-conformer's ``extend_pe``: the cache rebound to the dtype of
    the hidden states, which autocast decides."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("pe", torch.arange(4.0))

    def forward(self, x):
        h = self.lin(x)
        if self.pe.dtype != h.dtype:
            self.pe = self.pe.to(h.dtype)
        return h * self.pe


def _bf16():
    return torch.autocast("cpu", dtype=torch.bfloat16)


def test_a_program_exported_under_autocast_is_called_under_it():
    """Exported under the caller's autocast, the trace's dtypes are autocast's
    (``pe`` rebound to bfloat16): under the same autocast the program matches
    eager; called without it, where eager keeps ``pe`` in float32, it says so."""
    with _bf16():
        ep = assert_matches_eager(CastsItsCacheToTheActivations(), (torch.randn(2, 4),))
    assert program_meta(ep)["ambient_autocast"] == {"cpu": "bfloat16"}
    module = ep.module()
    with pytest.raises(RuntimeError, match=r"exported under torch.autocast\('cpu', dtype=torch.bfloat16\).*"
                                           r"Called under no autocast"):
        module(torch.randn(2, 4))
    assert module.pe.dtype == torch.float32  # nothing written


def test_the_autocast_check_compiles_with_the_program():
    """``torch.compile(ep.module())``: the check of the caller's autocast is
    traced with the program, with no builtin dynamo cannot trace (it warned
    of one), and a call under another autocast still raises."""
    with _bf16():
        ep = predispatch.export_predispatch(CastsItsCacheToTheActivations(), (torch.randn(2, 4),))
    torch._dynamo.reset()
    compiled = torch.compile(ep.module(), backend="eager")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Dynamo does not know how to trace")
        with _bf16():
            compiled(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="exported under torch.autocast"):
        compiled(torch.randn(2, 4))


class ReadsNoDtype(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x).relu()


def test_a_program_that_reads_no_dtype_runs_under_any_autocast():
    """Exported without autocast, or under it with no dtype read: nothing is
    checked, and outside autocast the program computes as eager does."""
    ep = assert_matches_eager(CastsItsCacheToTheActivations(), (torch.randn(2, 4),))
    assert "ambient_autocast" not in program_meta(ep)
    module = ReadsNoDtype()
    with _bf16():
        ep = predispatch.export_predispatch(copy.deepcopy(module), (torch.randn(2, 4),))
    assert "ambient_autocast" not in program_meta(ep)
    assert_matches_eager(module, (torch.randn(2, 4),), export=lambda *a, **k: ep, check_reexport=False)


def test_wav2vec2_conformer_exported_under_autocast_in_train_mode():
    transformers = pytest.importorskip("transformers")
    config = transformers.Wav2Vec2ConformerConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        conv_dim=(8, 8), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=4,
        num_conv_pos_embedding_groups=2, position_embeddings_type="relative", max_source_positions=64,
        conformer_conv_depthwise_kernel_size=3, layerdrop=0.0, mask_time_prob=0.0, num_labels=2)
    torch.manual_seed(0)
    model = transformers.Wav2Vec2ConformerForSequenceClassification(config).train()
    x = torch.randn(2, 160)
    with _bf16():
        ep = assert_matches_eager(model, (x,), inputs_require_grad=False)
    with pytest.raises(RuntimeError, match="exported under torch.autocast"):
        ep.module()(x)


# ---------------------------------------------------------------- tensors not registered


class InADict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.table = {"w": torch.nn.Parameter(torch.randn(3))}

    def forward(self, x):
        return x * self.table["w"]


class PlainAttribute(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = torch.randn(3, requires_grad=True)

    def forward(self, x):
        return x * self.scale


class Scales(torch.nn.Module):
    def __init__(self, t):
        super().__init__()
        self.t = t

    def forward(self, x):
        return x * self.t


class SharedBySubmodules(torch.nn.Module):
    def __init__(self):
        super().__init__()
        t = torch.randn(3, requires_grad=True)
        self.a, self.b = Scales(t), Scales(t)

    def forward(self, x):
        return self.a(x) + self.b(x)


_GRAD_GLOBAL = torch.randn(3, requires_grad=True)


class ReadsAGlobal(torch.nn.Module):
    def forward(self, x):
        return x * _GRAD_GLOBAL


@pytest.mark.parametrize("module, name, code", [
    (InADict(), "\"table['w']\"", 'x * self.table["w"]'),
    (PlainAttribute(), "'scale'", "x * self.scale"),
    (SharedBySubmodules(), "'a.t'", "x * self.t"),
    (ReadsAGlobal(), "a tensor held outside the module's attributes", "x * _GRAD_GLOBAL"),
], ids=["in_a_dict", "plain_attribute", "shared_by_submodules", "a_global"])
def test_a_tensor_requiring_grad_that_is_not_registered_is_refused_naming_it(module, name, code):
    """Eager's output requires grad and the tensor gets its gradient; a program
    would hold it as a constant (torch.export detaches it): refused."""
    with pytest.raises(predispatch.ExportError, match="neither a parameter, a buffer nor an input") as info:
        predispatch.export_predispatch(module, (torch.randn(3),))
    message = str(info.value)
    assert name in message and code in message and "test_module_attributes.py" in message, message


class UsesOneWithoutGradient(torch.nn.Module):
    """Its shape, a comparison, a detached copy, a no_grad block: no gradient
    eager would give it, so nothing to lose."""

    def __init__(self):
        super().__init__()
        self.t = torch.randn(3, requires_grad=True)

    def forward(self, x):
        y = x * self.t.detach() + torch.zeros(self.t.shape) + (self.t > 0)
        with torch.no_grad():
            y = y + 0 * self.t.sum()
        return y


def test_a_tensor_requiring_grad_used_without_a_gradient_exports():
    assert_matches_eager(UsesOneWithoutGradient(), (torch.randn(3),))


# ---------------------------------------------------------------- plain tensor attributes

_CONSTANT = torch.arange(3.0)


class UpdatesWhatItComputesFromAConstant(torch.nn.Module):
    """``self.c`` is a plain tensor attribute (a constant to the program);
    what an op computes from it is a fresh intermediate, updated freely."""

    def __init__(self, how):
        super().__init__()
        self.c = torch.ones(3, 2)
        self.how = how

    def forward(self, x):
        if self.how == "the_issue":
            t = self.c[:, 0] + 2
            t.sub_(1)
            return x + t
        if self.how == "through_a_view":
            t = self.c * 1
            t[0].mul_(3)
            return x + t.sum(1)
        if self.how == "a_global":
            t = _CONSTANT * 2
            t.add_(x)
            return t
        if self.how == "under_no_grad":
            with torch.no_grad():
                t = self.c.sum(1)
                t.add_(1)
            return x * t
        t = self.c.t().contiguous()  # a copy of a view of the constant
        t.add_(1)
        return x.sum() * t


@pytest.mark.parametrize("how", ["the_issue", "through_a_view", "a_global", "under_no_grad", "copy_of_a_view"])
def test_an_update_of_a_value_computed_from_a_constant_exports(how):
    assert_matches_eager(UpdatesWhatItComputesFromAConstant(how), (torch.randn(3),))


class UpdatesAnAliasOfAConstant(torch.nn.Module):
    def __init__(self, how):
        super().__init__()
        self.c = torch.ones(3, 2)
        self.how = how

    def forward(self, x):
        alias = {"view": lambda: self.c.view(6), "row": lambda: self.c[0], "detach": lambda: self.c.detach(),
                 "float": lambda: self.c.float()}[self.how]()
        alias.add_(1)  # eager updates self.c: nowhere to write it back
        return x * 2


@pytest.mark.parametrize("how", ["view", "row", "detach", "float"])
def test_an_update_of_an_alias_of_a_constant_stays_refused(how):
    with pytest.raises(predispatch.ExportError, match=r"neither a parameter, a buffer nor an input.*") as info:
        predispatch.export_predispatch(UpdatesAnAliasOfAConstant(how), (torch.randn(3),))
    assert "alias.add_(1)" in str(info.value)


def test_a_buffer_the_forward_adds_to_the_module_is_refused_naming_it():
    """Eager's module gains the buffer (``_buffers[name] = t`` bypasses
    register_buffer, refused naming its line in test_errors.py): the
    program's module would not hold it."""
    class AddsABuffer(torch.nn.Module):
        def forward(self, x):
            self._buffers["scale"] = x.detach() * 2
            return x * 2

    with pytest.raises(predispatch.ExportError, match="buffer 'scale', new at the forward's end"):
        predispatch.export_predispatch(AddsABuffer(), (torch.randn(3),))
