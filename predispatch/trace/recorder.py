"""What the tracer cannot see in the functional graph, recorded while tracing.

A TorchFunctionMode pushed inside the traced forward notes what the graph
cannot show:

* which ``_set_grad_enabled`` node enters and which exits a grad-mode block
  (the flat graph only shows the values, so nesting would be lost);
* tensors whose value was replaced without autograd seeing it (an in-place
  op under no_grad, or on a detached alias, directly or through views):
  eager keeps their old history, functionalization does not, so the
  keep-history pass restores it; views are brought up to date in the grad
  mode they were made in;
* tensors written in grad mode between two grad-mode markers: outside every
  grad block that code runs in the caller's mode, which may be no_grad; and
  replays of views made in grad mode, with where they were made;
* how each graph input was mutated ("hidden" from autograd, under
  "no_grad", or under "grad"), so the program writes it back the same way;
* the casts eager's autocast cache would hold (:mod:`predispatch.trace.autocast_cache`);
  ``t.set_(source)`` is traced onto an alias of ``source``; how in-place ops
  functionalization gets wrong are traced is :mod:`predispatch.trace.inplace_rules`.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys
import weakref

import torch
import torch.fx
import torch.nn.functional as F
import torch.utils._pytree as pytree

from .. import _torch
from . import eager_layout, inplace_rules
from ..ir import ops
from ..errors import PACKAGE_DIR, ExportError, is_library_file, user_location
from .autocast_cache import CastCache
from .grad_mode_reads import noting_grad_mode_reads, passed_mode
from .host_random import HostDraws, refusing_host_randomness
from .patching import patched
from .autograd_function.capture import capturing_autograd_functions
from .refusals import refusing_state_calls
from .stack_traces import stamping_stack_traces
from .translations import (
    autocast_blocks_as_in_eager,
    buffer_reassignment_as_update,
    inference_mode_as_no_grad,
    inside_inference_mode,
)

GRAD_BLOCK = "predispatch_grad_block"  # node.meta key: (phase, block id)
# attributes the recorder sets on the views it sees
_SOURCE = "_predispatch_source"  # the tensor the view was taken from
_DETACHED = "_predispatch_detached"  # a detach() result, or a view of one
_DETACH_RESULT = "_predispatch_detach_result"  # a detach() result (an autograd base of its own)
_EAGER_VIEW = "_predispatch_eager_view"  # made by a view op other than detach(): a view in eager too
_NO_GRAD_VIEW = "_predispatch_no_grad_view"  # made under no_grad, or a view of such a view
# node.meta key: a view op replaying a view made under no_grad, which in eager
# never requires grad; the keep-history pass leaves its inputs without history
NO_GRAD_VIEW_REPLAY = "predispatch_no_grad_view_replay"
# node.meta key: a view op replaying a view made in grad mode (where it is next
# read, or after the forward); the value is the node after which it was made
GRAD_VIEW_REPLAY = "predispatch_grad_view_replay"
# node.meta key: a view op making or replaying a user input traced as a view of
# another: the caller made it, and eager's has its history in any grad mode
INPUT_VIEW = "predispatch_input_view"
_INPUT_VIEW = "_predispatch_input_view"  # on such an input
_MADE_AFTER = "_predispatch_made_after"  # on a grad-mode view: the graph's last node then
_MADE_AS = "_predispatch_made_as"  # on a grad-mode view: its node as made
# node.meta key: a replay of a grad-mode view; the value is the view's node as made,
# whose history eager's view keeps while its base is updated out of autograd's sight
REPLAY_OF = "predispatch_replay_of"
_FROM_STACK = object()  # a grad-mode marker's caller: found on the Python stack
_LEAF = "_predispatch_leaf"  # made to require grad in the forward: read through the op
# the node holding a tensor's eager history when functionalization replays it
# from memory without it: a detached alias updated in grad mode, a grad-mode
# view of a tensor made to require grad or of such a tensor
_OWN_HISTORY = "_predispatch_own_history"
_SWAPPED = "_predispatch_swapped"  # given another's storage by set_()
_SWAPPED_AT = "_predispatch_swapped_at"  # where, last
# node.meta key: a keep_history read of a detached alias's own history (the value it
# keeps is the update's, which a later keep of the base's history must not replace)
OWN_HISTORY_READ = "predispatch_own_history_read"
# a copy writing values only: the written tensor's history is not the memory's (copy_pass)
VALUES_ONLY = "predispatch_values_only"
# node.meta key: a keep_history read of a set_() target's own history (the value it had);
# the value says whether the target is an eager view (made by a view op), not one relaid in place
SWAPPED_HISTORY = "predispatch_swapped_history"
SWAPPED_VIEW, _SWAPPED_NO_VIEW = "of a view", "of no view"
_SWAP_HISTORY = "_predispatch_swap_history"  # on a set_() target: (its own history's node, view or not)


def user_swap_location(t: torch.Tensor) -> str | None:
    """Where the module's code last gave ``t`` other memory with ``set_()``
    (None: it did not; predispatch's own write-backs are not the module's)."""
    return getattr(t, _SWAPPED_AT, None)


def mark_view(view: torch.Tensor, base: torch.Tensor) -> None:
    """``view`` was made from ``base`` out of the recorder's sight (an input
    traced as a view of another): updates of one concern the other."""
    setattr(view, _SOURCE, base)
    setattr(view, _EAGER_VIEW, True)
    setattr(view, _INPUT_VIEW, True)
    _torch.materialized_node(view).meta[INPUT_VIEW] = True


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

    def clear(self) -> None:
        """Forget a trace made again (see :func:`predispatch.trace.functional_trace.functional_trace`)."""
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default_factory())


class _Recorder(_torch.TorchFunctionMode):
    def __init__(self, record: TraceRecord, casts: CastCache, draws=None):
        super().__init__()
        self.record = record
        self.draws = draws  # host random draws: one passed to torch is read
        self.casts = casts  # eager autocast's cast cache, followed
        self._block_ids: dict[int, int] = {}
        self._owners: list[object] = []  # keeps ids unique while tracing
        self._watch: dict[int, tuple[torch.Tensor, torch.fx.Node]] | None = None
        self._span_views: list[torch.Tensor] = []  # views made since the last grad-mode marker
        # a view's lineage lives on the view (see _note_views), so it goes when the view goes;
        # grad-mode views still alive, and their nodes when the current no_grad span began
        self._grad_views: weakref.WeakSet = weakref.WeakSet()
        # grad-mode views of detached aliases: an update of the alias gives them its history
        self._detached_views: weakref.WeakSet = weakref.WeakSet()
        self._views_at_entry: dict[int, tuple[torch.Tensor, torch.fx.Node]] = {}
        self._any_no_grad_view = False
        # tensors written since the last grad-mode marker, in grad mode: id -> (tensor, old node)
        self._written: dict[int, tuple[torch.Tensor, torch.fx.Node]] | None = {}
        self._call = None  # (args, kwargs) of the torch call running
        self._after_a_grad_marker = False  # views made since may be made inside a grad block
        self._grad_mode = torch.is_grad_enabled()  # as the markers seen so far set it
        # grad-mode blocks no torch-function mode saw: (owner, mode before, where)
        self._hidden_blocks: list[tuple[object, bool, str]] = []
        self._any_leaf = False  # a tensor was made to require grad in the forward
        self._swapped: dict = {}  # storage a set_() made shared -> the tensors sharing it
        self._call_start = None  # the graph's last node before the user's torch call running

    def __torch_function__(self, func, types, args=(), kwargs=None):
        previous, self._call = self._call, (args, kwargs)
        if previous is None and self._swapped and (tracer := _torch.current_tracer()) is not None:
            self._call_start = _torch.last_node(tracer.graph)  # what the graph held before this call
        try:
            eager_layout.refuse_storage_offsets_unlike_eager(func, args, kwargs or {})
            out = self._handle(func, args, kwargs or {})
            eager_layout.follow(func, args, kwargs or {}, out)
            return out
        finally:
            self._call = previous

    def _handle(self, func, args, kwargs):
        if func is not _torch.SET_GRAD_ENABLED:
            self.sync_grad_mode()  # a hidden block ended: the bookkeeping below is the mode's
        if getattr(func, "__self__", None) is _DATA:
            if func.__name__ == "__set__":
                return self._assign_data(*args)
            func, args = torch.Tensor.detach, args[:1]  # t.data: see _assign_data
        if _sets_requires_grad(func, args, kwargs):
            return self._requires_grad(func, args, kwargs)
        if self.draws is not None and self.draws.pending:
            self.draws.note_torch_call(args, kwargs)
        if func is _torch.SET_GRAD_ENABLED:
            return self._set_grad_enabled(func, args, kwargs)
        if func in _RENORMING_LOOKUPS:
            return self._lookup_renorming_visibly(func, args, kwargs)
        if self._watch is not None:
            self._note_tensors(args, kwargs)
        elif args and _is_in_place(func) and getattr(args[0], _DETACHED, False):
            return self._mutate_detached_alias(func, args, kwargs)
        if self._after_a_grad_marker:
            for t in pytree.tree_leaves((args, kwargs)):
                self._current_node(t)
        cast_reads = self.casts.reads(args, kwargs, self._current_node)
        mark = _torch.last_node(_torch.current_tracer().graph) if cast_reads else None
        try:
            call = functools.partial(func, *args, **kwargs)
            if self._watch is None and self._any_no_grad_view and _reads_no_grad_view(args, kwargs):
                call = functools.partial(self._call_marking_view_replays, func, args, kwargs)
            if self._any_leaf and func not in (ops.REQUIRES_GRAD, ops.KEEP_HISTORY):  # our reads: not again
                out = self._call_reading_through(func, args, kwargs, call)
            else:
                out = call()
        except RuntimeError as e:
            if _is_custom_op(func) and "alias annotations" in str(e):
                raise ExportError(
                    f"{func} at {user_location()} returns an alias of its input (its schema says "
                    "so): functionalization cannot trace a custom op that does; return a new "
                    "tensor, or write the op's body in aten ops") from e
            raise
        if _is_custom_op(func):
            _refuse_hidden_alias(func, args, kwargs, out)
        self.casts.after(cast_reads, out, mark)
        self._note_views(func, args, out)
        if kwargs.get("requires_grad") and isinstance(out, _torch.FunctionalTensor):
            self._note_leaf(out)  # torch.ones(..., requires_grad=True)
        return out

    def _requires_grad(self, func, args, kwargs):
        """``t.requires_grad_()`` / ``t.requires_grad = True``: no node in a
        trace above autograd; the tensor is marked, and later calls read it
        through the op (:meth:`_call_reading_through`)."""
        t = args[0]
        required = t.requires_grad
        out = func(*args, **kwargs)
        if isinstance(t, _torch.FunctionalTensor):
            self._note_leaf(t, required)
        return out

    def _note_leaf(self, t, required=False) -> None:
        node = self._current_node(t)
        if node is None:
            return
        if node.op == "placeholder":
            if required:
                return  # a parameter that requires grad: nothing changes
            raise ExportError(
                f"requires_grad set on a parameter, buffer or input at {user_location()}: eager "
                "changes the caller's tensor, which a program cannot; set it before the call")
        setattr(t, _LEAF, True)
        for mark in (_DETACHED, _NO_GRAD_VIEW):  # a leaf now: its grad-mode views have a history
            if hasattr(t, mark):
                delattr(t, mark)
        self._any_leaf = True

    def read_leaf_outputs(self, out):
        """Outputs are read through their op too (functionalization replays
        an output view from memory once the forward returns)."""
        if not self._any_leaf:
            return out

        def read(t):
            through = self._read_through(t, replayed_later=True)
            if through is None:
                return t
            op, leading = through
            out = op(*(t for _ in leading), t)  # its leading arguments are nodes: set below
            node = _torch.current_node(out)
            node.args = (*leading, *node.args[len(leading):])
            if op is ops.KEEP_HISTORY:
                _mark_own_read(node, t)
            return out
        return pytree.tree_map_only(_torch.FunctionalTensor, read, out)

    def _read_through(self, t, replayed_later=False):
        """(op, nodes before ``t`` in its arguments) a read of ``t`` goes
        through, or None:

        * ``requires_grad`` for a tensor made to require grad;
        * ``keep_history(own, t)`` for a tensor whose history is the node
          ``own`` (a detached alias updated in grad mode: the update, see
          :meth:`_mutate_detached_alias`; a grad-mode view of a tensor read
          through an op: the view as made, from that read), once
          functionalization replayed it from memory, or will (an output)."""
        if getattr(t, _LEAF, False):
            return ops.REQUIRES_GRAD, ()
        own = getattr(t, _OWN_HISTORY, None)
        if isinstance(own, _ViewOfUpdate):
            own = own.node()
            setattr(t, _OWN_HISTORY, own)
        if own is not None and (replayed_later or self._current_node(t) is not own):
            return ops.KEEP_HISTORY, (own,)
        return None

    def _call_reading_through(self, func, args, kwargs, call, read_written=False):
        """A call reading tensors :meth:`_read_through` names: the nodes it
        makes read the op of them instead (a leaf's history, an alias's own),
        as eager's call would differentiate through them. The tensors
        themselves are untouched, so what aliases what is as in eager (a view
        of one reads it through the op; its later replays from the base do
        not); the tensor an in-place op writes is written as itself (and,
        ``read_written``, read through its op: a detached alias updated in
        grad mode again computes from its own history)."""
        written = args[0] if args and _is_in_place(func) and not read_written else None
        reading = {node: (through, t) for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, _torch.FunctionalTensor) and t is not written
                   and (through := self._read_through(t)) is not None
                   and (node := self._current_node(t)) is not None}
        if not reading:
            return call()
        graph = _torch.current_tracer().graph
        mark = _torch.last_node(graph)
        out = call()
        reads = {}
        for node in list(_torch.nodes_after(mark)):
            for value in [i for i in node.all_input_nodes if i in reading]:
                if value not in reads:
                    (op, leading), t = reading[value]
                    with graph.inserting_after(mark):
                        reads[value] = graph.call_function(op, (*leading, value))
                    if op is ops.KEEP_HISTORY:
                        _mark_own_read(reads[value], t)
                    reads[value].meta.update({k: v for k, v in node.meta.items()
                                              if k in ("stack_trace", "nn_module_stack")})
                    reads[value].meta["val"] = value.meta.get("val")
                node.replace_input_with(value, reads[value])
        return out

    def _assign_data(self, t, value):
        """``t.data`` is a detached alias for which the tracer records no node
        (the graph would keep the history): traced as ``t.detach()``, whose
        node and alias handling are the same. ``t.data = value`` gives ``t``
        ``value``'s memory and layout, keeping ``t``'s autograd identity and
        history: ``t.set_(value)`` under no_grad, which is traced as such (of
        another dtype or device: refused)."""
        if not _swappable(t, value):
            raise ExportError(
                f"assigning Tensor.data at {user_location()} a tensor of another dtype or device "
                "cannot be exported soundly: the tensor changes type under autograd, which a "
                "functional graph cannot express; convert a copy instead")
        with self, torch.no_grad():  # the mode is off inside its own handler
            t.set_(value)

    def _lookup_renorming_visibly(self, func, args, kwargs):
        """``F.embedding(max_norm=...)`` renorms the weight in place through a
        detached alias inside the call, where this mode does not see it (the
        graph would drop the weight's history). Renorm first, under this
        mode, then look up without max_norm."""
        bound = _RENORMING_LOOKUPS[func].bind(*args, **kwargs)
        max_norm = bound.arguments.get("max_norm")
        if max_norm is not None:
            norm_type = bound.arguments.get("norm_type", 2.0)
            with self:  # the mode is off inside its own handler
                torch.embedding_renorm_(bound.arguments["weight"].detach(),
                                        bound.arguments["input"].contiguous(), max_norm, norm_type)
            bound.arguments["max_norm"] = None
        return func(*bound.args, **bound.kwargs)

    def sync_no_grad_view_outputs(self, out) -> None:
        """Outputs are brought up to date after the forward; replay those that
        are views made under no_grad now, marked."""
        for t in pytree.tree_leaves(out):
            if getattr(t, _NO_GRAD_VIEW, False):
                self._call_marking_view_replays(torch._sync, (t,), {})

    def sync_grad_view_outputs(self, out) -> None:
        """Output views are brought up to date after the forward; replay those
        made in grad mode now, marked."""
        for t in pytree.tree_leaves(out):
            self._current_node(t)

    def _current_node(self, t) -> torch.fx.Node | None:
        """``t``'s node, up to date. A view made in grad mode whose base was
        updated since is replayed from the base, maybe in the caller's mode:
        the replay is marked with where the view was made (a block may have
        set grad on there)."""
        made_after, made_as = getattr(t, _MADE_AFTER, None), getattr(t, _MADE_AS, None)
        no_grad_view, input_view = getattr(t, _NO_GRAD_VIEW, False), getattr(t, _INPUT_VIEW, False)
        if made_after is None and made_as is None and not (no_grad_view or input_view):
            return _torch.current_node(t)
        last = _torch.last_node(_torch.current_tracer().graph)
        node = _torch.current_node(t)
        if last.next.op == "root":
            return node
        if no_grad_view:  # replayed, maybe in grad mode: eager's view has no history
            _mark_view_replays(last, NO_GRAD_VIEW_REPLAY)
        if input_view:  # replayed, maybe under a no_grad caller: eager's view has its history
            _mark_view_replays(last, INPUT_VIEW)
        if made_after is not None:  # replayed: the history stage reads where it was made
            for replay in _torch.nodes_after(last):
                replay.meta[GRAD_VIEW_REPLAY] = made_after
            self.record.needed.append(made_after)
        if made_as is not None and node is not made_as and node.meta.get(REPLAY_OF) is None:
            node.meta[REPLAY_OF] = made_as
            self.record.needed.append(made_as)
        return node

    def _call_marking_view_replays(self, func, args, kwargs):
        """In grad mode, functionalization may replay a view made under no_grad
        from its base, in grad mode, reading a value that keeps its history:
        the replay would require grad where eager's view does not. Mark the
        view ops this call creates."""
        last = _torch.last_node(_torch.current_tracer().graph)
        out = func(*args, **kwargs)
        _mark_view_replays(last, NO_GRAD_VIEW_REPLAY)
        return out

    def _note_views(self, func, args, out):
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, _torch.FunctionalTensor) and _torch.is_view(t):
                self._span_views.append(t)
                if source is not None and t is not source and not hasattr(t, _SOURCE):
                    setattr(t, _SOURCE, source)
                    setattr(t, _EAGER_VIEW, func is not torch.Tensor.detach)
                    detached = func is torch.Tensor.detach or getattr(source, _DETACHED, False)
                    no_grad = not torch.is_grad_enabled() or getattr(source, _NO_GRAD_VIEW, False)
                    if detached:
                        setattr(t, _DETACHED, True)
                        if func is torch.Tensor.detach:
                            setattr(t, _DETACH_RESULT, True)
                        if not no_grad:
                            self._detached_views.add(t)
                    if no_grad:
                        setattr(t, _NO_GRAD_VIEW, True)
                        self._any_no_grad_view = True
                    if not (detached or no_grad):  # a view with eager autograd history
                        self._grad_views.add(t)
                        setattr(t, _MADE_AS, _torch.materialized_node(t))
                        if self._after_a_grad_marker:
                            setattr(t, _MADE_AFTER, _torch.last_node(_torch.current_tracer().graph))
                    if not no_grad and func is not torch.Tensor.detach and (
                            getattr(source, _LEAF, False) or hasattr(source, _OWN_HISTORY)):
                        # its history is that of the view as made now, from the source's read
                        setattr(t, _OWN_HISTORY, _torch.materialized_node(t))

    @staticmethod
    def _detach_result(t):
        """The ``detach()`` result ``t`` is (a view of): its autograd base."""
        while not getattr(t, _DETACH_RESULT, False) and (source := getattr(t, _SOURCE, None)) is not None:
            t = source
        return t

    @staticmethod
    def _base(t: torch.Tensor) -> torch.Tensor:
        while (source := getattr(t, _SOURCE, None)) is not None:
            t = source
        return t

    def note_swapped(self, t, before) -> None:
        """``t.set_(source)`` (``before``: ``t``'s node until then): eager's set_
        under no_grad keeps ``t``'s autograd history, so an update of ``t`` in
        grad mode computes from it (the part it does not write keeps it):
        reads of ``t`` go through ``keep_history(before, value)``, ``before``
        of its first swap. (Given another shape where eager's history would
        not take it as autograd checks it, the history stage decides.)"""
        setattr(t, _SWAPPED_AT, user_location())
        if self._watch is not None and id(t) in self._watch:
            before = self._watch[id(t)][1]  # updated under this no_grad span: eager keeps the history before
        sharers = self._swapped.setdefault(_torch.storage_of(t), [])
        sharers += [s for s in (t, getattr(t, _SOURCE, None)) if s is not None and all(s is not o for o in sharers)]
        if getattr(t, _SWAPPED, False):
            return
        setattr(t, _SWAPPED, True)
        if before is None or hasattr(t, _OWN_HISTORY):
            return
        setattr(t, _OWN_HISTORY, before)
        # its reads: as the history stage keeps it (a no_grad update), shape checked (see SWAPPED_HISTORY)
        setattr(t, _SWAP_HISTORY, (before, SWAPPED_VIEW if _made_by_a_view(t) else _SWAPPED_NO_VIEW))
        self._any_leaf = True

    def _mutate_detached_alias(self, func, args, kwargs):
        """In grad mode, an in-place op on a detached alias changes its base's
        values without autograd seeing it: like a mutation under no_grad. The
        alias itself gets the update's history (from its operands): the
        base's new value, viewed as the alias, keeps it, and later reads of
        the alias, which functionalization replays from memory through the
        detach, read ``keep_history(that, value)`` (see :meth:`_read_through`)."""
        alias, base = args[0], self._base(args[0])
        detached = self._detach_result(alias)
        if hasattr(detached, _OWN_HISTORY):
            if not torch.is_grad_enabled():
                return func(*args, **kwargs)  # new values; the history eager keeps is read as before
            return self._update_own_history(func, args, kwargs, alias, detached)
        if (torch.is_grad_enabled() and _torch.layout(detached) != _torch.layout(base)
                and getattr(func, "__name__", None) not in _METADATA_UPDATES
                and _takes_a_float_tensor(args[1:], kwargs)):
            # the base's new value is not the alias's: the update's history is traced on a copy
            return self._update_own_history(func, args, kwargs, alias, detached)
        old = self._current_node(base)
        call = functools.partial(func, *args, **kwargs)
        out = self._call_reading_through(func, args, kwargs, call, read_written=True) if self._any_leaf \
            else call()
        new = self._current_node(base)
        # eager's autograd base of the alias is the detach result it is a view of:
        # the update gives it a history, from which every view of it regenerates its own
        # (not a new layout of the alias: the base's value is the one it had)
        if new is not old and (updated := _update_of(detached, base, old, new)) is not None:
            setattr(detached, _OWN_HISTORY, updated)
            self._any_leaf = True  # reads go through _read_through from now on
            for view in list(self._detached_views):
                if view is not detached and self._detach_result(view) is detached:
                    setattr(view, _OWN_HISTORY, _ViewOfUpdate(updated, detached, view, user_location()))
        if old is not None and new is not None and new is not old:
            self.record.replacements.append(Replacement(old, new, new, user_location()))
        return out

    def _update_own_history(self, func, args, kwargs, alias, detached):
        """In grad mode, an in-place op on (a view of) a detached alias that has
        a history of its own (an earlier update's, or the one ``set_`` kept):
        eager's update computes from that history, so the part it does not
        write keeps it. The op is traced on a copy of the alias's value that
        carries the history (``keep_history``; a plain copy for a first update
        of an alias of part of its base), through the same view; the
        copy's new value becomes the alias's history (``keep_history_if_no_grad``
        of the one before: code in the caller's mode keeps it under a no_grad
        caller), and its values are written to the alias's memory without it."""
        through = self._read_through(detached, replayed_later=True)
        if through is None:  # a first update: the alias has no history of its own yet
            copy = torch.clone(detached)
        else:
            own, value = through[1][0], self._current_node(detached)
            copy = ops.KEEP_HISTORY(detached, detached)
            node = _torch.current_node(copy)
            node.args = (own, value)
            _mark_own_read(node, detached)
        if getattr(func, "__name__", None) in _METADATA_UPDATES:  # a new layout, the same values
            if alias is detached:
                func(copy, *args[1:], **kwargs)
                setattr(detached, _OWN_HISTORY, self._current_node(copy))
            return func(*args, **kwargs)
        target = copy if alias is detached else self._same_view(copy, detached, alias)
        rest = (target, *args[1:])
        call = functools.partial(func, *rest, **kwargs)
        self._call_reading_through(func, rest, kwargs, call) if self._any_leaf else call()
        updated = self._current_node(copy)
        if through is not None:  # in the caller's mode, under a no_grad caller, eager keeps the history before
            kept = _torch.current_node(ops.KEEP_HISTORY_IF_NO_GRAD(copy, copy))
            kept.args, updated = (node, updated), kept
        base = self._base(alias)
        old = self._current_node(base)
        mark = _torch.last_node(_torch.current_tracer().graph)
        detached.copy_(copy.detach())
        for node in _torch.nodes_after(mark):  # the memory's new values, no history of the alias's
            if node.target is torch.ops.aten.copy.default:
                node.meta[VALUES_ONLY] = True
        if old is not None and (new := self._current_node(base)) is not None and new is not old:
            self.record.replacements.append(Replacement(old, new, new, user_location()))  # as above
        setattr(detached, _OWN_HISTORY, updated)
        self._any_leaf = True  # reads go through _read_through from now on
        for view in list(self._detached_views):
            if view is not detached and self._detach_result(view) is detached:
                setattr(view, _OWN_HISTORY, _ViewOfUpdate(updated, detached, view, user_location()))
        return alias

    @staticmethod
    def _same_view(copy, detached, alias):
        """``alias`` (a view of ``detached``) seen in ``copy`` (laid out as ``detached``)."""
        (_, stride, offset), (size, view_stride, view_offset) = _torch.layout(detached), _torch.layout(alias)
        if tuple(copy.stride()) != stride:
            raise ExportError(
                f"an in-place update, in grad mode at {user_location()}, of a view of a detached "
                "alias that has a history of its own, laid out in a way its copy is not: cannot "
                "be exported soundly; update the alias itself, or a clone")
        return copy.as_strided(size, view_stride, view_offset - offset)

    def before_functional_op(self, func, written) -> None:
        """Before each op functionalization sees (``written``: the tensors it writes)."""
        self.sync_grad_mode()
        if written:
            if self._swapped:
                self._note_swap_updates(func, written)
            self.note_written(written)

    def reuse_mark(self):
        """What a layer traced once and stamped later (:mod:`predispatch.trace.layer_reuse`)
        must leave as it found it; None where the recorder's state allows no
        reuse now (under no_grad, after a leaf, inside a hidden block, with a
        host random draw pending)."""
        if (self._watch is not None or self._any_leaf or self._hidden_blocks or not torch.is_grad_enabled()
                or (self.draws is not None and self.draws.pending)):
            return None
        r = self.record
        return (len(r.replacements), len(r.needed), len(self._block_ids), len(self._written or ()),
                self._after_a_grad_marker, self._any_no_grad_view, self._grad_mode)

    def sync_grad_mode(self) -> None:
        """A grad-mode change no torch-function mode saw: a library function
        reached through ``handle_torch_function`` (``nn.init.constant_``) runs
        its body, and the no_grad block in it, with every torch-function mode
        off. Marked before the next op, as a block whose exit restores the
        mode its entry found."""
        actual = torch.is_grad_enabled()
        if actual == self._grad_mode:
            return
        if self._hidden_blocks and self._hidden_blocks[-1][1] == actual:
            owner = self._hidden_blocks.pop()[0]
            phase = "exit"
        else:
            owner = object()
            self._hidden_blocks.append((owner, self._grad_mode, user_location()))
            phase = "enter"
        with torch._C.DisableTorchFunction():  # the marker's bookkeeping runs in the mode before it
            _torch.SET_GRAD_ENABLED(self._grad_mode)
        self._set_grad_enabled(_torch.grad_mode_marker, (actual,), {},
                               caller=(phase, owner))

    def refuse_unrestored_hidden_blocks(self) -> None:
        self.sync_grad_mode()
        if self._hidden_blocks:
            raise ExportError(
                f"grad mode changed inside the library call at {self._hidden_blocks[-1][2]} and "
                "not restored by the end of the forward: the program cannot know what mode its "
                "caller is left in; restore it before returning")

    def note_written(self, tensors) -> None:
        """Before an op writes ``tensors`` in grad mode: their values (and their
        bases') before the first write since the last grad-mode marker."""
        if self._written is None:  # under no_grad: the span's watch sees it
            if self._watch is not None:  # unless torch-function modes are off (see sync_grad_mode)
                self._note_tensors(tensors, {})
            return
        # the call's tensors too: a view made inside it (x[0] = v) leads to none
        called = [a for a in pytree.tree_leaves(self._call or ()) if isinstance(a, _torch.FunctionalTensor)]
        for written in [*tensors, *called]:
            for t in (written, self._base(written)):
                if id(t) not in self._written and (node := self._current_node(t)) is not None:
                    self._written[id(t)] = (t, node)

    def _note_swap_updates(self, func, tensors) -> None:
        """A write (not a layout change) to memory a set_() made shared: each
        other sharer's value before it and the ops that read it before the
        call (see :func:`keep_history.refuse_updates_of_saved_values`). A
        sharer with the writer's version counter (itself, its views) is
        eager's own check's business."""
        if torch.Tag.inplace_view in getattr(func, "tags", ()):
            return
        before = _nodes_up_to(self._call_start)
        # the update's own ops too, reading it as another operand than the one they write:
        # eager's in-place op saves that operand, then overwrites its memory
        own = _nodes_up_to(_torch.last_node(_torch.current_tracer().graph)) - before
        for storage in {_torch.storage_of(t) for t in tensors} & self._swapped.keys():
            for owner in self._swapped[storage]:
                if any(_counter_owner(owner) is _counter_owner(t) for t in tensors):
                    continue
                if (node := self._current_node(owner)) is not None:
                    readers = [(op, i) for op, i in _readers(node)
                               if op in before or (op in own and i not in (None, 0))]
                    self.record.swap_updates.append((node, readers, user_location()))

    def end_grad_mode_segment(self) -> None:
        """At a grad-mode marker in grad mode, or at the forward's end: the
        values written since the last marker were replaced."""
        written, self._written = self._written, {}
        pairs = {}
        for t, old in (written or {}).values():
            new = self._current_node(t)
            if new is not None and new is not old:
                pairs[new] = (old, _made_by_a_view(t), getattr(t, _SWAPPED, False))
        if pairs:
            exit = _torch.last_node(_torch.current_tracer().graph)
            self.record.replacements.extend(
                Replacement(old, new, exit, in_grad_mode=True, eager_view=view, swapped=swapped)
                for new, (old, view, swapped) in pairs.items())

    def _set_grad_enabled(self, func, args, kwargs, caller=_FROM_STACK):
        if bool(args[0]) and inside_inference_mode():
            raise ExportError(
                f"grad mode switched on inside a torch.inference_mode() block at {user_location()} "
                "cannot be exported soundly: in eager autograd still records nothing there, which "
                "a grad-mode region cannot express; use torch.inference_mode(False) to record, "
                "or leave grad mode off")
        if caller is _FROM_STACK:
            self.sync_grad_mode()  # a hidden block may have ended with no op after it
            caller = _torch.grad_mode_caller()
            if caller is None and bool(args[0]) == torch.is_grad_enabled() and _called_from_torch():
                with torch._C.DisableTorchFunction():  # torch setting the mode it has: no block
                    return func(*args, **kwargs)
        self._after_a_grad_marker = True
        was_enabled = torch.is_grad_enabled()
        # at every marker, not only where the trace's mode changes: a block may fix
        # the mode the caller's code (where a stale view is replayed) does not
        self._materialize_span_views()
        if was_enabled:
            self.end_grad_mode_segment()
        turning_on = not was_enabled and bool(args[0])
        if was_enabled and not bool(args[0]):
            self._note_views_at_entry()
        replaced = self._replaced_in_span() if turning_on else []
        node = func(*args, **kwargs)
        if isinstance(node, torch.fx.Node):
            node.meta[GRAD_BLOCK] = self._block_mark(caller)
            for old, new, view, swapped in replaced:
                self.record.replacements.append(Replacement(old, new, node, eager_view=view, swapped=swapped))
        if was_enabled and not torch.is_grad_enabled():
            self._watch = {}
        elif turning_on:
            self._watch = None
        self._written = {} if torch.is_grad_enabled() else None
        self._grad_mode = torch.is_grad_enabled()
        return None  # what eager's call returns (make_fx hands back its node)

    def _block_mark(self, caller):
        """(phase, block id, what the mode passed is: see :func:`passed_mode`)."""
        if caller is None:
            return ("bare", None, None)
        phase, owner = caller
        if id(owner) not in self._block_ids:
            self._block_ids[id(owner)] = len(self._block_ids)
            self._owners.append(owner)
        passed = (passed_mode(_torch.grad_mode_call_frame())
                  if isinstance(owner, torch.set_grad_enabled) and phase == "enter" else None)
        return (phase, self._block_ids[id(owner)], passed)

    def _note_tensors(self, args, kwargs):
        for arg in pytree.tree_leaves((args, kwargs)):
            if not isinstance(arg, _torch.FunctionalTensor):
                continue
            for t in (arg, self._base(arg)):  # a view made before the span changes its base
                if id(t) not in self._watch and (node := self._current_node(t)) is not None:
                    self._watch[id(t)] = (t, node)

    def _materialize_span_views(self):
        """Functionalization regenerates a view of a mutated tensor lazily, at
        its next use, which may be in another grad mode (a view taken under
        no_grad must not become differentiable). Bring views up to date in
        the mode they were made in."""
        for t in self._span_views:
            self._current_node(t)
        self._span_views = []

    def _note_views_at_entry(self):
        """Views made in grad mode have history in eager. If one is replayed
        inside the span (its base was mutated there) and used after it, the
        replay must keep that history: note each one's grad-mode value now."""
        self._views_at_entry = {}
        for view in list(self._grad_views):
            if (node := self._current_node(view)) is not None:
                self._views_at_entry[id(view)] = (view, node)

    def _replaced_in_span(self):
        """(old, new, made by a view op, set_() target) of the values the span replaced:
        tensors it used (noted at first use) and grad-mode views replayed inside it."""
        pairs = {}
        for t, old in (self._watch or {}).values():
            new = self._current_node(t)
            if new is not None and new is not old:
                swapped = getattr(t, _SWAPPED, False)
                if swapped and isinstance(own := getattr(t, _OWN_HISTORY, None), torch.fx.Node):
                    old = own  # a set_() target's history is its own, whatever its memory held
                pairs[new] = (old, _made_by_a_view(t), swapped)
        for view, old in self._views_at_entry.values():
            new = _torch.materialized_node(view)  # replayed inside the span, or not at all
            if new is not None and new is not old:  # the grad-mode value, even if first used after a mutation
                pairs[new] = (old, True, getattr(view, _SWAPPED, False))
        self._views_at_entry = {}
        return [(old, new, view, swapped) for new, (old, view, swapped) in pairs.items()]


_RENORMING_LOOKUPS = {f: inspect.signature(f) for f in (F.embedding, F.embedding_bag)}
_DATA = torch._C.TensorBase.__dict__["data"]  # torch-function modes see its __get__ / __set__


def _mark_own_read(node: torch.fx.Node, t: torch.Tensor) -> None:
    """``node``, ``keep_history(own, value)``, reads ``t``'s own history; a
    set_() target's kept from before the swap is marked as such."""
    node.meta[OWN_HISTORY_READ] = True
    swap = getattr(t, _SWAP_HISTORY, None)
    if swap is not None and swap[0] is node.args[0]:  # (not an own history given it later)
        node.meta[SWAPPED_HISTORY] = swap[1]


def _made_by_a_view(t: torch.Tensor) -> bool:
    """Was ``t`` made by a view op (or seen as a view of another input)? (A
    ``set_()`` does not change it, nor a relayout in place.)"""
    return getattr(t, _EAGER_VIEW, False)


def _mark_view_replays(last: torch.fx.Node, key: str) -> None:
    """Mark the view ops the graph got after ``last``."""
    for node in _torch.nodes_after(last):
        if getattr(node.target, "is_view", False):
            node.meta[key] = True


def _is_custom_op(func) -> bool:
    if not isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return False
    name = func._schema.name if isinstance(func, torch._ops.OpOverload) else func._qualified_op_name
    return name.split("::")[0] not in ("aten", "prim", "prims")


def _refuse_hidden_alias(func, args, kwargs, out) -> None:
    """A custom op kept whole that returns an alias of an input although its
    schema says it makes a new tensor: the program would not see the alias
    (aten's liars are found by tools/audit_composites.py and never kept)."""
    inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, _torch.FunctionalTensor)]
    for o in pytree.tree_leaves(out):
        if isinstance(o, _torch.FunctionalTensor) and _torch.hides_an_alias(o, inputs):
            raise ExportError(
                f"{func} returned an alias of its input although its schema says it returns a "
                f"new tensor, at {user_location()}: kept whole (the op policy keeps it), the "
                f"program would not see the alias; decompose it (OpPolicy.decompose) or declare "
                f"the alias in its schema (Tensor(a) -> Tensor(a))")


_REQUIRES_GRAD_ATTR = torch._C.TensorBase.__dict__["requires_grad"]


def _sets_requires_grad(func, args, kwargs) -> bool:
    """``t.requires_grad_()`` / ``t.requires_grad_(True)`` / ``t.requires_grad = True``."""
    if func is torch.Tensor.requires_grad_:
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return (getattr(func, "__self__", None) is _REQUIRES_GRAD_ATTR
            and func.__name__ == "__set__" and bool(args[1]))


def _swappable(t, value) -> bool:
    return isinstance(value, torch.Tensor) and (t.dtype, t.device) == (value.dtype, value.device)


@dataclasses.dataclass
class _ViewOfUpdate:
    """The history of a view made of a detached alias before the alias was
    updated in grad mode: eager regenerates it from the alias's new one, as
    ``as_strided`` of the update (made where it is first read)."""

    update: torch.fx.Node
    size: tuple
    stride: tuple
    offset: int
    where: str

    def __init__(self, update, alias, view, where):
        val = update.meta.get("val")
        (_, alias_stride, alias_offset), (size, stride, offset) = _torch.layout(alias), _torch.layout(view)
        if val is None or tuple(val.stride()) != alias_stride:
            raise ExportError(
                f"a view of a detached alias that is then updated in place with an operand that "
                f"requires grad, at {where}, when the update's value is laid out otherwise than "
                "the alias: cannot be exported soundly; take the view after the update")
        self.update, self.where = update, where
        self.size, self.stride, self.offset = size, stride, offset - alias_offset

    def node(self) -> torch.fx.Node:
        graph = self.update.graph
        with graph.inserting_after(_torch.last_node(graph)):
            node = graph.call_function(torch.ops.aten.as_strided.default,
                                       (self.update, list(self.size), list(self.stride), self.offset))
        node.meta["val"] = _torch.fake_as_strided(self.update.meta["val"], self.size, self.stride, self.offset)
        node.meta[OWN_HISTORY_READ] = True  # the update's own history: no kept one replaces it
        return node


# in-place ops that change a tensor's layout, not its values
_METADATA_UPDATES = {"t_", "transpose_", "swapdims_", "swapaxes_", "unsqueeze_", "squeeze_", "as_strided_"}


def _readers(node: torch.fx.Node) -> list[tuple[torch.fx.Node, int | None]]:
    """(op, the position of the argument it reads, None if not positional)
    of the ops other than views reading ``node``'s value (or a view of it,
    or it read through predispatch's ops: as a leaf, as a kept value)."""
    found = []
    for user in node.users:
        if user.op != "call_function":
            continue
        if getattr(user.target, "is_view", False) or user.target is ops.REQUIRES_GRAD or (
                user.target in (ops.KEEP_HISTORY, ops.KEEP_HISTORY_IF_NO_GRAD) and user.args[-1] is node):
            found += _readers(user)  # the same values on: read through
        elif user.target not in (ops.KEEP_HISTORY, ops.KEEP_HISTORY_IF_NO_GRAD):
            found.append((user, user.args.index(node) if node in user.args else None))
    return found


def _counter_owner(t):
    """The tensor whose autograd version counter ``t`` shares: its view
    chain's root, stopping at a set_() target (set_ keeps its own)."""
    while not getattr(t, _SWAPPED, False) and (source := getattr(t, _SOURCE, None)) is not None:
        t = source
    return t


def _nodes_up_to(mark: torch.fx.Node | None) -> set:
    if mark is None:
        return set()
    found, node = set(), mark
    while node.op != "root":
        found.add(node)
        node = node.prev
    return found


def _reshaped_history_differs(node: torch.fx.Node, relaid: bool = False) -> bool:
    """Would eager treat gradients of another shape reaching ``node``'s history
    otherwise than autograd's check does (a leaf's, a view's)? Then the
    history stage decides (see :func:`predispatch.passes.history._refuse_reshaped_history`).
    (``relaid``: the tensor is no eager view, the view ops holding it relaid it in place.)"""
    while node.op == "call_function" and node.args and (
            node.target in (ops.KEEP_HISTORY, ops.KEEP_HISTORY_IF_NO_GRAD)
            or (relaid and getattr(node.target, "is_view", False))):
        node = node.args[0]
    return _torch.returns_a_view(node)


def _takes_a_float_tensor(args, kwargs) -> bool:
    """Can an in-place op's operands give the tensor it writes a history?"""
    return any(isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex())
               for t in pytree.tree_leaves((args, kwargs)))


