"""In-place ops that functionalization alone turns into the wrong data flow.

Functionalization replaces ``t.op_(...)`` by ``op``'s functional variant and
rebinds ``t`` to its result. For most ops that is eager's value and eager's
autograd history. For the ops of the table below it is not, and they are
traced as eager's autograd sees them instead: the out-of-place result
written into ``t`` with ``t.copy_(result)``, whose functional form (see
:mod:`predispatch.passes.writes`) gives ``t`` the result's value, a zero gradient
to what ``t`` was, and the result's own history.

Rule, and why (each row a predicate on the in-place op):

* **no functionalization kernel** (``polygamma_``: its out-of-place form takes
  its arguments in another order, so torch's codegen skipped it and the
  fallback raises on the alias annotation);
* **composite out-of-place form** (``conj_physical_``): the functional variant
  functionalization emits is a composite the op policy decomposes when it is
  called directly, so a re-export of the program would trace something else;
* **result without a gradient path to ``t``** that eager's in-place op still
  records as a history with a zero gradient: comparisons (a bool result,
  cast back) and random fills (``normal_functional`` has no derivative at
  all, so ``t`` goes in detached: a draw reads its shape only). Eager's node
  also gives every other tensor operand a zero gradient (not none): each is
  linked by ``where(False, operand, result)``;
* **not recorded by autograd at all** (logical ops: non-differentiable, the
  tensor keeps its old history): traced under no_grad, like any update eager
  does not record;
* **a resize past the storage's end**: the tensor moves to a grown copy
  (see :class:`GrowingResize`).

A random fill draws into ``t`` in its memory order. Its functional variant
draws into a result laid out as ``t``, the same numbers at each place (and
through the same kernel: CPU's ``normal_`` has a faster path for contiguous
memory that draws other numbers), except ``bernoulli.p``, which draws into
a contiguous result, other numbers at each place where ``t`` is laid out
otherwise (dropout of a transpose): that draw is made on ``t`` permuted
into memory order, in every grad mode.

The history rows apply in grad mode only.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import _torch
from ..errors import ExportError, user_location

aten = torch.ops.aten

# comparisons in place: a bool result, cast back; eager records EqBackward & co.
_COMPARISONS = frozenset({"eq_", "ne_", "lt_", "le_", "gt_", "ge_"})
# logical ops in place: non-differentiable, so eager records nothing at all
_UNRECORDED = frozenset({"logical_and_", "logical_or_", "logical_xor_", "logical_not_"})
# in-place random fills: the draw reads the tensor's shape, not its values
_DRAWS = frozenset({"normal_", "uniform_", "bernoulli_", "exponential_", "cauchy_",
                    "geometric_", "log_normal_", "random_"})
# of those, the fills whose functional variant draws into a contiguous result (see above)
_CONTIGUOUS_DRAWS = frozenset({"bernoulli_"})


@dataclasses.dataclass(frozen=True)
class OutOfPlace:
    """``self.copy_(functional(...))`` for an in-place op."""

    functional: _torch.OpOverload
    for_history: bool  # a row of the history kind (see the module docstring)
    random: bool  # a draw: ``self`` gives its shape, not a history
    contiguous: bool = False  # a draw into a contiguous result, made in ``self``'s memory order

    def __call__(self, dispatch, op, args, kwargs):
        """Trace it with ``dispatch(func, args, kwargs)`` (the functional mode's)."""
        named = _by_name(op, args, kwargs)
        target = named["self"]
        order = memory_order(target) if self.contiguous else None
        if self.random:
            named["self"] = dispatch(aten.detach.default, (target,), {})
        if order is not None:  # drawn in memory order (bernoulli.p's result is contiguous)
            named["self"] = dispatch(aten.permute.default, (named["self"], order), {})
        schema = self.functional._schema.arguments
        result = dispatch(self.functional,
                          tuple(named[a.name] for a in schema if not a.kwarg_only and a.name in named),
                          {a.name: named[a.name] for a in schema if a.kwarg_only and a.name in named})
        if order is not None:
            result = dispatch(aten.permute.default, (result, [order.index(d) for d in range(len(order))]), {})
        if self.for_history:  # eager's node has a zero gradient for each tensor operand too
            for operand in [v for k, v in named.items() if k != "self" and _differentiable(v)]:
                false = dispatch(aten.scalar_tensor.default, (False,),
                                 {"dtype": torch.bool, "device": operand.device})
                result = dispatch(aten.where.self, (false, operand, result), {})
        dispatch(aten.copy_.default, (target, result), {})
        return target


@dataclasses.dataclass(frozen=True)
class Unrecorded:
    """An in-place op eager's autograd does not record (the tensor keeps the
    history it had): traced under no_grad, so a grad mode region holds it and
    later reads keep the old history (see :mod:`predispatch.passes.history`)."""

    for_history = True

    def __call__(self, dispatch, op, args, kwargs):
        with torch.no_grad():
            return dispatch(op, args, kwargs)


def memory_order(t) -> list[int] | None:
    """The permutation that lays ``t``'s dims out in memory order, where it
    is not the identity: eager's in-place draw fills ``t`` in memory order,
    and a functional variant may draw into a contiguous result instead
    (``bernoulli.p``), other numbers at each place. None where ``t`` is
    contiguous or its strides are symbolic. (The strides' order is looked
    at first: where it is the identity the answer is None whatever
    ``is_contiguous()`` says, which with a symbolic size is a sympy
    evaluation, traced, of about a thousand calls.)"""
    strides = t.stride()
    if not all(isinstance(s, int) for s in strides):
        return None
    order = sorted(range(t.dim()), key=lambda d: -strides[d])
    if order == list(range(t.dim())) or t.is_contiguous():
        return None
    return order


def _by_name(op, args, kwargs) -> dict:
    """The call's arguments by name, defaults filled in (the functional
    variant may make an argument required that the in-place op defaults)."""
    named = dict(zip((a.name for a in op._schema.arguments), args)) | dict(kwargs)
    for a in op._schema.arguments:
        if a.name not in named and a.has_default_value():
            named[a.name] = a.default_value
    return named


@dataclasses.dataclass(frozen=True)
class GrowingResize:
    """``t.resize_(size)`` past the end of ``t``'s storage (functionalization
    cannot grow one): ``t`` moves to a new storage holding its old elements
    first, as eager's reallocation does; the new ones are uninitialized in
    eager (zeros here). Within its storage, a resize is left as it is.
    Refused where other tensors share the storage (a view of it, its base):
    eager grows the memory they all read, the move would leave them behind."""

    for_history = False

    def __call__(self, dispatch, op, args, kwargs):
        named = _by_name(op, args, kwargs)
        target, size = named["self"], named["size"]
        if list(size) == list(target.shape) and named.get("memory_format") is None:
            return target  # eager's resize_ to the sizes it has is no op (functionalization's lays it out anew)
        numel = 1
        for n in size:
            numel *= n
        have = _torch.storage_elements(target)
        if numel <= have:
            return dispatch(op, args, kwargs)
        if _torch.storage_shared(target):
            raise ExportError(
                f"resize_ at {user_location()} grows memory other tensors share (a view of the tensor, or "
                "the tensor it views): eager grows it under all of them, which a program, giving the "
                "resized tensor memory of its own, cannot reproduce; resize a clone, or one whose memory "
                "is its own")
        flat = dispatch(aten.as_strided.default, (target, [have], [1], 0), {})
        grown = dispatch(aten.constant_pad_nd.default, (flat, [0, numel - have]), {})
        new = dispatch(aten.view.default, (grown, list(size)), {})
        out = dispatch(aten.set_.source_Tensor, (target, new), {})
        _torch.sync_wrapper_layout(target)  # its size as Python reads it (y.shape, numel()): the new one
        return out


class ResizeToTemplate:
    """``t.resize_as_(template)``: ``t.resize_(template.shape)``, whose
    rule grows ``t`` past its storage (:class:`GrowingResize`)."""

    for_history = False

    def __call__(self, dispatch, op, args, kwargs):
        named = _by_name(op, args, kwargs)
        return dispatch(aten.resize_.default, (named["self"], list(named["the_template"].shape)),
                        {k: v for k, v in kwargs.items() if k == "memory_format"})


def _differentiable(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def traced_as(op, grad_enabled: bool, target=None) -> OutOfPlace | Unrecorded | GrowingResize | ResizeToTemplate | None:
    """How the in-place ``op`` is traced (on ``target``), when not by
    functionalization alone. The history rows apply in grad mode only (under
    no_grad an update keeps the old history anyway: see
    :mod:`predispatch.passes.history`), but for a draw into a tensor not laid
    out contiguously, drawn in its memory order in every mode."""
    rule = _rule(op)
    if rule is None:
        return None
    if rule.for_history and not grad_enabled and not (
            getattr(rule, "random", False) and memory_order(target) is not None):
        return None
    return rule


@functools.lru_cache(maxsize=None)
def _rule(op) -> OutOfPlace | Unrecorded | GrowingResize | ResizeToTemplate | None:
    if not (isinstance(op, _torch.OpOverload) and op.namespace == "aten"
            and torch.Tag.inplace in op.tags):
        return None
    name = op._schema.name.split("::")[1]
    if name in _UNRECORDED:
        return Unrecorded()
    if op is aten.resize_.default:
        return GrowingResize()
    if op is aten.resize_as_.default:
        return ResizeToTemplate()
    if torch.Tag.inplace_view in op.tags:
        return None  # another layout (swapdims_, a composite of transpose_): never a copy of another shape
    random, contiguous = name in _DRAWS, name in _CONTIGUOUS_DRAWS
    functional = _functional_variant(op)
    if functional is None:
        return None
    if not _torch.has_own_functionalization_kernel(op) or _torch.has_composite_implicit_kernel(functional):
        return OutOfPlace(functional, for_history=False, random=random, contiguous=contiguous)
    if name in _COMPARISONS or random:
        return OutOfPlace(functional, for_history=True, random=random, contiguous=contiguous)
    return None


def _functional_variant(op) -> _torch.OpOverload | None:
    """The out-of-place op taking the same arguments and mutating none: by
    name and type (``ge_.Scalar``: ``ge.Scalar``, not ``ge.Tensor``), else by
    name only."""
    name = op._schema.name.split("::")[1].rstrip("_")
    candidates = [getattr(packet, overload) for packet in
                  filter(None, (getattr(aten, n, None) for n in (name, f"{name}_functional")))
                  for overload in packet.overloads()]
    candidates = [c for c in candidates if not c._schema.is_mutable]
    for arguments in (_named_and_typed, _named):
        wanted = arguments(op)
        found = next((c for c in candidates if arguments(c) == wanted), None)
        if found is not None:
            return found
    return None


def _named(op) -> set:
    return {a.name for a in op._schema.arguments}


def _named_and_typed(op) -> set:
    return {(a.name, str(a.type)) for a in op._schema.arguments}
