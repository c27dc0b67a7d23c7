"""Audit CompositeImplicitAutograd (CIA) aten ops for truthful schemas.

A CIA op may be kept un-decomposed in an exported graph only if its schema is
truthful: no alias/mutation annotation *and* no aliasing or mutation at run
time.  Some ops lie (e.g. ``aten::type_as`` returns ``self`` itself when the
dtype already matches), so besides reading schemas we run every op whose
schema claims to be functional on sample inputs and watch for:

* an output that *is* an input, or shares its storage (alias), and
* an input whose version counter or values changed (mutation).

Usage::

    python tools/audit_composites.py            # print the summary
    python tools/audit_composites.py --write    # also refresh the data files
    python tools/audit_composites.py --limit 50 # quick run on 50 ops

``--write`` regenerates ``predispatch/data/composite_audit-<release>.json`` and
``design/composite_audit-<release>.md`` for the installed torch release (2.13, 2.14, 2.15: each has its own); the output is sorted and timestamp-free so a
re-run on the same torch gives identical files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import itertools
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from predispatch._torch.release import RELEASE  # noqa: E402

JSON_PATH = REPO / "predispatch" / "data" / f"composite_audit-{RELEASE}.json"
MD_PATH = REPO / "design" / f"composite_audit-{RELEASE}.md"
CIA_KEY = "CompositeImplicitAutograd"

MAX_SAMPLES = 8  # samples that actually ran, per op
MAX_TRIES = 40  # samples looked at per op (many are rejected by the overload)
TIME_BUDGET_S = 3.0  # per op; a few OpInfo sample generators are slow
OPINFO_DTYPES = (torch.float32, torch.float64, torch.int64)


# --------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Sample:
    args: tuple
    kwargs: dict
    desc: str  # short, deterministic (shapes and dtypes only)


@dataclasses.dataclass(frozen=True)
class Observation:
    observed: str  # "alias" | "mutates" | "clean" | "untested"
    detail: str  # what was seen, with the sample that showed it
    ran: int  # samples that ran


@dataclasses.dataclass(frozen=True)
class AuditRecord:
    name: str
    schema_says: str  # "functional" | "alias" | "mutates"
    observed: str
    tagged: bool
    decision: str  # "keep" | "decompose"
    reason: str

    @property
    def is_liar(self) -> bool:
        """Schema claims functional but the op aliased/mutated at run time."""
        return (
            self.schema_says == "functional"
            and not self.tagged
            and self.observed in ("alias", "mutates")
        )


# --------------------------------------------------------------------------
# Enumeration and schema reading
# --------------------------------------------------------------------------


def _aten_packet_names() -> list[str]:
    # dir(torch.ops.aten) only lists packets already loaded, so take the
    # names from the registered schemas instead.
    names = {
        s.name.split("::", 1)[1]
        for s in torch._C._jit_get_all_schemas()
        if s.name.startswith("aten::")
    }
    return sorted(names)


def cia_overloads() -> list[torch._ops.OpOverload]:
    """Every aten overload with a CompositeImplicitAutograd kernel, by name."""
    found = {}
    for packet_name in _aten_packet_names():
        try:
            packet = getattr(torch.ops.aten, packet_name)
        except (AttributeError, RuntimeError):
            continue
        for overload in packet.overloads():
            try:
                op = getattr(packet, overload)
                has_cia = torch._C._dispatch_has_kernel_for_dispatch_key(
                    op.name(), CIA_KEY
                )
            except (AttributeError, RuntimeError):
                # TorchScript-only overloads (e.g. aten::__and__.bool) are not
                # in the dispatcher.
                continue
            if has_cia:
                found[op.name()] = op
    return [found[name] for name in sorted(found)]


def schema_says(op: torch._ops.OpOverload) -> str:
    schema = op._schema
    if schema.is_mutable:
        return "mutates"
    if any(a.alias_info is not None for a in [*schema.arguments, *schema.returns]):
        return "alias"
    return "functional"


def is_tagged(op: torch._ops.OpOverload) -> bool:
    return torch.Tag.maybe_aliasing_or_mutating in op.tags


def _short_name(op: torch._ops.OpOverload) -> str:
    """aten::add.Tensor -> add (the packet name)."""
    return op.name().split("::", 1)[1].split(".", 1)[0]


# --------------------------------------------------------------------------
# Sample descriptions (deterministic: dtype and shape, never values)
# --------------------------------------------------------------------------

_DTYPE_ABBR = {
    torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32",
    torch.float64: "f64", torch.complex32: "c32", torch.complex64: "c64",
    torch.complex128: "c128", torch.int8: "i8", torch.uint8: "u8",
    torch.int16: "i16", torch.int32: "i32", torch.int64: "i64", torch.bool: "b8",
}


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        dtype = _DTYPE_ABBR.get(value.dtype, str(value.dtype).replace("torch.", ""))
        layout = "" if value.layout == torch.strided else f"{value.layout}:".replace("torch.", "")
        return f"{layout}{dtype}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_describe(v) for v in value[:4])
        more = ", ..." if len(value) > 4 else ""
        return f"[{inner}{more}]"
    if isinstance(value, float):
        return f"{value:.3g}"
    return repr(value)


def describe_call(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> str:
    parts = [_describe(a) for a in args]
    parts += [f"{k}={_describe(v)}" for k, v in sorted(kwargs.items())]
    text = f"{_short_name(op)}({', '.join(parts)})"
    return text if len(text) <= 90 else text[:87] + "..."


# --------------------------------------------------------------------------
# Hand-written samples: the no-op paths where aliasing typically happens
# (same dtype, same shape, already contiguous, p=0 / train=False, ...).
# --------------------------------------------------------------------------


def _f(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


def _same_dtype_cast(dtype: torch.dtype) -> Callable[[], list]:
    return lambda: [((_f(3, dtype=dtype),), {})]


def _stack_single() -> list:
    return [(([_f(2, 3)],), {})]


# op name -> () -> [(args, kwargs), ...].  Builders are lazy so tensors are
# fresh for every run and the RNG seed set per op applies.
HAND_SAMPLES: dict[str, Callable[[], list]] = {
    # dtype / device conversions that may return `self`
    "aten::type_as": lambda: [((_f(2, 3), _f(2, 3)), {}), ((_f(2, 3), _f(1, dtype=torch.float64)), {})],
    "aten::_cast_Float": _same_dtype_cast(torch.float32),
    "aten::_cast_Double": _same_dtype_cast(torch.float64),
    "aten::_cast_Long": _same_dtype_cast(torch.int64),
    "aten::_cast_Int": _same_dtype_cast(torch.int32),
    "aten::_cast_Short": _same_dtype_cast(torch.int16),
    "aten::_cast_Char": _same_dtype_cast(torch.int8),
    "aten::_cast_Byte": _same_dtype_cast(torch.uint8),
    "aten::_cast_Half": _same_dtype_cast(torch.float16),
    "aten::chalf": _same_dtype_cast(torch.complex32),
    "aten::to.dtype": lambda: [((_f(2, 3), torch.float32), {})],
    "aten::to.other": lambda: [((_f(2, 3), _f(1)), {})],
    "aten::to.device": lambda: [((_f(2, 3), torch.device("cpu"), torch.float32), {})],
    "aten::to.dtype_layout": lambda: [((_f(2, 3),), {"dtype": torch.float32})],
    "aten::_to_cpu": lambda: [(([_f(3)],), {})],
    "aten::data": lambda: [((_f(3),), {})],
    "aten::to_dense": lambda: [((_f(3),), {})],
    "aten::to_sparse": lambda: [((_f(3, 3).to_sparse(),), {})],
    "aten::to_sparse.sparse_dim": lambda: [((_f(3, 3).to_sparse(), 2), {})],
    "aten::to_sparse_csr": lambda: [((_f(3, 3).to_sparse_csr(),), {})],
    "aten::_autocast_to_reduced_precision": lambda: [((_f(3), False, False, torch.float16, torch.bfloat16), {})],
    "aten::_autocast_to_full_precision": lambda: [((_f(3), False, False), {})],
    # layout no-ops
    "aten::contiguous": lambda: [((_f(2, 3),), {})],
    "aten::reshape": lambda: [((_f(2, 3), [2, 3]), {}), ((_f(2, 3).t(), [6]), {})],
    "aten::reshape_as": lambda: [((_f(2, 3), _f(2, 3)), {})],
    "aten::view_as": lambda: [((_f(2, 3), _f(2, 3)), {})],
    "aten::expand_as": lambda: [((_f(2, 3), _f(2, 3)), {})],
    "aten::broadcast_to": lambda: [((_f(2, 3), [2, 3]), {})],
    "aten::flatten.using_ints": lambda: [((_f(3),), {})],
    "aten::ravel": lambda: [((_f(3),), {})],
    "aten::_reshape_from_tensor": lambda: [((_f(2, 3), torch.tensor([6])), {})],
    "aten::sum_to_size": lambda: [((_f(2, 3), [2, 3]), {})],
    "aten::atleast_1d": lambda: [((_f(3),), {})],
    "aten::atleast_2d": lambda: [((_f(2, 3),), {})],
    "aten::atleast_3d": lambda: [((_f(2, 3, 4),), {})],
    "aten::atleast_1d.Sequence": lambda: [(([_f(3)],), {})],
    "aten::atleast_2d.Sequence": lambda: [(([_f(2, 3)],), {})],
    "aten::atleast_3d.Sequence": lambda: [(([_f(2, 3, 4)],), {})],
    "aten::broadcast_tensors": lambda: [(([_f(3)],), {}), (([_f(2, 3), _f(2, 3)],), {})],
    "aten::meshgrid": lambda: [(([_f(3)],), {})],
    "aten::meshgrid.indexing": lambda: [(([_f(3)],), {"indexing": "ij"})],
    "aten::cartesian_prod": lambda: [(([_f(3)],), {})],
    "aten::unsafe_chunk": lambda: [((_f(4), 1), {})],
    "aten::flatten_dense_tensors": lambda: [(([_f(3)],), {})],
    "aten::unflatten_dense_tensors": lambda: [((_f(6), [_f(2), _f(4)]), {})],
    "aten::einsum": lambda: [(("ij->ij", [_f(2, 3)]), {}), (("ij->ji", [_f(2, 3)]), {})],
    "aten::pad": lambda: [((_f(3), [0, 0]), {})],
    "aten::tile": lambda: [((_f(2, 3), [1, 1]), {})],
    "aten::repeat_interleave.self_int": lambda: [((_f(3), 1), {})],
    "aten::matrix_power": lambda: [((_f(3, 3), 1), {})],
    "aten::linalg_matrix_power": lambda: [((_f(3, 3), 1), {})],
    "aten::chain_matmul": lambda: [(([_f(3, 3)],), {})],
    "aten::concat": _stack_single,
    "aten::concatenate": _stack_single,
    "aten::hstack": _stack_single,
    "aten::vstack": _stack_single,
    "aten::dstack": _stack_single,
    "aten::row_stack": _stack_single,
    "aten::column_stack": _stack_single,
    "aten::diff": lambda: [((_f(4), 0), {})],
    "aten::native_channel_shuffle": lambda: [((_f(1, 4, 2, 2), 1), {})],
    "aten::fft_fftshift": lambda: [((_f(4), []), {})],
    "aten::float_power.Tensor_Scalar": lambda: [((_f(3, dtype=torch.float64), 1), {})],
    "aten::conj_physical": lambda: [((_f(3),), {})],
    "aten::linear": lambda: [((_f(2, 3), _f(4, 3), _f(4)), {}), ((_f(2, 3), _f(4, 3)), {})],
    "aten::matmul": lambda: [((_f(2, 3), _f(3, 4)), {})],
    "aten::layer_norm": lambda: [((_f(2, 3), [3]), {})],
    "aten::softmax.int": lambda: [((_f(2, 3), 1), {})],
    "aten::scaled_dot_product_attention": lambda: [((_f(1, 2, 3, 4), _f(1, 2, 3, 4), _f(1, 2, 3, 4)), {})],
    # dropout family: p=0 and train=False are the pass-through paths
    "aten::dropout": lambda: [((_f(2, 3), 0.5, False), {}), ((_f(2, 3), 0.0, True), {})],
    "aten::feature_dropout": lambda: [((_f(2, 3, 4), 0.5, False), {})],
    "aten::alpha_dropout": lambda: [((_f(2, 3), 0.5, False), {})],
    "aten::feature_alpha_dropout": lambda: [((_f(2, 3, 4), 0.5, False), {})],
    "aten::rrelu": lambda: [((_f(3),), {"training": False})],
    # norms that update running stats in place
    "aten::batch_norm": lambda: [
        ((_f(2, 3), None, None, _f(3), _f(3).abs(), True, 0.1, 1e-5, False), {}),
    ],
    "aten::instance_norm": lambda: [
        ((_f(2, 3, 4), None, None, _f(3), _f(3).abs(), True, 0.1, 1e-5, False), {}),
    ],
    "aten::group_norm": lambda: [((_f(2, 4, 3), 2), {})],
    # OpInfo samples use the Python signatures (str reductions, kwargs), so
    # the aten overloads of these common ops need their own samples.
    "aten::cdist": lambda: [((_f(2, 3), _f(4, 3)), {})],
    "aten::clip": lambda: [((_f(3), -1.0, 1.0), {}), ((_f(3), None, None), {})],
    "aten::tensordot": lambda: [((_f(2, 3), _f(3, 4), [1], [0]), {})],
    "aten::max_pool1d": lambda: [((_f(1, 2, 4), [1]), {})],
    "aten::max_pool2d": lambda: [((_f(1, 2, 4, 4), [1, 1]), {})],
    "aten::max_pool3d": lambda: [((_f(1, 2, 2, 2, 2), [1, 1, 1]), {})],
    "aten::adaptive_max_pool1d": lambda: [((_f(1, 2, 4), [4]), {})],
    "aten::nll_loss": lambda: [((_f(2, 3).log_softmax(1), torch.tensor([0, 2])), {})],
    "aten::nll_loss_nd": lambda: [((_f(2, 3).log_softmax(1), torch.tensor([0, 2])), {})],
    "aten::nll_loss2d": lambda: [((_f(1, 3, 2, 2).log_softmax(1), torch.zeros(1, 2, 2, dtype=torch.long)), {})],
    "aten::embedding_bag": lambda: [((_f(5, 3), torch.tensor([0, 1, 2]), torch.tensor([0, 2])), {})],
    "aten::margin_ranking_loss": lambda: [((_f(3), _f(3), torch.ones(3)), {})],
    "aten::cosine_embedding_loss": lambda: [((_f(2, 3), _f(2, 3), torch.ones(2)), {})],
    "aten::slogdet": lambda: [((_f(3, 3),), {})],
    "aten::frobenius_norm.dim": lambda: [((_f(2, 3), [1]), {})],
    "aten::nuclear_norm.dim": lambda: [((_f(2, 3), [0, 1]), {})],
    "aten::linalg_pinv": lambda: [((_f(2, 3), 1e-5), {})],
    "aten::linalg_matrix_rank": lambda: [((_f(2, 3), 1e-5), {})],
    "aten::vander": lambda: [((_f(3),), {})],
    "aten::grid_sampler": lambda: [((_f(1, 1, 3, 3), _f(1, 2, 2, 2), 0, 0, False), {})],
    "aten::upsample_nearest1d.vec": lambda: [((_f(1, 1, 3), [3], None), {})],
    "aten::upsample_nearest2d.vec": lambda: [((_f(1, 1, 2, 2), [2, 2], None), {})],
    "aten::upsample_nearest3d.vec": lambda: [((_f(1, 1, 2, 2, 2), [2, 2, 2], None), {})],
    "aten::upsample_linear1d.vec": lambda: [((_f(1, 1, 3), [3], False, None), {})],
    "aten::upsample_bilinear2d.vec": lambda: [((_f(1, 1, 2, 2), None, False, [1.0, 1.0]), {})],
    "aten::upsample_bicubic2d.vec": lambda: [((_f(1, 1, 2, 2), [2, 2], False, None), {})],
    "aten::upsample_trilinear3d.vec": lambda: [((_f(1, 1, 2, 2, 2), [2, 2, 2], False, None), {})],
    "aten::where.ScalarOther": lambda: [((_f(3) > 0, _f(3), 0.0), {})],
    "aten::where.ScalarSelf": lambda: [((_f(3) > 0, 0.0, _f(3)), {})],
    "aten::where.Scalar": lambda: [((_f(3) > 0, 1.0, 0.0), {})],
    # recurrent layers: dropout only applies with train=True
    "aten::rnn_tanh_cell": lambda: [((_f(1, 3), _f(1, 4), _f(4, 3), _f(4, 4), _f(4), _f(4)), {})],
    "aten::rnn_relu_cell": lambda: [((_f(1, 3), _f(1, 4), _f(4, 3), _f(4, 4), _f(4), _f(4)), {})],
    "aten::gru_cell": lambda: [((_f(1, 3), _f(1, 4), _f(12, 3), _f(12, 4), _f(12), _f(12)), {})],
    "aten::lstm_cell": lambda: [((_f(1, 3), [_f(1, 4), _f(1, 4)], _f(16, 3), _f(16, 4), _f(16), _f(16)), {})],
    "aten::rnn_tanh.input": lambda: [_rnn_sample(1, [_f(1, 1, 4)])],
    "aten::rnn_relu.input": lambda: [_rnn_sample(1, [_f(1, 1, 4)])],
    "aten::gru.input": lambda: [_rnn_sample(3, [_f(1, 1, 4)])],
    "aten::lstm.input": lambda: [_rnn_sample(4, [[_f(1, 1, 4), _f(1, 1, 4)]])],
}


def _rnn_sample(gates: int, hx: list) -> tuple:
    """One-layer, train=False sample for aten::{rnn_*,gru,lstm}.input."""
    params = [_f(4 * gates, 3), _f(4 * gates, 4), _f(4 * gates), _f(4 * gates)]
    # input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first
    return (_f(2, 1, 3), *hx, params, True, 1, 0.5, False, False, False), {}

# Internal/backend-specific ops that the schema-driven fallback must not
# poke with made-up arguments.
_FALLBACK_SKIP_PREFIXES = (
    "_add_batch_dim", "_backward", "_cufft", "_propagate_xla", "_remove_batch_dim",
    "_sparse", "_test_", "_validate_", "_wrapped_", "fbgemm_", "get_gradients",
    "quantized_",
)

# Schema type -> filler for the fallback; tensors are filled per dtype.
_FALLBACK_FILLERS: dict[str, Any] = {
    "Scalar": 1,
    "int": 0,
    "SymInt": 0,
    "float": 0.5,
    "bool": False,
    "ScalarType": torch.float32,
    "MemoryFormat": torch.contiguous_format,
}


def hand_samples(op: torch._ops.OpOverload) -> Iterator[Sample]:
    builder = HAND_SAMPLES.get(op.name())
    if builder is None:
        return
    for args, kwargs in builder():
        yield Sample(args, kwargs, describe_call(op, args, kwargs))


def fallback_samples(op: torch._ops.OpOverload) -> Iterator[Sample]:
    """Schema-driven samples: tensors plus simple fillers for the rest.

    Only for ops whose required arguments are all tensors or simple scalars
    (the float/int64 pair covers bitwise ops like aten::__and__).
    """
    if _short_name(op).startswith(_FALLBACK_SKIP_PREFIXES):
        return
    required = [a for a in op._schema.arguments if not a.has_default_value()]
    types = [str(a.type) for a in required]
    known = {"Tensor", "List[Tensor]", *_FALLBACK_FILLERS}
    if any(a.kwarg_only for a in required) or not set(types) <= known:
        return
    for dtype in (torch.float32, torch.int64):
        args = []
        for type_str in types:
            if type_str == "Tensor":
                args.append(_f(2, 3, dtype=dtype))
            elif type_str == "List[Tensor]":
                args.append([_f(2, 3, dtype=dtype)])
            else:
                args.append(_FALLBACK_FILLERS[type_str])
        yield Sample(tuple(args), {}, describe_call(op, tuple(args), {}))


# --------------------------------------------------------------------------
# OpInfo samples
# --------------------------------------------------------------------------


def _normalize(name: str) -> str:
    """'nn.functional.linear' -> 'linear', 'linalg.norm' -> 'linalg_norm'."""
    for prefix in ("torch.", "Tensor.", "nn.functional.", "_refs."):
        if name.startswith(prefix):
            name = name[len(prefix):]
    return name.replace(".", "_")


@functools.lru_cache(maxsize=None)
def opinfo_index() -> dict[str, tuple]:
    """aten packet name -> OpInfos that may exercise it.

    Imported lazily: torch.testing._internal.common_utils has import-time side
    effects (it freezes torch.backends flags and parses sys.argv).
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.testing._internal.common_methods_invocations import op_db

    index: dict[str, list] = {}
    for info in op_db:
        keys = {info.name, _normalize(info.name), info.aten_name,
                info.decomp_aten_name, info.aten_backward_name}
        keys |= {_normalize(alias.name) for alias in info.aliases}
        for variant in (info.method_variant, info.inplace_variant):
            keys.add(getattr(variant, "__name__", None))
        for key in keys - {None}:
            bucket = index.setdefault(key, [])
            if info not in bucket:
                bucket.append(info)
    return {k: tuple(v) for k, v in index.items()}


