"""The trace of the capture stage, in one pass.

``make_fx(pre_dispatch=True)`` over a function that runs the module under a
FunctionalTensorMode on the PreDispatch key, then returns the new values of
mutated inputs (parameters, buffers, user inputs, in that order) followed by
the outputs: the graph ``aot_export_module(pre_dispatch=True)`` makes, from
one trace instead of its two (a metadata pass, then the graph).

The steps, as :func:`functional_trace` takes them: the module's call
flattened (:func:`_flat_call`: its state first, then the user's inputs,
:class:`_FlatInputs`); one trace (:func:`_trace_once`), made again with
every layer traced where a stamped layer was mutated later (:func:`_trace`),
and again with overlapping user inputs seen through the base of their group
(a covering input, or a synthetic base made in the graph) where one of them
was mutated (:func:`_traced`); dead code dropped; the signature. Inside the
trace, the functionalized call (:func:`_functionalized_call`): the inputs
wrapped, the forward, the refusals of covers moved or relaid, the
write-backs, and the outputs that are inputs (returned as the caller's
tensors) or, in eager, views of inputs the forward wrote (:class:`OutputView`,
made again by ``ep.module()``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable

import torch

from .. import _torch
from ..errors import ExportError
from ..ir.blocks import grad_modes
from ..ir.records import Event, Kind
from . import eager_layout, input_aliasing, layer_reuse, recorder
from .recorder import marks
from .run_time_layouts import views_of_run_time_layouts_as_reshapes


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """How a parameter, buffer or input ends up after ``t_()``, ``resize_()``,
    ``set_()`` and the like: its storage (``"own"``; ``"other"``: that of the
    input ``source`` names; ``"value"``: one the forward made; ``"shared"``:
    the one the forward made that input ``source`` took before it) and its
    size, strides and storage offset there, counted from where that
    storage's owner starts (``"shared"``: where ``source`` ends up; None where
    symbolic: the new value's own are taken at run time), and its dtype
    where it changed (a rebound buffer)."""

    storage: str
    source: str | None
    size: tuple | None
    stride: tuple | None
    offset: int | None
    dtype: str | None = None  # a buffer rebound to a tensor of another dtype: that dtype
    # an input others are seen through, written and then relaid on its own memory: its value
    # is its memory as the call started, written back before the relayout
    as_started: bool = False
    # the grad mode of its last change ("grad", "no_grad", "caller"): the history stage's,
    # from the recorder; a program exported again has it from the program's record
    grad_mode: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items()
                if (k != "as_started" or v) and (k != "grad_mode" or v is not None)}


@dataclasses.dataclass(frozen=True)
class OutputView:
    """A user output that eager returns as a view of a parameter, buffer or
    input (``of``, keyed as :class:`LayoutChange`'s ``source``) whose memory
    the forward wrote: the program's value is a view of its own updated
    copy, so ``ep.module()`` makes the view again from the caller's tensor,
    after the write-backs (:mod:`predispatch.program.output_views`). Its
    ``size`` and ``stride``, its storage offset counted from where that
    tensor starts as the call leaves it (``offset``), and the grad mode
    eager made it in (``mode``): "no_grad" (no history), "grad" (blocks
    that set grad on), the "caller"'s (a view of its chain made outside
    every grad block), or "detached" (a view of a ``detach()``: no history
    in any mode)."""

    of: str
    size: tuple
    stride: tuple
    offset: int
    mode: str

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------- the flat call


@dataclasses.dataclass(frozen=True)
class _FlatInputs:
    """The traced function's flat inputs, in order: the module's state
    (parameters, then buffers; a tied tensor under each of its names), then
    the user's inputs, flattened. ``views``: the user inputs (by position
    among the user's) traced as views of another, which covers them."""

    state_keys: tuple  # "param:<name>" / "buffer:<name>", one per state input
    views: dict  # user position -> input_aliasing.View
    # user position -> input_aliasing.View of a synthetic base the module (a program exported again) builds
    built: dict = dataclasses.field(default_factory=dict)

    @property
    def n_state(self) -> int:
        return len(self.state_keys)

    def state(self, flat) -> list:
        """The module's state among ``flat`` (a list in this order)."""
        return list(flat[:self.n_state])

    def user(self, flat) -> list:
        """The user's inputs among ``flat`` (a list in this order)."""
        return list(flat[self.n_state:])

    def key(self, i: int) -> str:
        """Flat input ``i`` as the trace record names it (a user input by its position among the user's)."""
        return self.state_keys[i] if i < self.n_state else f"input:{i - self.n_state}"

    def user_positions(self, positions) -> list[int]:
        """The user inputs among the flat ``positions``, by position among the user's."""
        return [i - self.n_state for i in positions if i >= self.n_state]


