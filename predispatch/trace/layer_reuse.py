"""Repeated layers traced once, inside the capture stage's trace.

A transformer calls the same layer N times: the same module class, parameters
of the same shapes, inputs of the same metadata. The first call of each kind
is traced as usual and kept as a *template* (the nodes the call made, the
nodes it read, what it returned). A later call with the same *key* (module
class, parameter and buffer metadata, input metadata, pytree structure and
aliasing, grad mode) is *replayed* first: its forward runs on fresh meta
tensors, with the trace suspended, under a torch-function mode that logs
every torch call (function, arguments as constants or as numbered tensors
with their metadata, results). When the log equals a template's, the call is
*stamped*: the template's nodes are copied into the graph reading this
call's inputs and parameters, with this call's module path and call site in
their metadata, and its outputs are new traced tensors of the copied nodes.

What makes a layer's graph differ although its key is the same is Python
state outside the key (its index, a per-layer config entry, a counter):
such a state shows in the log (another op, another constant) or in the
module's attributes after the replay, and the call is traced. So is every
call the recorder of :mod:`predispatch.trace.recorder` would note something
about (a grad-mode or autocast block, an in-place update, an input
mutated), one that reads a tensor that is not its input or state, one that
draws host random numbers, and one returning an alias of an input. A stamped
call's inputs, state and outputs must not be mutated later (the recorder
would have followed its views): if one is, :class:`Retrace` makes the trace
again without reuse.

A later call of the same code at other sizes (a CNN's next stage) is stamped
from a template two traced calls of its *kind* make, its nodes' values made
again at its sizes: :mod:`predispatch.trace.layer_sizes`.

``predispatch.reuse_layers(False)`` (or ``PREDISPATCH_LAYER_REUSE=0`` in the environment)
turns it off; the program is the same either way, up to node names.
"""
from __future__ import annotations

import contextlib
import dataclasses
import operator
import os
import sys
import types

import torch

from .. import _torch
from . import layer_constants, layer_sizes
from ..ir.meta_keys import GRAD_MODE_READ
from .grad_mode_reads import grad_mode_read
from .host_random import host_generator_states, restore_host_generators
from .python_state import PythonState, Watch
from .recorder.spans import Settled

_ENV = "PREDISPATCH_LAYER_REUSE"
_enabled: list[bool] = []
_MAX_TEMPLATES = 4  # distinct logs per key before a key is traced without replays
_COPIED_META = frozenset({"val", "tensor_meta", "nn_module_stack", "torch_fn", "stack_trace",
                          "eager_input_vals"})  # a custom op's inputs as eager gave them: a stamp's alike


@contextlib.contextmanager
def reuse_layers(enabled: bool):
    """Exports in this block trace repeated layers once (``True``, the default
    unless ``PREDISPATCH_LAYER_REUSE=0``) or every layer (``False``).

        >>> layers = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
        >>> with predispatch.reuse_layers(False):
        ...     traced = predispatch.export_predispatch(layers, (torch.ones(1, 4),))
        >>> reused = predispatch.export_predispatch(layers, (torch.ones(1, 4),))
        >>> predispatch.format_program(traced) == predispatch.format_program(reused)
        True

    A later call of a layer with the same key (module class, parameter,
    buffer and input metadata, grad mode) is replayed on meta tensors; when
    its torch calls are those of a layer already traced, that layer's nodes
    are copied for it. The program is the same, up to node names; only the
    export is faster. design/layer-reuse.md says what makes a layer traced.
    """
    if not isinstance(enabled, bool):
        raise ValueError(f"reuse_layers takes True or False, got {enabled!r}")
    _enabled.append(enabled)
    try:
        yield
    finally:
        _enabled.pop()


def reuse_enabled() -> bool:
    return _enabled[-1] if _enabled else os.environ.get(_ENV, "1") != "0"


def note_no_reuse() -> None:
    """A trace made without reuse: the report says nothing was reused."""
    global last_report
    last_report = ReuseReport()


@dataclasses.dataclass
class ReuseReport:
    """What the last export's layer reuse did (for tests and tools/bench.py)."""

    stamped: int = 0  # calls made by copying a template
    traced: int = 0  # calls of repeated modules traced (templates among them)
    templates: int = 0
    resized: int = 0  # stamped calls among them made from a template of other sizes (layer_sizes)


last_report = ReuseReport()


class Retrace(Exception):
    """A stamped layer's input, state or output was mutated after the call."""


# ---------------------------------------------------------------- keys and logs

_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
          torch.memory_format, torch.Size, types.FunctionType, types.BuiltinFunctionType)


def _dims(values) -> tuple:
    return tuple(v if isinstance(v, int) else str(v) for v in values)


_SCALARS = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format})


def _constant(v, keep: list):
    """A non-tensor value as compared between calls."""
    if isinstance(v, _PLAIN):
        return (type(v), v) if not isinstance(v, torch.Size) else (torch.Size, _dims(v))
    if isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return ("sym", str(v))
    if isinstance(v, slice):
        return ("slice", _constant(v.start, keep), _constant(v.stop, keep), _constant(v.step, keep))
    if v is Ellipsis:
        return ("...",)
    keep.append(v)  # the same object in both calls (kept alive: ids stay unique)
    return ("object", id(v))


class _External(Exception):
    """The replayed layer read a tensor that is neither its input nor its state."""