def _update_of(alias, base, old: torch.fx.Node, new: torch.fx.Node) -> torch.fx.Node | None:
    """The node holding ``alias``'s value as the in-place update made it, before
    it reached ``base`` (``old`` -> ``new``): for an alias of all of the base,
    the base's new value (computed from the detached alias, so with the
    update's history only); for an alias of part of it, the value the base's
    update scatters in. None where the graph does not show it."""
    if _torch.layout(alias) == _torch.layout(base):  # (functionalization's: set_ updates only those)
        return new
    if (new is not None and new.op == "call_function" and str(new.target).split(".")[-2].endswith("_scatter")
            and new.args[0] is old and isinstance(new.args[1], torch.fx.Node)):
        val = new.args[1].meta.get("val")
        if isinstance(val, torch.Tensor) and tuple(val.shape) == _torch.layout(alias)[0]:
            return new.args[1]
    return None


_OVERRIDES = torch.overrides.__file__


def _called_from_torch() -> bool:
    """Is the torch call being handled made by torch's own code (past this
    package's frames and the torch-function dispatch)?"""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == _OVERRIDES
                                 or frame.f_code.co_filename.startswith(PACKAGE_DIR)):
        frame = frame.f_back
    return frame is not None and is_library_file(frame.f_code.co_filename)




