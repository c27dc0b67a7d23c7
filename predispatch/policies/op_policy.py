"""Which CompositeImplicitAutograd ops survive tracing, and why.

    >>> policy = OpPolicy.default()
    >>> policy.explain(torch.ops.aten.linear.default)
    'aten::linear: kept (a truthful aten composite: functional schema, not tagged, audit clean)'
    >>> policy.explain(torch.ops.aten.reshape.default)
    'aten::reshape: decomposed (its schema declares an alias or a mutation)'

A policy is a frozen value: ``keep`` and ``decompose`` return new policies.
The decision is one ordered rule table (``_RULES``); the first rule that
applies decides.

``keep``, ``decompose`` and ``explain`` take an overload or a packet; as in
torch's decomposition tables, a packet (``torch.ops.aten.to``) means each of
its overloads, judged one by one (``explain`` gives a line per overload).
"""
from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources

import torch

from .. import _torch

_AUDIT_FILE = f"composite_audit-{_torch.RELEASE}.json"  # the audit of the installed torch release


@functools.lru_cache(maxsize=1)
def audited_liars() -> dict[str, str]:
    """Ops whose schema claims to be functional but that the composite audit
    (tools/audit_composites.py, run on each supported torch release) saw
    aliasing or mutating: name -> evidence."""
    text = resources.files("predispatch").joinpath("data", _AUDIT_FILE).read_text()
    return dict(json.loads(text)["liars"])


def _declares_alias_or_mutation(op) -> bool:
    schema = op._schema
    return schema.is_mutable or any(
        a.alias_info is not None for a in (*schema.arguments, *schema.returns)
    )


def _tagged_liar(op) -> bool:
    return torch.Tag.maybe_aliasing_or_mutating in op.tags


@dataclasses.dataclass(frozen=True)
class OpPolicy:
    """Which CompositeImplicitAutograd ops a program keeps whole.

        >>> policy = predispatch.OpPolicy.default()
        >>> print(policy.explain(torch.ops.aten.linear.default))
        aten::linear: kept (a truthful aten composite: functional schema, not tagged, audit clean)
        >>> print(policy.explain(torch.ops.aten.type_as.default))
        aten::type_as: decomposed (the composite audit saw it alias or mutate although its schema says it does not)
        >>> policy = policy.decompose(torch.ops.aten.linear.default)
        >>> ep = predispatch.export_predispatch(torch.nn.Linear(2, 2), (torch.ones(1, 2),), op_policy=policy)
        >>> [n.target.__name__ for n in ep.graph.nodes if n.op == "call_function"]
        ['t.default', 'addmm.default']

    The default keeps an ``aten`` composite whose schema is functional and
    truthful (not tagged ``maybe_aliasing_or_mutating``, and clean in the
    audit of every aten composite, ``tools/audit_composites.py``), and
    decomposes every other composite. :meth:`keep` and :meth:`decompose`
    return a new policy; keeping an op whose schema lies is refused with
    ``ValueError``. design/op-policy.md has the rules."""

    kept: frozenset = frozenset()
    decomposed: frozenset = frozenset()

    @classmethod
    def default(cls) -> "OpPolicy":
        """The policy ``export_predispatch`` uses when given none."""
        return cls()

    def keep(self, op) -> "OpPolicy":
        """A policy that also keeps ``op`` (an overload, or every overload of a
        packet): e.g. your library's fused op, ``torch.ops.mylib.fused``."""
        ops = _overloads(op)
        for o in ops:
            # A non-composite is traced as itself whatever the policy says, so
            # only a composite's lie could hide behind a kept node.
            lie = _liar_reason(o) if _torch.has_composite_implicit_kernel(o) else None
            if lie is not None:
                raise ValueError(f"cannot keep {o.name()}: {lie}; keeping it would let an "
                                 "alias or a mutation hide behind a functional-looking node")
        return dataclasses.replace(self, kept=self.kept | ops, decomposed=self.decomposed - ops)

    def decompose(self, op) -> "OpPolicy":
        """A policy that decomposes ``op`` (an overload, or every overload of a packet)."""
        ops = _overloads(op)
        return dataclasses.replace(self, decomposed=self.decomposed | ops, kept=self.kept - ops)

    def explain(self, op) -> str:
        """What this policy does to ``op`` (each overload of a packet) and why."""
        lines = []
        for o in sorted(_overloads(op), key=lambda o: o.name()):
            decision, why = self.decide(o)
            verb = {True: "decomposed", False: "kept", None: "traced as itself"}[decision]
            lines.append(f"{o.name()}: {verb} ({why})")
        return "\n".join(lines)

    def should_decompose(self, op) -> bool | None:
        """True/False for a composite; None for an op that is not one (torch decides)."""
        return self.decide(op)[0]

    @functools.lru_cache(maxsize=4096)
    def decide(self, op) -> tuple[bool | None, str]:
        for applies, decision, why in _RULES:
            if applies(self, op):
                return decision, why
        raise AssertionError("the last rule always applies")


def _in_dispatcher(op) -> bool:
    """False for TorchScript-only overloads (``aten::add.t``, even ``aten.add.default``):
    the dispatcher does not know them, so no traced graph can call them."""
    return _torch.known_to_dispatcher(op)


def _overloads(op) -> frozenset:
    """The overloads ``op`` stands for: itself, or each dispatcher overload of a packet."""
    if isinstance(op, _torch.OpOverloadPacket):
        overloads = (getattr(op, name) for name in op.overloads())
        ops = frozenset(o for o in overloads if _in_dispatcher(o))
        if not ops:
            raise ValueError(f"{op} has no overload the dispatcher knows (TorchScript-only op)")
        return ops
    if not isinstance(op, _torch.OpOverload):
        raise ValueError("expected an op overload (torch.ops.aten.linear.default) or a packet "
                         f"(torch.ops.aten.linear, meaning each of its overloads), got {op!r}")
    if not _in_dispatcher(op):
        choices = ", ".join(sorted(str(o) for o in _overloads(op.overloadpacket)))
        raise ValueError(f"{op} is a TorchScript-only overload that no traced graph calls; "
                         f"choose one of {choices}, or pass the packet {op.overloadpacket}")
    return frozenset({op})


def _liar_reason(op) -> str | None:
    if _declares_alias_or_mutation(op):
        return "its schema declares an alias or a mutation"
    if _tagged_liar(op):
        return "it is tagged maybe_aliasing_or_mutating"
    if op.name() in audited_liars():
        return f"the composite audit saw it alias or mutate ({audited_liars()[op.name()]})"
    return None


def _is_aten(op) -> bool:
    return op.namespace in ("aten", "prim")


# (applies(policy, op), decision, reason): decision True = decompose.
_RULES = (
    (lambda p, op: not _torch.has_composite_implicit_kernel(op), None,
     "not a CompositeImplicitAutograd op"),
    (lambda p, op: _declares_alias_or_mutation(op), True,
     "its schema declares an alias or a mutation"),
    (lambda p, op: _tagged_liar(op), True, "tagged maybe_aliasing_or_mutating"),
    (lambda p, op: op.name() in audited_liars(), True,
     "the composite audit saw it alias or mutate although its schema says it does not"),
    (lambda p, op: op in p.decomposed, True, "decomposed by this policy"),
    (lambda p, op: op in p.kept, False, "kept by this policy"),
    (lambda p, op: _is_aten(op), False,
     "a truthful aten composite: functional schema, not tagged, audit clean"),
    (lambda p, op: True, True, "a non-aten composite: decomposed unless the policy keeps it"),
)
