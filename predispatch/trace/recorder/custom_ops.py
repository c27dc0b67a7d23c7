"""Custom ops kept whole that return an alias of their input: refused.

Custom ops kept whole that alias their input: functionalization cannot
trace one whose schema says it returns an alias, and one that returns an
alias although its schema says otherwise would hide it from the program.
Both refused, naming the op and what to do instead."""
from __future__ import annotations

import contextlib

from ... import _torch
from ...errors import ExportError, user_location

_TORCH_LIBRARIES = ("aten", "prim", "prims")


def is_custom_op(func) -> bool:
    """Is ``func`` an op of another library than torch's own?"""
    library = _torch.op_library(func)
    return library is not None and library not in _TORCH_LIBRARIES


@contextlib.contextmanager
def alias_annotations_explained(func):
    """A custom op whose schema declares an alias, refused by functionalization
    inside the block: its error told in the user's terms."""
    try:
        yield
    except RuntimeError as e:
        if is_custom_op(func) and "alias annotations" in str(e):
            raise ExportError(
                f"{func} at {user_location()} returns an alias of its input (its schema says "
                "so): functionalization cannot trace a custom op that does; return a new "
                "tensor, or write the op's body in aten ops") from e
        raise


def refuse_hidden_alias(func, args, kwargs, out) -> None:
    """A custom op kept whole that returns an alias of an input although its
    schema says it makes a new tensor: the program would not see the alias
    (aten's liars are found by tools/audit_composites.py and never kept)."""
    if not is_custom_op(func):
        return
    inputs = [t for t in _torch.pytree.tree_leaves((args, kwargs)) if isinstance(t, _torch.FunctionalTensor)]
    for o in _torch.pytree.tree_leaves(out):
        if isinstance(o, _torch.FunctionalTensor) and _torch.hides_an_alias(o, inputs):
            raise ExportError(
                f"{func} returned an alias of its input although its schema says it returns a "
                f"new tensor, at {user_location()} (as traced: where the op has a fake kernel, "
                f"register_fake, that is the kernel returning its input): the program would not see "
                f"the alias; {_what_to_do(func)}")


def _what_to_do(func) -> str:
    overload = func if isinstance(func, _torch.OpOverload) else getattr(func, "default", None)
    if isinstance(overload, _torch.OpOverload) and _torch.has_composite_implicit_kernel(overload):
        # kept whole, or decomposed and an op it calls is the liar
        return ("where the op policy keeps it whole, decompose it (OpPolicy.decompose); where it is decomposed, "
                "an op it calls returns the alias: declare the alias in that op's schema (Tensor(a) -> "
                "Tensor(a)), or return a clone")
    return ("declare the alias in its schema (Tensor(a) -> Tensor(a)), or return a clone (from the fake "
            "kernel too, where the real one makes a new tensor)")