class _CallLog(_torch.TorchFunctionMode):
    """Logs every torch call: the function, its arguments (tensors as their
    number among those the layer was given or made, with their metadata) and
    its results.

    With a ``guide`` (an earlier call's log), a call equal to the guide's call at
    the same place gets a new empty tensor with the metadata the guide's
    result had instead of running: an op's result metadata is a function of
    its arguments' (which the log holds), so the log is the one running would
    give, without the meta kernels. A call that differs from the guide's at
    its place runs; the guide's later calls still stand for equal ones (a
    layer's own drop rate changes one call, not the rest)."""

    def __init__(self, tensors: list, guide: list | None = None):
        super().__init__()
        self.guide = guide
        self.number = {}
        self.alive = []  # ids stay unique while logging
        for t in tensors:
            self._register(t)
        self.calls: list = []
        self.keep: list = []
        self.external = False
        self.rules = _torch.meta_rules()

    def _register(self, t) -> tuple:
        entry = self.number.get(id(t))
        if entry is None:
            self.alive.append(t)
        entry = self.number[id(t)] = (len(self.alive) - 1 if entry is None else entry[0],
                                      tuple(t.shape), t.stride(), t.storage_offset(), t.dtype, t.requires_grad,
                                      t.layout, t.is_conj(), t.is_neg())
        return entry

    def encode(self, x, new: bool):
        """Arguments or results as compared (meta tensors: sizes are ints)."""
        kind = type(x)
        if kind in _SCALARS:  # the common cases first: as _constant has them
            return (kind, x)
        if kind is tuple or kind is list:
            return (kind, *[self.encode(v, new) for v in x])
        if isinstance(x, torch.Tensor):
            if new:
                return self._register(x)
            entry = self.number.get(id(x))
            if entry is None:
                self.external = True
                raise _External()
            return entry
        if isinstance(x, (tuple, list)) and not isinstance(x, torch.Size):
            return (type(x), *[self.encode(v, new) for v in x])
        if isinstance(x, dict):
            return (dict, *[(k, self.encode(v, new)) for k, v in x.items()])
        return _constant(x, self.keep)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        with Watch.paused():  # torch's and the log's own code: not the layer's
            return self._logged_call(func, args, kwargs or {})

    def _logged_call(self, func, args, kwargs):
        with _torch.torch_function_disabled():  # the log's own reads: no mode below sees them
            called = self.encode(args, new=False), self.encode(kwargs, new=False), _ambient()
            if self.guide is not None:
                out = self._as_guided(func, called)
                if out is not None:
                    return out
        with self.rules:  # a batch norm's outputs by rule, not by its meta decomposition
            out = func(*args, **kwargs)
        with _torch.torch_function_disabled():
            self.calls.append((func, called, self.encode(out, new=True)))
        return out

    def _as_guided(self, func, called):
        """The guide's new tensor for this call where it has the same call
        here and its result is one; None where the call is to run."""
        step = len(self.calls)
        if step < len(self.guide) and self.guide[step][0] == func and self.guide[step][1] == called:
            result = self.guide[step][2]
            if (isinstance(result[0], int) and result[0] == len(self.alive) and result[3] == 0
                    and result[6:] == (torch.strided, False, False)):
                _, size, stride, _, dtype, requires_grad, *_ = result
                out = torch.empty_strided(size, stride, dtype=dtype, device="meta", requires_grad=requires_grad)
                self.alive.append(out)
                self.number[id(out)] = result  # its metadata, as _register reads it: made from it
                self.calls.append((func, called, result))
                return out
        return None  # another call (a float of its own, say): it runs; later equal calls are guided again


def _ambient() -> tuple:
    """The global state an op's result metadata depends on besides its arguments."""
    return (torch.is_grad_enabled(), _torch.any_autocast_enabled(), torch.is_inference_mode_enabled(),
            torch.get_default_dtype())


def _state(module: torch.nn.Module) -> list:
    return [t for _, t in (*module.named_parameters(remove_duplicate=False),
                           *module.named_buffers(remove_duplicate=False))]


_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _raw_meta(t: torch.Tensor) -> tuple:
    """A tensor's metadata as a key holds it, symbolic sizes as they are (:func:`_frozen` writes them)."""
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.device.type, t.requires_grad)


def _key(module, flat: list, spec, state: list):
    """What a call shares with another whose graph it may reuse, with its
    symbolic sizes as they are (:func:`_frozen` makes it a key); None where a
    leaf cannot be compared (a tensor not traced)."""
    keep: list = []
    leaves = []
    tensors = []
    for x in flat:
        if isinstance(x, torch.Tensor):
            if not isinstance(x, _torch.FunctionalTensor):
                return None
            leaves.append((_raw_meta(x), _torch.inner_value(x).requires_grad))
            tensors.append(x)
        else:
            leaves.append(("sym", x) if isinstance(x, _SYMBOLIC) else _constant(x, keep))
    for t in state:
        if not isinstance(t, _torch.FunctionalTensor):
            return None
        tensors.append(t)
    first, storages, aliasing = {}, {}, []
    for i, t in enumerate(tensors):
        storage = _torch.storage_of(t)
        aliasing.append((first.setdefault(id(t), i), storages.setdefault(storage, i)))
    return (type(module), str(spec), tuple(leaves), tuple(_raw_meta(t) for t in state),
            tuple(aliasing), torch.is_grad_enabled(), tuple(id(k) for k in keep)), keep


def _frozen(raw):
    """A raw key (:func:`_key`) as compared: each symbolic size written as the
    shape env simplifies it now (once it learned ``s70 == s53``, a size that
    was ``s70`` reads ``s53``)."""
    if isinstance(raw, tuple):
        return tuple(_frozen(v) for v in raw)
    return str(raw) if isinstance(raw, _SYMBOLIC) else raw


def _symbolic_sizes(raw) -> list:
    if isinstance(raw, tuple):
        return [s for v in raw for s in _symbolic_sizes(v)]
    return [raw] if isinstance(raw, _SYMBOLIC) else []


