"""The pipeline: a module, or a Function's forward or backward, made a program, stage by stage.

    capture     the module traced into a flat functional pre-dispatch graph, with what the trace saw
    assumptions each data-dependent branch the example took, checked at run time naming its line
    effects     an op with effects on a script object called directly, in the graph's order
    history     values updated out of autograd's sight keep eager's history
    dead code   what the history stage did not need goes
    writes      functionalized writes written with differentiable ops
    regions     grad-mode and autocast blocks become higher-order ops
    functional  no in-place op is left (G1's safety net)
    signature   outputs named; write-backs, layouts and the autocast policy recorded
    program     a PredispatchProgram, a real torch.export.ExportedProgram

:data:`STAGES` is that list, defined once: :func:`predispatch.export_predispatch`
runs it on a module (:class:`ModuleExport`), and every autograd.Function the
trace meets runs it on its forward and on its backward, every control-flow
operator (``torch.cond``, ``while_loop``, ``map``) on its branches or bodies
(:class:`~predispatch.trace.autograd_function.subgraphs.FunctionBody`, handed down
to the trace layer by :func:`run`). A stage is a function of the
:class:`Work` the stages hand on; where the two subjects differ (how they are
captured, what the last two stages make), the stage asks the subject.
design/architecture.md draws this table.
"""
from __future__ import annotations

import contextlib

import dataclasses
from typing import Callable

import torch

from .ir.control_flow_op import module_stacks_into_branches
from .ir.records import TraceRecord
from .passes import assumptions, dead_code, effects, functional_check, history, regions, signature, writes
from .policies.autocast_policy import AutocastPolicy
from .policies.op_policy import OpPolicy
from .program import program
from .trace import capture as trace_capture
from .trace import functional_trace
from .trace import recorder
from .trace.autograd_function import body as trace_body
from .trace.autograd_function.subgraphs import FunctionBody, subgraphs_traced_by
from .trace.internal_errors import internal_errors_as_export_errors
from . import _torch


@dataclasses.dataclass(frozen=True)
class ModuleExport:
    """A module's export, the subject of :func:`predispatch.export_predispatch`."""

    module: torch.nn.Module
    args: tuple
    kwargs: dict | None
    dynamic_shapes: object
    op_policy: OpPolicy
    autocast_policy: AutocastPolicy
    sharding_layouts: dict  # a sharded module's DTensor layouts (predispatch.distributed)
    data_dependent: str = "refuse"  # "specialize": take the example's branches, checked at run time


@dataclasses.dataclass
class Work:
    """What the stages hand on: the subject, what the trace saw, what capture
    made (a graph module with a signature), and what the program stage made."""

    subject: ModuleExport | FunctionBody
    record: TraceRecord = dataclasses.field(default_factory=TraceRecord)
    captured: object = None  # trace.capture.Captured | trace.autograd_function.body.CapturedBody
    result: object = None  # a PredispatchProgram | (graph module, its tensor constants)

    @property
    def exports_a_module(self) -> bool:
        return isinstance(self.subject, ModuleExport)


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    does: str  # one line, for design/architecture.md
    run: Callable[[Work], None]
    modules: tuple  # where its work is done (design/architecture.md names them)


def _capture(work: Work) -> None:
    s = work.subject
    work.captured = (
        trace_capture.capture_module(s.module, s.args, s.kwargs, s.dynamic_shapes, s.op_policy, work.record,
                                     s.data_dependent)
        if work.exports_a_module else trace_body.capture_function_body(s, work.record))


def _assumptions(work: Work) -> None:
    r = work.record
    carried = assumptions.carried_assumptions(work.subject.module) if work.exports_a_module else []
    made = assumptions.check_assumptions(work.captured.gm, r.specialized_guards, r.unbacked_bindings) \
        if r.specialized_guards else []
    if carried:
        assumptions.drop_regenerated_checks(work.captured.gm, r.unbacked_bindings)
    if work.exports_a_module:
        assumptions.drop_restated_checks(work.captured.gm)
        assumptions.write_pinned_values(work.captured.gm)
        assumptions.say_check_conditions(work.captured.gm)
    r.assumptions = [*carried, *(a for a in made if a not in carried)]