@dataclasses.dataclass(frozen=True)
class _Tracing:
    """What each trace of the module's call takes: the flat function (the
    module's call on :class:`_FlatInputs`), make_fx's inputs, and who hears
    of a relaid input and of a second trace."""

    flat_fn: Callable
    flat_args: list
    on_layout_change: Callable | None
    on_retrace: Callable | None
    rebound: Callable = dict  # () -> "buffer:<fqn>" -> the tensor the forward rebound it to
    record: object = None  # the TraceRecord the recorder fills (user inputs seen as views are noted in it)

    def note_retrace(self) -> None:
        if self.on_retrace is not None:
            self.on_retrace()


def functional_trace(mod: torch.nn.Module, args, kwargs, keep=frozenset, on_layout_change=None,
                     on_retrace=None, rebound=dict, record=None, on_output_view=None):
    """(graph module, aot-style GraphSignature, the user inputs seen as views
    of others: see :mod:`predispatch.trace.input_aliasing`) of ``mod(*args, **kwargs)``.
    Dead code goes, except the nodes ``keep()`` names. ``on_layout_change(key,
    LayoutChange)`` hears of each input whose layout or storage changed (keys
    as ``"param:<name>"``, ``"buffer:<name>"``, ``"input:<flat index>"``);
    ``on_retrace()`` of a second trace (inputs overlapping in memory, one mutated);
    ``rebound()`` names the buffers the forward rebound (keys as above), each
    written back as the tensor it holds at the end. ``record``: the recorder's
    TraceRecord, where the user inputs traced as views of another are noted.
    ``on_output_view(index, OutputView)`` hears of each user output (by its
    flat position) that eager returns as a view of an input the forward wrote."""
    named_parameters = dict(mod.named_parameters(remove_duplicate=False))
    named_buffers = dict(mod.named_buffers(remove_duplicate=False))
    tracing, layout, in_spec, out_spec = _flat_call(mod, args, kwargs or {}, named_parameters, named_buffers,
                                                    on_layout_change, on_retrace)
    tracing = dataclasses.replace(tracing, rebound=rebound, record=record)
    gm, mutated, layout, out_views = _traced(tracing, layout)
    if on_output_view is not None:
        for index, view in _made_in_modes(gm, out_views).items():
            on_output_view(index, view)
    _drop_storage_swaps_of_constants(gm)
    _drop_dead_code(gm, keep())
    views_of_run_time_layouts_as_reshapes(gm)
    outputs_made_distinct(gm, range(len(mutated)))
    return (gm, _signature(gm, named_parameters, named_buffers, mutated, in_spec, out_spec.spec),
            {**layout.views, **layout.built})


def _flat_call(mod, args, kwargs: dict, named_parameters: dict, named_buffers: dict, on_layout_change,
               on_retrace) -> tuple:
    """The module's call over flat inputs, its state first, as AOTAutograd
    makes it: (:class:`_Tracing`, :class:`_FlatInputs` with no views yet,
    the inputs' spec, the outputs' spec, known once traced)."""
    state_flat, state_spec = _torch.pytree.tree_flatten({**named_parameters, **named_buffers})
    call = _torch.create_functional_call(mod, state_spec, len(state_flat), store_orig_mod=True)
    flat_fn, out_spec = _torch.create_tree_flattened_fn(call, [*state_flat, *args], kwargs)
    flat_args, in_spec = _torch.pytree.tree_flatten(([*state_flat, *args], kwargs))
    keys = (*(f"param:{n}" for n in named_parameters), *(f"buffer:{n}" for n in named_buffers))
    return _Tracing(flat_fn, flat_args, on_layout_change, on_retrace), _FlatInputs(keys, {}), in_spec, out_spec


# ---------------------------------------------------------------- the traces


def _traced(tracing: _Tracing, layout: _FlatInputs) -> tuple:
    """(graph module, the flat positions of the inputs written back, the
    layout it was traced with, the outputs eager returns as views of inputs
    written: see :func:`_output_views`): traced again with overlapping user inputs
    seen through the base of their group, where the first trace mutated
    one; but for the synthetic bases a program exported again builds
    itself (its example inputs aliasing as the program's did), which the
    trace does not build a second time: the same graph (G7)."""
    gm, mutated, built, out_views = _trace(tracing, layout)
    overlapping = _overlapping_inputs(layout, tracing.flat_args, mutated)
    layout = dataclasses.replace(layout, built={
        j: v for j, v in overlapping.items() if v.base is not None and built.get(j) == v})
    views = {j: v for j, v in overlapping.items() if j not in layout.built}
    if not views:
        return gm, mutated, layout, out_views
    tracing.note_retrace()
    layout = dataclasses.replace(layout, views=views)
    gm, mutated, _, out_views = _trace(tracing, layout)
    return gm, mutated, layout, out_views


