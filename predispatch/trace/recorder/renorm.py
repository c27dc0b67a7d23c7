"""``F.embedding(max_norm=...)``: the weight's renorm made visible to the trace.

``F.embedding(max_norm=...)`` / ``F.embedding_bag(max_norm=...)``: the
lookup renorms the weight in place through a detached alias inside the
call, where torch-function modes are off (the graph would drop the
weight's history). Renormed first, seen by the recorder, then looked up
without ``max_norm``."""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F

from .state import TorchCall, TraceState

_RENORMING_LOOKUPS = {f: inspect.signature(f) for f in (F.embedding, F.embedding_bag)}


def is_renorming_lookup(state: TraceState, call: TorchCall) -> bool:
    return call.func in _RENORMING_LOOKUPS


def lookup_renorming_visibly(state: TraceState, call: TorchCall):
    bound = _RENORMING_LOOKUPS[call.func].bind(*call.args, **call.kwargs)
    max_norm = bound.arguments.get("max_norm")
    if max_norm is not None:
        norm_type = bound.arguments.get("norm_type", 2.0)
        with call.recorder:  # the recorder is off inside its own handler
            torch.embedding_renorm_(bound.arguments["weight"].detach(),
                                    bound.arguments["input"].contiguous(), max_norm, norm_type)
        bound.arguments["max_norm"] = None
    return call.func(*bound.args, **bound.kwargs)