def opinfo_samples(op: torch._ops.OpOverload) -> Iterator[Sample]:
    """OpInfo samples, in float32 first, then float64 / int64."""
    for info in opinfo_index().get(_short_name(op), ()):
        supported = info.supported_dtypes("cpu")
        for dtype in (d for d in OPINFO_DTYPES if d in supported):
            try:
                generated = info.sample_inputs("cpu", dtype, requires_grad=False)
                for s in generated:
                    args = (s.input, *s.args)
                    yield Sample(args, dict(s.kwargs), describe_call(op, args, s.kwargs))
            except Exception:
                continue  # a broken sample generator only costs us samples


# --------------------------------------------------------------------------
# Empirical check
# --------------------------------------------------------------------------


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _storage_ptr(t: torch.Tensor) -> int | None:
    """Base pointer of a non-empty dense storage, else None."""
    if t.layout != torch.strided:
        return None
    try:
        storage = t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None
    # Zero-size storages may all share a null/static pointer.
    if storage.nbytes() == 0 or storage.data_ptr() == 0:
        return None
    return storage.data_ptr()


def _alias_kind(out: torch.Tensor, inp: torch.Tensor) -> str | None:
    if out is inp:
        return "returned an input itself"
    ptr = _storage_ptr(out)
    if ptr is not None and ptr == _storage_ptr(inp):
        return "output shares storage with an input"
    if out._base is not None and (out._base is inp or out._base is inp._base):
        return "output is a view of an input"
    if inp._base is not None and inp._base is out:
        return "output is the base of an input"
    return None