def _overlapping_inputs(layout: _FlatInputs, flat_args: list, mutated: list[int]) -> dict:
    """User inputs that overlap another in memory, where one of their group
    was mutated -> how each is seen from the base of the group, an input
    covering it or a synthetic one (see
    :func:`predispatch.trace.input_aliasing.aliased_inputs`)."""
    user = layout.user(flat_args)
    if not _some_share_storage(user):
        return {}
    return input_aliasing.aliased_inputs(user, layout.user_positions(mutated))


def _some_share_storage(inputs) -> bool:
    storages = [input_aliasing.storage(t) for t in inputs
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and _torch.may_be_nonempty(t)]
    return len(storages) != len(set(storages))


def _trace(tracing: _Tracing, layout: _FlatInputs) -> tuple:
    """:func:`_trace_once`; again with every layer traced where a stamped
    layer's tensors were mutated later (:class:`layer_reuse.Retrace`)."""
    try:
        return _trace_once(tracing, layout)
    except layer_reuse.Retrace:
        tracing.note_retrace()
        with layer_reuse.reuse_layers(False):
            return _trace_once(tracing, layout)


def _trace_once(tracing: _Tracing, layout: _FlatInputs) -> tuple:
    """One make_fx trace of the functionalized call: (graph module, the flat
    positions of the inputs written back, in the order of their new values,
    the user inputs a program exported again sees through synthetic bases
    it builds itself: see :func:`predispatch.trace.input_aliasing.views_built_by_program`,
    the outputs eager returns as views of inputs written: :func:`_output_views`)."""
    mutated: list[int] = []
    built: dict = {}
    out_views: dict = {}

    @functools.wraps(tracing.flat_fn)  # carries the module: make_fx records nn_module_stack and stack traces
    def functionalized(*flat):
        # make_fx made and tracked the inputs with torch-function modes off (below): on for the module
        with _torch.torch_function_enabled():
            return _functionalized_call(flat, tracing, layout, (mutated, built, out_views))

    # make_fx's own work around the module's call (making, tracking and reading the inputs and outputs:
    # metadata reads, not the module's torch calls) with torch-function modes off, at ~250 us an input;
    # the grad mode as it was: a bare switch left in force must not start a second trace in its mode
    with _torch.enable_python_dispatcher(), _torch.wrappers_sized_by_wrapped_storage(), \
            _torch.torch_function_disabled(), _torch.placeholders_without_stack_traces(), \
            torch.set_grad_enabled(torch.is_grad_enabled()):
        gm = _torch.make_fx(functionalized, record_module_stack=True, pre_dispatch=True)(*tracing.flat_args)
    return gm, mutated, built, out_views


# ---------------------------------------------------------------- the functionalized call


@dataclasses.dataclass(frozen=True)
class _CallInputs:
    """One traced call's flat inputs: make_fx's (``given``) and the
    FunctionalTensors the module runs on (``functional``: a tied tensor
    wrapped once, a user input seen through another a view of it)."""

    layout: _FlatInputs
    given: tuple
    functional: list

    def user(self) -> list:
        return self.layout.user(self.functional)

    def given_user(self) -> list:
        return self.layout.user(self.given)

    def views_apart(self) -> dict:
        """The user inputs seen through another (a cover), but for the same tensor given twice."""
        user = self.user()
        return {j: v for j, v in self.layout.views.items() if v.base is None and user[j] is not user[v.of]}

    def of_synthetic_bases(self) -> list[int]:
        """The user inputs seen through a synthetic base (each written back as itself)."""
        return [j for j, v in self.layout.views.items() if v.base is not None]


@dataclasses.dataclass(frozen=True)
class _InputStarts:
    """Where each input started, before the forward: functionalization's
    storage and storage offset (None: not a FunctionalTensor), and eager's
    (``eager``: the shadows, see :mod:`predispatch.trace.eager_layout`)."""

    storages: list
    offsets: list
    eager: eager_layout.Start
    # flat position of an input others are seen through (a cover) -> an alias of it as it started
    covers: dict = dataclasses.field(default_factory=dict)
    # the flat positions of the covers written back as they started (see _written_as_started)
    written_as_started: set = dataclasses.field(default_factory=set)


def _functionalized_call(flat: tuple, tracing: _Tracing, layout: _FlatInputs, found: tuple) -> tuple:
    """The module's flat call on FunctionalTensors: the new values of the
    inputs it wrote, then its outputs (a user input seen through another
    and returned as it is: the caller's tensor, as in eager). What it
    finds goes in ``found``: (the flat positions of the inputs written, in
    order; the inputs a program exported again sees through synthetic
    bases it builds; the outputs eager returns as views of inputs written)."""
    mutated, built, out_views = found
    with _torch.functional_mode():
        inputs = _functional_inputs(flat, layout, tracing.record)
        starts = _input_starts(inputs)
        outputs = tracing.flat_fn(*inputs.functional)
    built.update(input_aliasing.views_built_by_program(inputs.user()))
    _refuse_moved_covers(inputs)
    written = _write_backs(inputs, starts, tracing.on_layout_change, tracing.rebound(), tracing.record)
    mutated.extend(i for i, _ in written)
    as_given = _views_returned_as_given(inputs, built, starts.written_as_started)
    _refuse_returned_views_of_relaid_covers(inputs, as_given, outputs)
    out_views.update(_output_views(inputs, starts, outputs, as_given))
    return (*[value for _, value in written],
            *[as_given[id(o)] if id(o) in as_given else _torch.from_functional(o) for o in outputs])