def _reads_no_grad_view(args, kwargs) -> bool:
    return any(getattr(t, _NO_GRAD_VIEW, False) for t in pytree.tree_leaves((args, kwargs))
               if isinstance(t, _torch.FunctionalTensor))


def _is_in_place(func) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name in ("__setitem__", "__iadd__", "__imul__", "__isub__", "__itruediv__")


def _note_mutation_kinds(record: TraceRecord, module, flat_inputs, strip) -> None:
    for name, t in module.named_parameters(remove_duplicate=False):
        if (kind := _torch.mutation_kind(t)) is not None:
            record.mutation_kinds[f"param:{strip(name)}"] = kind
    for name, t in module.named_buffers(remove_duplicate=False):
        if (kind := _torch.mutation_kind(t)) is not None:
            record.mutation_kinds[f"buffer:{strip(name)}"] = kind
    for i, t in enumerate(flat_inputs):
        if isinstance(t, torch.Tensor) and (kind := _torch.mutation_kind(t)) is not None:
            record.mutation_kinds[f"input:{i}"] = kind


def _set_calls_to_aliases(on_swap):
    """``t.set_(source)``: ``t`` takes ``source``'s storage and layout. Traced
    as ``t.set_(source.alias())``, the same storage, so that ``t``'s new value
    is a node of its own: the history stage may give it ``t``'s old history
    (``set_`` under no_grad keeps it) without giving it to ``source``. From
    then on ``t`` is to the recorder what a ``source.detach()`` is: an update
    of either changes the other's values, not its history. (set_ bypasses
    torch-function modes, so the method itself is wrapped; a storage or no
    argument is left to functionalization, which refuses them.) ``on_swap(t,
    node before)`` tells the recorder."""
    def aliasing(set_):
        def call(self, source=None, *args, **kwargs):
            out = traced(self, source, *args, **kwargs)
            if _torch.is_traced(self):  # (after the layout changes the trace made for it)
                eager_layout.set_to(self, source if isinstance(source, torch.Tensor) and not args else None)
            return out

        def traced(self, source=None, *args, **kwargs):
            if not (_torch.is_traced(self) and _torch.is_traced(source)) or args or kwargs or _UNOBSERVED:
                return set_(self, *(() if source is None else (source,)), *args, **kwargs)
            if _torch.storage_of(self) == _torch.storage_of(source):
                # the memory it has (set_ to itself, to its view): a new layout at most, as eager
                # gives it; functionalization's set_ would freeze the storage its views share
                layout = _torch.layout(source)
                setattr(self, _SWAPPED_AT, user_location())
                if _torch.layout(self) == layout:
                    return self
                with eager_layout.in_functional_terms():
                    return self.as_strided_(*layout)
            before = _torch.current_node(self)
            out = set_(self, _alias_in_grad_mode(source))
            _torch.sync_wrapper_layout(self)
            # the same memory as source, its own autograd identity: like a detach of it
            # (of the root of source's views: source may be a view of self)
            root = _Recorder._base(source)
            for mark, value in ((_SOURCE, None if root is self else root), (_DETACHED, True),
                                (_DETACH_RESULT, True)):
                setattr(self, mark, value)
            on_swap(self, before)
            return out
        return call
    return patched(torch.Tensor, "set_", aliasing)