@contextlib.contextmanager
def _swapped(module: torch.nn.Module, replacements: dict):
    """The module's parameters and buffers in ``replacements`` (by id) swapped in."""
    saved = []
    try:
        for m in module.modules():
            for table in _torch.state_tables(m):
                for name, t in table.items():
                    if t is not None and id(t) in replacements:
                        saved.append((table, name, t))
                        table[name] = replacements[id(t)]
        yield
    finally:
        for table, name, t in reversed(saved):
            table[name] = t


def _hooked(module: torch.nn.Module) -> bool:
    """Hooks inside the layer see its tensors, which a stamped call has none of."""
    if _torch.global_module_hooks():
        return True
    return any(_torch.has_own_hooks(m) for m in module.modules() if m is not module)


def _replay(forward, flat: list, spec, state: list, module, guide, named):
    """The log of ``forward`` run on fresh meta tensors (symbolic sizes at their example values) with the trace
    suspended, or None where the call cannot be compared so (it reads another
    tensor, draws host random numbers, changes Python state it can reach,
    fails); and the globals its code named (``named`` where given, see :func:`_isolated`)."""
    return _logged(forward, flat, spec, state, module, guide, named)  # its module calls not the tracer's


def _logged(forward, flat: list, spec, state: list, module, guide, named):
    tensors = [x for x in flat if isinstance(x, torch.Tensor)] + state
    with _torch.torch_function_disabled():  # metadata reads, not the layer's
        layouts = {id(t): ([_torch.size_hint(v) for v in t.shape], [_torch.size_hint(v) for v in t.stride()],
                           t.dtype, t.requires_grad) for t in tensors}
    if any(None in size or None in stride for size, stride, _, _ in layouts.values()):
        return None, named
    with _torch.trace_suspended():
        fakes = {}
        for t in tensors:
            if id(t) not in fakes:
                size, stride, dtype, requires_grad = layouts[id(t)]
                fakes[id(t)] = torch.empty_strided(size, stride, dtype=dtype, device="meta",
                                                   requires_grad=requires_grad)
        fake_flat = [fakes[id(x)] if isinstance(x, torch.Tensor) else x for x in flat]
        args, kwargs = _torch.pytree.tree_unflatten(fake_flat, spec)
        log = _CallLog([fakes[id(t)] for t in tensors], guide)
        with _swapped(module, fakes):
            return _isolated(forward, args, kwargs, module, log, named)


def _isolated(forward, args, kwargs, module, log, named):
    """``forward`` run under ``log``, the Python state it could reach put
    back as it was: its log (None where it failed, wrote that state, or
    reached state that could not be put back, then stopped before it runs)
    and the (globals, names) of the code it ran. ``named``: those of an
    earlier replay of the kind, saved up front; None: every frame watched."""
    reached = PythonState()
    reached.reach(module, args, kwargs)
    for namespace, names in named or ():
        reached.name_globals(namespace, names)
    if reached.unseeable is not None:
        return None, named
    generators, ambient = host_generator_states(), _torch.ambient_modes()
    failed = False
    watch = Watch(reached) if named is None else contextlib.nullcontext()
    try:
        # above autograd, as the trace's FunctionalTensors are: results do not require grad
        with watch, torch.device("meta"), _torch.below_autograd(), log:
            out = forward(*args, **kwargs)
        returned = log.encode(out, new=False) if reached.unseeable is None else None
    except Exception:
        failed = True
    finally:
        changed = reached.restore()  # the replay's Python side effects
        changed |= _torch.restore_ambient_modes(ambient)
        drew = restore_host_generators(generators)
    learned = reached.code_names if named is None and not failed and reached.unseeable is None else named
    if failed or reached.unseeable is not None or log.external or drew or changed:
        return None, learned
    return (log.calls, returned, log.keep), learned


# ---------------------------------------------------------------- templates


@dataclasses.dataclass
class _Template:
    inputs: list  # the nodes the call read, by position among its tensors and state
    nodes: list  # the nodes it made
    outputs: list  # per output leaf: ("node", (node, requires grad)) or ("value", value)
    out_spec: object
    torch_fns: dict  # node -> (torch function, its count relative to the call's start)
    increments: dict  # torch function -> how many calls the call made
    writes: list  # what the call wrote in grad mode: (("output", leaf) | ("state", i) | ("settled", view, swapped), old, new)
    updates: list  # its state updated in place: (position among the state, its new value's node, mutation kind)
    # the inputs (positions) and output leaves whose memory the call made views of, which the recorder follows
    # (a later update of theirs replays those views): a stamp's must stay as it leaves them
    viewed: tuple
    last_fn: object
    depth: int  # module-stack entries around the call (the layer's own included)
    inner_stacks: dict  # node -> its module-stack entries inside the call (one tuple per distinct stack)
    module_calls: dict  # module path -> (calls before, after) of the modules the call called
    module_key: str
    module_path: str
    call_site: str | None


def _torch_fn_offsets(nodes, before: dict, after: dict, made_under: dict) -> dict | None:
    """Each node's ``torch_fn`` as (function, count relative to the call's
    start); None where a count cannot be told apart. ``made_under``: the
    function each node was made under, where known (its name alone can be
    ambiguous: every property getter is ``__get__``)."""
    grew = [f for f, n in after.items() if n != before.get(f, 0)]
    found = {}
    for node in nodes:
        if "torch_fn" not in node.meta:
            continue
        name, qualified = node.meta["torch_fn"]
        prefix, _, count = name.rpartition("_")
        if not count.isdigit():
            return None
        count = int(count)
        matches = [(f, count - before.get(f, 0)) for f in ([made_under[node]] if node in made_under else grew)
                   if f"{f.__class__.__name__}.{f.__name__}" == qualified
                   and prefix == f.__name__ and before.get(f, 0) < count <= after.get(f, 0)]
        if len(matches) != 1:
            return None
        found[node] = matches[0]
    return found


