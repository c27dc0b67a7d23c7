"""The autocast a program was exported under, checked at each call.

Autocast the caller has on while a module is exported applies to the traced
ops below the trace: the graph holds the ops, not the casts, so at run time
they follow the caller's autocast as eager's do. But a Python decision the
forward made on a dtype autocast gave (a buffer rebound to ``x.dtype``, a
``.to()`` taken or skipped) is baked in: where the forward read a dtype
under that autocast, the program computes what eager computes only under it,
and ``ep.module()`` says so when called under another, rather than return
another result (or fail on a dtype mismatch deep inside). A forward that
reads no dtype is not checked.

A cast the forward took or skipped under no autocast is guarded where it
is: torch.export's guard before each ``.to()`` (``_assert_tensor_metadata``)
runs as :func:`dtype_guard`, which says which line's cast the call breaks
and why (an autocast the program was not exported under) rather than
torch's bare dtype mismatch.
"""
from __future__ import annotations

import torch

from .. import _torch
from ..errors import node_location


class AutocastCallError(RuntimeError):
    """A call ``ep.module()`` refuses: under its autocast (or with its
    dtypes) the program would compute otherwise than eager."""


def current_autocast() -> dict[str, str]:
    """device -> autocast dtype name, where autocast is on."""
    return {d: str(torch.get_autocast_dtype(d)).removeprefix("torch.")
            for d in _torch.autocast_devices() if torch.is_autocast_enabled(d)}


def _described(state: dict) -> str:
    return " and ".join(f"torch.autocast({d!r}, dtype=torch.{t})" for d, t in sorted(state.items())) or "no autocast"


def check_ambient_autocast(exported: dict) -> None:
    now = current_autocast()
    if now != exported:
        raise AutocastCallError(
            f"this program was exported under {_described(exported)}, and its forward read a "
            "dtype autocast gave (a branch on it, a cast to it, such as a buffer rebound to an "
            f"activation's dtype): the program took that autocast's decision. Called under "
            f"{_described(now)}, it would compute otherwise than eager; call it under the same "
            "autocast, or export the module outside autocast (an autocast block inside the "
            "module's forward is a region the program runs under at every call)")


_torch.mark_side_effectful(check_ambient_autocast)


def check_ambient_autocast_at_calls(unlifted: torch.fx.GraphModule, exported: dict | None) -> None:
    """``ep.module()`` of a program exported under ``exported`` first checks the caller's autocast."""
    if not exported:
        return
    graph = unlifted.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    with graph.inserting_after(inputs[-1]) if inputs else graph.inserting_before(next(iter(graph.nodes))):
        graph.call_function(check_ambient_autocast, (dict(exported),))
    unlifted.recompile()


def dtype_guard(node: torch.fx.Node, exported: dict | None, emit: bool = True):
    """The guard ``node`` (torch.export's ``_assert_tensor_metadata`` before a
    ``.to()``, of a program exported under autocast ``exported``) as a
    function: a tensor of another dtype than traced raises
    :class:`AutocastCallError` naming the cast's line. ``emit``: then call the
    op itself (a re-export records it again); ``emit=False``: the check only,
    for a trace that specializes on the call's dtypes (compile_training's)."""
    where = node_location(node.meta.get("stack_trace")) or node.name
    exported = dict(exported or {})

    def guard(t, size=None, stride=None, dtype=None, *, device=None, layout=None):
        if dtype is not None and t.dtype != dtype:
            raise AutocastCallError(_dtype_changed(where, dtype, t.dtype, exported))
        if emit:
            _torch.ASSERT_TENSOR_METADATA_BINDING(t, size, stride, dtype, device=device, layout=layout)

    guard.__name__ = "dtype_guard"
    return guard


def _dtype_changed(where: str, traced: torch.dtype, now: torch.dtype, exported: dict) -> str:
    found = current_autocast()
    why = (f"this call runs under {_described(found)}, the program was exported under {_described(exported)}: "
           "a cast taken or skipped for the exported dtypes is not in the program as eager would run it now. "
           "Call it under the autocast it was exported under, or export under the autocast you call it with"
           if found != exported else "call it with inputs of the dtypes it was exported with")
    return (f"the program's cast at {where} was traced for a {str(traced).removeprefix('torch.')} tensor; "
            f"this call gives it {str(now).removeprefix('torch.')}: {why}")
