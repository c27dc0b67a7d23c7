"""Random numbers drawn outside torch while the forward is traced.

Python's ``random`` and numpy's global generator are invisible to the
tracer: a drawn number is a constant to it, and the program would replay
this export's draws on every call where eager draws anew (transformers'
SpecAugment masks). torch's generator is recorded as ops and is fine.

A draw is refused (``ExportError`` naming its line) only when its value can
change the program. A float draw comes back as a :class:`Draw`, which notes
when it is read: arithmetic, conversion, reaching a torch call; a comparison
that no value in the draw's range could change is not a read (layer drop
with ``random.uniform(0, 1) < 0.0``, or not reached at all in eval mode).
Any other draw (arrays, ints) is a read at once. Draws after the forward
seeds the generator replay the same values each call and are not refused.
A generator whose state changed without a wrapped call is refused too.
"""
from __future__ import annotations

import contextlib
import math
import sys


from .._torch import pytree
from ..errors import ExportError, is_library_file, user_location
from .._torch.patching import patched

_NOT_DRAWS = {"getstate", "get_state", "get_bit_generator"}
_SEEDING = {"seed", "setstate", "set_state", "set_bit_generator"}
_UNIT_DRAWS = {"random", "random_sample", "ranf", "rand"}  # a float in (0, 1) without arguments


def _generators() -> dict:
    """name -> (module, global generator instance)."""
    import random

    generators = {"Python's random": (random, random._inst)}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        generators["numpy.random"] = (numpy.random, numpy.random.mtrand._rand)
    return generators


def _state(instance):
    if hasattr(instance, "getstate"):  # Python's
        return instance.getstate()
    state = instance.get_state(legacy=False)  # numpy's: a dict holding an array
    return state["state"]["key"].tobytes(), state["state"]["pos"], state["has_gauss"], state["gauss"]


def _range(attr: str, args, kwargs) -> tuple[float, float]:
    """The open interval a float draw lies in, as far as its call tells."""
    if attr in _UNIT_DRAWS and not args and kwargs.get("size") is None:
        return 0.0, 1.0
    if attr == "uniform":
        low = args[0] if args else kwargs.get("low", kwargs.get("a", 0.0))
        high = args[1] if len(args) > 1 else kwargs.get("high", kwargs.get("b", 1.0))
        if isinstance(low, (int, float)) and isinstance(high, (int, float)):
            return min(low, high), max(low, high)
    return -math.inf, math.inf


class Draw(float):
    """A float drawn from a host generator while tracing; reading it calls ``on_read``."""

    def __new__(cls, value: float, low: float, high: float, on_read):
        draw = super().__new__(cls, value)
        draw.low, draw.high, draw.on_read = low, high, on_read
        return draw


def _reading(name):
    plain = getattr(float, name)

    def method(self, *args):
        self.on_read()
        return plain(float.__float__(self), *args)
    return method


def _comparing(name, always_true, always_false):
    """A comparison with a number whose outcome is the same for every value
    of the draw's open range does not read it."""
    plain = getattr(float, name)

    def method(self, other):
        if type(other) in (int, float, bool):
            if always_true(self.low, self.high, other):
                return True
            if always_false(self.low, self.high, other):
                return False
        self.on_read()
        return plain(float.__float__(self), other)
    return method


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
              "__truediv__", "__rtruediv__", "__floordiv__", "__rfloordiv__", "__mod__",
              "__rmod__", "__divmod__", "__rdivmod__", "__pow__", "__rpow__", "__neg__",
              "__pos__", "__abs__", "__float__", "__int__", "__bool__", "__round__",
              "__trunc__", "__floor__", "__ceil__", "__eq__", "__ne__", "__hash__"):
    setattr(Draw, _name, _reading(_name))
