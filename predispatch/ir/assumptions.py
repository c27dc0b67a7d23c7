"""The data-dependent branches a program assumes: the record, its run-time message, reading it back.

Exported with ``data_dependent="specialize"``, a program takes the branches
its example's data took (``if mask.all():``, ``x.item() > 0``, a loop over
``nonzero()``); each is an :class:`Assumption`, kept in the program's record
(:mod:`predispatch.ir.program_meta`) and checked when the program runs by an
``aten._assert_scalar`` whose message :func:`run_time_message` writes.
"""
from __future__ import annotations

import dataclasses

from .program_meta import program_meta

META_FIELD = "data_dependent_assumptions"


@dataclasses.dataclass(frozen=True)
class Assumption:
    """At ``where`` (the user's ``file:line in function``), running ``code``,
    the example's data made ``condition`` (over ``u0``, ``u1``, ...: values
    read from tensors) equal ``value``."""

    where: str
    code: str
    condition: str
    value: str

    def describe(self) -> str:
        return f"{self.where}: `{self.code}` took {self.condition} == {self.value}"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> "Assumption":
        return cls(**data)


_MESSAGE_START = "data-dependent branch: "


def is_run_time_message(message: str) -> bool:
    """A check :func:`run_time_message` wrote (met again when ``ep.module()`` is exported)."""
    return message.startswith(_MESSAGE_START)


def run_time_message(assumptions: list[Assumption]) -> str:
    """What a program says when a call's data would take another branch."""
    return (_MESSAGE_START + "this call's data takes another branch than the example the program "
            "was exported with (data_dependent='specialize') took at "
            + "; and at ".join(a.describe() for a in assumptions)
            + " (u0, u1, ...: values read from tensors there)")


def assumptions(ep_or_gm) -> list[Assumption]:
    """The data-dependent branches a program assumes (none where it was
    exported refusing them, the default)."""
    return [Assumption.from_json(a) for a in program_meta(ep_or_gm).get(META_FIELD, [])]