def _functional_inputs(flat: tuple, layout: _FlatInputs, record) -> _CallInputs:
    """make_fx's inputs as the FunctionalTensors the module runs on."""
    given_user = layout.user(flat)
    # the wrappers' own metadata reads (some twenty per input) are not the module's torch calls:
    # no torch-function mode sees them (make_fx's would count each, at ~100 us an input)
    with _torch.torch_function_disabled():
        state = _wrapped_once(layout.state(flat))
        user = [None if j in layout.views else _torch.to_functional(a) for j, a in enumerate(given_user)]
    _seen_through_bases(given_user, user, layout.views, record)
    return _CallInputs(layout, flat, state + user)


def _wrapped_once(state: list) -> list:
    """The module's state as FunctionalTensors: a tied parameter or buffer
    (one tensor, two names) is wrapped once."""
    wrapped = {}
    for a in state:
        if id(a) not in wrapped:
            wrapped[id(a)] = _torch.to_functional(a)
    return [wrapped[id(a)] for a in state]


def _seen_through_bases(given_user: list, user: list, views: dict, record) -> None:
    """Each user input seen through a base (``views``; None in ``user``)
    becomes that view of it: of its cover's FunctionalTensor (the cover
    itself, where the same tensor was given twice), or of its group's
    synthetic base (:func:`_synthetic_base`; the same tensor twice, one view)."""
    bases = {}
    for j, v in sorted(views.items()):
        if v.base is None:
            base = user[v.of]
            if given_user[j] is given_user[v.of]:
                user[j] = base
                continue
        else:
            twin = next((k for k in sorted(views) if k < j and given_user[k] is given_user[j]), None)
            if twin is not None:
                user[j] = user[twin]
                continue
            if v.of not in bases:
                bases[v.of] = _synthetic_base(given_user, views, v.of, record)
            base = bases[v.of]
        user[j] = base.as_strided(v.size, v.stride, v.offset - (v.base[0] if v.base else 0))
        recorder.mark_view(user[j], base, record)


def _synthetic_base(given_user: list, views: dict, first: int, record) -> torch.Tensor:
    """The memory the inputs of ``first``'s group reach, from the first
    element one of them reaches to the last, as a new tensor holding their
    values (zeros where none reaches): AOTAutograd's synthetic base, made in
    the graph (each input a view of it, at its offset less the base's start). Where inputs overlap they hold the same values: the order of
    the writes does not matter. Its nodes are noted as the caller's views
    among the inputs' are: made in any grad mode (the caller made them)."""
    group = [j for j, v in sorted(views.items()) if v.base is not None and v.of == first]
    distinct = [j for j in group if not any(given_user[k] is given_user[j] for k in group if k < j)]
    with _torch.torch_function_disabled():
        sources = {j: _torch.to_functional(given_user[j]) for j in distinct}
    like, (start, end) = given_user[first], views[first].base
    last = _torch.last_node(_torch.current_tracer().graph)
    base = torch.zeros(end - start, dtype=like.dtype, device=like.device)
    for j in distinct:
        v = views[j]
        base = torch.as_strided_scatter(base, sources[j], v.size, v.stride, v.offset - start)
    for node in _torch.nodes_after(last):
        record.note(Event(Kind.SYNTHETIC_BASE, node))
    return base


def _input_starts(inputs: _CallInputs) -> _InputStarts:
    functional = inputs.functional
    # an input seen through a synthetic base starts in eager's storage where the base does, and further
    shifts = {inputs.layout.n_state + j: v.base[0] for j, v in inputs.layout.views.items() if v.base is not None}
    covers = sorted({inputs.layout.n_state + v.of for v in inputs.views_apart().values()})
    with _torch.torch_function_disabled():
        storages = [_torch.storage_of(f) for f in functional]
        offsets = [_torch.storage_offset(f) for f in functional]
        # each cover's memory as it started: dead code unless written back so (_written_as_started)
        started = {i: torch.ops.aten.alias.default(functional[i]) for i in covers}
        return _InputStarts(storages, offsets, eager_layout.shadow_inputs(functional, shifts), started)


def _refuse_moved_covers(inputs: _CallInputs) -> None:
    """A cover given other memory while an input seen through it was
    written (see :func:`predispatch.trace.input_aliasing.refuse_moved_cover`)."""
    user, apart = inputs.user(), inputs.views_apart()
    for cover in sorted({v.of for v in inputs.layout.views.values()}):
        if _torch.storage_changed(user[cover]) and any(
                _torch.has_data_mutation(user[j]) for j, v in apart.items() if v.of == cover):
            input_aliasing.refuse_moved_cover(cover, recorder.user_swap_location(user[cover]))