@dataclasses.dataclass
class _Stamped:
    tensors: list  # inputs, state and outputs of a stamped call
    counters: list  # their storage counters then


class LayerReuse:
    """One forward's layer reuse: wraps the repeated modules' ``forward``."""

    def __init__(self, root: torch.nn.Module, recorder, stamper):
        self.recorder, self.stamper = recorder, stamper
        self.templates: dict = {}
        self.parametric: dict = {}  # key -> its parametric templates (layer_constants)
        self.from_one_call: dict = {}  # id of a template -> its layer_constants.FromOneCall (or None)
        self.kinds: dict = {}  # key -> (its kind (layer_sizes.kind_of), its tensors' sizes), or (None, None)
        self.sized: dict = {}  # kind -> its traced calls: [(template, log, sizes)]
        self.resized: dict = {}  # kind -> its layer_sizes.Resized templates
        self.named: dict = {}  # key -> the (globals, names) of the code its first complete replay ran
        self.named_by_kind: dict = {}  # kind (layer_sizes.kind_of) -> the same, of its first key
        self.last_log: dict = {}  # key -> the calls its last complete replay logged (the next one's guide)
        self.raw_keys: dict = {}  # a key with symbolic sizes -> its raw key (:func:`_key`)
        self.learned = 0  # the shape env's equals when the keys were written (:meth:`_keyed`)
        self.keep: list = []
        self.stamped: list[_Stamped] = []
        with _torch.torch_function_disabled():  # metadata reads, not the forward's
            self.layers = _repeated_modules(root)
        global last_report
        last_report = self.report = ReuseReport()

    @contextlib.contextmanager
    def installed(self):
        installed = []
        try:
            for module in self.layers:
                own = module.__dict__.get("forward")
                forward = module.forward
                module.forward = self._wrapped(module, forward)
                installed.append((module, own))
            yield self
        finally:
            for module, own in installed:
                if own is None:
                    del module.forward
                else:
                    module.forward = own

    def _wrapped(self, module, forward):
        def reused_forward(*args, **kwargs):  # not named forward: stack traces skip it
            caller = sys._getframe(1)
            return self.call(module, _torch.bound_to_receiver(forward, module, caller), caller, args, kwargs)
        return reused_forward

    def call(self, module, forward, caller, args, kwargs):
        self.report.traced += 1  # undone where stamped
        mark = self.recorder.reuse_mark()
        if mark is None or _torch.autocast_nesting() != 0 or any(
                torch.is_autocast_enabled(d) for d in _torch.autocast_devices()):
            return forward(*args, **kwargs)
        flat, spec = _torch.pytree.tree_flatten((args, kwargs))
        state = _state(module)
        with _torch.torch_function_disabled():  # metadata reads, not the layer's
            keyed = _key(module, flat, spec, state)
        if keyed is None:
            return forward(*args, **kwargs)
        raw, keep = keyed
        key = self._keyed(raw)
        templates = self.templates.setdefault(key, [])
        self.keep.append(keep)  # objects the key names by id stay alive: ids stay unique
        if len(templates) >= _MAX_TEMPLATES or sum(t is None for _, t in templates) >= 2 or _hooked(module):
            return forward(*args, **kwargs)  # nothing to reuse here, likely: no replays
        # the kind's last log guides: the next layer is most like the one before
        # (a drop rate of its own changes a call or two, a first layer may lack a branch)
        guide = self.last_log.get(key)
        if key not in self.kinds:  # one key, one kind and sizes
            with _torch.torch_function_disabled():  # metadata reads, not the layer's
                self.kinds[key] = self._kind(raw, flat, state)
        kind, sizes = self.kinds[key]
        # the code a kind's calls run is one: the names its first replay learned serve each size
        named = self.named.get(key, self.named_by_kind.get(kind))
        log, self.named[key] = _replay(forward, flat, spec, state, module, guide, named)
        if kind is not None and self.named[key] is not None:
            self.named_by_kind.setdefault(kind, self.named[key])
        if log is None:
            return forward(*args, **kwargs)
        self.last_log[key] = log[0]
        for template, constants in self._matches(key, templates, log):
            with _torch.torch_function_disabled():  # no torch call is the layer's
                stamped = self._stamp(template, module, caller, flat, state, constants)
            if stamped is not None:
                self.report.stamped += 1
                self.report.traced -= 1
                return stamped[0]
        for resized in self.resized.get(kind, ()):
            with _torch.torch_function_disabled():  # the checks' and the fake kernels' torch calls
                constants = resized.constants_for(sizes, log)
                stamped = None if constants is None else self._stamp(
                    resized.template, module, caller, flat, state, constants, (resized, log[1]))
            if stamped is not None:
                self.report.stamped += 1
                self.report.resized += 1
                self.report.traced -= 1
                templates.append((log, stamped[1]))  # this key's later calls: stamped from this one, as it is
                return stamped[0]
        out, template = self._trace(module, forward, caller, flat, state, args, kwargs, mark)
        if template is not None:
            self._pair(key, templates, log, template)
            if kind is not None:
                self._pair_sizes(kind, sizes, log, template)
        templates.append((log, template))
        self.report.templates += template is not None
        return out

    def _kind(self, raw, flat: list, state: list) -> tuple:
        """(the call's kind, its sizes): its key with sizes apart and its tensors'
        dimensions (layer_sizes); (None, None) where a size is symbolic or a tensor not dense."""
        sizes = layer_sizes.sizes_of([x for x in flat if isinstance(x, torch.Tensor)] + state)
        return (None, None) if sizes is None else (layer_sizes.kind_of(raw), sizes)

    def _pair_sizes(self, kind, sizes: tuple, log: tuple, template: _Template) -> None:
        """A template of other sizes (:mod:`.layer_sizes`) of this call's and an earlier one of its kind."""
        traced = self.sized.setdefault(kind, [])
        for first, first_log, first_sizes in traced:
            resized = layer_sizes.paired(first, first_log, first_sizes, template, log, sizes)
            if resized is not None:
                self.resized.setdefault(kind, []).append(resized)
                break
        if len(traced) < _MAX_TEMPLATES:
            traced.append((template, log, sizes))

    def _keyed(self, raw) -> tuple:
        """The key of a raw key (:func:`_frozen`); where the shape env learned
        an equal since the keys were written, the tables' keys written anew first."""
        sizes = _symbolic_sizes(raw)
        if not sizes:
            return _frozen(raw)
        learned = _torch.symbols_learned(sizes)
        if learned != self.learned:
            self.learned = learned
            self._rekey()
        key = _frozen(raw)
        self.raw_keys.setdefault(key, raw)
        return key

    def _rekey(self) -> None:
        """Each table's keys as the shape env writes them now: two kinds whose
        sizes were two symbols it has since learned are equal (the first
        layer's input sequence ``s70``, the mask's ``s53``) are one kind."""
        moved = {key: _frozen(raw) for key, raw in self.raw_keys.items()}
        if all(old == new for old, new in moved.items()):
            return
        for table, merge in ((self.templates, list.__add__), (self.parametric, list.__add__),
                             (self.named, lambda first, _: first), (self.last_log, lambda _, last: last)):
            merged: dict = {}
            for key, value in table.items():
                new = moved.get(key, key)
                merged[new] = merge(merged[new], value) if new in merged else value
            table.clear()
            table.update(merged)
        self.raw_keys = {moved[key]: raw for key, raw in self.raw_keys.items()}

    def _matches(self, key, templates: list, log: tuple):
        """(template, the constants in its holes) a call with this log may be stamped from."""
        for logged, template in templates:
            if template is not None and logged[:2] == log[:2]:
                yield template, {}
        for parametric in self.parametric.get(key, ()):
            with _torch.torch_function_disabled():  # the check's own torch calls
                constants = parametric.constants_for(log)
            if constants is not None:
                yield parametric.template, constants
        for logged, template in templates:
            if template is None or not layer_constants.differs_in_floats_only(logged, log):
                continue
            with _torch.torch_function_disabled():  # the dispatches' own torch calls
                if id(template) not in self.from_one_call:
                    self.from_one_call[id(template)] = layer_constants.from_one_call(template, logged)
                parametric = self.from_one_call[id(template)]
                constants = parametric.constants_for(log) if parametric is not None else None
            if constants is not None:
                yield template, constants

    def _pair(self, key, templates: list, log: tuple, template: _Template) -> None:
        """A parametric template (:mod:`.layer_constants`) of this call's and an earlier one's."""
        for logged, first in templates:
            parametric = first is not None and layer_constants.paired(first, logged, template, log)
            if parametric:
                self.parametric.setdefault(key, []).append(parametric)
                return

    # -- the first call of a kind: traced, kept as a template

    def _trace(self, module, forward, caller, flat, state, args, kwargs, mark):
        tracer = _torch.current_tracer()
        inputs = [x for x in flat if isinstance(x, torch.Tensor)] + state
        with _torch.torch_function_disabled():  # metadata reads, not the layer's
            in_nodes = [_torch.materialized_node(t) for t in inputs]
            counters = [(_torch.storage_counters(t), _torch.mutation_kind(t)) for t in inputs]
        counts, num_calls = dict(tracer.torch_fn_counts), dict(tracer.num_calls)
        depth, (module_key, (module_path, _)) = len(tracer.module_stack), list(tracer.module_stack.items())[-1]
        start, written, views = _torch.last_node(tracer.graph), self.recorder.written_so_far(), self.recorder.views_made()
        with _torch.torch_fns_recorded(tracer, {}) as made_under:
            out = forward(*args, **kwargs)
        with _torch.torch_function_disabled():  # metadata reads, not the layer's
            return out, self._template(inputs, in_nodes, counters, counts, num_calls, depth, module_key,
                                       module_path, caller, start, out, (mark, written, views, len(state)),
                                       made_under)

    def _template(self, inputs, in_nodes, counters, counts, num_calls, depth, module_key, module_path,
                  caller, start, out, mark, made_under):
        """The call's template, or None where a later call could not be stamped from it."""
        tracer = _torch.current_tracer()
        mark, written, views, n_state = mark  # inputs: the call's tensors, then its state (n_state of them)
        # first: a view it wrote whose base it wrote again is replayed from the base here, a node of the call's
        written = self.recorder.written_since(written)
        nodes = list(_torch.nodes_after(start))
        updates = _state_updates(inputs, counters, n_state, set(nodes))
        if self.recorder.reuse_mark() != mark or None in in_nodes or updates is None:
            return None
        out_flat, out_spec = _torch.pytree.tree_flatten(out)
        outputs = _outputs(out_flat, inputs, set(nodes))
        offsets = _torch_fn_offsets(nodes, counts, tracer.torch_fn_counts, made_under)
        writes = _writes(written, set(nodes), out_flat,
                         {id(t): i for i, t in enumerate(inputs[len(inputs) - n_state:])})
        module_calls = {p: (num_calls.get(p, 0), n) for p, n in tracer.num_calls.items()
                        if n != num_calls.get(p, 0)}
        if (outputs is None or offsets is None or writes is None or not _copyable(nodes, set(in_nodes), depth)
                or any(not p.startswith(module_path + ".") for p in module_calls)):
            return None
        return _Template(
            in_nodes, nodes, outputs, out_spec, offsets,
            {f: n - counts.get(f, 0) for f, n in tracer.torch_fn_counts.items() if n != counts.get(f, 0)}, writes,
            updates, _viewed(self.recorder.views_made_since(views), inputs, out_flat),
            tracer.torch_fn_metadata, depth, _inner_stacks(nodes, depth), module_calls, module_key, module_path,
            self.stamper.call_site_text(caller) if self.stamper is not None else None)

    # -- a later call of the kind: the template's nodes copied

    def _stamp(self, template: _Template, module, caller, flat, state, constants: dict, resized=None):
        """(the call's outputs, made by copying the template's nodes; the
        template as this call made it, where ``resized``); None where the
        module calls it makes would be named otherwise than the template's.
        ``resized``: (a layer_sizes.Resized template, what the call's replay
        returned) where the call's sizes are not the template's: its nodes'
        values made again (None where they cannot be, or differ from the replay's)."""
        tracer = _torch.current_tracer()
        stack = list(tracer.module_stack.items())
        module_key, (module_path, _) = stack[-1]
        # the modules the template's call called, named under this call's path: (calls before, after)
        module_calls = {_moved(p, template.module_path, module_path): counts
                        for p, counts in template.module_calls.items()}
        if any(tracer.num_calls.get(p, 0) != before for p, (before, _) in module_calls.items()):
            return None
        inputs = [x for x in flat if isinstance(x, torch.Tensor)] + state
        env = _nodes_read(template, inputs)
        values = {}
        if resized is not None:
            values = layer_sizes.values_at(resized[0], [env[n].meta["val"] for n in template.inputs], constants)
            if values is None or not layer_sizes.returns_as_replayed(
                    [values[node] for kind, (node, _) in template.outputs if kind == "node"], resized[1]):
                return None
        call_site = self.stamper.call_site_text(caller) if self.stamper is not None else None
        relocation = _Relocation(template, {k: (fqn, _class_name(cls)) for k, (fqn, cls) in stack},
                                 module_key, module_path, call_site if call_site != template.call_site else None,
                                 tracer.torch_fn_counts)
        for node in template.nodes:
            env[node] = relocation.copied(tracer.graph, node, env)
            if node in constants:
                layer_constants.filled(env[node], constants[node])
            if node in values:
                _torch.set_value(env[node], values[node])
        _advance_counters(tracer, template, module_calls)
        _update_state(template, env, state, values)
        made, leaves = _outputs_made(template, env, values)
        self.recorder.note_stamped_writes(_writes_made(template, env, leaves, state))
        inputs_viewed, leaves_viewed = template.viewed
        tensors = [*(inputs[i] for i in inputs_viewed), *(leaves[j] for j in leaves_viewed)]
        self.stamped.append(_Stamped(tensors, [_torch.storage_counters(t) for t in tensors]))
        here = _made_here(template, env, call_site) if resized is not None else None
        return _torch.pytree.tree_unflatten(leaves, template.out_spec), here

    def check_stamped(self) -> None:
        """After the forward: no stamped call's tensors were mutated since."""
        with _torch.torch_function_disabled():  # metadata reads, not the forward's
            changed = any([_torch.storage_counters(t) for t in s.tensors] != s.counters for s in self.stamped)
        if changed:
            raise Retrace()


