"""What a trace depends on of a call: its inputs, grad mode, autocast state and the module's state.

Calls with equal :class:`CallKey` s share their traced graphs. A program
with dynamic shapes is traced once for all the sizes its ranges allow: the
key of that trace leaves the dynamic sizes out (:meth:`CallKey.generalized`).
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import operator

import torch
from torch.export.graph_signature import InputKind

from ... import _torch
from ...ir.program_meta import program_meta
from ...trace import input_aliasing
from .autocast import ambient_autocast


class CallNotSupportedError(RuntimeError):
    """A call the compiled module refuses, as ``ep.module()`` does.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(3, 2), (torch.ones(4, 3),))
        >>> predispatch.compile_training(ep)(torch.ones(4, 5))
        Traceback (most recent call last):
        ...
        predispatch.downstream.training.CallNotSupportedError: the compiled program cannot take these inputs: ...

    The message names the input (a size outside the program's shapes, a
    non-tensor input other than the exported value)."""


@dataclasses.dataclass(frozen=True)
class ProgramShapes:
    """The program's dynamic dimensions: per flat input, ``{dim: symbol name}``
    (empty where static), and each symbol's range ``(lower, upper or None)``."""

    dims: tuple
    ranges: dict

    @classmethod
    def of(cls, ep) -> ProgramShapes:
        values = {n.name: n.meta.get("val") for n in ep.graph.nodes if n.op == "placeholder"}
        dims = []
        for spec in ep.graph_signature.input_specs:
            if spec.kind == InputKind.USER_INPUT:
                val = values.get(getattr(spec.arg, "name", None))
                sizes = val.shape if isinstance(val, torch.Tensor) else ()
                dims.append({d: _torch.symbol_of(n) for d, n in enumerate(sizes) if _torch.symbol_of(n)})
        names = {name for d in dims for name in d.values()}
        return cls(tuple(dims), {name: _torch.value_range(ep.range_constraints, name) for name in names})


@dataclasses.dataclass(frozen=True)
class TensorInput:
    """What a trace depends on of a tensor input. ``autograd`` is
    ``(requires_grad, is_leaf)``: whether it requires grad decides what the
    backward saves (traced as requiring grad, an input would make autograd
    save a parameter the forward then updates under no_grad, which eager does
    not); whether it is a leaf matters for an input the program mutates (the
    history its write-back gets), and is True for the others. A symbolic
    trace's key has ``None`` for each dynamic size and for the strides
    (contiguous ones)."""

    shape: tuple
    stride: tuple | None
    dtype: torch.dtype
    device: torch.device
    autograd: tuple

    @classmethod
    def of(cls, t: torch.Tensor, mutated: bool) -> TensorInput:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device,
                   (t.requires_grad, t.is_leaf or not mutated))

    def example(self, hint: torch.Tensor) -> torch.Tensor:
        """A tensor for the trace, with the sizes and strides of ``hint`` (the call's)."""
        t = torch.empty_strided(hint.shape, hint.stride(), dtype=self.dtype, device=self.device)
        requires_grad, is_leaf = self.autograd
        t.requires_grad_(requires_grad)
        if is_leaf:
            return t
        with torch.enable_grad():
            return t.clone()


@dataclasses.dataclass(frozen=True)
class ConstantInput:
    """A non-tensor input, by type and value (Python has ``True == 1 == 1.0``)."""

    type: type
    value: object


