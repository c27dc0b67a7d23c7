"""A Function's subgraphs traced by the pipeline, which the trace layer cannot import.

The trace meets an autograd.Function in the forward (:mod:`.capture`) and
needs its forward and backward traced by the whole pipeline, a layer above
it (a control-flow operator's branches too: :mod:`predispatch.trace.control_flow`); the pipeline hands itself down for the span of an export
(:func:`subgraphs_traced_by`), as torch's ``reenter_make_fx`` finds the
tracer that is running.
"""
from __future__ import annotations

import contextlib
import dataclasses


class RelaidInput(Exception):
    """A subgraph gives one of its inputs another layout or storage in place
    (``transpose_``, ``set_``): the program could not write it back as eager leaves it."""


@dataclasses.dataclass(frozen=True)
class FunctionBody:
    """A Function's forward or backward, the subject of a pipeline run: ``fn``
    traced on ``fake_inputs``, placeholders named ``names``; an autocast
    block that does not say gets ``autocast_cache``. The capture fills
    ``updated``: the positions of the inputs ``fn`` updates in place, whose
    new values are the graph's last outputs, in that order."""

    fn: object
    fake_inputs: list
    names: list
    autocast_cache: bool
    updated: list = dataclasses.field(default_factory=list, compare=False)


@dataclasses.dataclass(frozen=True)
class Subgraph:
    """A traced body: its graph module, its tensor constants (its last
    inputs) and the inputs it updates in place (:attr:`FunctionBody.updated`)."""

    gm: object
    constants: list
    updated: list


_TRACERS: list = []  # the pipeline, as handed down for the span of an export (innermost last)


@contextlib.contextmanager
def subgraphs_traced_by(trace):
    """Until exit, :func:`subgraph` traces with ``trace(FunctionBody) -> (graph module, constants)``."""
    _TRACERS.append(trace)
    try:
        yield
    finally:
        _TRACERS.pop()


def subgraph(fn, fake_inputs: list, names: list[str], autocast_cache: bool) -> Subgraph:
    """``fn(*fake_inputs)`` traced by the pipeline the export runs (capture,
    history, dead code, writes, regions, G1's net)."""
    if not _TRACERS:
        raise RuntimeError("internal: an autograd.Function met outside an export's pipeline")
    body = FunctionBody(fn, fake_inputs, names, autocast_cache)
    gm, constants = _TRACERS[-1](body)
    return Subgraph(gm, constants, list(body.updated))
