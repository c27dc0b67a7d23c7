"""What a trace depends on of a call: its inputs, grad mode, autocast state and the module's state.

Calls with equal :class:`CallKey` s share their traced graphs.
"""
from __future__ import annotations

import dataclasses
import itertools

import torch
from torch.export.graph_signature import InputKind

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
class TensorInput:
    """What a trace depends on of a tensor input. ``autograd`` is
    ``(requires_grad, is_leaf)``: whether it requires grad decides what the
    backward saves (traced as requiring grad, an input would make autograd
    save a parameter the forward then updates under no_grad, which eager does
    not); whether it is a leaf matters for an input the program mutates (the
    history its write-back gets), and is True for the others."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    autograd: tuple

    @classmethod
    def of(cls, t: torch.Tensor, mutated: bool) -> TensorInput:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device,
                   (t.requires_grad, t.is_leaf or not mutated))

    def example(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
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
    trainable: tuple  # which parameters require grad (frozen ones get no gradient output)
    state: tuple  # lifted_state: the traced function holds the tensors it lifted

    @classmethod
    def of(cls, leaves: list, mutated: frozenset, grad_enabled: bool, module) -> CallKey:
        inputs = tuple(TensorInput.of(x, i in mutated) if isinstance(x, torch.Tensor)
                       else ConstantInput(type(x), x) for i, x in enumerate(leaves))
        return cls(inputs, grad_enabled, tuple(sorted(ambient_autocast().items())),
                   tuple(p.requires_grad for p in module.parameters()), lifted_state(module))

    def constants(self) -> dict:
        return {i: x.value for i, x in enumerate(self.inputs) if isinstance(x, ConstantInput)}

    def examples(self) -> list[torch.Tensor]:
        return [x.example() for x in self.inputs if isinstance(x, TensorInput)]


def mutated_inputs(ep) -> frozenset:
    """Positions, among the flat user inputs, of those the program mutates."""
    sig = ep.graph_signature
    names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    mutated = set(sig.user_inputs_to_mutate.values())
    return frozenset(i for i, name in enumerate(names) if name in mutated)


def lifted_state(module: torch.nn.Module) -> tuple:
    """What a trace assumes of the tensors it lifts (the parameters and
    buffers): which tensors they are (it holds them), and their metadata."""
    return tuple((id(t), t.dtype, t.device, t.shape)
                 for t in itertools.chain(module.parameters(), module.buffers()))
