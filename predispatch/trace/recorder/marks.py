"""The marks the recorder sets on the tensors it sees, and what a view's lineage tells.

What the recorder marks on the tensors it sees: one ``_predispatch_*``
attribute per mark (:class:`Mark`), and what a view's lineage tells (its
base, the ``detach()`` result it is a view of, whose version counter it
shares). A mark lives on its tensor, so it goes when the tensor goes."""
from __future__ import annotations

import torch
import torch.fx

from ... import _torch
from ...ir.records import Event, Kind, TraceRecord


class Mark:
    """One attribute the recorder sets on tensors, read with a default."""

    def __init__(self, name: str, default=None):
        self.attribute, self.default = f"_predispatch_{name}", default

    def of(self, t):
        return getattr(t, self.attribute, self.default)

    def set(self, t, value=True) -> None:
        setattr(t, self.attribute, value)

    def on(self, t) -> bool:
        """Was it set (to anything, None included)?"""
        return hasattr(t, self.attribute)

    def clear(self, t) -> None:
        if hasattr(t, self.attribute):
            delattr(t, self.attribute)


# -- a view's lineage (views.py)
SOURCE = Mark("source")  # the tensor the view was taken from
EAGER_VIEW = Mark("eager_view", False)  # made by a view op other than detach(): a view in eager too
NO_GRAD_VIEW = Mark("no_grad_view", False)  # made under no_grad, or a view of such a view
INPUT_VIEW = Mark("input_view", False)  # a user input traced as a view of another
MADE_AFTER = Mark("made_after")  # on a grad-mode view: the graph's last node then
MADE_AS = Mark("made_as")  # on a grad-mode view: its node as made

# -- detached aliases (detached.py)
DETACHED = Mark("detached", False)  # a detach() result, or a view of one
DETACH_RESULT = Mark("detach_result", False)  # a detach() result (an autograd base of its own)
DATA_ALIAS = Mark("data_alias", False)  # a t.data result: a version counter of its own too

# -- reads through an op (leaves.py)
LEAF = Mark("leaf", False)  # made to require grad in the forward: read through the op
# the node holding a tensor's eager history when functionalization replays it
# from memory without it: a detached alias updated in grad mode, a grad-mode
# view of a tensor made to require grad or of such a tensor (or a PendingHistory)
OWN_HISTORY = Mark("own_history")

# -- storage swaps (swaps.py)
SWAPPED = Mark("swapped", False)  # given another's storage by set_()
WRITTEN_WITH_GRAD = Mark("written_with_grad", False)  # written in grad mode (or the caller's) from another float tensor
SWAPPED_AT = Mark("swapped_at")  # where, last
# on a set_() target: (its own history's node, whether it was made by a view op), for its reads
SWAP_HISTORY = Mark("swap_history")


class PendingHistory:
    """An own history made where it is first read (a view of a detached
    alias updated after the view was made: :class:`.detached.ViewOfUpdate`)."""

    def node(self) -> torch.fx.Node:
        raise NotImplementedError


def own_history(t) -> torch.fx.Node | None:
    """The node holding ``t``'s own history (a pending one is made now), or None."""
    own = OWN_HISTORY.of(t)
    if isinstance(own, PendingHistory):
        own = own.node()
        OWN_HISTORY.set(t, own)
    return own


def base(t: torch.Tensor) -> torch.Tensor:
    """The root of ``t``'s view chain (``t`` itself for no view)."""
    while (source := SOURCE.of(t)) is not None:
        t = source
    return t


def detach_result(t: torch.Tensor) -> torch.Tensor:
    """The ``detach()`` result ``t`` is (a view of): its autograd base."""
    while not DETACH_RESULT.of(t) and (source := SOURCE.of(t)) is not None:
        t = source
    return t


def counter_owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose autograd version counter ``t`` shares: its view
    chain's root, stopping at a set_() target (set_ keeps its own)."""
    while not SWAPPED.of(t) and (source := SOURCE.of(t)) is not None:
        t = source
    return t


def made_by_a_view(t: torch.Tensor) -> bool:
    """Was ``t`` made by a view op (or seen as a view of another input)? (A
    ``set_()`` does not change it, nor a relayout in place.)"""
    return EAGER_VIEW.of(t)


def user_swap_location(t: torch.Tensor) -> str | None:
    """Where the module's code last gave ``t`` other memory with ``set_()``
    (None: it did not; predispatch's own write-backs are not the module's)."""
    return SWAPPED_AT.of(t)


def mark_view(view: torch.Tensor, base: torch.Tensor, record: TraceRecord) -> None:
    """``view`` was made from ``base`` out of the recorder's sight (an input
    traced as a view of another): updates of one concern the other."""
    SOURCE.set(view, base)
    EAGER_VIEW.set(view)
    INPUT_VIEW.set(view)
    record.note(Event(Kind.INPUT_VIEW, _torch.materialized_node(view)))
