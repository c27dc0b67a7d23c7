"""A call like the last one, recognized without computing its key.

A training loop calls the compiled module the same way every step. Its
:class:`~.calls.CallKey` reads each parameter's and input's metadata in
Python: on a ResNet, about 0.3 ms a step, the step's kernels having left
the caches cold. :class:`LastCall` makes the same comparisons with the last
call in few C calls: each tensor's metadata (one C++ check for all, which
covers requires_grad in grad mode), the state's tensors by identity, and
the rest of the key as the key compares it. A call it does not recognize
takes the key's way.
"""
from __future__ import annotations

import operator

import torch

from ... import _torch
from .calls import CallKey, shared_memory

_requires_grad = operator.attrgetter("requires_grad")


class LastCall:
    """The variant of a call (``key``, on ``leaves``, with the module's state
    tensors ``state``), and the check that another call has the same key."""

    def __init__(self, variant, key: CallKey, leaves: list, state: list, mutated: frozenset):
        self.variant, self.key = variant, key
        self.tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.leafness = [(i, leaves[i].is_leaf) for i in self.tensor_positions if i in mutated]
        self.constants = [(i, type(x), x) for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)]
        self.state = state  # the traced graphs hold these tensors already
        tensors = [leaves[i] for i in self.tensor_positions] + state
        self.requires_grad = list(map(_requires_grad, tensors))
        self.metadata = _torch.metadata_check(tensors)
        self.autocast_switches = _torch.autocast_switches()

    def matches(self, leaves: list, state: list) -> bool:
        """Would ``CallKey.of`` give this call (its ``leaves``, the module's
        state tensors ``state``) the last call's key?"""
        key = self.key
        grad_enabled = torch.is_grad_enabled()
        if (len(leaves) != len(key.inputs) or len(state) != len(self.state) or grad_enabled != key.grad_enabled
                or not all(map(operator.is_, state, self.state))):
            return False
        for i, kind, value in self.constants:
            x = leaves[i]
            if type(x) is not kind or x != value:
                return False
        tensors = [leaves[i] for i in self.tensor_positions]
        if (not all(isinstance(x, torch.Tensor) for x in tensors)
                or not all(leaves[i].is_leaf == was for i, was in self.leafness)):
            return False
        tensors += state
        return (self.metadata(tensors)  # requires_grad too, in grad mode
                and (grad_enabled or list(map(_requires_grad, tensors)) == self.requires_grad)
                and self._same_autocast() and shared_memory(leaves) == key.aliasing)

    def _same_autocast(self) -> bool:
        """The same devices with autocast on, each at the same dtype."""
        return (_torch.autocast_switches() == self.autocast_switches
                and all(torch.get_autocast_dtype(device) == dtype for device, dtype in self.key.autocast))
