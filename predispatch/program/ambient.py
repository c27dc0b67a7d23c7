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
"""
from __future__ import annotations

import torch

from .. import _torch


def current_autocast() -> dict[str, str]:
    """device -> autocast dtype name, where autocast is on."""
    return {d: str(torch.get_autocast_dtype(d)).removeprefix("torch.")
            for d in _torch.autocast_devices() if torch.is_autocast_enabled(d)}


def _described(state: dict) -> str:
    return " and ".join(f"torch.autocast({d!r}, dtype=torch.{t})" for d, t in sorted(state.items())) or "no autocast"


def check_ambient_autocast(exported: dict) -> None:
    now = current_autocast()
    if now != exported:
        raise RuntimeError(
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