def _made_here(template: _Template, env: dict, call_site: str | None) -> _Template:
    """The template as a stamp made it (``env``: its nodes -> the copies): the
    copies are a template of this call's sizes, its module paths still the
    first call's (its inner stacks are), its call site this call's (its stack traces start with it)."""
    def node(n):
        return env.get(n, n)
    return dataclasses.replace(
        template, inputs=[node(n) for n in template.inputs], nodes=[node(n) for n in template.nodes],
        outputs=[(kind, (node(v[0]), v[1]) if kind == "node" else v) for kind, v in template.outputs],
        torch_fns={node(n): f for n, f in template.torch_fns.items()},
        writes=[(where, node(old), node(new)) for where, old, new in template.writes],
        updates=[(position, node(n), kind) for position, n, kind in template.updates],
        inner_stacks={node(n): stack for n, stack in template.inner_stacks.items()},
        call_site=call_site if call_site is not None else template.call_site)


def _nodes_read(template: _Template, inputs: list) -> dict:
    """The template's input nodes -> this call's nodes of its ``inputs``;
    :class:`Retrace` where a stale view is brought up to date here (not where
    the layer reads it) or where the inputs alias otherwise than the template's."""
    before = [_torch.materialized_node(t) for t in inputs]
    now = [_torch.current_node(t) for t in inputs]
    if any(a is not b for a, b in zip(before, now)):
        raise Retrace()
    env = {}
    for old, new in zip(template.inputs, now):
        if env.setdefault(old, new) is not new:
            raise Retrace()
    return env