_BELOW = (lambda lo, hi, c: c >= hi, lambda lo, hi, c: c <= lo)  # draw < c, draw <= c
_ABOVE = (lambda lo, hi, c: c <= lo, lambda lo, hi, c: c >= hi)  # draw > c, draw >= c
for _name, _rule in (("__lt__", _BELOW), ("__le__", _BELOW), ("__gt__", _ABOVE), ("__ge__", _ABOVE)):
    setattr(Draw, _name, _comparing(_name, *_rule))


class HostDraws:
    """The draws of one traced forward."""

    def __init__(self):
        self.pending = False  # a Draw is out: torch calls are checked for one
        self.read_at: dict[str, str] = {}  # generator -> line of the first draw read
        self.drawn: set[str] = set()
        self.seeded: set[str] = set()

    def note_read(self, generator: str, where: str) -> None:
        self.read_at.setdefault(generator, where)

    def note_torch_call(self, args, kwargs) -> None:
        """A Draw passed to torch becomes part of the graph: a read."""
        for leaf in pytree.tree_leaves((args, kwargs)):
            if isinstance(leaf, Draw):
                leaf.on_read()

    def watching(self, generator: str, attr: str):
        """A replacement maker for ``patched``: ``fn`` draws, or seeds."""
        return lambda fn: self._watched(generator, attr, fn)

    def _watched(self, generator: str, attr: str, fn):
        def call(*args, **kwargs):
            # called through patched()'s dispatch: the caller is 2 frames up
            if is_library_file(sys._getframe(2).f_code.co_filename):  # torch's own use
                return fn(*args, **kwargs)
            if attr in _SEEDING:
                self.seeded.add(generator)
                return fn(*args, **kwargs)
            value = fn(*args, **kwargs)
            self.drawn.add(generator)
            if generator in self.seeded:  # the same values every call
                return value
            where = user_location()
            if type(value) is float:
                self.pending = True
                return Draw(value, *_range(attr, args, kwargs),
                            lambda: self.note_read(generator, where))
            self.note_read(generator, where)
            return value
        return call


@contextlib.contextmanager
def refusing_host_randomness(draws: HostDraws):
    """Wrap the generators' module functions (``np.random.rand``,
    ``random.uniform``, ...) while the forward runs; refuse read draws after."""
    generators = _generators()
    before = {name: _state(inst) for name, (_, inst) in generators.items()}
    with contextlib.ExitStack() as stack:
        for name, (module, inst) in generators.items():
            for attr in dir(module):
                fn = getattr(module, attr, None)
                bound = getattr(fn, "__self__", None) is inst or attr in _SEEDING  # np.random.seed is not bound
                if callable(fn) and bound and not attr.startswith("_") and attr not in _NOT_DRAWS:
                    stack.enter_context(patched(module, attr, draws.watching(name, attr)))
        yield
    for name, (_, inst) in generators.items():
        unseen = name not in draws.drawn and name not in draws.seeded and _state(inst) != before[name]
        if name in draws.read_at or unseen:
            raise ExportError(
                f"random numbers drawn with {name} at {draws.read_at.get(name, 'an unknown line')} "
                "cannot be exported soundly: the tracer sees them as constants, so the program "
                "would reuse this export's draws on every call where eager draws anew. Draw "
                "them with torch's generator (torch.rand, torch.randint, ...), which the graph "
                "records, or turn the feature off for export")



def host_generator_states() -> dict:
    """name -> (global generator instance, its state now, as it restores)."""
    return {name: (instance, instance.getstate() if hasattr(instance, "getstate")
                   else instance.get_state(legacy=False))
            for name, (_, instance) in _generators().items()}


def restore_host_generators(states: dict) -> bool:
    """Put the generators back as ``states`` found them; whether any had drawn."""
    drew = False
    for instance, full in states.values():
        python = hasattr(instance, "setstate")
        before = full if python else (full["state"]["key"].tobytes(), full["state"]["pos"],
                                      full["has_gauss"], full["gauss"])
        if _state(instance) != before:
            drew = True
            instance.setstate(full) if python else instance.set_state(full)
    return drew
