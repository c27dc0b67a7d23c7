"""torch's random generator seeded, forked or restored in the forward: recorded, not refused.

The draws a program makes (``aten.randn``, ``aten.bernoulli``, ...) act on
the caller's generator at run time, as eager's do. A forward that also
seeds it (``torch.manual_seed(42)``), reads and restores it
(``torch.get_rng_state()`` / ``set_rng_state``) or forks it (``fork_rng``,
torch's test helper ``freeze_rng_state``) has those calls recorded as the
generator ops of :mod:`predispatch.ir.generator_ops`, in the order they ran
among the draws: the program draws what eager draws and leaves the
generator as eager leaves it. The real generator is not touched while
tracing (the trace draws nothing).

A ``torch.Generator`` made in the forward (``torch.Generator().manual_seed(s)``,
a diffusion sampler's noise) starts from the same state on every call, where
eager makes it anew; its state is a value of the graph (a seed's state, or a
constant), and each draw from it is a draw from the device's default
generator set to that state, the state after it kept and the default
generator restored (:mod:`predispatch.trace.recorder.generators`). Its
own state calls act on that value as eager's act on the generator
(``g.get_state()`` after a draw, ``g.set_state(s)``, ``g.manual_seed(s)``
again); ``g.seed()`` is refused. A generator made before the forward keeps
its own state between calls and is the graph's as before (a constant
object: ``torch.export.save`` keeps its state at the save).

A seed must be a number the program can hold: a literal, or a size of a
dynamic shape. A seed read from a tensor's data is refused, naming the
line; so is ``torch.seed()``, whose seed eager draws anew each call.
"""
from __future__ import annotations

import contextlib
import numbers
import threading

import torch

from .. import _torch
from ..errors import ExportError, user_location
from ..ir import generator_ops
from .._torch.patching import patched

_CPU = torch.device("cpu")


def _seed_of(seed):
    """The seed as the graph holds it: an int, or a SymInt of a dynamic size."""
    if isinstance(seed, torch.SymInt):
        return seed
    if isinstance(seed, torch.Tensor) and _torch.is_traced(seed):
        raise ExportError(
            f"torch.manual_seed(a tensor) at {user_location()} cannot be exported soundly: the "
            "seed is read from a tensor's data, which a program cannot hold as a literal, and "
            "its draws would be this export's on every call; seed with a Python int")
    seed = int(seed)  # as torch.manual_seed reads it (a host random draw read here is refused)
    if not _fits_a_graph_int(seed):
        raise ExportError(
            f"torch.manual_seed({seed}) at {user_location()} cannot be exported: a graph holds a "
            "seed as a 64-bit signed int; seed with a smaller number")
    return seed


def _fits_a_graph_int(seed: int) -> bool:
    return -2**63 <= seed < 2**63


def _seeding(_original):
    def manual_seed(seed):
        generator_ops.MANUAL_SEED(_seed_of(seed))
        return torch.default_generator
    return manual_seed


def _getting(_original):
    def get_rng_state():
        return generator_ops.GET_RNG_STATE(_CPU)
    return get_rng_state


def _setting(_original):
    def set_rng_state(new_state):
        generator_ops.SET_RNG_STATE(new_state, _CPU)
    return set_rng_state


def _getting_device(device_type: str):
    def make(_original):
        def get_rng_state(device=device_type):
            return generator_ops.GET_RNG_STATE(_device(device_type, device))
        return get_rng_state
    return make


def _setting_device(device_type: str):
    def make(_original):
        def set_rng_state(new_state, device=device_type):
            generator_ops.SET_RNG_STATE(new_state, _device(device_type, device))
        return set_rng_state
    return make


def _device(device_type: str, device) -> torch.device:
    """A device module's ``device`` argument (an index, a name, a device) as a
    device with its index (the current one where it names none)."""
    device = torch.device(device_type, device) if isinstance(device, int) else torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def _refusing_device_seed(original):
    def seed(*args, **kwargs):
        raise ExportError(
            f"{original.__module__}.{original.__name__}() at {user_location()} cannot be exported "
            "soundly: the program records torch.manual_seed(s), which seeds every device, and "
            "not a device's own seeding")
    return seed


def _accelerator():
    """(device type, device module) of the accelerator present, or None."""
    if not torch.accelerator.is_available():
        return None
    device_type = torch.accelerator.current_accelerator().type
    return device_type, torch.get_device_module(device_type)


def _freezing(_original):
    """``freeze_rng_state()``: a fork of the CPU generator and the current
    accelerator's, as the helper does (it forks under ``no_dispatch``, where
    the trace would not see it)."""
    @contextlib.contextmanager
    def freeze_rng_state():
        accelerator = _accelerator()
        if accelerator is None:
            with torch.random.fork_rng(devices=[]):
                yield
            return
        device_type, module = accelerator
        with torch.random.fork_rng(devices=[module.current_device()], device_type=device_type):
            yield
    return freeze_rng_state


_GENERATOR = torch.Generator  # torch's C type, whose methods act on the real generator


