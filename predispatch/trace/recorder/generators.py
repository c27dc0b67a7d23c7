"""Draws from a ``torch.Generator`` made in the forward: under its state, on the default generator.

A generator made in the forward starts each call from the state it was
made and seeded with; the graph holds that state as a value
(:class:`predispatch.trace.random_state.ForwardGenerators`), never the
generator object. A draw from it (``torch.randn(..., generator=g)``) is the
same draw from the device's default generator, set to ``g``'s state for
it: the state after it is ``g``'s next, and the default generator is put
back as it was, as eager's draw leaves it."""
from __future__ import annotations

import dataclasses

import torch

from ...ir import generator_ops
from .state import TorchCall, TraceState


def draws_from_forward_generator(state: TraceState, call: TorchCall) -> bool:
    generator = call.kwargs.get("generator")
    return generator is not None and state.generators.owns(generator)


def _device_of(generator: torch.Generator) -> torch.device:
    device = generator.device
    if device.type != "cpu" and device.index is None:
        device = torch.device(device.type, torch.get_device_module(device.type).current_device())
    return device


def draw_under_its_state(state: TraceState, call: TorchCall):
    """The call without its generator, the default generator set to the
    generator's state around it; returns (that call, what runs after it)."""
    generator = call.kwargs["generator"]
    generators, device = state.generators, _device_of(generator)
    caller_state = generator_ops.GET_RNG_STATE(device)
    generator_ops.SET_RNG_STATE(generators.state_of(generator), device)
    generators.draws += 1

    def after():
        generators.states[id(generator)] = generator_ops.GET_RNG_STATE(device)
        generator_ops.SET_RNG_STATE(caller_state, device)

    kwargs = {k: v for k, v in call.kwargs.items() if k != "generator"}
    return dataclasses.replace(call, kwargs=kwargs), after
