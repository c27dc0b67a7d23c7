"""Module cases from PyTorch's own export tests (test/export/test_export.py),
run through predispatch against eager (issue 40).

Each case is one of torch's test modules, rewritten here in our words (the
torch test it comes from is named in ``source``), checked as a test of ours
would: ``assert_matches_eager`` (outputs and which require grad, gradients
of inputs and parameters, buffers and inputs afterwards, under grad mode on
and off, re-export stable), or, where no program can reproduce eager, the
refusal's message. torch's control-flow operators (``torch.cond``,
``while_loop``, ``map``) are kept as themselves (issue 41; more of their
cases in tests/test_control_flow.py).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

import predispatch
from predispatch.testing.eager import assert_matches_eager

Dim = torch.export.Dim


@dataclasses.dataclass
class Case:
    source: str  # the torch test (test/export/test_export.py) the module comes from
    make: object  # () -> module
    args: tuple
    kwargs: dict | None = None
    options: dict = dataclasses.field(default_factory=dict)  # export_predispatch options
    check: dict = dataclasses.field(default_factory=dict)  # assert_matches_eager options
    refused: str | None = None  # the refusal's message (a regex), where refusal is right
    differs: str | None = None  # a known difference from eager, open (a strict xfail: why)


def module(fn, **attrs):
    """A module whose forward is ``fn(self, *args)``, with ``attrs`` set in
    ``__init__`` (``attrs`` values that are callables make the attribute)."""

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            for name, value in attrs.items():
                setattr(self, name, value() if callable(value) and not isinstance(value, torch.Tensor) else value)

        def forward(self, *args, **kwargs):
            return fn(self, *args, **kwargs)

    M.__name__ = M.__qualname__ = fn.__name__
    return M


# ---------------------------------------------------------------- modules


def _branches_on_scripting(x):
    return x.cos() if torch.jit.is_scripting() else x.sin()


_traced = torch.jit.trace(_branches_on_scripting, torch.randn(3))  # traced with is_scripting() False: sin


class ScriptedStaticMethod(torch.nn.Module):
    @staticmethod
    @torch.jit.script
    def _forward(x: torch.Tensor) -> torch.Tensor:
        if torch.jit.is_scripting():
            return x.cos()
        return x.sin()

    def forward(self, x):
        return ScriptedStaticMethod._forward(x) * 2


def traced_function(self, x):
    return _traced(x) * 3


def basic(self, x, y):  # a list input
    return x[0] + y


class SymIntOutput(torch.nn.Module):
    def forward(self, x):
        z, y = x.size()
        return z + y + x[0], z


def returns_a_number(self, x, y):
    return y


def returns_its_input(self, x, y):
    return x


def constant_output(self, x, y):
    return 5


class MutatedBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(1))

    def forward(self, x):
        self.buf.add_(1)
        return x.sum() + self.buf.sum()


class MutatedBuffersInSubmodules(torch.nn.Module):
    class Bar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(1))

        def forward(self, x):
            self.buf.add_(1)
            return x.sum() + self.buf.sum()

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.zeros(1))
        self.bar = self.Bar()

    def forward(self, x):
        self.buf.add_(1)
        self.bar.buf.add_(2)
        return self.bar(x) + self.buf.sum()


class BufferUpdatedAfterSubmoduleReadsIt(torch.nn.Module):
    class Bar(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("buf", torch.zeros(1))

        def forward(self, x):
            return x.sum() + self.buf.sum()

    def __init__(self):
        super().__init__()
        self.bar = self.Bar()

    def forward(self, x):
        y = self.bar(x)
        self.bar.buf.add_(2)
        return y + self.bar.buf.sum()


class ParameterDividedUnderNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.parameter = torch.nn.Parameter(torch.ones(4, 4))

    def forward(self, x):
        with torch.no_grad():
            self.parameter.div_(2)
        return x + self.parameter


def bincount(self, x):
    weights = torch.linspace(0, 1, steps=5)
    return x.bincount(weights)


@torch.jit.script
def _scripted(x: torch.Tensor):
    if torch.jit.is_scripting():
        return x.cos()
    return x.sin()


def inline_script_function(self, x):  # traced from its Python source with is_scripting() True, as eager runs it
    return _scripted(x)


def vmap_then_to(self, x, y):
    f = lambda a, b: ((a * b).to("cpu", memory_format=torch.channels_last) + 1).sum(dim=0)  # noqa: E731
    return torch.vmap(f)(x, y).sum(dim=0)


def kwargs_and_defaults(self, pos0, tuple0, *myargs, mykw0=None, **mykwargs):
    out = pos0
    for arg in tuple0:
        out = out + arg
    for arg in myargs:
        out = out + arg
    if mykw0 is not None:
        out = out + mykw0
    return out + mykwargs["input0"] + mykwargs["input1"]


def keyword_only(self, x, *, scale=2.0, bias):
    return x * scale + bias


def nested_pytrees(self, inputs):
    x, (y, z) = inputs["a"], inputs["b"]
    return {"sum": x + y, "pair": [z * 2, (x * z,)]}


class LinearThenConv(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(3, 3)
        self.conv = torch.nn.Conv2d(3, 3, 3)

    def forward(self, x):
        return self.conv(self.linear(x).permute(0, 3, 1, 2)).relu()


class ConstantTensorAttribute(torch.nn.Module):
    """A plain tensor attribute read, not written: a constant of the program."""

    def __init__(self):
        super().__init__()
        self.b = torch.ones(3, 3)
        self.lin = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.lin(x) + self.b


class NonPersistentBuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("foo", torch.rand(2, 3), persistent=False)

    def forward(self, x):
        return self.foo + x


class SharedSubmodule(torch.nn.Module):
    """One Linear under two names: its parameters tied."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.b = self.a

    def forward(self, x):
        return self.b(self.a(x))


