"""Python state a layer's replay can reach: saved before it, compared and put back after.

Layer reuse (:mod:`predispatch.trace.layer_reuse`) runs a later call of a repeated
layer once more, on meta tensors, to decide whether an earlier call's graph
serves it. Its torch calls are logged; its Python side effects must not
outlive it: the real call (stamped or traced) has to find every object it
reaches as eager would. And a call whose replay wrote anything outside its
own tensors is traced, not stamped, since a stamp runs no Python.

What is tracked:

* *deep roots*: the replay's arguments (their pytree containers are the
  replay's own copies, the objects in them the caller's) and the layer with
  its submodules, to any depth, with the classes of the objects reached;
* *named globals*: for each function the replay runs, the globals its code
  names and, through module objects, the attributes it names, one level into
  their values; functions reached carry their closure cells and defaults.
  The first replay of a kind of call learns which code runs by watching
  every frame start (:class:`Watch`, ``sys.settrace``: six times slower
  Python while it is on); later replays of the kind save those names up
  front and run unwatched.

A reached object is saved by the rule of its kind (:data:`_RULES`): a dict's
items, a list's elements, an instance's attributes, a class's own
attributes, a cell's value, a cache's counters. :meth:`PythonState.restore`
compares each with the object now, by identity, and puts back what differs.

What cannot be put back stops the replay before it does harm: an iterator or
generator reached before the replay means no replay; reached while it runs,
the replay stops before the code that names it starts. A function cache
(``functools.lru_cache``) the replay filled is emptied (a cached function is
pure: its callers cannot tell) and counts as a change. Not seen: state behind
C objects (a lock, a numpy array, an OrderedDict's or a function's
attributes), objects reached only through a named global's values' values,
the state of torch's, the standard library's and predispatch's own Python
code (not watched: caches, warning registries and the trace's own state,
which no layer's result depends on).
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import operator
import os
import sys
import sysconfig
import types
from typing import Callable

import torch

from ..errors import PACKAGE_DIR

_MISSING = object()
_DEEP = sys.maxsize
_BUDGET = 100_000  # objects per replay: past it, the state counts as unseeable
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python (a static one cannot be set)
_GENERATOR_CODE = 0x20 | 0x80 | 0x200  # CO_GENERATOR | CO_COROUTINE | CO_ASYNC_GENERATOR
_ATOMS = frozenset({int, float, complex, bool, str, bytes, type(None), range, slice, type(Ellipsis),
                    type(NotImplemented), torch.dtype, torch.device, torch.layout, torch.memory_format,
                    torch.Size})
_NOT_WALKED = (torch.Tensor, types.ModuleType, types.CodeType, types.FrameType, type(len.__call__))
_OWN_DIRS = (os.path.dirname(torch.__file__) + os.sep, PACKAGE_DIR)
_STDLIB = os.path.join(sysconfig.get_paths()["stdlib"], "")
_OWN_PACKAGES = frozenset({"torch", __package__.partition(".")[0]})  # their functions' and classes' state is not the layer's


class _Unseeable(BaseException):
    """Raised into a replay before code that names state no save can hold
    (a BaseException: a layer's ``except Exception`` does not swallow it)."""


# ---------------------------------------------------------------- saving, comparing, putting back


def _same(a, b) -> bool:
    return a is b or (type(a) is type(b) and type(a) in _ATOMS and a == b)


def _same_sequence(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y or _same(x, y) for x, y in zip(a, b))


def _read_dict(d: dict) -> dict:
    """A dict's items as stored: a subclass's own ``__getitem__`` is not
    called (transformers' ``ACT2FN`` makes a new module each time, and
    ``dict.copy`` of an OrderedDict subclass calls it for every key)."""
    return dict(dict.items(d))


def _same_dict(a: dict, b: dict) -> bool:
    if len(a) != len(b):
        return False
    for key, value in a.items():
        now = b.get(key, _MISSING)
        if now is not value and not _same(value, now):
            return False
    return True


def _same_members(a: list, b: list) -> bool:
    return len(a) == len(b) and {id(x) for x in a} == {id(x) for x in b}


def _put_back_dict(d: dict, content: dict) -> None:
    d.clear()
    d.update(content)


def _put_back_set(s: set, members: list) -> None:
    s.clear()
    s.update(members)


def _put_back_deque(d, elements: list) -> None:
    d.clear()
    d.extend(elements)


def _put_back_list(lst: list, elements: list) -> None:
    lst[:] = elements


def _read_buffer(b) -> bytes:
    return bytes(memoryview(b).cast("B"))


def _put_back_buffer(b, content: bytes) -> None:
    memoryview(b).cast("B")[:] = content


def _instance_dict(obj) -> dict:
    return object.__getattribute__(obj, "__dict__")


def _read_attributes(obj) -> dict:
    return dict.copy(_instance_dict(obj))


def _put_back_attributes(obj, content: dict) -> None:
    _put_back_dict(_instance_dict(obj), content)


def _read_class(cls: type) -> dict:
    return dict(cls.__dict__)


def _put_back_class(cls: type, content: dict) -> None:
    for name in [n for n in cls.__dict__ if n not in content]:
        delattr(cls, name)
    for name, value in content.items():
        if cls.__dict__.get(name, _MISSING) is not value:
            setattr(cls, name, value)


def _slot_names(cls: type) -> tuple:
    names = []
    for klass in cls.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        names += [s for s in ((slots,) if isinstance(slots, str) else slots) if s not in ("__dict__", "__weakref__")]
    return tuple(names)


def _read_slots(obj) -> dict:
    return {name: getattr(obj, name, _MISSING) for name in _slot_names(type(obj))}


def _put_back_slots(obj, content: dict) -> None:
    for name, value in content.items():
        if value is not _MISSING:
            setattr(obj, name, value)
        elif hasattr(obj, name):
            delattr(obj, name)


def _read_cell(cell) -> list:
    try:
        return [cell.cell_contents]
    except ValueError:  # empty
        return [_MISSING]


def _put_back_cell(cell, content: list) -> None:
    if content[0] is not _MISSING:
        cell.cell_contents = content[0]
    else:
        del cell.cell_contents


def _cache_counters(cache) -> tuple:
    info = cache.cache_info()
    return info.misses, info.currsize


@dataclasses.dataclass(frozen=True)
class _Named:
    """Some entries of a namespace (a module's globals), by name."""

    namespace: dict
    names: tuple


def _read_named(named: _Named) -> dict:
    get = named.namespace.get
    return {n: get(n, _MISSING) for n in named.names}


def _put_back_named(named: _Named, content: dict) -> None:
    for name, value in content.items():
        if value is not _MISSING:
            named.namespace[name] = value
        else:
            named.namespace.pop(name, None)


# ---------------------------------------------------------------- what is reached from what


def _dict_values(obj, content: dict):
    return [*content.keys(), *content.values()]


def _values(obj, content: dict):
    return content.values()


def _elements(obj, content):
    return content


def _is_library_file(filename: str) -> bool:
    """torch's, predispatch's or the standard library's: code whose state (caches, warning
    registries, the trace's own) is not a layer's."""
    return filename.startswith(_OWN_DIRS) or (filename.startswith(_STDLIB) and "-packages" + os.sep not in filename)


def _function_parts(f, _) -> list:
    if _is_library_file(f.__code__.co_filename):
        return []  # torch's or predispatch's (a wrapped forward's closure is the trace's)
    return [*(f.__defaults__ or ()), *(f.__kwdefaults__ or {}).values(), *(f.__closure__ or ())]


def _owner(method, _) -> list:
    owner = getattr(method, "__self__", None)
    return [] if owner is None or isinstance(owner, types.ModuleType) else [owner]


# ---------------------------------------------------------------- the rules, one per kind of object


@dataclasses.dataclass(frozen=True)
class _Rule:
    """How one kind of object is saved, compared, put back and walked into."""

    name: str
    applies: Callable[[type], bool]  # to instances of a type
    save: Callable | None = None  # obj -> content; None: nothing saved, only walked into
    same: Callable | None = None  # (content, content) -> bool
    put_back: Callable | None = None  # (obj, content) -> None
    children: Callable = lambda obj, content: ()  # (obj, content) -> the objects it holds
    unseeable: bool = False  # its state can be neither saved nor put back


def _has_instance_dict(cls: type) -> bool:
    return cls.__dictoffset__ != 0 and bool(cls.__flags__ & _HEAPTYPE)  # an OrderedDict's or function's: not seen


# Every rule that applies to an object is used (a dict subclass has items and attributes).
_RULES = (
    _Rule("iterator", lambda cls: hasattr(cls, "__next__"), unseeable=True),
    _Rule("cache", lambda cls: callable(getattr(cls, "cache_info", None)) and callable(getattr(cls, "cache_clear", None)),
          _cache_counters, operator.eq, lambda cache, _: cache.cache_clear()),
    _Rule("dict", lambda cls: issubclass(cls, dict), _read_dict, _same_dict, _put_back_dict, _dict_values),
    _Rule("list", lambda cls: issubclass(cls, list), list.copy, _same_sequence, _put_back_list, _elements),
    _Rule("set", lambda cls: issubclass(cls, set), list, _same_members, _put_back_set, _elements),
    _Rule("deque", lambda cls: issubclass(cls, collections.deque), list, _same_sequence, _put_back_deque, _elements),
    _Rule("bytearray", lambda cls: issubclass(cls, bytearray), _read_buffer, operator.eq, _put_back_buffer),
    _Rule("immutable container", lambda cls: issubclass(cls, (tuple, frozenset)), children=lambda obj, _: obj),
    _Rule("cell", lambda cls: cls is types.CellType, _read_cell, _same_sequence, _put_back_cell, _elements),
    _Rule("function", lambda cls: cls is types.FunctionType, children=_function_parts),
    _Rule("method", lambda cls: cls in (types.MethodType, types.BuiltinMethodType), children=_owner),
    _Rule("attributes", _has_instance_dict, _read_attributes, _same_dict, _put_back_attributes, _values),
    _Rule("slots", lambda cls: bool(_slot_names(cls)), _read_slots, _same_dict, _put_back_slots, _values),
)
_CLASS = _Rule("class", lambda cls: True, _read_class, _same_dict, _put_back_class, _values)
_NAMED = _Rule("named globals", lambda cls: True, _read_named, _same_dict, _put_back_named)
_EMPTY = _Rule("empty container", lambda cls: cls in _EMPTIABLE, len, operator.eq, lambda obj, _: obj.clear())
_EMPTIABLE = frozenset({dict, collections.OrderedDict, list, set})
_BY_TYPE: dict[type, tuple[_Rule, ...]] = {}


def _rules_for(obj) -> tuple[_Rule, ...]:
    cls = type(obj)
    rules = _BY_TYPE.get(cls)
    if rules is None:  # decided once per type, but for classes
        if issubclass(cls, type):  # a class: its own attributes, if it is the layer's code's
            return (_CLASS,) if obj.__flags__ & _HEAPTYPE and obj.__module__.partition(".")[0] not in _OWN_PACKAGES \
                else ()
        rules = _BY_TYPE[cls] = tuple(r for r in _RULES if r.applies(cls))
    return rules


# ---------------------------------------------------------------- the state of one replay


class PythonState:
    """What one replay can reach, saved; :meth:`restore` puts it back.

    ``unseeable`` names the first thing that could not be saved (then the
    replay must not run, or is stopped)."""

    def __init__(self):
        self.records: list[tuple] = []  # (object, its rule, its content then)
        self.depth: dict[int, int] = {}  # id -> the deepest walk made from the object
        self.alive: list = []  # reached objects kept alive: ids stay unique
        self.named: set = set()  # (namespace id, names) recorded
        self.code_names: list[tuple[dict, tuple]] = []  # (globals, names) of the code a watch saw run
        self.unseeable: str | None = None

    def reach(self, *roots) -> None:
        """Save everything reachable from ``roots``, to any depth."""
        for root in roots:
            self._walk(root, _DEEP)

    def name_globals(self, namespace: dict, names: tuple) -> None:
        """Save the entries of ``namespace`` called ``names`` (absent ones too:
        a new global is a change) and one level into their values; modules
        among them by the same names, but for library modules (builtin, the
        standard library's, torch's: :func:`_is_library_file`)."""
        key = (id(namespace), names)
        if key in self.named:
            return
        self.named.add(key)
        named = _Named(namespace, names)
        self.alive.append(named)
        content = _read_named(named)
        self.records.append((named, _NAMED, content))
        for value in content.values():
            if isinstance(value, types.ModuleType):
                if not _is_library_file(getattr(value, "__file__", None) or _STDLIB):
                    self.name_globals(_instance_dict(value), names)
            elif value is not _MISSING:
                self._walk(value, 1)

    def _walk(self, root, depth: int) -> None:
        if type(root) in _ATOMS or isinstance(root, _NOT_WALKED):
            return
        stack = [(root, depth)]
        pop, push, depths, records, alive = stack.pop, stack.append, self.depth, self.records, self.alive
        while stack:
            obj, depth = pop()
            seen = depths.get(id(obj))
            if seen is not None and seen >= depth:
                continue
            depths[id(obj)] = depth
            cls = type(obj)
            if seen is None:
                alive.append(obj)
                if len(alive) > _BUDGET:
                    self.unseeable = f"more than {_BUDGET} Python objects"
                    return
                if depth and cls.__flags__ & _HEAPTYPE and id(cls) not in depths:
                    push((cls, 1))  # its class's own attributes
            rules = _BY_TYPE.get(cls)
            for rule in _rules_for(obj) if rules is None else rules:
                if rule.unseeable:
                    self.unseeable = f"{cls.__qualname__} (an {rule.name})"
                    return
                content = None
                if rule.save is not None:
                    content = rule.save(obj)
                    if seen is None:
                        records.append((obj, rule, content))
                if depth:
                    for child in rule.children(obj, content):
                        kind = type(child)
                        if kind in _EMPTIABLE and not child:  # most of a module's tables: saved as empty
                            records.append((child, _EMPTY, 0))
                        elif kind not in _ATOMS and not isinstance(child, _NOT_WALKED):
                            push((child, depth - 1))

    def restore(self) -> bool:
        """Put every saved object back as it was; whether any had changed."""
        changed = False
        for obj, rule, content in reversed(self.records):
            if not rule.same(content, rule.save(obj)):
                changed = True
                rule.put_back(obj, content)
        return changed


class Watch:
    """While open, every new frame outside the library code (:func:`_is_library_file`) has the
    globals its code names saved into ``state`` before it runs
    (``sys.settrace``, chained to a tracer already installed). A frame whose
    names reach what cannot be saved is stopped before it starts: an
    :class:`_Unseeable` error, which the watch catches; ``stopped`` says why."""

    _own: dict = {}  # code -> whether it is torch's or predispatch's (shared by every watch)

    def __init__(self, state: PythonState):
        self.state = state
        self.seen: set = set()
        self.stopped: str | None = None

    def __enter__(self):
        self.outer = sys.gettrace()
        sys.settrace(self._on_call)
        return self

    def __exit__(self, kind, error, tb):
        sys.settrace(self.outer)
        if self.stopped is None and self.state.unseeable is not None:
            self.stopped = self.state.unseeable
        return isinstance(error, _Unseeable)

    @staticmethod
    @contextlib.contextmanager
    def paused():
        """Library code run inside a watch (a torch call) runs unwatched: tracing slows Python sixfold."""
        tracer = sys.gettrace()
        if not isinstance(getattr(tracer, "__self__", None), Watch):
            yield
            return
        sys.settrace(tracer.__self__.outer)
        try:
            yield
        finally:
            sys.settrace(tracer)

    def _on_call(self, frame, event, arg):
        code = frame.f_code
        if code not in self.seen:
            self.seen.add(code)
            own = self._own.get(code)
            if own is None:
                own = self._own[code] = _is_library_file(code.co_filename)
            if not own and self.state.unseeable is None:
                self.state.code_names.append((frame.f_globals, code.co_names))
                self.state.name_globals(frame.f_globals, code.co_names)
                if self.state.unseeable is not None and not code.co_flags & _GENERATOR_CODE:
                    raise _Unseeable(self.state.unseeable)  # a generator's frame outlives it: not raised into
        return self.outer(frame, event, arg) if self.outer is not None else None