def _history(work: Work) -> None:
    c = work.captured
    history.keep_histories(c.gm, c.signature, work.record, work.subject.module if work.exports_a_module else c.module)


def _dead_code(work: Work) -> None:
    c = work.captured
    dead_code.eliminate_dead_code(c.gm, c.signature, c.artifact.aten.constants if work.exports_a_module else None)


def _regions(work: Work) -> None:
    one_op = None if work.exports_a_module else "an autograd.Function's forward or backward"
    work.record.grad_mode_after = regions.replace_blocks_with_regions(work.captured.gm, one_op)


def _signature(work: Work) -> None:
    if work.exports_a_module:  # a Function's subgraph: its outputs by position, nothing recorded
        s = work.subject
        module_stacks_into_branches(work.captured.gm)
        signature.name_inputs_apart_from_state(work.captured)
        signature.sync_output_names(work.captured)
        signature.record_program_meta(work.captured, s.module, s.autocast_policy, s.sharding_layouts,
                                      work.record.grad_mode_after)


def _program(work: Work) -> None:
    c = work.captured
    if not work.exports_a_module:
        c.gm.recompile()
        work.result = (c.gm, c.constants)
        return
    work.result = _torch.build_exported_program(  # the sharded state still local
        program.PredispatchProgram, work.subject.module, c.artifact, c.signature,
        args=c.args, kwargs=c.kwargs, dynamic_shapes=c.dynamic_shapes,
        state_dict=c.original_state_dict, verify_additional_inputs=c.verify_additional_inputs)


STAGES = (
    Stage("capture", "the module traced into a flat functional pre-dispatch graph, with what the trace saw",
          _capture, (trace_capture, trace_body, functional_trace, recorder)),
    Stage("assumptions", "each data-dependent branch the example took, checked at run time naming its line",
          _assumptions, (assumptions,)),
    Stage("effects", "an op with effects on a script object called directly, in the graph's order",
          lambda w: effects.call_effects_directly(w.captured.gm), (effects,)),
    Stage("history", "values updated out of autograd's sight keep eager's history", _history, (history,)),
    Stage("dead code", "what the history stage did not need goes", _dead_code, (dead_code,)),
    Stage("writes", "functionalized writes written with differentiable ops",
          lambda w: writes.replace_writes(w.captured.gm), (writes,)),
    Stage("regions", "grad-mode and autocast blocks become higher-order ops", _regions, (regions,)),
    Stage("functional", "no in-place op is left (G1's safety net)",
          lambda w: functional_check.refuse_remaining_mutations(w.captured.gm), (functional_check,)),
    Stage("signature", "outputs named; write-backs, layouts and the autocast policy recorded", _signature,
          (signature,)),
    Stage("program", "a PredispatchProgram, a real torch.export.ExportedProgram", _program, (program,)),
)


def run(subject: ModuleExport | FunctionBody):
    """``subject`` through :data:`STAGES`: its program (a Function's subgraph:
    its graph module and tensor constants). Functions met meanwhile are traced
    by this same function (handed down to the trace layer)."""
    work = Work(subject)
    with subgraphs_traced_by(run):
        for stage in STAGES:
            with _said_to_the_user(subject, stage):
                stage.run(work)
    return work.result


def _said_to_the_user(subject, stage: Stage):
    """Where the user gets what a stage raises (a module's export), an
    unexpected torch error as an ExportError; a Function's subgraphs leave
    theirs to the caller, which reads some as refusals of its own."""
    if isinstance(subject, ModuleExport):
        return internal_errors_as_export_errors(stage.name)  # never a raw torch error
    return contextlib.nullcontext()
