"""The dead-code stage: what the history stage did not need goes.

Replaced values the history stage might have read were kept through the
trace; now unused, they go, and so do the lifted constants only they read.
"""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind

from .. import _torch


def eliminate_dead_code(gm: torch.fx.GraphModule, signature, constants: dict | None) -> None:
    """Dead nodes go, and constant placeholders nothing reads with their
    input specs and entries in ``constants`` (the program's lifted constants)."""
    gm.graph.eliminate_dead_code(is_impure_node=_torch.impure_by_op())
    unused = {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and not n.users}
    for spec in [s for s in signature.input_specs
                 if s.kind == InputKind.CONSTANT_TENSOR and s.arg.name in unused]:
        gm.graph.erase_node(unused[spec.arg.name])
        signature.input_specs.remove(spec)
        if constants is not None:
            constants.pop(spec.target, None)
    gm.recompile()
