"""A script object's (torchbind's) method returning a Python value: refused while traced.

The trace runs such a method on the object's fake, whose Python value (a
queue's size) no op computes: the program would keep the example's value
for every call.
"""
from __future__ import annotations

from ... import _torch
from ...errors import ExportError, user_location


VALUE_RETURNED = ("returns a Python value of a script object (torchbind) and cannot be exported soundly: "
                  "the trace reads it off the example's object, and the program would keep that value for "
                  "every call; return a tensor instead")


def is_python_value(value) -> bool:
    """A plain int, float, bool or string: a constant of the trace, not a value the program computes."""
    return isinstance(value, (bool, int, float, str))


def python_values_refused():
    """While the forward is traced: a method of a script object returning a Python value, refused."""
    def check(method: str, result) -> None:
        if any(is_python_value(v) for v in _torch.pytree.tree_leaves(result)):
            raise ExportError(f"the script object's method {method}() at {user_location()} {VALUE_RETURNED}")

    return _torch.script_object_method_results(check)