@dataclasses.dataclass
class _Relocation:
    """A template's nodes as copied at this call: their module stack under
    this call's module path, their stack traces from this call's site
    (``call_site``: None where it is the template's), their ``torch_fn``
    counted from this call's start (``counts``: the tracer's so far)."""

    template: _Template
    outer: dict  # this call's module-stack entries, around and including the layer's
    module_key: str
    module_path: str
    call_site: str | None
    counts: dict
    stacks: dict = dataclasses.field(default_factory=dict)  # id of a template's inner stack -> this call's
    traces: dict = dataclasses.field(default_factory=dict)  # a template's stack trace -> this call's

    def copied(self, graph: torch.fx.Graph, node: torch.fx.Node, env: dict) -> torch.fx.Node:
        """``node`` copied into ``graph``, reading ``env``'s nodes for the template's."""
        copy = _torch.copy_node(graph, node, lambda a: env.get(a, a))  # a symbolic size made before: shared
        meta = copy.meta
        if "nn_module_stack" in meta:
            meta["nn_module_stack"] = dict(self._module_stack(node))  # a node's own, as the tracer gives each
        trace = meta.get("stack_trace")
        if trace and self.call_site is not None:
            meta["stack_trace"] = self._stack_trace(trace)
        if node in self.template.torch_fns:
            f, offset = self.template.torch_fns[node]
            meta["torch_fn"] = (f"{f.__name__}_{self.counts.get(f, 0) + offset}", node.meta["torch_fn"][1])
        return copy

    def _module_stack(self, node: torch.fx.Node) -> dict:
        inner = self.template.inner_stacks[node]
        whole = self.stacks.get(id(inner))
        if whole is None:
            template = self.template
            whole = self.stacks[id(inner)] = {**self.outer, **{
                _moved_key(k, template.module_key, self.module_key): (
                    _moved(fqn, template.module_path, self.module_path), cls)
                for k, (fqn, cls) in inner}}
        return whole

    def _stack_trace(self, trace: str) -> str:
        if trace not in self.traces:
            self.traces[trace] = self.call_site + trace[len(self.template.call_site):]
        return self.traces[trace]