def _snapshot(t: torch.Tensor) -> tuple[int, torch.Tensor | None]:
    if t.layout != torch.strided:
        return t._version, None
    return t._version, t.detach().clone()


def _values_changed(t: torch.Tensor, before: torch.Tensor | None) -> bool:
    if before is None:
        return False
    if t.shape != before.shape or t.dtype != before.dtype:
        return True
    if t.is_floating_point() or t.is_complex():
        return not torch.allclose(t, before, rtol=0, atol=0, equal_nan=True)
    return not torch.equal(t, before)


def observe_call(op: torch._ops.OpOverload, sample: Sample) -> tuple[str, str]:
    """Run one sample; return (verdict, what) with verdict alias/mutates/clean.

    Raises whatever the op raises (callers skip rejected samples).
    """
    inputs = _tensors((sample.args, sample.kwargs))
    snapshots = [_snapshot(t) for t in inputs]
    result = op(*sample.args, **sample.kwargs)
    for out in _tensors(result):
        for inp in inputs:
            kind = _alias_kind(out, inp)
            if kind:
                return "alias", kind
    for inp, (version, before) in zip(inputs, snapshots):
        if inp._version != version:
            return "mutates", "bumped an input's version counter"
        if _values_changed(inp, before):
            return "mutates", "changed an input's values"
    return "clean", ""


