"""The pipeline: a module, or a Function's forward or backward, made a program, stage by stage.

    capture     the module traced into a flat functional pre-dispatch graph, with what the trace saw
    assumptions each data-dependent branch the example took, checked at run time naming its line
    history     values updated out of autograd's sight keep eager's history
    dead code   what the history stage did not need goes
    writes      functionalized writes written with differentiable ops
    regions     grad-mode and autocast blocks become higher-order ops
    functional  no in-place op is left (G1's safety net)
    signature   outputs named; write-backs, layouts and the autocast policy recorded
    program     a PredispatchProgram, a real torch.export.ExportedProgram

:data:`STAGES` is that list, defined once: :func:`predispatch.export_predispatch`
runs it on a module (:class:`ModuleExport`), and every autograd.Function the
trace meets runs it on its forward and on its backward
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

from .ir.records import TraceRecord
from .passes import assumptions, dead_code, functional_check, history, regions, signature, writes
from .passes.history import (
    drop_unseen_leaves,
    insert_kept_histories,
    may_require_grad,
    refuse_updates_of_saved_values,
    refuse_views_of_reshaped_inputs,
)
from .passes.regions import grad_modes
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
    r.assumptions = [*carried, *(a for a in made if a not in carried)]


def _history(work: Work) -> None:
    c = work.captured
    _keep_histories(c.gm, c.signature, work.record, work.subject.module if work.exports_a_module else c.module)


def _keep_histories(gm: torch.fx.GraphModule, sig, record: TraceRecord, module: torch.nn.Module) -> None:
    """Kept histories first; then leaves whose history no output shows go, as
    a re-export of the program (which holds the kept histories) sees them."""
    requiring = {name for name, p in module.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    insert_kept_histories(gm, record.replacements,
                          lambda modes: may_require_grad(gm, sig, requiring, modes),
                          [s.kind.name for s in sig.output_specs], _write_backs(sig))
    refuse_updates_of_saved_values(record.swap_updates, lambda: may_require_grad(gm, sig, requiring),
                                   gm.graph, [s.kind.name for s in sig.output_specs])
    refuse_views_of_reshaped_inputs(gm.graph, _reshaped_covers(gm, sig, record),
                                    {r.old for r in record.replacements if not r.in_grad_mode})

    def leaf_analyses():
        off = grad_modes(gm.graph)  # a no_grad caller's: grad on inside the blocks that set it only
        return [(may_require_grad(gm, sig, requiring), may_require_grad(gm, sig, requiring, leaves=False,
                                                                        inputs=False)),
                (may_require_grad(gm, sig, requiring, off), may_require_grad(gm, sig, requiring, off, leaves=False,
                                                                             inputs=False))]
    drop_unseen_leaves(gm, leaf_analyses)


def _reshaped_covers(gm: torch.fx.GraphModule, sig, record: TraceRecord) -> set:
    """The placeholders of user inputs other inputs view that the forward
    gave another shape."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    covers = {v.of for v in record.input_views.values()}
    reshaped = set()
    for c in covers:
        size = record.layouts.get(f"input:{c}", {}).get("size")
        node = placeholders.get(sig.user_inputs[c])
        if size is not None and node is not None and tuple(size) != tuple(node.meta["val"].shape):
            reshaped.add(node)
    return reshaped


def _write_backs(sig) -> dict[int, str]:
    """Output position -> the name of the placeholder it writes back."""
    placeholder = {s.target: s.arg.name for s in sig.input_specs if s.target is not None}
    placeholder.update({s.arg.name: s.arg.name for s in sig.input_specs if hasattr(s.arg, "name")})
    return {i: placeholder[s.target] for i, s in enumerate(sig.output_specs)
            if s.kind.name.endswith("_MUTATION") and s.target in placeholder}


def _dead_code(work: Work) -> None:
    c = work.captured
    dead_code.eliminate_dead_code(c.gm, c.signature, c.artifact.aten.constants if work.exports_a_module else None)


def _regions(work: Work) -> None:
    one_op = None if work.exports_a_module else "an autograd.Function's forward or backward"
    work.record.grad_mode_after = regions.replace_blocks_with_regions(work.captured.gm, one_op)


def _signature(work: Work) -> None:
    if work.exports_a_module:  # a Function's subgraph: its outputs by position, nothing recorded
        s = work.subject
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
