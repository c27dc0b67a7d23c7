"""The module ``compile_training`` returns: a drop-in for the exported module, one traced variant per kind of call."""
from __future__ import annotations

import collections
import dataclasses

import torch
import torch.fx

from ..._torch import pytree
from ... import _torch
from ...policies.autocast_policy import AutocastPolicy
from ...program.requires_grad_calls import call_tensors, check_requires_grad_reads
from .autocast import BackwardCheck, as_autocast_kwargs, assumed_autocast, sensitive_ops
from .backends import Backend
from .calls import CallKey, CallNotSupportedError, LiftedState, ProgramShapes
from .joint import FlatModule, trace
from .last_call import LastCall
from .runners import run_as_eager_nodes

OP_BY_OP = Backend("eager")


@dataclasses.dataclass(frozen=True)
class Program:
    """What every trace of the program shares: ``ep.module()`` as traced
    (``joint.for_autograd_tracing``), its input structure and number of
    outputs, autocast policy, mutated inputs, dynamic shapes, the backend
    compiling its graphs, and whether it reads a generator's state."""

    module: torch.nn.Module
    in_spec: object
    num_outputs: int
    policy: AutocastPolicy
    mutated: frozenset
    shapes: ProgramShapes
    backend: Backend
    reads_generators: bool = False  # joint.reads_generators
    training: bool | None = None  # the module's mode at export (None: not recorded, an older program)
    check_aliasing: object = None  # (flat input leaves) -> None, raising for memory shared unlike the export's
    requires_grad_reads: tuple = ()  # the forward's reads a call's tensors decide (program/requires_grad_calls.py)