class NoGradBlockReturning(torch.nn.Module):
    def forward(self, x):
        with torch.no_grad():
            x = x + 1
            return x, None


class SetGradEnabledBlocks(torch.nn.Module):
    def forward(self, x):
        x = x + 1
        y = x.sin().sum()
        with torch.set_grad_enabled(False):
            z = y + 1
            with torch.enable_grad():
                w = z * x
        return z, w.sum() - 1


class AutocastBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x) @ x.T
        with torch.autocast("cpu", enabled=False):
            z = self.lin(x)
        return y.float() + z.sum()


@dataclasses.dataclass
class PointsIn:
    x: torch.Tensor
    y: list
    z: dict


class DataclassInput(torch.nn.Module):
    def forward(self, inp: PointsIn):
        return inp.x + inp.y[0] + inp.z["k"]


torch.export.register_dataclass(PointsIn, serialized_type_name="test_export_cases.PointsIn")


class InputMutated(torch.nn.Module):
    def forward(self, x, y):
        x.add_(y)
        return x * 2


class InputMutatedAndReturned(torch.nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x


class InputTransposedInPlace(torch.nn.Module):
    def forward(self, x):
        x.transpose_(0, 1)
        return x + 1


class TrainingBatchNorm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bn = torch.nn.BatchNorm2d(3)
        self.conv = torch.nn.Conv2d(3, 3, 1)

    def forward(self, x):
        return self.bn(self.conv(x))


class Dropout(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.drop = torch.nn.Dropout(0.5)
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.drop(self.lin(x))


class LSTM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 6, batch_first=True)

    def forward(self, x):
        out, (h, c) = self.lstm(x)
        return out.sum(1) + h[0]


class GRUCell(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = torch.nn.GRUCell(4, 4)

    def forward(self, x, h):
        for t in range(x.shape[1]):
            h = self.cell(x[:, t], h)
        return h


class MultiheadAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = torch.nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        out, weights = self.attn(x, x, x)
        return out, weights


def sdpa(self, q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class TransformerEncoderLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)

    def forward(self, x):
        return self.layer(x)


class Norms(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = torch.nn.LayerNorm(8)
        self.gn = torch.nn.GroupNorm(2, 4)
        self.emb = torch.nn.Embedding(10, 8)

    def forward(self, ids, img):
        return self.ln(self.emb(ids)).sum(), self.gn(img)


def interpolate(self, x):
    return F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False)


def view_chain(self, x):
    y = x.view(2, 6).t().contiguous().reshape(3, 4)
    return y[1:, ::2] * 3


def item_as_size(self, x):  # an unbacked size from .item(), declared a size
    b = x.item()
    torch._check_is_size(b)
    return torch.full((b, 1), 1)


def masked_select(self, x):  # an output of data-dependent shape
    return x.masked_select(x > 0).sum(), x.nonzero().shape[0]


class SymIntArithmetic(torch.nn.Module):
    def forward(self, x):
        n = x.shape[0]
        return x.reshape(n // 2, -1) + math.floor(n / 3), torch.sym_max(n, 3)


class SliceOfDynamic(torch.nn.Module):
    def forward(self, x, y):
        return x + y[1:]


def type_as_and_casts(self, x, y):
    return x.type_as(y) + y.double().float() + x.to(torch.int32).float()


class AliasedOutputs(torch.nn.Module):
    def forward(self, x):
        y = x * 2
        return y, y.view(-1), y[0]


class TensorHoldingBuffersAndParams(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("running", torch.zeros(3))
        self.weight = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        self.running.mul_(0.9).add_(x.detach().mean(0) * 0.1)
        return x * self.weight + self.running


class NestedNoGradUnderAutocast(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.lin(x)
            with torch.no_grad():
                z = self.lin(y.float())
        return y.float() + z.float()


class RebindsBufferAndReadsOld(torch.nn.Module):
    """(issue 40's buffer rebinding, in torch's export test style)"""

    def __init__(self):
        super().__init__()
        self.register_buffer("buf", torch.ones(3))

    def forward(self, x):
        buf = self.buf
        self.buf = buf + 3
        return x * buf + self.buf


# (more of test_export.py's idioms: containers of modules and parameters, indexing, in-place
# updates of views, named-tuple outputs, data-dependent sizes)


class ModuleDictAndParameterList(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 4), "b": torch.nn.Linear(4, 4)})
        self.scales = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4)) for _ in range(2)])

    def forward(self, x):
        for (name, layer), scale in zip(self.layers.items(), self.scales):
            x = layer(x) * scale
        return x