class ForwardGenerators:
    """The ``torch.Generator`` objects made while the forward is traced, and
    each one's state as the graph has it (from its first draw on). Their
    own state calls (``get_state``, ``set_state``, ``manual_seed``) read
    and set that graph value (:func:`_following_state`)."""

    def __init__(self):
        self.made: dict[int, torch.Generator] = {}  # id -> generator, alive for the trace
        self.states: dict[int, torch.Tensor] = {}  # id -> its state now, a graph value
        self.seen: dict[int, torch.Tensor] = {}  # id -> the real generator's state at its last draw
        self.draws = 0  # draws from them so far

    def owns(self, generator) -> bool:
        return self.made.get(id(generator)) is generator

    def state_of(self, generator: torch.Generator) -> torch.Tensor:
        """Its state now. The trace draws nothing from the real generator, so
        its real state changes only where the forward seeds or sets it
        (``g.manual_seed(s)``, before its first draw or between two): then
        the graph's state starts again from the real one."""
        real = _GENERATOR.get_state(generator)
        seen = self.seen.get(id(generator))
        if seen is None or not torch.equal(seen, real):
            self.states[id(generator)] = _initial_state(generator)
            self.seen[id(generator)] = real
        return self.states[id(generator)]

    @contextlib.contextmanager
    def noting_made(self):
        """``torch.Generator`` replaced, for the tracing thread, by a class that
        makes real generators and notes them; still their type for
        ``isinstance`` (the C type's methods cannot be replaced)."""
        original = torch.Generator
        replacement = self._making(original, threading.get_ident())
        torch.Generator = replacement
        try:
            yield
        finally:
            torch.Generator = original

    def set_state(self, generator: torch.Generator, state: torch.Tensor) -> None:
        """``generator`` now has ``state``, a graph value."""
        self.states[id(generator)] = state
        self.seen[id(generator)] = _GENERATOR.get_state(generator)

    def restart(self, generator: torch.Generator) -> None:
        """``generator``'s real state was set (seeded, or set to a real
        state): the graph's starts again from it at its next use."""
        self.states.pop(id(generator), None)
        self.seen.pop(id(generator), None)

    def _making(self, _original, thread: int):
        made, following = self.made, _following_state(self)

        class _Meta(type):
            def __call__(cls, *args, **kwargs):
                generator = (following if threading.get_ident() == thread else _original)(*args, **kwargs)
                if threading.get_ident() == thread:
                    made[id(generator)] = generator
                return generator

            def __instancecheck__(cls, obj):
                return isinstance(obj, _original)

            def __subclasscheck__(cls, sub):
                return issubclass(sub, _original)

        return _Meta("Generator", (), {"__doc__": _original.__doc__, "__module__": "torch"})


def _following_state(generators: ForwardGenerators) -> type:
    """A ``torch.Generator`` (a subclass: draws take it as theirs) whose
    state calls act on the state the graph has for it, as eager's act on
    the generator: ``get_state()`` after a draw is the state after it, and
    ``set_state(s)`` / ``manual_seed(s)`` set where the next draw starts.
    ``seed()`` draws a seed anew each call, which a program cannot
    reproduce: refused."""
    class Generator(_GENERATOR):
        def get_state(self):
            return generators.state_of(self)

        def set_state(self, new_state):
            if _torch.is_traced(new_state):
                generators.set_state(self, new_state)
            else:
                _GENERATOR.set_state(self, new_state)  # torch checks it, as eager's does
                generators.restart(self)
            return self

        def manual_seed(self, seed):
            _GENERATOR.manual_seed(self, seed)
            generators.restart(self)
            return self

        def seed(self):
            raise ExportError(
                f"torch.Generator.seed() at {user_location()} cannot be exported soundly: eager "
                "seeds the generator anew on each call, which a program cannot reproduce; seed "
                "it with manual_seed(s)")

    Generator.__module__ = "torch"
    return Generator


def _initial_state(generator: torch.Generator) -> torch.Tensor:
    """A generator's state as a graph value: the state of its seed, where it
    is that (``manual_seed(s)``: the seed a literal), else the state itself,
    a constant."""
    state = _GENERATOR.get_state(generator)
    seed = generator.initial_seed()
    if generator.device.type == "cpu" and _fits_a_graph_int(seed) and torch.equal(
            state, _GENERATOR().manual_seed(seed).get_state()):
        return generator_ops.SEED_STATE(seed)
    return state


@contextlib.contextmanager
def generator_calls_as_ops(generators: ForwardGenerators):
    """While the forward is traced, torch's generator calls (from any code:
    torch's own helpers seed and fork inside the ops they wrap) record the
    generator ops instead of acting on the real generator. A change of the
    real default generator's state the trace did not see (a method of
    ``torch.default_generator``, whose C type cannot be wrapped) is refused,
    except where the example's real values are propagated (they draw from it,
    and it is put back after the trace: such a change goes unseen there)."""
    before = torch.default_generator.get_state()
    with contextlib.ExitStack() as stack:
        for module in (torch, torch.random):
            stack.enter_context(patched(module, "manual_seed", _seeding))
            stack.enter_context(patched(module, "get_rng_state", _getting))
            stack.enter_context(patched(module, "set_rng_state", _setting))
        accelerator = _accelerator()
        if accelerator is not None:
            device_type, module = accelerator
            stack.enter_context(patched(module, "get_rng_state", _getting_device(device_type)))
            stack.enter_context(patched(module, "set_rng_state", _setting_device(device_type)))
            for name in ("manual_seed", "manual_seed_all", "seed", "seed_all"):
                stack.enter_context(patched(module, name, _refusing_device_seed))
        stack.enter_context(generators.noting_made())
        for owner in _torch.rng_freezing_owners():
            stack.enter_context(patched(owner, "freeze_rng_state", _freezing))
        yield
    if not _torch.real_values_propagating() and not torch.equal(before, torch.default_generator.get_state()):
        torch.default_generator.set_state(before)  # the caller's, as an export found it
        raise ExportError(
            "torch's random generator was seeded or set in the forward by a call the trace "
            "cannot see (a method of torch.default_generator: manual_seed, set_state, seed), "
            "at an unknown line: the program would not do it. Use torch.manual_seed(s) or "
            "torch.set_rng_state(state), which the program records")
