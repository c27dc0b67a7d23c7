"""A Function's subgraphs traced by the pipeline, which the trace layer cannot import.

The trace meets an autograd.Function in the forward (:mod:`.capture`) and
needs its forward and backward traced by the whole pipeline, a layer above
it; the pipeline hands itself down for the span of an export
(:func:`subgraphs_traced_by`), as torch's ``reenter_make_fx`` finds the
tracer that is running.
"""
from __future__ import annotations

import contextlib
import dataclasses


class MutatedInput(Exception):
    """A subgraph updates one of its inputs in place."""


@dataclasses.dataclass(frozen=True)
class FunctionBody:
    """A Function's forward or backward, the subject of a pipeline run: ``fn``
    traced on ``fake_inputs``, placeholders named ``names``; an autocast
    block that does not say gets ``autocast_cache``."""

    fn: object
    fake_inputs: list
    names: list
    autocast_cache: bool


_TRACERS: list = []  # the pipeline, as handed down for the span of an export (innermost last)


@contextlib.contextmanager
def subgraphs_traced_by(trace):
    """Until exit, :func:`subgraph` traces with ``trace(FunctionBody) -> (graph module, constants)``."""
    _TRACERS.append(trace)
    try:
        yield
    finally:
        _TRACERS.pop()


def subgraph(fn, fake_inputs: list, names: list[str], autocast_cache: bool):
    """``fn(*fake_inputs)`` traced by the pipeline the export runs (capture,
    history, dead code, writes, regions, G1's net): (the graph module, its
    tensor constants, which it takes as its last inputs)."""
    if not _TRACERS:
        raise RuntimeError("internal: an autograd.Function met outside an export's pipeline")
    return _TRACERS[-1](FunctionBody(fn, fake_inputs, names, autocast_cache))
