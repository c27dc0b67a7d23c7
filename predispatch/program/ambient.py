"""The autocast a program was exported under, checked at each call.

Autocast the caller has on while a module is exported applies to the traced
ops below the trace: the graph holds the ops, not the casts, yet every dtype
the trace saw (and every Python decision made on one: a buffer rebound to
``x.dtype``, a ``.to()`` skipped) is autocast's. Such a program computes what
eager computes only under that same autocast; ``ep.module()`` says so when
called under another, rather than return another result (or fail on a
dtype mismatch deep inside).
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
            f"this program was exported under {_described(exported)}, which applied to its ops "
            "without being recorded: its dtypes (and any branch the module took on one, such as a "
            f"buffer rebound to an activation's dtype) are that autocast's. Called under "
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