def _write_backs(inputs: _CallInputs, starts: _InputStarts, on_layout_change,
                 rebound: dict, record=None) -> list[tuple[int, torch.Tensor]]:
    """(flat position, new value) of each input the forward wrote, relaid,
    gave other storage or (a buffer) rebound, in order; ``on_layout_change``
    hears of the relaid and the rebound (``record``: the trace's, whose
    mutation kinds of inputs written back through a cover are dropped)."""
    made = {}  # storage the forward made -> (the first input laid on it, its offset there)
    written = []
    for i, f in _written_back_once(inputs):
        key = inputs.layout.key(i)
        if key in rebound:  # rebound: written back as the tensor the name holds now
            f = rebound[key]
            if _torch.is_traced(f):  # else a constant (a global): its value is written
                _torch.apply_pending_updates(f)
            change = _rebound_layout(i, f, inputs.given[i], starts, made, inputs.layout.key)
            if change is not None and on_layout_change is not None:
                on_layout_change(key, change)
            written.append((i, _torch.from_functional(f)))
            continue
        _torch.apply_pending_updates(f)
        relaid = _torch.has_metadata_mutation(f) or _torch.storage_changed(f)
        if relaid and on_layout_change is not None:
            f, change = _written_as_started(i, f, _layout_change(i, f, starts, made, inputs.layout.key), starts,
                                            record)
            on_layout_change(key, change)
        if relaid or _torch.has_data_mutation(f):
            written.append((i, _torch.from_functional(f)))
    return written + _cover_views_relaid(inputs, starts, made, on_layout_change, record)


_WRITTEN_AS_STARTED = "_predispatch_written_as_started"


def note_written_as_started(target: torch.Tensor, value: torch.Tensor) -> None:
    """A program exported again writes ``value`` to ``target``, a traced
    input, as its memory as the call started, then relays it: the trace
    writes it back as ``value`` (:func:`_written_as_started`; the same graph, G7)."""
    setattr(target, _WRITTEN_AS_STARTED, value)


_RELAID_IN = "_predispatch_relaid_in"


def note_relaid_in(target: torch.Tensor, grad_mode: str | None) -> None:
    """A program exported again relays ``target``, a traced input, as the
    program's record says, out of the recorder's sight: the record's grad
    mode of the change is the new program's too (G7)."""
    setattr(target, _RELAID_IN, grad_mode)


def _written_as_started(i: int, f, change: LayoutChange, starts: _InputStarts, record) -> tuple:
    """(the value written back, its layout change) of input ``i`` (``f``
    after the forward): an input other inputs are seen through (a cover),
    its memory written (through it or them) and then relaid on it (``t_()``,
    ``y.set_(y[1][0])``), is written back as its memory as the call started
    (everything written through the group), then relaid: its new layout
    may reach only part of it. Where the new layout is symbolic or reaches
    past that memory (grown), as before: its value, in its new layout."""
    start = getattr(f, _WRITTEN_AS_STARTED, None)
    start = starts.covers.get(i) if start is None else start
    if start is None or change.storage != "own" or change.size is None or not _torch.has_data_mutation(f):
        return f, change
    started = _torch.storage_extent(tuple(start.size()), tuple(start.stride()), 0)
    if not isinstance(started, int) or change.offset < 0 or (
            _torch.storage_extent(change.size, change.stride, change.offset) > started):
        return f, change
    if _covers_all_of(change, start, started):  # its value in its new layout is all of the memory
        return f, change
    last = _torch.last_node(_torch.current_tracer().graph)
    _torch.apply_pending_updates(start)  # replayed from the memory written, at the forward's end
    for node in _torch.nodes_after(last) if record is not None else ():
        record.note(Event(Kind.REGENERATED_VIEW, node))  # with the memory's history in any mode, as eager's
    starts.written_as_started.add(i)
    return start, dataclasses.replace(change, as_started=True)


def _covers_all_of(change: LayoutChange, start, extent: int) -> bool:
    """Does the new layout, of the same shape, reach each element of the
    memory as it started once (``t_()`` of a square matrix)? Then the value
    in it says all the memory holds, and carries eager's history: written
    back so, relaid in its grad mode, not as the memory started (whose
    history comes through the base's update, in the old layout, where
    eager's has none if the relayout was out of autograd's sight: under a
    no_grad caller, a gradient reaching the inputs transposed). Of another
    shape, eager's history under a no_grad caller takes no gradient at all."""
    size, stride = tuple(change.size), tuple(change.stride)
    return (change.offset == 0 and size == tuple(start.size()) and math.prod(size) == extent == start.numel()
            and _dense(size, stride) and _dense(size, tuple(start.stride())))


