"""The module ``compile_training`` returns: a drop-in for the exported module, one traced variant per kind of call."""
from __future__ import annotations

import collections
import copy
import dataclasses

import torch
import torch.fx

from ..._torch import pytree
from ... import _torch
from ...policies.autocast_policy import AutocastPolicy
from .autocast import BackwardCheck, as_autocast_kwargs, assumed_autocast, sensitive_ops
from .calls import CallKey, CallNotSupportedError, lifted_state
from .joint import FlatModule, trace


class Variant:
    """The program traced for one kind of call (a :class:`CallKey`)."""

    def __init__(self, module: torch.nn.Module, in_spec, key: CallKey, policy: AutocastPolicy):
        self.key = key
        self.flat = FlatModule(module, in_spec, key.constants())
        self.compiled, self.forward_graph, self.backward_graph = trace(
            self.flat, key, policy.backward_pass_autocast)
        assumed = assumed_autocast(policy, dict(key.autocast))
        # a subclass's gradient is unwrapped into several tangents: one None cannot stand for them
        self.passes_absent_gradients = (self.backward_graph is not None
                                        and _torch.tangents_are_plain(self.backward_graph))
        if self.backward_graph is None:  # traced under no_grad
            self.check = BackwardCheck(policy, assumed, {})
        else:
            self.check = BackwardCheck(policy, assumed, sensitive_ops(self.backward_graph),
                                       self.backward_graph.code, self.backward_code_under)

    def backward_code_under(self, state: dict) -> str:
        """The code of this call's backward traced under another autocast state."""
        _, _, backward = trace(self.flat, self.key, as_autocast_kwargs(state))
        return backward.code


class CompiledTraining(torch.nn.Module):
    """The module :func:`compile_training` returns: a drop-in for the exported module.

        >>> model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
        >>> x, y = torch.randn(8, 3), torch.randn(8, 1)
        >>> train = predispatch.compile_training(predispatch.export_predispatch(model, (x,)))
        >>> list(train.state_dict()) == list(model.state_dict())
        True
        >>> train.load_state_dict(model.state_dict())
        <All keys matched successfully>
        >>> opt = torch.optim.AdamW(train.parameters(), lr=1e-3)
        >>> for step in range(3):
        ...     opt.zero_grad(); torch.nn.functional.mse_loss(train(x), y).backward(); opt.step()
        >>> type(train.forward_graph).__name__.startswith("GraphModule")
        True

    Its parameters and buffers are the program's, under the exported
    module's names and in its order, so ``state_dict()`` and
    ``load_state_dict()`` are interchangeable with the original's and an
    optimizer over ``parameters()`` trains it. The traced functions read the tensors themselves: updates in place (an
    optimizer step, ``load_state_dict``) are seen by the next call, and a
    tensor replaced (``load_state_dict(..., assign=True)``) gets the program
    traced again.
    """

    max_variants = 8  # traced kinds of call kept; the least recently used goes first

    def __init__(self, first: Variant, policy: AutocastPolicy, mutated: frozenset,
                 grad_mode_after: bool | None = None):
        super().__init__()
        adopt_state(self, first.flat.module)
        # Not submodules: the traced module and graphs are how it runs, not
        # state of its own (named_parameters, state_dict are the module's).
        vars(self).update(flat=first.flat, first=first)
        self.policy = policy
        self.mutated = mutated
        self.grad_mode_after = grad_mode_after  # a bare switch's, in force at the forward's end
        self.backward_check = first.check
        self.variants = collections.OrderedDict({first.key: first})

    @property
    def forward_graph(self) -> torch.fx.GraphModule:
        return self.first.forward_graph

    @property
    def backward_graph(self) -> torch.fx.GraphModule:
        return self.first.backward_graph

    def __deepcopy__(self, memo):
        """The compiled functions hold the parameters they were traced with:
        a copy is traced again, over copies of them."""
        module = copy.deepcopy(self.flat.module, memo)
        key = next(reversed(self.variants))
        key = dataclasses.replace(key, state=lifted_state(module))
        first = Variant(module, self.flat.in_spec, key, self.policy)
        return CompiledTraining(first, self.policy, self.mutated, self.grad_mode_after)

    def forward(self, *args, **kwargs):
        leaves = _torch.call_leaves(self.flat.module, args, kwargs)
        key = CallKey.of(leaves, self.mutated, torch.is_grad_enabled(), self.flat.module)
        variant = self.variant(key, args, kwargs)
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        history = [x.grad_fn for x in inputs]
        outputs = list(variant.compiled(*inputs))
        for node in compiled_backward_nodes(outputs + inputs, history):
            if variant.passes_absent_gradients:  # see run_backward
                _torch.pass_absent_gradients(node)
            node.register_prehook(lambda grad_outputs: variant.check())
        if self.grad_mode_after is not None:  # the caller left in it, as by eager
            torch.set_grad_enabled(self.grad_mode_after)
        return pytree.tree_unflatten(outputs, variant.flat.out_spec)

    def variant(self, key: CallKey, args, kwargs) -> Variant:
        """The graphs traced for calls like this one; traced now if new, once
        ``ep.module()``'s checks accept the inputs."""
        if key in self.variants:
            self.variants.move_to_end(key)
            return self.variants[key]
        for stale in [k for k in self.variants if k.state != key.state]:  # they hold replaced tensors
            del self.variants[stale]
        try:
            _torch.check_call_inputs(self.flat.module, args, kwargs)
        except RuntimeError as e:
            raise CallNotSupportedError(f"the compiled program cannot take these inputs: {e}") from None
        variant = self.variants[key] = Variant(self.flat.module, self.flat.in_spec, key, self.policy)
        if len(self.variants) > self.max_variants:
            self.variants.popitem(last=False)
        return variant


def adopt_state(owner: torch.nn.Module, module: torch.nn.Module) -> None:
    """``module``'s parameters, buffers and the submodules holding them,
    on ``owner`` under the same names and in the same order (the unlifted
    program's submodules are those of the exported module that hold state;
    its region submodules hold none)."""
    # its own parameters and buffers: the same dicts, so that a tensor
    # replaced on one (load_state_dict(assign=True)) is replaced on both
    _torch.share_module_state(owner, module)
    for name, child in _torch.child_modules(module).items():
        if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            owner.add_module(name, child)


def compiled_backward_nodes(tensors: list, history: list) -> list:
    """The autograd nodes of the compiled function that ``tensors`` (a call's
    outputs and inputs, after it) depend on, found by a walk through the nodes
    the call made; ``history``: the inputs' ``grad_fn`` before the call.

    The check runs in a pre-hook of these nodes, once each time the compiled
    backward is about to run and in the autocast state the backward runs
    under (inside the compiled backward, autocast is off)."""
    seen = {id(n): n for n in history if n is not None}
    found, todo = [], [t.grad_fn for t in tensors if isinstance(t, torch.Tensor)]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node  # kept alive, so that its id is not reused meanwhile
        if _torch.is_compiled_backward_node(node):
            found.append(node)
        else:
            todo.extend(n for n, _ in node.next_functions)
    return found