def samples_for(op: torch._ops.OpOverload) -> Iterator[Sample]:
    """Hand-written samples first (they target no-op paths), then OpInfo,
    then schema-driven fillers for ops nothing else covers."""
    yield from hand_samples(op)
    yield from opinfo_samples(op)
    yield from fallback_samples(op)


def check_op(
    op: torch._ops.OpOverload,
    samples: Iterable[Sample] | None = None,
    max_samples: int = MAX_SAMPLES,
) -> Observation:
    """Run ``op`` on samples until it aliases/mutates or the caps are hit."""
    if samples is None:
        samples = samples_for(op)
    ran, clean_desc = 0, ""
    deadline = time.monotonic() + TIME_BUDGET_S
    # Seed for deterministic samples (and dropout masks) without disturbing
    # the caller's RNG state.
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        torch.manual_seed(0)
        warnings.simplefilter("ignore")
        for sample in itertools.islice(samples, MAX_TRIES):
            try:
                verdict, what = observe_call(op, sample)
            except Exception:
                continue  # the overload rejected this sample
            ran += 1
            if verdict != "clean":
                return Observation(verdict, f"{what} (sample: {sample.desc})", ran)
            clean_desc = clean_desc or sample.desc
            if ran >= max_samples or time.monotonic() > deadline:
                break
    if ran == 0:
        return Observation("untested", "no sample ran", 0)
    return Observation("clean", f"{ran} sample(s) clean, e.g. {clean_desc}", ran)