def _advance_counters(tracer, template: _Template, module_calls: dict) -> None:
    """The tracer's counts of torch functions and module calls as after the
    template's call (``module_calls``: its module calls, named as here)."""
    counts = tracer.torch_fn_counts
    for f, n in template.increments.items():
        counts[f] = counts.get(f, 0) + n
    for p, (_, after) in module_calls.items():
        tracer.num_calls[p] = after
    tracer.torch_fn_metadata = template.last_fn


def _viewed(views: list, inputs: list, out_flat: list) -> tuple:
    """(the positions of ``inputs``, the output leaves) in whose memory the call
    made ``views``: the tensors of a stamp whose later updates would replay views
    that the template's trace had and a stamp has not (:meth:`check_stamped`)."""
    memory = {_torch.storage_of(v) for v in views}
    return (tuple(i for i, t in enumerate(inputs) if _torch.storage_of(t) in memory),
            tuple(j for j, o in enumerate(out_flat) if isinstance(o, torch.Tensor) and _torch.storage_of(o) in memory))


def _state_updates(inputs: list, before: list, n_state: int, made: set) -> list | None:
    """The call's state updated in place, as a stamp updates its own: (position
    among the state, the node of its new value, how it was mutated); None where
    the call changed what a stamp cannot (an input, a layout or storage, state
    mutated before the call, a value not made by the call)."""
    updates = []
    for i, (t, (counters, kind)) in enumerate(zip(inputs, before)):
        if _torch.storage_counters(t) == counters:
            continue
        position = i - (len(inputs) - n_state)
        node = _torch.current_node(t)
        if (position < 0 or kind is not None or _torch.has_metadata_mutation(t) or _torch.storage_changed(t)
                or node not in made):
            return None
        updates.append((position, node, _torch.mutation_kind(t)))
    return updates


def _update_state(template: _Template, env: dict, state: list, values: dict) -> None:
    """The stamped layer's state updated as the template's was: its new values
    the copied nodes', mutated in the grad mode (or hidden) the template's were
    (``values``: the nodes' values at this call's sizes, where they differ)."""
    for position, node, kind in template.updates:
        value = _torch.traced_output(_torch.fresh_like(values.get(node, node.meta["val"]), False), env[node])
        with torch.no_grad() if kind == "no_grad" else contextlib.nullcontext():
            _torch.functional_write(state[position], value, hidden=kind == "hidden")


def _writes(written: list, made: set, out_flat: list, state: dict) -> list | None:
    """What a call wrote in grad mode (the recorder's notes, :meth:`written_since`),
    as a stamp of it notes it again: each output and each piece of its state it
    wrote, by position, and each value it made and wrote, settled (no code
    outside can reach it); None where it wrote a value made before it. A value
    noted but left as it was (an input it read while writing another) is no write."""
    leaves = {id(o): i for i, o in enumerate(out_flat) if isinstance(o, torch.Tensor)}
    writes = []
    for t, old, new, view, swapped in written:
        if new is old or new is None:
            continue
        if id(t) in leaves:
            writes.append((("output", leaves[id(t)]), old, new))
        elif id(t) in state:
            writes.append((("state", state[id(t)]), old, new))
        elif old in made and new in made:
            writes.append((("settled", view, swapped), old, new))
        else:
            return None
    return writes


def _writes_made(template: _Template, env: dict, leaves: list, state: list) -> list:
    """The template's writes (:func:`_writes`) for this stamp: (the value, its node before the write)."""
    written = []
    for (kind, *how), old, new in template.writes:
        value = {"output": lambda: leaves[how[0]], "state": lambda: state[how[0]],
                 "settled": lambda: Settled(env[new], *how)}[kind]()
        written.append((value, env.get(old, old)))
    return written


def _outputs_made(template: _Template, env: dict, values: dict) -> tuple[list, list]:
    """(the new traced tensors, the call's output leaves): a fresh traced
    tensor for each output node of the template's copied (once per node),
    of its value at this call's sizes (``values``, where they differ)."""
    def fresh(node, requires_grad):
        return _torch.traced_output(_torch.fresh_like(values.get(node, node.meta["val"]), requires_grad), env[node])

    # an output the call wrote in place: made as it was before, then written, as the trace left it
    # (functionalization replays a later view of a written tensor from it: slices, not one split)
    written = {how[0]: (old, new) for (where, *how), old, new in template.writes if where == "output"}
    made, leaves = {}, []
    for j, (kind, value) in enumerate(template.outputs):
        if kind == "value":
            leaves.append(value)
            continue
        node, requires_grad = value
        if node not in made:
            write = written.get(j)
            if write is not None and write[1] is node and write[0] in env:
                made[node] = fresh(write[0], requires_grad)
                _torch.functional_write(made[node], fresh(node, requires_grad), hidden=False)
            else:
                made[node] = fresh(node, requires_grad)
        leaves.append(made[node])
    return list(made.values()), leaves