def _dense(size: tuple, stride: tuple) -> bool:
    """Do ``size`` and ``stride`` lay elements out without gaps or overlaps?"""
    expected = 1
    for step, n in sorted((step, n) for n, step in zip(size, stride) if n != 1):
        if step != expected:
            return False
        expected *= n
    return True


def _cover_views_relaid(inputs: _CallInputs, starts: _InputStarts, made: dict, on_layout_change, record) -> list:
    """(flat position, new value) of each user input seen through a cover
    input and given another layout or storage by the forward: written back
    for its layout (its values are the cover's, written back through it:
    the mode the recorder noted for its data is dropped)."""
    relaid = []
    for j in inputs.views_apart():
        f, i = inputs.user()[j], inputs.layout.n_state + j
        _torch.apply_pending_updates(f)
        if not (_torch.has_metadata_mutation(f) or _torch.storage_changed(f)):
            continue
        change = _layout_change(i, f, starts, made, inputs.layout.key)
        given = inputs.given_user()[j]
        if (change.storage, change.size, change.stride, change.offset) == (
                "own", tuple(given.shape), tuple(given.stride()), 0):
            continue  # t_() of a vector: laid out as it was
        if on_layout_change is not None:
            on_layout_change(inputs.layout.key(i), change)
        if record is not None:
            record.mutation_kinds.pop(f"input:{j}", None)
        relaid.append((i, _torch.from_functional(f)))
    return relaid


def _rebound_layout(i: int, value, given, starts: _InputStarts, made: dict, key_of) -> LayoutChange | None:
    """A buffer rebound to ``value``: None where a plain write of its data
    leaves the buffer as eager's (the same layout, on memory of its own or
    the forward's), else where ``value`` keeps its elements, and its dtype
    where it changed (a view of an input's memory in another dtype is
    refused: the program would reinterpret that input's bytes)."""
    if not _torch.is_traced(value):
        return None
    change = _layout_change(i, value, starts, made, key_of)
    if value.dtype == given.dtype:
        start = 0 if change.storage == "own" else given.storage_offset()  # "own": counted from its start
        same = change.storage in ("own", "value") and (change.size, change.stride, change.offset) == (
            tuple(given.size()), tuple(given.stride()), start)
        return None if same else change
    if change.storage != "value":
        raise ExportError(
            f"buffer {key_of(i).partition(':')[2].removeprefix('_export_root.')!r} rebound to a "
            "tensor of another dtype that "
            f"shares memory with {'itself' if change.storage == 'own' else change.source} "
            "cannot be exported soundly: the program would write its bytes back as the new "
            "dtype; rebind it to a copy (.to(dtype) of another dtype, .clone())")
    return dataclasses.replace(change, dtype=str(value.dtype).removeprefix("torch."))


def _written_back_once(inputs: _CallInputs):
    """(flat position, FunctionalTensor) of the inputs that are written back
    as themselves: a tied tensor under its first name, no user input seen
    through a cover input (its values written back through it; its layout:
    :func:`_cover_views_relaid`), each seen through a synthetic base once."""
    done = {id(inputs.user()[j]) for j in inputs.views_apart()}
    for i, f in enumerate(inputs.functional):
        if isinstance(f, _torch.FunctionalTensor) and id(f) not in done:
            done.add(id(f))
            yield i, f


def _views_returned_as_given(inputs: _CallInputs, built: dict, as_started=()) -> dict:
    """id of each user input seen through another or a synthetic base (also
    one the module, a program exported again, builds: ``built``) and not
    relaid, and of each input written back as it started, then relaid
    (``as_started``, flat positions: its value is not the one written back)
    -> the caller's tensor, which the call returns where it returns the
    input as it is (after the write-backs, laid out as eager left it)."""
    user, given_user = inputs.user(), inputs.given_user()
    seen = (*inputs.views_apart(), *inputs.of_synthetic_bases(), *built)
    return {**{id(user[j]): given_user[j] for j in seen if not _torch.has_metadata_mutation(user[j])},
            **{id(inputs.functional[i]): inputs.given[i] for i in as_started}}


_RETURNED_AS_VIEW = "_predispatch_returned_as_view_of"


def note_output_view(value: torch.Tensor, target: torch.Tensor, view: dict) -> None:
    """A program exported again: ``value``, an output its ``module()`` makes
    again as ``view`` (:meth:`OutputView.to_json`) of ``target``, a traced
    input, is returned as it is, marked: the trace finds the same view
    (:func:`_output_views`) and the graph keeps the program's value (G7)."""
    setattr(value, _RETURNED_AS_VIEW, (target, view))