# --------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------


def audit_op(op: torch._ops.OpOverload, observation: Observation | None = None) -> AuditRecord:
    says, tagged = schema_says(op), is_tagged(op)
    if observation is None:
        # Mutating schemas (out=/in-place) mutate by design: nothing to learn.
        observation = (
            check_op(op) if says != "mutates"
            else Observation("untested", "not run: schema declares mutation", 0)
        )
    seen = observation.observed
    lied = seen in ("alias", "mutates")
    keep = says == "functional" and not tagged and not lied
    if keep:
        reason = "functional schema; " + (
            "samples clean" if seen == "clean" else "no sample ran"
        )
    elif says != "functional":
        reason = f"schema declares {'mutation' if says == 'mutates' else 'aliasing'}"
    elif tagged:
        reason = "tagged maybe_aliasing_or_mutating"
        if lied:
            reason += f"; {observation.detail}"
    else:
        reason = observation.detail
    return AuditRecord(op.name(), says, seen, tagged, "keep" if keep else "decompose", reason)


def run_audit(limit: int | None = None, progress: bool = False) -> list[AuditRecord]:
    ops = cia_overloads()
    if limit is not None:
        ops = ops[:limit]
    records = []
    with _no_test_function_lookup():
        for i, op in enumerate(ops):
            if progress:
                print(f"[{i + 1}/{len(ops)}] {op.name()}", file=sys.stderr, flush=True)
            records.append(audit_op(op))
    return records


