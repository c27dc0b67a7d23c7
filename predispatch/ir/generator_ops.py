"""torch's random generators as a program sets, reads and restores them at run time.

A forward that seeds, forks or restores torch's generator (``manual_seed``,
``fork_rng``, ``get_rng_state`` / ``set_rng_state``) is recorded as these ops,
in the order it ran them among the draws (``aten.randn``, ``aten.bernoulli``,
...), which act on the same generator at run time:

* ``manual_seed(seed)``: ``torch.manual_seed(seed)``, every device's generator;
  returns the CPU generator's new state;
* ``get_rng_state(device)``: the state of a device's default generator, a
  uint8 tensor (the CPU's: ``torch.get_rng_state()``);
* ``set_rng_state(state, device)``: that generator set to ``state``; returns
  a copy of it (an op that returns nothing is not a value AOTAutograd's
  partitioner can place);
* ``seed_state(seed)``: the state ``torch.Generator().manual_seed(seed)`` has,
  a CPU generator's (a pure function of the seed: what a generator made and
  seeded in the forward starts from).

The seed is a literal of the graph and a state a tensor, so a program
survives ``torch.export.save`` / ``load`` with predispatch imported. Like
torch's random ops, the ops that change a generator are tagged
``nondeterministic_seeded``, and marked side-effectful, so that dead-code
elimination keeps them also where it drops unused draws (torch's tracing
contexts: ``run_decompositions``); a read no one uses goes. Their order is the graph's, as for torch's random ops: a
pass that merges equal calls (inductor's CSE) could merge two reads with a
draw between them, as it would not two draws. (torch's own ``run_with_rng_state``
higher-order op is the model; it takes an op as an argument, which a saved
program cannot hold.)
"""
from __future__ import annotations

import torch

from .. import _torch

_LIB = torch.library.Library("predispatch", "FRAGMENT")
_CHANGES_GENERATOR = (torch.Tag.nondeterministic_seeded,)
_LIB.define("manual_seed(SymInt seed) -> Tensor", tags=_CHANGES_GENERATOR)
_LIB.define("get_rng_state(Device device) -> Tensor")  # a read: goes where unused
_LIB.define("set_rng_state(Tensor state, Device device) -> Tensor", tags=_CHANGES_GENERATOR)
_LIB.define("seed_state(SymInt seed) -> Tensor")


# torch's own, bound at import: while a forward is traced the trace replaces
# them with calls of these ops, whose real kernels (run where the example's
# real values are propagated) must not call back into the trace
_GET_RNG_STATE, _SET_RNG_STATE, _MANUAL_SEED = torch.get_rng_state, torch.set_rng_state, torch.manual_seed
_GENERATOR = torch.Generator


def _device_module(device: torch.device):
    return None if device.type == "cpu" else torch.get_device_module(device.type)


def _get_state(device: torch.device) -> torch.Tensor:
    module = _device_module(device)
    return _GET_RNG_STATE() if module is None else module.get_rng_state(device)


def _set_state(state: torch.Tensor, device: torch.device) -> torch.Tensor:
    module = _device_module(device)
    _SET_RNG_STATE(state) if module is None else module.set_rng_state(state, device)
    return state.clone()


def _manual_seed(seed: int) -> torch.Tensor:
    _MANUAL_SEED(int(seed))
    return _GET_RNG_STATE()


def _seed_state(seed: int) -> torch.Tensor:
    return _GENERATOR().manual_seed(int(seed)).get_state()


_CPU = torch.device("cpu")
_CPU_STATE_SIZE = _GET_RNG_STATE().numel()


def _state_like(device: torch.device) -> torch.Tensor:
    """A fake state: the size of the real one (a device's read now, as eager would)."""
    size = _CPU_STATE_SIZE if device.type == "cpu" else _get_state(device).numel()
    return torch.empty(size, dtype=torch.uint8)


_LIB.impl("manual_seed", _manual_seed, "CompositeExplicitAutograd")
_LIB.impl("get_rng_state", _get_state, "CompositeExplicitAutograd")
_LIB.impl("set_rng_state", _set_state, "CompositeExplicitAutograd")
_LIB.impl("seed_state", _seed_state, "CompositeExplicitAutograd")
torch.library.register_fake("predispatch::manual_seed", lambda seed: _state_like(_CPU), lib=_LIB)
torch.library.register_fake("predispatch::get_rng_state", _state_like, lib=_LIB)
torch.library.register_fake("predispatch::set_rng_state", lambda state, device: torch.empty_like(state),
                            lib=_LIB)
torch.library.register_fake("predispatch::seed_state", lambda seed: torch.empty(_CPU_STATE_SIZE, dtype=torch.uint8),
                            lib=_LIB)

MANUAL_SEED = torch.ops.predispatch.manual_seed.default
GET_RNG_STATE = torch.ops.predispatch.get_rng_state.default
SET_RNG_STATE = torch.ops.predispatch.set_rng_state.default
SEED_STATE = torch.ops.predispatch.seed_state.default
READS = (GET_RNG_STATE, SEED_STATE)  # ops that read a state and change none
for _op in (MANUAL_SEED, SET_RNG_STATE):
    # kept by dead-code elimination in torch's tracing contexts too, where it
    # drops random ops whose result is unused (run_decompositions)
    _torch.mark_side_effectful(_op)
