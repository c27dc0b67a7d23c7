"""The data the recorder's handlers act on: one explicit TraceState per recorded forward.

The data the recorder's handlers act on: one explicit :class:`TraceState`
per recorded forward (everything the recorder remembers between torch calls,
what a tensor carries aside: see :mod:`.marks`), and the :class:`TorchCall`
each handler is given."""
from __future__ import annotations

import dataclasses
import typing
import weakref
from typing import Callable

import torch
import torch.fx

from ... import _torch
from ...ir.records import TraceRecord
from ..autocast_cache import CastCache
from ..host_random import HostDraws
from ..random_state import ForwardGenerators

# id(tensor) -> (the tensor, its node then): the first value a span saw of each tensor
FirstValues = dict[int, tuple[torch.Tensor, torch.fx.Node]]


class HiddenBlock(typing.NamedTuple):
    """A grad-mode block no torch-function mode saw enter (see
    :func:`.grad_blocks.sync_grad_mode`)."""

    owner: object  # stands for the block's context manager: its block id's key
    mode_before: bool  # the grad mode its entry found, which its exit restores
    where: str  # the user's line that entered it


@dataclasses.dataclass(eq=False)
class TraceState:
    """What the recorder remembers while one forward is traced (a view's own
    lineage lives on the view, :mod:`.marks`, so it goes when the view goes)."""

    # -- what the trace hands on, and what it follows
    record: TraceRecord  # what the later stages read (its events, needed nodes, ...)
    casts: CastCache  # eager autocast's cast cache, followed
    draws: HostDraws | None = None  # host random draws: one passed to torch is read
    # torch.Generator objects made in the forward, their states as graph values (generators.py)
    generators: ForwardGenerators = dataclasses.field(default_factory=ForwardGenerators)

    # -- grad-mode blocks (grad_blocks.py)
    grad_mode: bool = dataclasses.field(default_factory=torch.is_grad_enabled)  # as the markers seen so far set it
    block_ids: dict[int, int] = dataclasses.field(default_factory=dict)  # id(block's owner) -> block id
    owners: list[object] = dataclasses.field(default_factory=list)  # the owners, alive: keeps their ids unique
    hidden_blocks: list[HiddenBlock] = dataclasses.field(default_factory=list)  # open, innermost last
    after_a_grad_marker: bool = False  # views made since may be made inside a grad block
    bare_switches: int = 0  # grad-mode switches with no block (a layer making one is traced, not stamped)

    # -- what changed between two grad-mode markers (spans.py)
    # under no_grad: each tensor the span used, at its first use (None in grad mode)
    watch: FirstValues | None = None
    # in grad mode: each tensor written, before its first write (None under no_grad)
    written: FirstValues | None = dataclasses.field(default_factory=dict)
    span_views: list[torch.Tensor] = dataclasses.field(default_factory=list)  # views made since the last marker
    # grad-mode views and their nodes when the current no_grad span began
    views_at_entry: FirstValues = dataclasses.field(default_factory=dict)

    # -- views (views.py)
    # id -> a grad-mode view alive (by id: a set would compare two tensors with ==)
    grad_views: weakref.WeakValueDictionary = dataclasses.field(default_factory=weakref.WeakValueDictionary)
    # grad-mode views of detached aliases: an update of the alias gives them its history
    detached_views: weakref.WeakSet = dataclasses.field(default_factory=weakref.WeakSet)
    any_no_grad_view: bool = False  # a view was made under no_grad: calls reading one mark its replays
    replays_noted: set = dataclasses.field(default_factory=set)  # nodes noted as a view's replay

    # -- reads through an op (leaves.py)
    # a tensor was made to require grad, or has a history of its own: calls read it through an op
    reads_through: bool = False
    reading_data: bool = False  # a t.data read is being answered (data.py): its detach result is marked

    # -- storage swaps (swaps.py)
    # id of each parameter, buffer and input the forward got -> its key ("param:<fqn>", "input:<i>", ...)
    graph_inputs: dict = dataclasses.field(default_factory=dict)
    swapped: dict = dataclasses.field(default_factory=dict)  # storage a set_() made shared -> its sharers
    call_start: torch.fx.Node | None = None  # the graph's last node before the user's torch call running

    # -- the torch call running
    call: tuple | None = None  # its (args, kwargs); None between the user's calls


@dataclasses.dataclass(frozen=True)
class TorchCall:
    """One torch call a torch-function mode sees, as the recorder's handlers take it."""

    func: Callable
    args: tuple
    kwargs: dict
    # the recorder handling it: off inside its own handler, entered again where a
    # handler's own calls must be seen (a ``t.data = v`` traced as ``t.set_(v)``)
    recorder: _torch.TorchFunctionMode

    @property
    def in_place(self) -> bool:
        return is_in_place(self.func)


def is_in_place(func) -> bool:
    """Does ``func`` write its first argument (by its name: ``add_``, ``__iadd__``)?"""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in (
        "__setitem__", "__iadd__", "__imul__", "__isub__", "__itruediv__")