def _output_views(inputs: _CallInputs, starts: _InputStarts, outputs, as_given: dict) -> dict:
    """Flat output position -> (:class:`OutputView`, the nodes of the views
    of its chain made in grad mode, whose blocks tell its mode) of each output
    that eager returns as a view of an input whose memory the forward wrote
    (the program's value is a view of its own copy), or that a program
    exported again makes so (:func:`note_output_view`). An input returned
    as it is: ``as_given``, or torch's write-back returns it."""
    first: dict = {}
    for i, f in enumerate(inputs.functional):
        if isinstance(f, _torch.FunctionalTensor):  # not a None or a number given as an input
            first.setdefault(id(f), i)
    found = {}
    for n, o in enumerate(outputs):
        if not isinstance(o, _torch.FunctionalTensor) or id(o) in first or id(o) in as_given:
            continue
        target, view = getattr(o, _RETURNED_AS_VIEW, (None, None))
        if id(target) in first:
            found[n] = (OutputView(inputs.layout.key(first[id(target)]), tuple(view["size"]),
                                   tuple(view["stride"]), view["offset"], view["mode"]), ())
        elif (seen := _eager_view_of_input(inputs, starts, o, first)) is not None:
            found[n] = seen
    return found


def _eager_view_of_input(inputs: _CallInputs, starts: _InputStarts, o, first: dict) -> tuple | None:
    """(:class:`OutputView`, the nodes of its chain's views made in grad
    mode: see :func:`_made_in`) where ``o`` is, in eager, a view of a
    parameter, buffer or input (the first its view chain reaches) whose
    memory the forward wrote, on that memory still and of its dtype, with
    a layout eager's shadows know; else None (a view of memory a ``set_()``
    gave, a symbolic layout: the program's value, as before)."""
    seen = _viewed_input(o, first)
    if seen is None:
        return None
    i, f = seen
    if _torch.storage_changed(f) or not _torch.has_data_mutation(f) or f.dtype != o.dtype:
        return None
    mine, theirs = eager_layout.of(o), eager_layout.of(f)
    if mine is None or theirs is None or not mine[3] == theirs[3] == starts.eager.storages[i]:
        return None
    mode, made = _made_in(o, f)
    if mode is None:
        return None
    return OutputView(inputs.layout.key(i), mine[0], mine[1], mine[2] - theirs[2], mode), made


def _viewed_input(o, first: dict) -> tuple | None:
    """(flat position, FunctionalTensor) of the first input ``o``'s view
    chain reaches; None where it reaches none, or passes a tensor given
    other memory (``set_()``), made to require grad, or with a history of
    its own (a detached alias written in grad mode)."""
    t = o
    while id(t) not in first:
        if marks.SWAPPED.of(t) or marks.LEAF.of(t) or marks.OWN_HISTORY.on(t):
            return None
        t = marks.SOURCE.of(t)
        if t is None:
            return None
    return first[id(t)], t


def _made_in(view, source) -> tuple:
    """(the grad mode eager made ``view`` of ``source`` in, as
    :class:`OutputView` says it, or None where the recorder did not see it
    made; the nodes of the views of its chain made in grad mode, whose
    blocks say which). A view of a view made under no_grad has no history
    (nor one of a ``detach()``), whatever the mode it is made in; one made
    in grad mode of a view made in the caller's mode has none under a
    no_grad caller: the chain's views made in grad mode decide together."""
    if marks.DETACHED.of(view):
        return "detached", ()
    if marks.NO_GRAD_VIEW.of(view):
        return "no_grad", ()
    made, t = [], view
    while t is not source:
        if marks.MADE_AS.of(t) is None:
            return None, ()
        made.append(marks.MADE_AS.of(t))
        t = marks.SOURCE.of(t)
    return "grad", tuple(made)


def _made_in_modes(gm: torch.fx.GraphModule, out_views: dict) -> dict[int, OutputView]:
    """:func:`_output_views`' finds, each view made in grad mode told as made
    in blocks that set grad on ("grad") or, where a view of its chain was
    made outside every grad block, in the "caller"'s mode (which the
    program's caller sets)."""
    modes = grad_modes(gm.graph) if any(made for _, made in out_views.values()) else {}
    return {n: view if not made else dataclasses.replace(
                view, mode="caller" if any(modes.get(node) is None for node in made) else "grad")
            for n, (view, made) in out_views.items()}


def _refuse_returned_views_of_relaid_covers(inputs: _CallInputs, as_given: dict, outputs) -> None:
    """A view returned as it is, its cover relaid (see
    :func:`predispatch.trace.input_aliasing.refuse_relaid_cover`)."""
    user, given_user = inputs.user(), inputs.given_user()
    for j, v in inputs.views_apart().items():
        if id(user[j]) in as_given and any(o is user[j] for o in outputs):
            cover = user[v.of]
            input_aliasing.refuse_relaid_cover(v.of, j, cover.shape != given_user[v.of].shape,
                                               recorder.user_swap_location(cover))