@dataclasses.dataclass(frozen=True)
class CallKey:
    """Calls with equal keys share their traced graphs."""

    inputs: tuple  # per input leaf: a TensorInput or a ConstantInput
    grad_enabled: bool
    autocast: tuple  # the ambient autocast state, as sorted (device, dtype) pairs
    trainable: tuple  # which parameters and buffers require grad (frozen ones get no gradient output)
    state: tuple  # LiftedState: the traced function holds the tensors it lifted
    aliasing: tuple = ()  # shared_memory(leaves): a new pattern is checked against the export's

    @classmethod
    def of(cls, leaves: list, mutated: frozenset, grad_enabled: bool, state: LiftedState) -> CallKey:
        inputs = tuple(TensorInput.of(x, i in mutated) if isinstance(x, torch.Tensor)
                       else ConstantInput(type(x), x) for i, x in enumerate(leaves))
        tensors, trainable = state.read()
        return cls(inputs, grad_enabled, tuple(sorted(ambient_autocast().items())), trainable, tensors,
                   shared_memory(leaves))

    def generalized(self, leaves: list, shapes: ProgramShapes) -> CallKey:
        """The key of a trace for every size the program allows: its dynamic
        sizes left out, of the contiguous inputs (the others stay static)."""
        inputs = []
        for x, dims, leaf in zip(self.inputs, shapes.dims, leaves):
            if dims and isinstance(x, TensorInput) and leaf.is_contiguous():
                x = dataclasses.replace(x, shape=tuple(None if d in dims else n for d, n in enumerate(x.shape)),
                                        stride=None)
            inputs.append(x)
        return dataclasses.replace(self, inputs=tuple(inputs))

    @property
    def symbolic(self) -> bool:
        return any(isinstance(x, TensorInput) and x.stride is None for x in self.inputs)

    def constants(self) -> dict:
        return {i: x.value for i, x in enumerate(self.inputs) if isinstance(x, ConstantInput)}

    def examples(self, hints: list, shapes: ProgramShapes) -> list:
        """The trace's inputs, one per tensor input: fake tensors like the
        ``hints`` (a call's tensors), with the program's symbolic sizes where
        this key leaves them out, in a shape environment of their own (which
        inductor's FX graph cache needs, static sizes or not)."""
        tensors = [(x, dims) for x, dims in zip(self.inputs, shapes.dims) if isinstance(x, TensorInput)]
        examples = [x.example(hint) for (x, _), hint in zip(tensors, hints)]
        dims = [d if x.stride is None else {} for x, d in tensors]
        return _torch.symbolic_examples(examples, dims, shapes.ranges)


def shared_memory(leaves: list) -> tuple:
    """Which tensor inputs share memory with an earlier one: per input leaf,
    (that one's position, its own storage offset), or None. The traced
    graphs hold for the pattern of the export's example inputs only
    (``ep.module()`` checks it, ``input_aliasing``); a call of another
    pattern is checked as it would be (:meth:`CompiledTraining.variant`)."""
    first, pattern = {}, []
    for i, x in enumerate(leaves):
        key = _storage_of(x)
        pattern.append(None if key is None or key not in first else (first[key], x.storage_offset()))
        if key is not None:
            first.setdefault(key, i)
    return tuple(pattern) if any(p is not None for p in pattern) else ()


def _storage_of(x) -> int | None:
    if type(x) not in (torch.Tensor, torch.nn.Parameter):
        return None  # not a tensor, or a subclass (a DTensor's local shards are its own)
    storage = x.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else None


def aliasing_check(ep):
    """``ep.module()``'s checks of the memory a call's inputs share (a
    function of the flat input leaves), or None where it has none."""
    record = program_meta(ep)
    views, repeated, mutated = record.get("input_views", {}), record.get("repeated_inputs", {}), mutated_inputs(ep)
    if not repeated and not mutated:
        return None

    def check(leaves: list) -> None:
        if repeated:
            input_aliasing.check_inputs_repeated_as_exported(repeated, *leaves)
        if mutated:
            input_aliasing.check_inputs_alias_as_exported(views, sorted(mutated), *leaves)

    return check


def mutated_inputs(ep) -> frozenset:
    """Positions, among the flat user inputs, of those the program mutates."""
    sig = ep.graph_signature
    names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    mutated = set(sig.user_inputs_to_mutate.values())
    return frozenset(i for i, name in enumerate(names) if name in mutated)


_not_none = functools.partial(operator.is_not, None)


class LiftedState:
    """What a trace assumes of the tensors it lifts (the parameters and
    buffers): which tensors they are (it holds them), their metadata, and
    which require grad; read per call from the tables that hold them."""

    def __init__(self, module: torch.nn.Module):
        # each submodule's (shared ones once), in modules() order: read per call,
        # they show a tensor replaced without walking the module tree again
        self.tables = [table for m in module.modules() for table in _torch.state_tables(m)]

    def tensors(self) -> list:
        """The tensors, in the tables' order (C loops: this runs each call)."""
        return list(filter(_not_none, itertools.chain.from_iterable(map(dict.values, self.tables))))

    def read(self) -> tuple[tuple, tuple]:
        """(the tensors and their metadata, which require grad)."""
        tensors = self.tensors()
        return (tuple((id(t), t.dtype, t.device, t.shape) for t in tensors),
                tuple(t.requires_grad for t in tensors))