def _alias_in_grad_mode(source):
    """``source.alias()`` made with grad on, unseen: under no_grad it would be
    a view made under no_grad, whose replay after an update in grad mode the
    trace's own autograd refuses (eager's set_ makes no view at all)."""
    with unobserved(), torch._C.DisableTorchFunction():
        mode = torch.is_grad_enabled()
        torch._C._set_grad_enabled(True)
        try:
            return torch.ops.aten.alias.default(source)
        finally:
            torch._C._set_grad_enabled(mode)


@contextlib.contextmanager
def _wrapping_what_modes_miss(recorder: _Recorder, draws: HostDraws):
    """What bypasses torch-function modes, wrapped where it lives while the
    forward runs (see :mod:`predispatch.trace.patching`)."""
    with _set_calls_to_aliases(recorder.note_swapped), noting_grad_mode_reads(), capturing_autograd_functions(), \
            refusing_host_randomness(draws), inference_mode_as_no_grad(), \
            buffer_reassignment_as_update(), refusing_state_calls():
        yield


@contextlib.contextmanager
def recording(module: torch.nn.Module, record: TraceRecord, strip, reuse_layers: bool = False):
    """Run ``module``'s forward under the recorder while it is traced
    (``reuse_layers``: repeated layers traced once, see :mod:`predispatch.trace.layer_reuse`)."""
    forward = module.forward
    eager_autocast_cache = torch.is_autocast_cache_enabled()  # make_fx turns it off

    def recorded_forward(*args, **kwargs):
        # what autocast may cache casts of: parameters, buffers, inputs (what at run time)
        casts = CastCache({id(t): _torch.current_node(t) for t in (
            *module.parameters(), *module.buffers(), *pytree.tree_leaves((args, kwargs)))
            if _torch.is_traced(t) and t.is_floating_point()})
        # the stamper on top: nodes the recorder's own calls make get the user's stack too
        # (and it stamps autocast's enter/exit as wrapped for the cache flag below it)
        draws = HostDraws()
        recorder = _Recorder(record, casts, draws)
        with autocast_blocks_as_in_eager(eager_autocast_cache, recorder.sync_grad_mode), \
                recorder, stamping_stack_traces() as stamper, \
                _wrapping_what_modes_miss(recorder, draws), _observing_ops(recorder.before_functional_op), \
                _reusing_layers(module, recorder, stamper, reuse_layers) as reuse:
            out = forward(*args, **kwargs)
            if reuse is not None:
                reuse.check_stamped()
            recorder.refuse_unrestored_hidden_blocks()
            out = recorder.read_leaf_outputs(out)
            recorder.sync_no_grad_view_outputs(out)
            if torch.is_grad_enabled():
                recorder.end_grad_mode_segment()
            recorder.sync_grad_view_outputs(out)
            draws.note_torch_call(out, None)  # a draw returned is replayed too
        _note_mutation_kinds(record, module, pytree.tree_leaves((args, kwargs)), strip)
        return out

    had_own_forward = "forward" in module.__dict__
    module.forward = recorded_forward
    try:
        yield
    finally:
        if had_own_forward:
            module.forward = forward
        else:
            del module.forward


