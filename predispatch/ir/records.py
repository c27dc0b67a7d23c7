"""What the trace hands the later stages besides the graph: TraceRecord, and its Events.

The recorder (:mod:`predispatch.trace.recorder`) fills a :class:`TraceRecord`
while the forward runs; the history, signature and program stages read it.
What it saw happen out of autograd's sight is one list of typed
:class:`Event` records, each of a :class:`Kind`: the history stage
(:mod:`predispatch.passes.history`) indexes them by node and decides from
them, instead of reading marks scattered over ``node.meta``."""
from __future__ import annotations

import dataclasses
import enum

import torch.fx


class Kind(enum.Enum):
    """What an :class:`Event` says happened to a tensor, as eager's autograd sees it."""

    # writes: ``of`` replaced by ``node`` without autograd seeing it (eager keeps ``of``'s history)
    NO_GRAD_WRITE = "no_grad write"  # in a no_grad span; ``at``: the marker ending it
    # in grad mode outside every grad block: the caller's mode, which may be no_grad
    # (``at``: the last node before the next grad-mode marker)
    CALLERS_MODE_WRITE = "caller's-mode write"
    DETACHED_ALIAS_WRITE = "detached-alias write"  # through a detach() / .data alias, in grad mode
    # reads the recorder made, ``keep_history(own, value)`` (``node``), of a tensor's own history:
    OWN_HISTORY_READ = "own-history read"  # a detached alias updated in grad mode, a set_() target, ...
    STORAGE_SWAP = "storage swap"  # ... a set_() target's, kept from before the swap (``of``)
    # view ops functionalization replays (``node``), marked with how eager's view was made:
    INPUT_VIEW = "input view"  # a user input traced as a view of another: history in any mode
    NO_GRAD_VIEW = "no_grad view replay"  # made under no_grad: no history in eager
    GRAD_VIEW = "grad-mode view replay"  # made in grad mode after the marker ``of``
    VIEW_REPLAY = "view replay"  # a replay of the view ``of`` as made (in grad mode)
    REGENERATED_VIEW = "regenerated view"  # as_strided of an update: eager regenerates it in any mode
    # the nodes building a synthetic base of user inputs that share memory (zeros, each input's
    # values scattered in): the caller's values, whose history they carry in any mode
    SYNTHETIC_BASE = "synthetic base"
    # an in-place update, through a set_() target, of memory shared with ``node``
    # (``readers``: (op, argument position) reading it by then)
    SAVED_VALUE_UPDATE = "saved-value update"
    # a parameter, buffer or input (``input``) given another layout in place; ``node``: its value then
    RELAYOUT = "relayout"
    # a parameter, buffer or input set_() in grad mode to the value ``node``: eager links the
    # caller's tensor to that value's history through set_'s node (no derivative)
    LINKED_BY_SET = "linked by set_()"


WRITES = frozenset({Kind.NO_GRAD_WRITE, Kind.CALLERS_MODE_WRITE, Kind.DETACHED_ALIAS_WRITE})

# the refusal of a LINKED_BY_SET (the recorder's, for a leaf; the history stage's, for the rest)
LINKED_BY_SET = (
    "set_() in grad mode at {where} gives a parameter, buffer or input the memory of a tensor that requires "
    "grad: eager links the caller's tensor to that tensor's history through set_ (which has no derivative), "
    "which a program cannot reproduce; set_ under no_grad, or set_ a detached tensor")


@dataclasses.dataclass(frozen=True)
class Event:
    """One thing the recorder saw (see :class:`Kind` for what each field holds)."""

    kind: Kind
    node: torch.fx.Node
    of: torch.fx.Node | None = None
    at: torch.fx.Node | None = None
    where: str | None = None  # the user's source line, where the stage needs it
    # the tensor written or swapped, as the recorder knew it: made by a view op
    # (None: not known; a value functionalization holds as a view of its own
    # memory, relaid in place by t_(), is no eager view), and a set_() target by then
    eager_view: bool | None = None
    swapped: bool = False
    readers: tuple = ()
    input: str | None = None  # a parameter, buffer or input, as TraceRecord's keys name it

    @property
    def old(self) -> torch.fx.Node | None:
        return self.of

    @property
    def new(self) -> torch.fx.Node:
        return self.node


def write(kind: Kind, old: torch.fx.Node, new: torch.fx.Node, at: torch.fx.Node, *, where: str | None = None,
          eager_view: bool | None = None, swapped: bool = False) -> Event:
    """A write event: ``old`` replaced by ``new``, taking effect after ``at``."""
    return Event(kind, new, old, at, where, eager_view, swapped)


@dataclasses.dataclass
class TraceRecord:
    events: list[Event] = dataclasses.field(default_factory=list)
    # nodes the history stage reads although nothing else may use them (where a replayed view was made)
    needed: list = dataclasses.field(default_factory=list)
    # "param:<fqn>" / "buffer:<fqn>" / "input:<flat index>" -> mutation kind
    mutation_kinds: dict[str, str] = dataclasses.field(default_factory=dict)
    # keys as in mutation_kinds -> LayoutChange.to_json() of inputs relaid or given another storage
    layouts: dict[str, dict] = dataclasses.field(default_factory=dict)
    # user inputs (flat position) traced as views of another (input_aliasing.View)
    input_views: dict = dataclasses.field(default_factory=dict)
    # user outputs (flat position) eager returns as views of an input the forward wrote
    # -> functional_trace.OutputView.to_json(), "of" keyed as in mutation_kinds
    output_views: dict = dataclasses.field(default_factory=dict)
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
    # each ``t.requires_grad`` the forward read that the call's tensors decide: {"where": the
    # user's line, "sources": their keys (as in mutation_kinds), "answer": the example's}
    requires_grad_reads: list = dataclasses.field(default_factory=list)
    # keys as in mutation_kinds of the tensors written in place: only through ``.data`` (eager's
    # alias with a version counter of its own), or otherwise too
    written_through_data: set = dataclasses.field(default_factory=set)
    written_otherwise: set = dataclasses.field(default_factory=set)

    def note(self, event: Event) -> None:
        self.events.append(event)

    def writes(self) -> int:
        """How many write events were noted so far."""
        return sum(1 for e in self.events if e.kind in WRITES)

    def clear(self) -> None:
        """Forget a trace made again (see :func:`predispatch.trace.functional_trace.functional_trace`)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default if field.default_factory is dataclasses.MISSING
                    else field.default_factory())