def _inner_stacks(nodes, depth: int) -> dict:
    """node -> the module-stack entries inside the call (past ``depth``), as a
    tuple shared by the nodes with the same stack (a copy moves each once)."""
    distinct, inner = {}, {}
    for node in nodes:
        if "nn_module_stack" in node.meta:
            entries = tuple(list(node.meta["nn_module_stack"].items())[depth:])
            inner[node] = distinct.setdefault(entries, entries)
    return inner


def _moved(name: str, old: str, new: str) -> str:
    """``name`` under the module ``old`` named as under ``new``."""
    if name == old:
        return new
    return new + name[len(old):] if name.startswith(old + ".") else name


def _moved_key(key: str, old: str, new: str) -> str:
    """An ``nn_module_stack`` key under the module keyed ``old`` keyed as
    under ``new``. A key is its module's name, with ``@n`` after it on the
    module's (n+1)-th call; the keys of the modules inside it name it
    without that (``layers.0@1`` holds ``layers.0.norm@1``)."""
    if key == old:
        return new
    return _moved(key, old.partition("@")[0], new.partition("@")[0])


def _class_name(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else cls


def _outputs(out_flat, inputs, made: set) -> list | None:
    """The template's outputs, or None where a later call's cannot be made
    from nodes: an alias of an input or of another output, a view, a tensor
    whose layout a fresh one cannot have."""
    storages = {_torch.storage_of(t) for t in inputs}
    outputs, seen = [], {}
    for o in out_flat:
        if not isinstance(o, torch.Tensor):
            if not isinstance(o, (int, float, bool, str, type(None))):
                return None
            outputs.append(("value", o))
            continue
        if not isinstance(o, _torch.FunctionalTensor) or _torch.is_view(o):
            return None
        node = _torch.materialized_node(o)
        storage = _torch.storage_of(o)
        if node not in made or storage in storages or seen.setdefault(storage, o) is not o:
            return None
        inner = _torch.inner_value(o)
        if _torch.fresh_like(inner, inner.requires_grad) is None:
            return None
        outputs.append(("node", (node, inner.requires_grad)))
    return outputs


def _copyable(nodes, in_nodes: set, depth: int) -> bool:
    """Nodes a copy reproduces: aten ops (and symbolic size arithmetic) on the
    call's inputs or on each other (or on symbolic sizes made before, which a
    copy shares), with no metadata but torch's own, no unbacked symbols."""
    made = set()
    for node in nodes:
        if _is_grad_mode_read(node):  # where the layer's code read the grad mode: the same code, read again
            continue
        if node.op != "call_function" or not (
                _torch.is_functional_overload(node.target) or node.target is _GETITEM
                or (_is_symbolic(node) and _is_size_arithmetic(node.target))):
            return False
        if not node.meta.keys() <= _COPIED_META or _torch.free_unbacked_symbols(node.meta.get("val")):
            return False
        if len(node.meta.get("nn_module_stack", ())) < depth:
            return False
        if any(a not in made and a not in in_nodes and not _is_symbolic(a) for a in node.all_input_nodes):
            return False
        made.add(node)
    return True


def _is_grad_mode_read(node) -> bool:
    """A marker of the layer's code reading the grad mode (:mod:`.grad_mode_reads`):
    no inputs, its code and offset as metadata; a stamp, in the same grad mode, reads it again."""
    return node.op == "call_function" and node.target is grad_mode_read and not node.args \
        and node.meta.keys() <= {GRAD_MODE_READ}


def _is_symbolic(node) -> bool:
    return isinstance(node.meta.get("val"), (torch.SymInt, torch.SymFloat, torch.SymBool))


def _is_size_arithmetic(target) -> bool:
    return getattr(target, "__module__", None) in ("_operator", "math") or (
        getattr(target, "__module__", None) == "torch" and getattr(target, "__name__", "").startswith("sym_"))


_GETITEM = operator.getitem


def _repeated_modules(root: torch.nn.Module) -> list:
    """The outermost submodules (with submodules of their own: layers, not
    single ops) whose class, submodules' classes, and parameter and buffer
    shapes repeat. (A layer whose submodules differ, a stochastic depth that
    is an ``Identity`` at rate 0, runs other code: replaying it to compare
    with the others would be wasted. Modules that repeat only at other sizes,
    a CNN's first block of each stage, are not wrapped either: their replays
    cost more than the few stamps a template of other sizes gives them,
    measured on timm's ResNets and diffusers' U-Net, design/layer-reuse.md.)"""
    def signature(m):
        return (type(m), tuple((n, type(c)) for n, c in m.named_modules(remove_duplicate=False)),
                tuple((n, _dims(t.shape), t.dtype) for n, t in (
                    *m.named_parameters(remove_duplicate=False), *m.named_buffers(remove_duplicate=False))))

    by_class: dict = {}
    for m in root.modules():
        if m is not root and next(m.children(), None) is not None:
            by_class.setdefault(type(m), []).append(m)
    groups: dict = {}
    for ms in by_class.values():  # a class seen once cannot repeat (and the outer ones walk every parameter)
        for m in ms if len(ms) > 1 else ():
            groups.setdefault(signature(m), []).append(m)
    repeated = {id(m) for ms in groups.values() if len(ms) > 1 for m in ms}
    chosen, seen = [], set()

    def walk(m):
        for child in m.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            if id(child) in repeated:
                chosen.append(child)
            else:
                walk(child)
    walk(root)
    return chosen
