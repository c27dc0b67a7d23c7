"""What an op's backward saves, for the history stage's refusal of updates of saved memory.

An update through a ``set_()`` of memory an op saved for backward makes
eager's backward read the updated values (set_ shares no version counter),
which no program can reproduce: the history stage refuses it where the op's
backward does read what was updated. torch's derivatives.yaml says what
each aten op saves (``_torch.saved_for_backward``); the rows here are what it
does not say.
"""
from __future__ import annotations

from ... import _torch

# ops autograd knows without a derivatives.yaml formula, whose backward saves no tensor:
# copy (its gradient is grad, cast; copy_'s is written by hand), the *_like factories
# (no gradient reaches their input)
_SAVE_NOTHING = frozenset({"copy", "full_like", "zeros_like", "ones_like", "empty_like", "rand_like",
                           "randn_like", "randint_like"})

def _saves_nothing(op) -> bool:
    """predispatch's own ops, and the ops of ``_SAVE_NOTHING``."""
    return getattr(op, "namespace", None) == "predispatch" or _torch.op_overload_name(op) in _SAVE_NOTHING


def saves_its_result(op) -> bool:
    """Does ``op``'s backward read its own output (``relu``, ``exp``)? True
    where unknown (a composite, a higher-order op, an op of another library)."""
    if _saves_nothing(op):
        return False
    saved = _torch.saved_for_backward(op)
    return True if saved is None else saved[1]


def saves_its_input(op, position: int | None) -> bool:
    """Does ``op``'s backward read the tensor it takes at positional
    ``position`` (``mul`` its factors; ``add`` none)? True where unknown."""
    if _saves_nothing(op):
        return False
    saved = _torch.saved_for_backward(op)
    schema = getattr(op, "_schema", None)
    if saved is None or position is None or schema is None or position >= len(schema.arguments):
        return True
    return schema.arguments[position].name in saved[0]