@contextlib.contextmanager
def _no_test_function_lookup():
    """OpInfo's sample iterators look for the unittest test running them by
    crawling the stack (``inspect.stack()`` reads each frame's source: three
    quarters of the audit's time under pytest). The audit is no unittest
    test, so the lookup finds none; it is told so at once."""
    from torch.testing._internal import common_utils
    from torch.testing._internal.opinfo import core

    saved = common_utils.extract_test_fn, core.extract_test_fn
    common_utils.extract_test_fn = core.extract_test_fn = lambda: None
    try:
        yield
    finally:
        common_utils.extract_test_fn, core.extract_test_fn = saved


def summarize(records: list[AuditRecord]) -> dict:
    functional = [r for r in records if r.schema_says == "functional"]
    return {
        "cia_ops": len(records),
        "functional_schema": len(functional),
        "tested": sum(r.observed != "untested" for r in functional),
        "tagged": sorted(r.name for r in records if r.tagged),
        "liars": {r.name: r.reason for r in sorted(records, key=lambda r: r.name) if r.is_liar},
        "kept": sum(r.decision == "keep" for r in records),
    }


# --------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------


def _torch_version() -> str:
    return torch.__version__.split("+", 1)[0]


def render_json(records: list[AuditRecord]) -> str:
    summary = summarize(records)
    payload = {
        "torch_version": _torch_version(),
        "generated_by": "tools/audit_composites.py",
        "liars": summary["liars"],
        "tagged": summary["tagged"],
        "checked": summary["tested"],
        "functional_schema": summary["functional_schema"],
        "cia_ops": summary["cia_ops"],
    }
    return json.dumps(payload, indent=2, sort_keys=False) + "\n"


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown(records: list[AuditRecord]) -> str:
    s = summarize(records)
    liars = [r for r in records if r.is_liar]
    tagged = [r for r in records if r.tagged]
    kept = [r for r in records if r.decision == "keep"]
    lines = [
        "# CompositeImplicitAutograd audit",
        "",
        "Generated by `tools/audit_composites.py` (do not edit by hand). Regenerate with",
        "",
        "```",
        "python tools/audit_composites.py --write",
        "```",
        "",
        "CompositeImplicitAutograd (CIA) aten ops are either kept in exported graphs",
        "or decomposed. An op is kept only if its schema is truthful: no alias or",
        "mutation annotation, no `maybe_aliasing_or_mutating` tag, and, when run on",
        "sample inputs (hand-written no-op cases such as same dtype / train=False,",
        "then torch's OpInfo samples), no output aliasing an input and no input",
        "mutated. Ops whose schema claims functional but that alias or mutate at run",
        f"time are *liars*; they are listed in `predispatch/data/composite_audit-{RELEASE}.json`.",
        "",
        f"- torch version: {_torch_version()}",
        f"- CIA ops: {s['cia_ops']}",
        f"- functional schema: {s['functional_schema']} "
        f"(empirically tested: {s['tested']})",
        f"- tagged `maybe_aliasing_or_mutating`: {len(s['tagged'])}",
        f"- liars beyond the tagged ones: {len(s['liars'])}",
        f"- kept: {s['kept']}; every other CIA op is decomposed "
        "(ops whose schema declares alias/mutation are not listed below)",
        "",
        "| op | schema says | observed | tag | policy decision |",
        "| --- | --- | --- | --- | --- |",
    ]
    for group in (liars, tagged, kept):
        for r in group:
            tag = "yes" if r.tagged else ""
            decision = r.decision if r.decision == "keep" else f"decompose: {r.reason}"
            lines.append(
                f"| `{r.name}` | {r.schema_says} | {r.observed} | {tag} | {_md_cell(decision)} |"
            )
    return "\n".join(lines) + "\n"


