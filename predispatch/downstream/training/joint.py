"""The program as AOTAutograd traces it: its write-backs as the ops they run eagerly, flat inputs.

:func:`trace` is the joint forward/backward trace of one kind of call,
compiled by a backend (``backends.py``).
"""
from __future__ import annotations

import torch
import torch.fx

from ..._torch import pytree
from ... import _torch
from ...program.program import leave_caller_in_grad_mode
from ...program.write_backs import read_before_mutation, write_back_under_no_grad, write_back_with_grad
from .autocast import as_autocast_kwargs, autocast_entered
from .calls import CallKey
from .backends import Backend


def _write_back_for_autograd(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``program.write_back_with_grad`` as it runs eagerly: a ``copy_`` that
    AOTAutograd traces with its autograd history. (The program's version
    writes below autograd when traced, which is for re-exporting only.)"""
    if target.is_leaf and target.requires_grad:
        with torch.no_grad():
            return target.copy_(value)
    return target.copy_(value)


def _write_back_under_no_grad_for_autograd(target: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return target.copy_(value)


_FOR_AUTOGRAD = {write_back_with_grad: _write_back_for_autograd,
                 write_back_under_no_grad: _write_back_under_no_grad_for_autograd,
                 read_before_mutation: torch.clone}


def for_autograd_tracing(unlifted: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``ep.module()`` with its write-backs as the plain ops they run eagerly,
    so that AOTAutograd's trace gives a mutated input its autograd history."""
    for node in list(unlifted.graph.nodes):
        if node.op == "call_function" and node.target in _FOR_AUTOGRAD:
            node.target = _FOR_AUTOGRAD[node.target]
        elif node.op == "call_function" and node.target is leave_caller_in_grad_mode:
            unlifted.graph.erase_node(node)  # the mode left to the caller: set after the compiled call
    for gm in unlifted.modules():  # the program's graph and its regions' subgraphs
        if isinstance(gm, torch.fx.GraphModule):
            _drop_dtype_guards(gm)
    unlifted.recompile()
    return unlifted


_DTYPE_GUARD = torch.ops.aten._assert_tensor_metadata.default


def _drop_dtype_guards(gm: torch.fx.GraphModule) -> None:
    """torch.export's guard before each ``.to()`` goes: each kind of call is
    traced for its dtypes, so it cannot fail, and it costs the step much: an
    op with side effects, AOTAutograd's partitioner copies it into the
    backward with what computes its input (for a language model's head, the
    whole vocabulary projection, computed a second time)."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is _DTYPE_GUARD:
            gm.graph.erase_node(node)
    gm.recompile()


class FlatModule(torch.nn.Module):
    """The program as a function of its flat tensor inputs, returning a tuple."""

    def __init__(self, module, in_spec, constants):
        super().__init__()
        self.module = module
        self.in_spec = in_spec
        self.constants = constants  # non-tensor input leaves, by position
        self.out_spec = None

    def forward(self, *tensors):
        leaves, it = [], iter(tensors)
        for i in range(self.in_spec.num_leaves):
            leaves.append(self.constants[i] if i in self.constants else next(it))
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        out_leaves, self.out_spec = pytree.tree_flatten(self.module(*args, **kwargs))
        return tuple(out_leaves)


def trace(flat: FlatModule, key: CallKey, examples: list, backward_autocast, backend: Backend):
    """The joint forward/backward trace of ``flat`` for calls like ``key``
    (on ``examples``, its inputs), under its grad mode and autocast state,
    compiled by ``backend``.
    Returns (compiled function, forward graph, backward graph or None)."""
    graphs: dict = {}
    bwd = backward_autocast if isinstance(backward_autocast, str) else list(backward_autocast)
    with (_torch.backward_pass_autocast(bwd), _torch.no_donated_buffers(),
          autocast_entered(as_autocast_kwargs(dict(key.autocast))), torch.set_grad_enabled(key.grad_enabled)):
        compiled = backend.compile(flat, examples, graphs)
    return compiled, graphs["forward"], graphs.get("backward")
