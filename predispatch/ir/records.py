"""What the trace hands the later stages besides the graph: TraceRecord, Replacement.

What the trace hands the later stages besides the graph: the frozen-shape
records :mod:`predispatch.trace.recorder` fills while the forward runs and the
history, signature and program stages read (:class:`TraceRecord`, its
:class:`Replacement` entries)."""
from __future__ import annotations

import dataclasses

import torch.fx


@dataclasses.dataclass
class Replacement:
    """``old`` was replaced by ``new`` without autograd seeing it (under no_grad,
    or through a detached alias); later uses after ``exit`` keep ``old``'s history."""

    old: torch.fx.Node
    new: torch.fx.Node
    exit: torch.fx.Node
    detached_alias_at: str | None = None  # source line, when through a detached alias
    # made while the trace ran in grad mode: outside every grad block this code
    # runs in the caller's mode, and under a no_grad caller eager keeps ``old``'s
    # history (``exit`` is then the last node before the next grad-mode marker)
    in_grad_mode: bool = False
    # was eager's tensor made by a view op (None: not known)? A value functionalization
    # holds as a view of its own memory (relaid in place: t_()) is not an eager view
    eager_view: bool | None = None
    swapped: bool = False  # a set_() target (by then)


@dataclasses.dataclass
class TraceRecord:
    replacements: list[Replacement] = dataclasses.field(default_factory=list)
    # "param:<fqn>" / "buffer:<fqn>" / "input:<flat index>" -> mutation kind
    mutation_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    # nodes the history stage reads although nothing else may use them
    needed: list = dataclasses.field(default_factory=list)
    # keys as in mutation_kinds -> LayoutChange.to_json() of inputs relaid or given another storage
    layouts: dict[str, dict] = dataclasses.field(default_factory=dict)
    # user inputs (flat position) traced as views of another (input_aliasing.View)
    input_views: dict = dataclasses.field(default_factory=dict)
    # (value before, read by an op by then, where): in-place updates of memory a set_() made shared
    swap_updates: list = dataclasses.field(default_factory=list)
    # the grad mode the forward leaves its caller in, a bare switch's (None: the caller's own)
    grad_mode_after: bool | None = None
    # "buffer:<fqn>" -> the tensor the forward rebound it to, of another dtype (its traced value)
    rebound_buffers: dict = dataclasses.field(default_factory=dict)
    # the guards decided by the example's real values (data_dependent="specialize"):
    # the seam's SpecializedGuard records, as the shape environment deferred them
    specialized_guards: list = dataclasses.field(default_factory=list)
    # node -> the names of the unbacked symbols it binds (item, nonzero), as the trace made them
    unbacked_bindings: dict = dataclasses.field(default_factory=dict)
    # what those guards assume, each checked at run time (ir.assumptions.Assumption)
    assumptions: list = dataclasses.field(default_factory=list)
    # the forward read a tensor's dtype in Python while autocast was on (a decision autocast may make)
    reads_dtype_under_autocast: bool = False
    # device -> autocast dtype name, of the autocast the caller had on when the module was exported,
    # where the forward read a dtype under it (the program checks it at each call)
    ambient_autocast: dict = dataclasses.field(default_factory=dict)

    def clear(self) -> None:
        """Forget a trace made again (see :func:`predispatch.trace.functional_trace.functional_trace`)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default if field.default_factory is dataclasses.MISSING
                    else field.default_factory())