def setitem_on_a_clone(self, x, y):
    z = x.clone()
    z[0] = y
    z[:, 1] += 1
    return z * 2


def index_put_with_mask(self, x):
    y = x * 1
    y[y > 0] = 0.0
    return y


def scatter_add_and_cumsum(self, x, index):
    out = torch.zeros(3, 4).scatter_add_(0, index, x)
    return out.cumsum(1)


def named_tuple_outputs(self, x):
    values, indices = x.max(dim=1)
    top = x.topk(2, dim=1)
    return values, indices, top.values, x.sort(dim=1).values


def chunk_split_cat(self, x):
    a, b = x.chunk(2, dim=1)
    c = torch.cat([b, a], dim=1)
    return [t * 2 for t in c.split(1, dim=0)]


def einsum_and_pad(self, x, y):
    return F.pad(torch.einsum("ij,jk->ik", x, y), (1, 1))


def arange_of_a_size(self, x):
    return x + torch.arange(x.shape[0]).unsqueeze(1)


def unique_values(self, x):  # an output of data-dependent size
    return torch.unique(x)


def tensor_of_sizes(self, x):
    return torch.tensor([x.shape[0], x.shape[1]]) * 2


class BufferCopiedFromAnotherDtype(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.zeros(3, dtype=torch.float64))

    def forward(self, x):
        self.state.copy_(x)
        return self.state.float() * x


class IntBufferCounter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return x * self.count


class ParameterViewUpdatedUnderNoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3, 4))

    def forward(self, x):
        with torch.no_grad():
            self.w[0].mul_(0.5)
        return x @ self.w


class DataAndRequiresGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(3))

    def forward(self, x):
        y = x.detach().requires_grad_()
        return (y * self.w.data).sum() + (x * self.w).sum()


def complex_numbers(self, x):
    c = torch.view_as_complex(x)
    return torch.view_as_real(c * c.conj()).sum(-1)


def where_and_clamp(self, x, y):
    return torch.where(x > y, x, y).clamp(min=-0.5, max=0.5) + torch.maximum(x, y)


class EmbeddingBagAndConv1d(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.bag = torch.nn.EmbeddingBag(10, 4, mode="sum")
        self.conv = torch.nn.Conv1d(4, 4, 3, padding=1)

    def forward(self, ids, offsets, seq):
        return self.bag(ids, offsets), self.conv(seq)


class LazyLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.LazyLinear(3)
        self.lin(torch.zeros(1, 4))  # materialized, as a module is before export

    def forward(self, x):
        return self.lin(x)


class InferenceModeBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        with torch.inference_mode():
            frozen = self.lin(x)
        return self.lin(x) + frozen.clone()


class UnregisteredParameterInADict(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.params = {"foo": torch.nn.Parameter(torch.ones(3, 3))}

    def forward(self, x):
        return x + self.params["foo"]


class TensorAttributeRequiringGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.const = torch.randn(2, 2, requires_grad=True)

    def forward(self, x):
        return x + self.const


class DataDependentBranch(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:
            return x.sin()
        return x.cos()


class ShapeBranch(torch.nn.Module):  # a branch on a static shape: specialized, fine
    def forward(self, x):
        if x.shape[0] == 4:
            return x + 1
        return x


class CondModule(torch.nn.Module):
    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: t.sin(), lambda t: t.cos(), (x,))


class MapModule(torch.nn.Module):
    def forward(self, xs, y):
        from torch._higher_order_ops.map import map as hop_map

        return hop_map(lambda x, y: x + y, xs, y)


class WhileLoopModule(torch.nn.Module):
    def forward(self, i, x):
        from torch._higher_order_ops.while_loop import while_loop

        return while_loop(lambda i, x: i < 3, lambda i, x: (i + 1, x * 2), (i, x))


def item_of(self, t):
    return t.item()


def view_by_item(self, x):
    """A size read from a tensor, pinned by the view it shapes (``u0 * 4 == 24``)."""
    return torch.randn(24).view(x.item(), 4)


def layer_norm_by_item(self, scalar, weight, bias):
    n = scalar.item()
    return F.layer_norm(torch.ones(2, n), normalized_shape=(n,), weight=weight, bias=bias)


class ItemsChecked(torch.nn.Module):
    def forward(self, x, y, z):
        m, n = x.item(), y.item()
        torch._check(m == 4)
        torch._check(n == z.shape[0])
        return m + n + z


class NonzeroCountAsSize(torch.nn.Module):
    def forward(self, a, b, c):
        ones = a.new_ones([torch.nonzero(a).size(0), b.size(0)])
        torch._check(ones.size(0) >= 1)
        return ones + c


def checked_or_and(self, xs):
    from torch.fx.experimental.symbolic_shapes import sym_and, sym_or

    u0, u1, u2 = xs.tolist()
    torch._check(sym_or(u0 == 2, u0 == 4, u0 == 6))
    torch._check(sym_and(u1 >= 4, u1 <= 8, u2 == 5))
    return u0 + u1 + u2


def narrowed_by_item(self, xs, y):
    return torch.stack(xs, 0).narrow(0, y.item(), 1).squeeze()


# ---------------------------------------------------------------- the cases

r = torch.randn


_DX = Dim("dx", min=3, max=9)


def _ints(*shape):
    return torch.randint(0, 8, shape)


CASES = {
    "basic": Case("test_basic", module(basic), ([r(1, 3)], r(1, 3))),
    "symint_output": Case("test_symint_output", SymIntOutput, (r(2, 3),),
                          options={"dynamic_shapes": ((Dim("d0"), Dim("d1")),)}),
    "returns_a_number": Case("test_no_tensor_computation", module(returns_a_number), ([r(1, 3)], 1)),
    "returns_its_input": Case("test_no_tensor_computation_2", module(returns_its_input), (r(3), 1)),
    "constant_output": Case("test_no_tensor_computation_3", module(constant_output), (r(3), 1)),
    "mutated_buffer": Case("test_to_module_with_mutated_buffer", MutatedBuffer, (r(5, 5),)),
    "mutated_buffers_in_submodules": Case("test_to_module_with_mutated_buffer_multiple",
                                          MutatedBuffersInSubmodules, (r(5, 5),)),
    "buffer_updated_after_submodule": Case("test_to_module_with_mutated_buffer_multiple_update_sub_later",
                                           BufferUpdatedAfterSubmoduleReadsIt, (r(5, 5),)),
    "parameter_divided_under_no_grad": Case("test_no_grad_param_inplace", ParameterDividedUnderNoGrad, (r(4, 4),)),
    "bincount": Case("test_bincount", module(bincount), (_ints(5),)),
    "inline_script_function": Case("test_inline_script_function", module(inline_script_function), (r(3, 4),)),
    "vmap_then_to": Case("test_vmap_to_assert", module(vmap_then_to), (r(4, 4, 4, 4), r(4, 4, 4, 4))),
    "kwargs_and_defaults": Case("test_export_func_with_var_keyword_args", module(kwargs_and_defaults),
                                (r(2, 3), (r(2, 3),), r(2, 3), r(2, 3)),
                                {"mykw0": r(2, 3), "input0": r(2, 3), "input1": r(2, 3)}),
    "keyword_only": Case("test_export_func_with_keyword_only_args", module(keyword_only), (r(3),),
                         {"bias": r(3)}),
    "nested_pytrees": Case("test_export_func_with_pytree_args", module(nested_pytrees),
                           ({"a": r(3), "b": (r(3), r(3))},)),
    "linear_then_conv": Case("test_linear_conv", LinearThenConv, (r(2, 5, 5, 3),)),
    "constant_tensor_attribute": Case("test_tensor_attribute_zero_args", ConstantTensorAttribute, (r(3, 3),)),
    "non_persistent_buffer": Case("test_non_persistent_buffer", NonPersistentBuffer, (r(2, 3),)),
    "shared_submodule": Case("test_shared_submodule_nn_module_stack", SharedSubmodule, (r(2, 4),)),
    "no_grad_block_returning": Case("test_set_grad_empty", NoGradBlockReturning, (r(3, 3),)),
    "set_grad_enabled_blocks": Case("test_predispatch_set_grad", SetGradEnabledBlocks, (r(3, 3),)),
    "autocast_block": Case("test_predispatch_autocast", AutocastBlock, (r(2, 4),), check={"atol": 1e-2, "rtol": 1e-2}),
    "nested_no_grad_under_autocast": Case("test_predispatch_autocast_and_set_grad", NestedNoGradUnderAutocast,
                                          (r(2, 4),), check={"atol": 1e-2, "rtol": 1e-2}),
    "dataclass_input": Case("test_pytree_register_data_class", DataclassInput,
                            (PointsIn(r(3), [r(3)], {"k": r(3)}),)),
    "input_mutated": Case("test_export_input_mutation", InputMutated, (r(3), r(3)),
                          check={"inputs_require_grad": False}),
    "input_mutated_and_returned": Case("test_input_mutation_returned", InputMutatedAndReturned, (r(3),),
                                       check={"inputs_require_grad": False}),
    "input_transposed_in_place": Case("test_metadata_mutation_of_input", InputTransposedInPlace, (r(2, 3),),
                                      check={"inputs_require_grad": False}),
    "training_batch_norm": Case("test_batchnorm_training", TrainingBatchNorm, (r(2, 3, 4, 4),)),
    "dropout": Case("test_dropout_training", Dropout, (r(2, 4),)),
    "lstm": Case("test_export_rnn_variants", LSTM, (r(2, 5, 4),)),
    "gru_cell_loop": Case("test_export_rnn_cell", GRUCell, (r(2, 3, 4), r(2, 4))),
    "multihead_attention": Case("test_mha", MultiheadAttention, (r(2, 5, 8),)),
    "sdpa": Case("test_sdpa_export", module(sdpa), (r(1, 2, 4, 8), r(1, 2, 4, 8), r(1, 2, 4, 8))),
    "transformer_encoder_layer": Case("test_transformer_encoder", TransformerEncoderLayer, (r(2, 5, 8),)),
    "norms_and_embedding": Case("test_layer_norm_group_norm", Norms, (_ints(2, 3), r(2, 4, 3, 3))),
    "interpolate": Case("test_interpolate", module(interpolate), (r(1, 2, 3, 3),)),
    "view_chain": Case("test_view_reshape", module(view_chain), (r(12),)),
    "item_as_size": Case("test_export_inline_constraints", module(item_as_size), (torch.tensor([3]),)),
    "masked_select": Case("test_masked_select_nonzero", module(masked_select), (r(8),)),
    "sym_int_arithmetic": Case("test_sym_ops", SymIntArithmetic, (r(8, 2),),
                               options={"dynamic_shapes": ({0: Dim("n", min=2, max=64) * 2},)}),
    "slice_of_dynamic": Case("test_derived_dim_basic", SliceOfDynamic, (r(4), r(5)),
                             options={"dynamic_shapes": ({0: _DX}, {0: _DX + 1})}),
    "type_as_and_casts": Case("test_type_as", module(type_as_and_casts), (r(3), r(3))),
    "aliased_outputs": Case("test_aliased_outputs", AliasedOutputs, (r(2, 3),)),
    "running_statistic": Case("test_buffer_and_parameter", TensorHoldingBuffersAndParams, (r(4, 3),)),
    "rebinds_buffer_and_reads_old": Case("issue 40 (test_export's buffer idioms)", RebindsBufferAndReadsOld, (r(3),)),
    "module_dict_and_parameter_list": Case("test_module_dict_and_list", ModuleDictAndParameterList, (r(2, 4),)),
    "setitem_on_a_clone": Case("test_setitem", module(setitem_on_a_clone), (r(3, 3), r(3))),
    "index_put_with_mask": Case("test_index_put_mask", module(index_put_with_mask), (r(3, 4),)),
    "scatter_add_and_cumsum": Case("test_scatter_add", module(scatter_add_and_cumsum),
                                   (r(2, 4), torch.tensor([[0, 1, 2, 0], [2, 0, 0, 1]]))),
    "named_tuple_outputs": Case("test_max_topk_sort", module(named_tuple_outputs), (r(3, 5),)),
    "chunk_split_cat": Case("test_split_cat", module(chunk_split_cat), (r(2, 4),)),
    "einsum_and_pad": Case("test_einsum", module(einsum_and_pad), (r(2, 3), r(3, 4))),
    "arange_of_a_size": Case("test_arange_dynamic", module(arange_of_a_size), (r(4, 3),)),
    "unique_values": Case("test_unique", module(unique_values), (torch.tensor([3.0, 1.0, 3.0, 2.0]),),
                          check={"inputs_require_grad": False}),  # (unique has no derivative)
    "tensor_of_sizes": Case("test_tensor_from_sizes", module(tensor_of_sizes), (r(2, 3),)),
    "buffer_copied_from_another_dtype": Case("test_buffer_copy_dtype", BufferCopiedFromAnotherDtype, (r(3),)),
    "int_buffer_counter": Case("test_int_buffer_mutation", IntBufferCounter, (r(3),)),
    "parameter_view_updated_under_no_grad": Case("test_param_view_mutation_no_grad",
                                                 ParameterViewUpdatedUnderNoGrad, (r(2, 3),)),
    "data_and_requires_grad": Case("test_detach_requires_grad", DataAndRequiresGrad, (r(3),)),
    "complex_numbers": Case("test_complex", module(complex_numbers), (r(3, 2),)),
    "where_and_clamp": Case("test_where_clamp", module(where_and_clamp), (r(4), r(4))),
    "embedding_bag_and_conv1d": Case("test_embedding_bag", EmbeddingBagAndConv1d,
                                     (_ints(6), torch.tensor([0, 3]), r(2, 4, 5))),
    "lazy_linear": Case("test_lazy_module_kwargs", LazyLinear, (r(2, 4),)),
    "script_function_static_method": Case("test_inline_script_class_method", ScriptedStaticMethod, (r(3),)),
    "traced_function": Case("test_inline_script_function (torch.jit.trace)", module(traced_function), (r(3),)),
    "inference_mode_block": Case("test_inference_mode", InferenceModeBlock, (r(2, 4),)),
    "shape_branch": Case("test_export_assume_static_by_default", ShapeBranch, (r(4, 5),)),
    "data_dependent_branch_specialized": Case("test_export_with_data_dependent_branch", DataDependentBranch,
                                              (torch.ones(3),), options={"data_dependent": "specialize"}),
    # values read from tensors, their checks pinning them: exported again, the same program (G7)
    "bool_item": Case("test_symbool_item", module(item_of), (torch.tensor([True]),)),
    "view_by_item": Case("test_no_check_is_size_error", module(view_by_item), (torch.tensor(6),)),
    "layer_norm_by_item": Case("test_layer_norm_unbacked_normalized_shape", module(layer_norm_by_item),
                               (torch.tensor(6, dtype=torch.int32), r(6), r(6))),
    "items_checked": Case("test_replaced_unbacked_bindings", ItemsChecked,
                          (torch.tensor(4), torch.tensor(5), r(5)),
                          options={"dynamic_shapes": (None, None, (Dim("dz", max=16),))}),
    "nonzero_count_as_size": Case("test_colin_unbacked_backed_vr_sub", NonzeroCountAsSize,
                                  (torch.ones(8), r(4), r(8, 4)),
                                  options={"dynamic_shapes": (None, None, (Dim.DYNAMIC, Dim.STATIC))}),
    "checked_or_and": Case("test_sym_or_sym_and", module(checked_or_and), (torch.tensor([2, 6, 5]),)),
    "narrowed_by_item": Case("test_no_suggested_fixes_for_data_dependent_errors", module(narrowed_by_item),
                             ([torch.ones(5) * i for i in range(10)], torch.tensor(2))),
    # where refusal is right
    "data_dependent_branch": Case("test_export_with_data_dependent_branch", DataDependentBranch, (r(3),),
                                  refused="data-dependent Python control flow .* x.sum\\(\\) > 0"),
    "unregistered_parameter": Case("test_not_registered_parameter", UnregisteredParameterInADict, (r(1, 3),),
                                   refused="attribute \"params\\['foo'\\]\".* neither a parameter, a buffer"),
    "constant_requiring_grad": Case("test_constant_requires_grad", TensorAttributeRequiringGrad, (r(2, 2),),
                                    refused="attribute 'const'.* neither a parameter, a buffer"),
    # control-flow operators (issue 41)
    "cond": Case("test_cond_with_module_stack_export_with", CondModule, (r(3),)),
    "map": Case("test_map_buffers", MapModule, (r(3, 2), r(2))),
    "while_loop": Case("test_while_loop_simple", WhileLoopModule, (torch.tensor(0), r(3))),
}


def _instantiate(case: Case) -> torch.nn.Module:
    torch.manual_seed(0)
    return case.make()


def _options(case: Case) -> dict:
    return dict(case.options)


def _matching(name: str, case: Case):
    if case.differs is None:
        return name
    return pytest.param(name, marks=pytest.mark.xfail(strict=True, reason=case.differs))


@pytest.mark.parametrize("name", [_matching(n, c) for n, c in CASES.items() if c.refused is None])
def test_matches_eager(name):
    case = CASES[name]
    assert_matches_eager(_instantiate(case), case.args, case.kwargs, **case.check, **_options(case))


@pytest.mark.parametrize("name", [n for n, c in CASES.items() if c.refused is not None])
def test_refused_naming_the_construct(name):
    case = CASES[name]
    with pytest.raises(predispatch.ExportError, match=case.refused) as info:
        predispatch.export_predispatch(_instantiate(case), case.args, case.kwargs, **_options(case))
    assert "test_export_cases.py" in str(info.value)


@pytest.mark.parametrize("name, other", [("view_by_item", (torch.tensor(5),)),
                                         ("items_checked", (torch.tensor(3), torch.tensor(5), r(5))),
                                         ("checked_or_and", (torch.tensor([2, 6, 4]),)),
                                         ("checked_or_and", (torch.tensor([2, 9, 5]),)),
                                         ("narrowed_by_item", ([r(5) for _ in range(10)], torch.tensor(10)))])
def test_a_call_the_checks_refuse_fails_as_eager_fails_exported_again_too(name, other):
    """The checks the program keeps of the values it reads from tensors (a
    pinned value written as a constant where an op reads it, a check torch
    wrote again dropped as restated or implied by earlier bounds: G7) still
    refuse a call eager fails on, in the program and in it exported again."""
    case = CASES[name]
    with pytest.raises(RuntimeError):
        _instantiate(case)(*other)
    ep = predispatch.export_predispatch(_instantiate(case), case.args, case.kwargs, **_options(case))
    for program in (ep, predispatch.export_predispatch(ep.module(), case.args, case.kwargs, **_options(case))):
        with pytest.raises(RuntimeError, match="Runtime assertion failed"):
            program.module()(*other)


# ---------------------------------------------------------------- issue 40, item 5


class SymIntInARegion(torch.nn.Module):
    """A size computed inside a block and returned: the region's output, named
    in the signature as the region's getitem (a SpecViolationError before)."""

    def __init__(self, how):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "no_grad":
            with torch.no_grad():
                n = x.shape[0] * 2
        elif self.how == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                n = x.shape[0] + x.shape[1]
        elif self.how == "float":
            with torch.no_grad():
                n = x.shape[0] / 3
        else:
            with torch.no_grad():
                with torch.enable_grad():
                    n = x.shape[0] - 1
        return x * 2, n


@pytest.mark.parametrize("how", ["no_grad", "autocast", "float", "nested"])
def test_a_symint_computed_in_a_region_is_an_output(how):
    shapes = {"x": {0: Dim("batch")}}
    ep = assert_matches_eager(SymIntInARegion(how), (r(4, 3),), dynamic_shapes=shapes)
    assert_matches_eager(SymIntInARegion(how), (r(7, 3),), export=lambda *a, **k: ep, check_reexport=False)


class CallsAModuleInput(torch.nn.Module):
    def forward(self, x, sub):
        return sub(x) * 2


def test_a_module_passed_as_an_input_is_named_by_the_program_after_the_export():
    """torch's test_export_module_as_input style: the program's input spec
    names the module the user passed (weakly, as torch.export does), not a
    copy the trace made and dropped: ``copy.deepcopy(ep.module())`` works
    once the export is done, and the program runs on another module."""
    import copy
    import gc

    ep = predispatch.export_predispatch(CallsAModuleInput(), (r(2, 3), torch.nn.Linear(3, 3)))
    gc.collect()
    program = ep.module()
    copy.deepcopy(program)  # torch's raw TypeError (a dead weak reference) before
    other, x = torch.nn.Linear(3, 3), r(2, 3)
    torch.testing.assert_close(program(x, other), other(x) * 2)