def print_summary(records: list[AuditRecord], elapsed: float) -> None:
    s = summarize(records)
    print(f"CIA ops:                      {s['cia_ops']}")
    print(f"claim functional schema:      {s['functional_schema']}")
    print(f"  empirically tested:         {s['tested']}")
    print(f"tagged maybe_aliasing_or_mut: {len(s['tagged'])}")
    print(f"liars beyond the tagged ones: {len(s['liars'])}")
    for name, reason in s["liars"].items():
        print(f"  {name}: {reason}")
    print(f"kept: {s['kept']}   ({elapsed:.1f}s)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the JSON and markdown outputs")
    parser.add_argument("--limit", type=int, default=None, help="audit only the first N ops")
    parser.add_argument("--verbose", action="store_true", help="print each op as it is audited")
    opts = parser.parse_args(argv)
    if opts.write and opts.limit is not None:
        parser.error("--write needs the full audit; drop --limit")

    torch.set_num_threads(1)
    start = time.monotonic()
    records = run_audit(opts.limit, progress=opts.verbose)
    print_summary(records, time.monotonic() - start)
    if opts.write:
        JSON_PATH.parent.mkdir(parents=True, exist_ok=True)
        MD_PATH.parent.mkdir(parents=True, exist_ok=True)
        JSON_PATH.write_text(render_json(records))
        MD_PATH.write_text(render_markdown(records))
        print(f"wrote {JSON_PATH.relative_to(REPO)} and {MD_PATH.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
