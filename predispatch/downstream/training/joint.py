"""The program as AOTAutograd traces it: its write-backs as the ops they run eagerly, flat inputs.

:func:`trace` is the joint forward/backward trace of one kind of call,
compiled by a backend (``backends.py``).
"""
from __future__ import annotations

import torch
import torch.fx

from ..._torch import pytree
from ... import _torch
from ...ir import generator_ops
from ...ir.autograd_function_op import AUTOGRAD_FUNCTION, run_autograd_function
from ...program.ambient import dtype_guard
from ...program.program import leave_caller_in_grad_mode
from ...program.requires_grad_calls import check_requires_grad_reads
from ...program.run_time_calls import DTYPE_GUARD
from ...program.write_backs import (read_before_mutation, write_back_layout, write_back_under_no_grad,
                                      write_back_with_grad)
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


def _autograd_function_applied(fwd, bwd, *inputs, **spec):
    """A Function's op as the autograd.Function it runs (``run_autograd_function``),
    not the op: where nothing it takes requires grad, the op would stay in
    the graphs whole, which a compiler cannot lower; this way its forward is
    traced inline. (A torch-function mode on, as inductor's trace has one,
    would make it call the op.)"""
    with _torch.torch_function_modes_suspended():
        return run_autograd_function(fwd, bwd, *inputs, **spec)


def _write_back_layout_for_autograd(target: torch.Tensor, value: torch.Tensor, source, layout: dict, mode):
    """``program.write_back_layout`` as AOTAutograd can trace it: a tensor
    relaid on its own memory (``x.t_()``) by ``as_strided_``, the metadata
    change it carries out to the caller's tensor after the call (the
    program's ``set_`` to a view of itself it does not see). One whose
    values were written too is the program's: AOTAutograd cannot write an
    input's data and layout back both."""
    size, stride, offset = layout["size"], layout["stride"], layout["offset"]
    if (mode is not None or layout["storage"] != "own" or layout.get("dtype") is not None or layout.get("as_started")
            or size is None or _torch.storage_extent(size, stride, target.storage_offset() + offset)
            * target.element_size() > target.untyped_storage().nbytes()):
        return write_back_layout(target, value, source, layout, mode)
    with torch.no_grad():
        return target.as_strided_(size, stride, target.storage_offset() + offset)


_FOR_AUTOGRAD = {write_back_with_grad: _write_back_for_autograd,
                 write_back_under_no_grad: _write_back_under_no_grad_for_autograd,
                 read_before_mutation: torch.clone,
                 AUTOGRAD_FUNCTION: _autograd_function_applied,
                 write_back_layout: _write_back_layout_for_autograd}


def for_autograd_tracing(unlifted: torch.fx.GraphModule, exported_autocast: dict | None = None) -> torch.fx.GraphModule:
    """``ep.module()`` with its write-backs as the plain ops they run eagerly,
    so that AOTAutograd's trace gives a mutated input its autograd history;
    Functions' ops as the autograd.Functions they run; dtype guards checked
    while tracing, not traced (``exported_autocast``: the autocast the
    program was exported under, which their errors name)."""
    for node in list(unlifted.graph.nodes):
        if node.op == "call_function" and node.target is leave_caller_in_grad_mode:
            unlifted.graph.erase_node(node)  # the mode left to the caller: set after the compiled call
        elif node.op == "call_function" and node.target is check_requires_grad_reads:
            unlifted.graph.erase_node(node)  # checked once per kind of call, on its tensors (compiled.py)
    for gm in unlifted.modules():  # the program's graph and its regions' subgraphs
        if isinstance(gm, torch.fx.GraphModule):
            for node in list(gm.graph.nodes):
                if node.op == "call_function" and node.target in _FOR_AUTOGRAD:
                    node.target = _FOR_AUTOGRAD[node.target]
            _dtype_guards_checked_when_traced(gm, exported_autocast)
    return unlifted


def reads_generators(module: torch.nn.Module) -> bool:
    """Does the program read a generator's state (``generator_ops.READS``)?"""
    return any(node.op == "call_function" and node.target in generator_ops.READS
               for gm in module.modules() if isinstance(gm, torch.fx.GraphModule) for node in gm.graph.nodes)


def _dtype_guards_checked_when_traced(gm: torch.fx.GraphModule, exported_autocast: dict | None) -> None:
    """torch.export's guard before each ``.to()``, checked on the trace's
    tensors, which have the call's dtypes (each kind of call is traced for
    its own): a call whose dtypes the program's casts were not traced for
    is refused (``ambient.dtype_guard``), as ``ep.module()`` refuses it; and
    no op is left in the graph. Left there, it would cost the step much: an
    op with side effects, AOTAutograd's partitioner copies it into the
    backward with what computes its input (for a language model's head, the
    whole vocabulary projection, computed a second time)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is DTYPE_GUARD:
            node.target = dtype_guard(node, exported_autocast, emit=False)
    gm.recompile()


class FlatModule(torch.nn.Module):
    """The program as a function of its flat tensor inputs, returning a tuple
    (of ``num_outputs``, its user outputs).

    Its parameters and buffers are the program's, each tensor once: one
    tensor under two names (a buffer two submodules register) is one input
    of the trace, as eager has one tensor. (AOTAutograd lifts every name,
    and cannot take one input twice where the program writes it.)"""

    def __init__(self, module, in_spec, constants, num_outputs: int):
        super().__init__()
        vars(self)["module"] = module  # not a submodule: its state is lifted once, below
        self.in_spec = in_spec
        self.num_outputs = num_outputs
        self.constants = constants  # non-tensor input leaves, by position
        self.out_spec = None
        self.state_names = {}  # the program's name of each parameter and buffer -> this module's
        own = {}  # id of a tensor -> its name here
        for kind, named in (("parameter", module.named_parameters(remove_duplicate=False)),
                            ("buffer", module.named_buffers(remove_duplicate=False))):
            for name, t in named:
                if id(t) not in own:
                    own[id(t)] = f"{kind}_{len(own)}"
                    (self.register_parameter if kind == "parameter" else self.register_buffer)(own[id(t)], t)
                self.state_names[name] = own[id(t)]

    def forward(self, *tensors):
        leaves, it = [], iter(tensors)
        for i in range(self.in_spec.num_leaves):
            leaves.append(self.constants[i] if i in self.constants else next(it))
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        state = {name: getattr(self, own) for name, own in self.state_names.items()}
        out = torch.func.functional_call(self.module, state, args, kwargs)
        out_leaves, self.out_spec = pytree.tree_flatten(out)
        return tuple(out_leaves)



def trace(flat: FlatModule, key: CallKey, examples: list, backward_autocast, backend: Backend,
          reads_generators: bool = False):
    """The joint forward/backward trace of ``flat`` for calls like ``key``
    (on ``examples``, its inputs), under its grad mode and autocast state,
    compiled by ``backend`` (``reads_generators``: see ``Backend.compile``).
    Returns (compiled function, forward graph, backward graph or None)."""
    graphs: dict = {}
    bwd = backward_autocast if isinstance(backward_autocast, str) else list(backward_autocast)
    with (_torch.backward_pass_autocast(bwd), _torch.no_donated_buffers(), _torch.rnns_for_training(),
          autocast_entered(as_autocast_kwargs(dict(key.autocast))), torch.set_grad_enabled(key.grad_enabled)):
        compiled = backend.compile(flat, examples, flat.num_outputs, graphs, reads_generators)
    return compiled, graphs["forward"], graphs.get("backward")