def _layout_change(i: int, f, starts: _InputStarts, made: dict, key_of) -> LayoutChange:
    """Where input ``i`` (``f``, after the forward) keeps its elements, and how
    (its offset counted from where the owner of that storage started): as
    its shadow says (see :mod:`predispatch.trace.eager_layout`), else as
    functionalization's tensors do (symbolic sizes; memory the forward made,
    ``made``: where earlier inputs took some)."""
    if (shadow := eager_layout.of(f)) is not None:
        size, stride, offset, storage = shadow
        storages, offsets = starts.eager.storages, starts.eager.offsets
    else:
        storage = _torch.storage_of(f)
        size, stride, offset = _torch.layout(f)
        storages, offsets = starts.storages, starts.offsets
    owner = i if storages[i] == storage else next(
        (j for j, s in enumerate(storages) if s is not None and s == storage), None)
    place = "value" if owner is None else "own" if owner == i else "other"
    if owner is not None:
        offset -= offsets[owner]
    elif storage in made:  # x.set_(v); z.set_(v): z shares the memory x took
        place, (owner, first_offset) = "shared", made[storage]
        offset -= first_offset
    elif isinstance(offset, int):
        made[storage] = (i, offset)
    if not all(isinstance(v, int) for v in (*size, *stride, offset)):
        size = stride = offset = None
    return LayoutChange(place, key_of(owner) if place in ("other", "shared") else None, size, stride, offset,
                        grad_mode=getattr(f, _RELAID_IN, None))


# ---------------------------------------------------------------- after the trace


def _drop_storage_swaps_of_constants(gm: torch.fx.GraphModule) -> None:
    """Functionalization turns ``a.set_(b)`` into data flow (``a`` reads ``b``'s
    storage from then on) and also runs ``set_`` on its wrappers' inner
    tensors, which the tracer records on constants it does not know: drop them."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and getattr(node.target, "overloadpacket", None) is torch.ops.aten.set_
                and any(a.op == "get_attr" for a in node.all_input_nodes)):
            constants = [a for a in node.all_input_nodes if a.op == "get_attr"]
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            for c in constants:
                if not c.users:
                    gm.graph.erase_node(c)
                    if hasattr(gm, c.target):
                        delattr(gm, c.target)


def _drop_dead_code(gm: torch.fx.GraphModule, kept) -> None:
    """Dead code goes, but for the ``kept`` nodes, the impure, and those
    binding an unbacked symbol (``item``, ``nonzero``): torch.export's
    runtime-assert pass recomputes a data-dependent condition from them."""
    impure = _torch.impure_by_op(impure_random=True)  # Node.is_impure's default
    gm.graph.eliminate_dead_code(
        is_impure_node=lambda n: n in kept or impure(n) or bool(_torch.unbacked_symbols_bound(n)))
    gm.recompile()


def outputs_made_distinct(gm: torch.fx.GraphModule, positions) -> None:
    """Each output at ``positions`` (new values of inputs) a node of its own:
    an alias where two inputs take one value (``x.set_(v); z.set_(v)``; a
    buffer rebound to an input, then written: both are written back), as
    the signature names each written input by its output's name."""
    output = gm.graph.output_node()
    outputs, seen = list(output.args[0]), set()
    for i in positions:
        node = outputs[i]
        if not isinstance(node, torch.fx.Node):
            continue
        if node in seen:
            with gm.graph.inserting_before(output):
                outputs[i] = gm.graph.call_function(torch.ops.aten.alias.default, (node,))
            outputs[i].meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace")})
        seen.add(outputs[i])
    output.args = (tuple(outputs),)
    gm.recompile()


def _signature(gm, named_parameters, named_buffers, mutated, in_spec, out_spec):
    """The aot-style GraphSignature: the state lifted as the first inputs, the
    new values of the ``mutated`` inputs (flat positions) the first outputs."""
    inputs, outputs = _torch.graph_input_names(gm), _torch.graph_output_names(gm)
    params, buffers = list(named_parameters), list(named_buffers)
    n_params, n_state = len(params), len(params) + len(buffers)
    to_mutate = {"param": {}, "buffer": {}, "input": {}}
    for out_name, i in zip(outputs, mutated):
        if i < n_params:
            to_mutate["param"][out_name] = params[i]
        elif i < n_state:
            to_mutate["buffer"][out_name] = buffers[i - n_params]
        else:
            to_mutate["input"][out_name] = inputs[i]
    return _torch.GraphSignature(
        parameters=params, buffers=buffers, user_inputs=inputs[n_state:],
        user_outputs=outputs[len(mutated):],
        inputs_to_parameters=dict(zip(inputs[:n_params], params)),
        inputs_to_buffers=dict(zip(inputs[n_params:n_state], buffers)),
        buffers_to_mutate=to_mutate["buffer"], parameters_to_mutate=to_mutate["param"],
        user_inputs_to_mutate=to_mutate["input"], in_spec=in_spec, out_spec=out_spec,
        backward_signature=None, input_tokens=[], output_tokens=[])