class Variant:
    """The program traced for one kind of call (a :class:`CallKey`), on
    inputs laid out as ``tensors`` (a call's; for a key with symbolic sizes,
    their sizes are the trace's hints). A symbolic trace that made a size
    static is ``specialized``: its graphs hold for no other size."""

    def __init__(self, program: Program, key: CallKey, tensors: list):
        self._program, self.key = program, key
        self.hints = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in tensors]
        self.flat = FlatModule(program.module, program.in_spec, key.constants(), program.num_outputs)
        examples = key.examples(self.hints, program.shapes)
        policy = program.policy
        self.compiled, self.forward_graph, self.backward_graph = trace(
            self.flat, key, examples, policy.backward_pass_autocast, program.backend, program.reads_generators)
        self.guards, self.specialized = None, False
        if key.symbolic:
            try:
                self.guards = _torch.ShapeGuards(examples)
            except Exception:  # a size the program has dynamic came out static
                self.specialized = True
        assumed = assumed_autocast(policy, dict(key.autocast))
        # a subclass's gradient is unwrapped into several tangents: one None cannot stand for them
        self.passes_absent_gradients = (self.backward_graph is not None
                                        and _torch.tangents_are_plain(self.backward_graph))
        if self.backward_graph is None:  # traced under no_grad
            self.check = BackwardCheck(policy, assumed, {})
        else:
            op_by_op = program.backend == OP_BY_OP  # else the code to compare with is traced when needed
            self.check = BackwardCheck(policy, assumed, sensitive_ops(self.backward_graph),
                                       self.backward_graph.code if op_by_op else None, self.backward_code_under)

    def accepts(self, tensors: list) -> bool:
        """Do this variant's graphs hold for these inputs' sizes?"""
        if self.specialized:
            return False
        return self.guards is None or self.guards.hold(tensors)

    def backward_code_under(self, state: dict | None) -> str:
        """The code of this call's backward traced op by op under another
        autocast state (None: under the program's assumption)."""
        bwd = self._program.policy.backward_pass_autocast if state is None else as_autocast_kwargs(state)
        examples = self.key.examples(self.hints, self._program.shapes)
        _, _, backward = trace(self.flat, self.key, examples, bwd, OP_BY_OP)
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
    max_calls = 64  # calls' exact layouts mapped to the variant that takes them

    def __init__(self, program: Program, grad_mode_after: bool | None = None):
        super().__init__()
        adopt_state(self, program.module)
        if program.training is not None:
            self.training = program.training
        # Not submodules: the traced module and graphs are how it runs, not
        # state of its own (named_parameters, state_dict are the module's).
        # Attributes of the instance (not nn.Module's tables), named apart from the
        # exported module's own submodules.
        vars(self).update(
            _program=program, _first=None,
            _flat_form=_torch.flat_call_form(program.module),  # how a call's inputs lie, if flat
            _last=None,  # the last call's LastCall
            _grad_mode_after=grad_mode_after,  # a bare switch's, in force at the forward's end
            _state=LiftedState(program.module),
            _variants=collections.OrderedDict(),  # by the key they were traced for
            _calls=collections.OrderedDict())  # a call's exact key -> its variant

    def train(self, mode: bool = True):
        """As exported only: the graphs compute as the module did then (batch
        statistics and dropout in train mode), and cannot switch."""
        exported = self._program.training
        if exported is not None and mode != exported:
            raise NotImplementedError(
                f"compile_training: the program was exported with the module in {_mode(exported)} mode; its "
                f"graphs compute as {_mode(exported)} mode does (BatchNorm's statistics, dropout) and cannot "
                f"switch to {_mode(mode)} mode. Export the module in {_mode(mode)} mode for that "
                f"(model.{'train' if mode else 'eval'}(), then export_predispatch), or run the eager module")
        return super().train(mode)

    @property
    def forward_graph(self) -> torch.fx.GraphModule:
        return self._first.forward_graph

    @property
    def backward_graph(self) -> torch.fx.GraphModule:
        return self._first.backward_graph

    @property
    def backward_check(self) -> BackwardCheck:
        return self._first.check

    def __deepcopy__(self, memo):
        """The compiled functions hold the parameters they were traced with:
        a copy is traced again, over copies of them."""
        module = _torch.copy_unlifted(self._program.module, memo)
        program = dataclasses.replace(self._program, module=module)
        last = next(reversed(self._variants.values()))
        key = dataclasses.replace(last.key, state=LiftedState(module).read()[0])
        new = CompiledTraining(program, self._grad_mode_after)
        new.add(Variant(program, key, last.hints))
        return new

    def forward(self, *args, **kwargs):
        leaves = None if self._flat_form is None else _torch.flat_call_leaves(self._flat_form, args, kwargs)
        if leaves is None:
            leaves = _torch.call_leaves(self._program.module, args, kwargs)
        state, last = self._state.tensors(), self._last
        variant = last.variant if last is not None and last.matches(leaves, state) else self.call_variant(
            leaves, state, args, kwargs)
        inputs = [x for x in leaves if isinstance(x, torch.Tensor)]
        history = [x.grad_fn for x in inputs]
        outputs = list(variant.compiled(*inputs))
        for node in compiled_backward_nodes(outputs + inputs, history):
            if variant.passes_absent_gradients:  # see run_backward
                _torch.pass_absent_gradients(node)
                run_as_eager_nodes(node)
            node.register_prehook(lambda grad_outputs: variant.check())
        if self._grad_mode_after is not None:  # the caller left in it, as by eager
            torch.set_grad_enabled(self._grad_mode_after)
        out_spec = variant.flat.out_spec
        return outputs[0] if out_spec.is_leaf() else pytree.tree_unflatten(outputs, out_spec)

    def call_variant(self, leaves: list, state: list, args, kwargs) -> Variant:
        """The variant of a call unlike the last one, by its key."""
        key = CallKey.of(leaves, self._program.mutated, torch.is_grad_enabled(), self._state)
        variant = self._calls.get(key)
        if variant is None:
            variant = self._calls[key] = self.variant(key, leaves, args, kwargs)
            if len(self._calls) > self.max_calls:
                self._calls.popitem(last=False)
        vars(self)["_last"] = LastCall(variant, key, leaves, state, self._program.mutated)
        return variant

    def variant(self, key: CallKey, leaves: list, args, kwargs) -> Variant:
        """The graphs that take calls like this one, once ``ep.module()``'s
        checks accept its inputs: the variant traced for every size the
        program allows where its guards hold, else one for these sizes;
        traced now if new."""
        self._drop_stale(key.state)
        try:
            _torch.check_call_inputs(self._program.module, args, kwargs)
            if self._program.check_aliasing is not None:
                self._program.check_aliasing(leaves)
            if reads := self._program.requires_grad_reads:
                check_requires_grad_reads(reads, call_tensors(self._program.module, leaves, reads))
        except RuntimeError as e:
            raise CallNotSupportedError(f"the compiled program cannot take these inputs: {e}") from None
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        general = key.generalized(leaves, self._program.shapes)
        if general.symbolic:
            found = self._variants.get(general) or self.add(Variant(self._program, general, tensors))
            if found.accepts(tensors):
                self._variants.move_to_end(general)
                return found
        if key in self._variants:
            self._variants.move_to_end(key)
            return self._variants[key]
        return self.add(Variant(self._program, key, tensors))

    def add(self, variant: Variant) -> Variant:
        """Keep ``variant`` (the first is the one whose graphs the module shows)."""
        self._variants[variant.key] = variant
        if self._first is None:
            vars(self)['_first'] = variant
        if len(self._variants) > self.max_variants:
            _, gone = self._variants.popitem(last=False)
            for k in [k for k, v in self._calls.items() if v is gone]:
                del self._calls[k]
        return variant

    def _drop_stale(self, state: tuple) -> None:
        """Variants traced over tensors since replaced go (they hold them)."""
        for stale in [k for k in self._variants if k.state != state]:
            del self._variants[stale]
        for stale in [k for k in self._calls if k.state != state]:
            del self._calls[stale]


def _mode(training: bool) -> str:
    return "train" if training else "eval"


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