@contextlib.contextmanager
def _reusing_layers(module, recorder, stamper, enabled: bool):
    from .layer_reuse import LayerReuse, note_no_reuse, reuse_enabled

    if not (enabled and reuse_enabled()):
        if enabled:
            note_no_reuse()
        yield None
        return
    with LayerReuse(module, recorder, stamper).installed() as reuse:
        yield reuse


_UNOBSERVED: list[bool] = []  # inside unobserved(): ops go straight to functionalization


@contextlib.contextmanager
def unobserved():
    """Ops traced meanwhile are not the forward's own (a write-back of
    ``ep.module()`` exported again): no rule, no recorder sees them."""
    _UNOBSERVED.append(True)
    try:
        yield
    finally:
        _UNOBSERVED.pop()


def _observing_ops(observer):
    """``observer(op, tensors it writes)`` before each op on FunctionalTensors,
    seen where functionalization sees it (so in-place updates inside library
    calls, ``F.relu(x, inplace=True)``, are seen too). A subclass of the mode
    would not do: higher-order ops look their functionalization rule up by
    the mode's exact type."""
    def observed(dispatch):
        def call(mode, func, types, args=(), kwargs=None, rules=True):
            kwargs = kwargs or {}
            if _UNOBSERVED:
                return dispatch(mode, func, types, args, kwargs)
            if (rules and args and isinstance(args[0], _torch.FunctionalTensor)  # not a kernel's inner call
                    and (rewrite := inplace_rules.traced_as(func, torch.is_grad_enabled())) is not None):
                # the rewrite's own ops are observed; the op it rewrites is not rewritten again
                return rewrite(lambda f, a, k: call(mode, f, types, a, k, rules=f is not func),
                               func, args, kwargs)
            tensors = []
            if written := _torch.written_arguments(func):
                tensors = [t for i, name in written
                           for t in ((args[i] if i < len(args) else kwargs.get(name)),)
                           if isinstance(t, _torch.FunctionalTensor)]
            observer(func, tensors)
            return dispatch(mode, func, types, args, kwargs)
        return call
    return patched(_torch.FunctionalTensorMode, "__torch_dispatch__", observed)
