"""``compile_training``: a program's forward and backward traced ahead of time (contract §3).

It checks at run time that the backward runs under the autocast state it
was traced for.

    >>> train = compile_training(ep)
    >>> out = train(x); out.sum().backward()
    >>> train.forward_graph, train.backward_graph     # torch.fx.GraphModules

The graphs are traced for the program's example inputs, in grad mode, under
the autocast state ``compile_training`` runs under. A call that differs in
what a trace depends on (input sizes, dtypes, strides, a dynamic non-tensor
input's value, grad mode, the ambient autocast state, which inputs and
parameters require grad, and which mutated inputs are leaves) gets graphs
traced for it, kept in
a small cache;
a call ``ep.module()`` would refuse (a size outside the program's shapes, a
non-tensor input other than the exported one) raises :class:`CallNotSupportedError`.

The gradients are eager's, ``None`` included: a parameter or input that
eager's autograd never reaches (behind an output left out of the loss, or
only read and updated under no_grad) keeps ``.grad`` at ``None``, not zeros
(see :func:`_run_backward`).

The backward is traced under the program's ``backward_pass_autocast``
(AOTAutograd's ``backward_pass_autocast`` config): "same_as_forward" = the
autocast state the forward ran under, "off", or a list of
``torch.amp.autocast`` kwargs. Both graphs are run with autocast disabled:
the casts they need are in the graphs already. Each time a backward runs
under an ambient autocast state that differs from that assumption, the
backward is traced again under the state found; if that gives another
graph, the program's ``on_backward_autocast_mismatch`` says what to do.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import itertools
import warnings
from collections.abc import Callable

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from .._torch import pytree
from .. import _torch
from ..ir.program_meta import program_meta
from ..ir.assumptions import assumptions
from ..policies.autocast_policy import AutocastPolicy, autocast_policy
from ..errors import BackwardAutocastMismatchError, BackwardAutocastMismatchWarning
from ..ir import generator_ops
from ..program.program import leave_caller_in_grad_mode
from ..program.write_backs import read_before_mutation, write_back_under_no_grad, write_back_with_grad


class CallNotSupportedError(RuntimeError):
    """A call the compiled module refuses, as ``ep.module()`` does.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(3, 2), (torch.ones(4, 3),))
        >>> predispatch.compile_training(ep)(torch.ones(4, 5))
        Traceback (most recent call last):
        ...
        predispatch.downstream.training.CallNotSupportedError: the compiled program cannot take these inputs: ...

    The message names the input (a size outside the program's shapes, a
    non-tensor input other than the exported value)."""


# --------------------------------------------------------------------------
# Autocast states: device -> dtype when autocast is on there (absent = off).


def ambient_autocast() -> dict[str, torch.dtype]:
    return {d: torch.get_autocast_dtype(d) for d in _torch.autocast_devices()
            if torch.is_autocast_enabled(d)}


def as_autocast_kwargs(state: dict) -> list[dict]:
    """A state as ``torch.amp.autocast`` kwargs (the list form of ``backward_pass_autocast``)."""
    return [{"device_type": d, "dtype": t} for d, t in sorted(state.items())]


@contextlib.contextmanager
def autocast_entered(kwargs_list: list[dict]):
    """Autocast off everywhere, then each ``torch.amp.autocast(**kw)`` entered
    (what AOTAutograd does for a list ``backward_pass_autocast``)."""
    with _torch.disable_autocast(), contextlib.ExitStack() as stack:
        for kw in kwargs_list:
            stack.enter_context(torch.amp.autocast(**kw))
        yield


def assumed_autocast(policy: AutocastPolicy, forward_state: dict) -> dict[str, torch.dtype]:
    bwd = policy.backward_pass_autocast
    if bwd == "same_as_forward":
        return dict(forward_state)
    # What torch.autocast really does with the dicts: it disables itself for
    # a dtype the device does not support (it has warned about it already).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast_entered([] if bwd == "off" else bwd):
            return ambient_autocast()


def _describe(state: dict) -> str:
    if not state:
        return "no autocast"
    return ", ".join(f"autocast({d!r}, {str(t).replace('torch.', '')})" for d, t in sorted(state.items()))


@dataclasses.dataclass(frozen=True)
class BackwardCheck:
    """What the backward assumes, which of its ops autocast would change, per
    device, and (``code_under``) the backward's code when traced under a state."""

    policy: AutocastPolicy
    assumed: dict
    sensitive_ops: dict  # device -> sorted names of backward ops with an autocast kernel there
    traced_code: str = ""
    code_under: Callable[[dict], str] | None = None
    _verdicts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def mismatch(self, found: dict) -> str | None:
        devices = [d for d in set(found) | set(self.assumed)
                   if found.get(d) != self.assumed.get(d) and self.sensitive_ops.get(d)]
        if not devices or not self._changes_backward(found):
            return None
        ops = {d: self.sensitive_ops[d][:5] for d in sorted(devices)}
        return (f"the backward ran under {_describe(found)} but was traced assuming "
                f"{_describe(self.assumed)} (backward_pass_autocast="
                f"{self.policy.backward_pass_autocast!r}); its ops that autocast treats "
                f"differently: {ops}. Export with the backward_pass_autocast the backward really "
                "runs under, run the backward outside that autocast, or set "
                "on_backward_autocast_mismatch='warn' or 'do_nothing'.")

    def _changes_backward(self, found: dict) -> bool:
        """Does tracing the backward under ``found`` give another graph? An op
        with an autocast kernel may still be left alone (its inputs are in the
        autocast dtype already), so only a retrace tells. Cached per state."""
        if self.code_under is None:
            return True
        key = tuple(sorted(found.items()))
        if key not in self._verdicts:
            self._verdicts[key] = self.code_under(found) != self.traced_code
        return self._verdicts[key]

    def __call__(self) -> None:
        action = self.policy.on_backward_autocast_mismatch
        if action == "do_nothing":
            return
        problem = self.mismatch(ambient_autocast())
        if problem is None:
            return
        if action == "error":
            raise BackwardAutocastMismatchError(problem)
        warnings.warn(problem, BackwardAutocastMismatchWarning, stacklevel=3)


def sensitive_ops(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Per device, the ops of ``gm`` that autocast on that device would cast."""
    found: dict[str, set] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, _torch.OpOverload):
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        devices = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
        for device in devices:
            if _torch.has_autocast_kernel(node.target, device):
                found.setdefault(device, set()).add(str(node.target))
    return {d: sorted(ops) for d, ops in found.items()}


# --------------------------------------------------------------------------
# Calls: what a trace depends on.


@dataclasses.dataclass(frozen=True)
class TensorInput:
    """What a trace depends on of a tensor input. ``autograd`` is
    ``(requires_grad, is_leaf)``: whether it requires grad decides what the
    backward saves (traced as requiring grad, an input would make autograd
    save a parameter the forward then updates under no_grad, which eager does
    not); whether it is a leaf matters for an input the program mutates (the
    history its write-back gets), and is True for the others."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    autograd: tuple

    @classmethod
    def of(cls, t: torch.Tensor, mutated: bool) -> TensorInput:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device,
                   (t.requires_grad, t.is_leaf or not mutated))

    def example(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=self.device)
        requires_grad, is_leaf = self.autograd
        t.requires_grad_(requires_grad)
        if is_leaf:
            return t
        with torch.enable_grad():
            return t.clone()


@dataclasses.dataclass(frozen=True)
class ConstantInput:
    """A non-tensor input, by type and value (Python has ``True == 1 == 1.0``)."""

    type: type
    value: object


@dataclasses.dataclass(frozen=True)
class CallKey:
    """Calls with equal keys share their traced graphs."""

    inputs: tuple  # per input leaf: a TensorInput or a ConstantInput
    grad_enabled: bool
    autocast: tuple  # the ambient autocast state, as sorted (device, dtype) pairs
    trainable: tuple  # which parameters require grad (frozen ones get no gradient output)
    state: tuple  # lifted_state: the traced function holds the tensors it lifted

    @classmethod
    def of(cls, leaves: list, mutated: frozenset, grad_enabled: bool, module) -> CallKey:
        inputs = tuple(TensorInput.of(x, i in mutated) if isinstance(x, torch.Tensor)
                       else ConstantInput(type(x), x) for i, x in enumerate(leaves))
        return cls(inputs, grad_enabled, tuple(sorted(ambient_autocast().items())),
                   tuple(p.requires_grad for p in module.parameters()), lifted_state(module))

    def constants(self) -> dict:
        return {i: x.value for i, x in enumerate(self.inputs) if isinstance(x, ConstantInput)}

    def examples(self) -> list[torch.Tensor]:
        return [x.example() for x in self.inputs if isinstance(x, TensorInput)]


def mutated_inputs(ep) -> frozenset:
    """Positions, among the flat user inputs, of those the program mutates."""
    sig = ep.graph_signature
    names = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    mutated = set(sig.user_inputs_to_mutate.values())
    return frozenset(i for i, name in enumerate(names) if name in mutated)


# --------------------------------------------------------------------------
# Tracing with AOTAutograd.


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
    unlifted.recompile()
    return unlifted


class _FlatModule(torch.nn.Module):
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


def _run_without_autocast(gm: torch.fx.GraphModule):
    def run(args):  # AOTAutograd's boxed calling convention
        with _torch.disable_autocast():
            return gm(*args)

    return _torch.boxed(run)


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _tangents_needed(gm: torch.fx.GraphModule) -> list[frozenset]:
    """Per output of the backward graph ``gm``, the positions (among its
    placeholders) of the tangents it is computed from."""
    needs = {n: frozenset([i]) if _torch.is_tangent(n) else frozenset()
             for i, n in enumerate(_placeholders(gm))}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            needs[node] = frozenset().union(*(needs[n] for n in node.all_input_nodes))
    (outputs,) = gm.graph.output_node().args
    return [needs[o] if isinstance(o, torch.fx.Node) else frozenset() for o in outputs]


def _zeros_as_traced(tangent: torch.fx.Node) -> torch.Tensor:
    val = tangent.meta["val"]  # the graphs are traced for static shapes
    return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device).zero_()


def _run_backward(gm: torch.fx.GraphModule):
    """The backward graph, giving the gradients eager's autograd gives.

    Autograd calls the compiled backward with ``None`` for an output that got
    no gradient (:func:`_torch.pass_absent_gradients`, set on each call's
    node): an output left out of the loss, or the new value of a parameter or
    input written back under no_grad, which nothing differentiates. The graph
    takes zeros there; but a gradient computed from such tangents only is
    ``None``, since eager's autograd never reaches that parameter or input
    (left zeros, an optimizer would update a parameter eager's skips). A
    gradient that needs no tangent at all is left as computed."""
    tangents = {i: n for i, n in enumerate(_placeholders(gm)) if _torch.is_tangent(n)}
    needs = _tangents_needed(gm)

    def run(args):  # AOTAutograd's boxed calling convention
        absent = {i for i in tangents if args[i] is None}
        for i in absent:
            args[i] = _zeros_as_traced(tangents[i])
        with _torch.disable_autocast():
            grads = gm(*args)
        if not absent:
            return grads
        return type(grads)(None if need and need <= absent else g for g, need in zip(grads, needs))

    return _torch.boxed(run)


def _without_dead_random_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torch's default partitioner copies the forward's random ops into the
    backward, unused; run, each would draw from the generator once more per
    step than eager does (the next step's dropout masks would differ); so
    does it the forward's generator ops (a seed, a restore), and the reads
    of generator states they used."""
    for node in reversed(list(gm.graph.nodes)):  # users first: a read only they used goes too
        if (node.op == "call_function" and not node.users
                and (torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
                     or node.target in generator_ops.READS)):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def trace(flat: _FlatModule, key: CallKey, backward_autocast):
    """AOTAutograd's joint trace of ``flat`` for calls like ``key``, under its
    grad mode and autocast state.
    Returns (compiled function, forward graph, backward graph or None)."""
    graphs: dict = {}

    def fw_compiler(gm, _inputs):
        graphs["forward"] = gm
        return _run_without_autocast(gm)

    def bw_compiler(gm, _inputs):
        graphs["backward"] = gm = _without_dead_random_ops(gm)
        return _run_backward(gm)

    bwd = backward_autocast if isinstance(backward_autocast, str) else list(backward_autocast)
    with (_torch.backward_pass_autocast(bwd), _torch.no_donated_buffers(),
          autocast_entered(as_autocast_kwargs(dict(key.autocast))), torch.set_grad_enabled(key.grad_enabled)):
        compiled = _torch.aot_module_simplified(flat, key.examples(), fw_compiler=fw_compiler,
                                                bw_compiler=bw_compiler)
    return compiled, graphs["forward"], graphs.get("backward")


class Variant:
    """The program traced for one kind of call (a :class:`CallKey`)."""

    def __init__(self, module: torch.nn.Module, in_spec, key: CallKey, policy: AutocastPolicy):
        self.key = key
        self.flat = _FlatModule(module, in_spec, key.constants())
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
            if variant.passes_absent_gradients:  # see _run_backward
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


def lifted_state(module: torch.nn.Module) -> tuple:
    """What a trace assumes of the tensors it lifts (the parameters and
    buffers): which tensors they are (it holds them), and their metadata."""
    return tuple((id(t), t.dtype, t.device, t.shape)
                 for t in itertools.chain(module.parameters(), module.buffers()))


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


def compile_training(ep) -> CompiledTraining:
    """Trace ``ep``'s joint forward/backward ahead of time.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(3, 1), (torch.randn(4, 3),))
        >>> train = predispatch.compile_training(ep)
        >>> train(torch.randn(4, 3)).sum().backward()
        >>> train.weight.grad.shape
        torch.Size([1, 3])
        >>> [str(n.target) for n in train.forward_graph.graph.nodes if n.op == "call_function"]
        ['aten.t.default', 'aten.addmm.default']

    Returns a :class:`CompiledTraining`, a drop-in for the exported module;
    its ``forward_graph`` and ``backward_graph`` are ``torch.fx.GraphModule``
    s. The backward is traced under the program's ``backward_pass_autocast``
    and checked at run time (:class:`BackwardAutocastMismatchError`); a call
    of a new kind (sizes, dtypes, grad mode, ambient autocast) is traced
    again. See the module's documentation and design/training.md.
    """
    policy = autocast_policy(ep)
    if assumptions(ep):
        raise ValueError(
            "compile_training cannot take a program exported with data_dependent='specialize' "
            f"({len(assumptions(ep))} data-dependent branch(es) assumed, e.g. at {assumptions(ep)[0].where}): "
            "its ahead-of-time trace has no value to read them from; use ep.module()")
    if ep.example_inputs is None:
        raise ValueError("compile_training needs the program's example inputs (ep.example_inputs)")
    module = for_autograd_tracing(ep.module())
    leaves, in_spec = pytree.tree_flatten(ep.example_inputs)
    mutated = mutated_inputs(ep)
    first = Variant(module, in_spec, CallKey.of(leaves, mutated, True, module), policy)
    return CompiledTraining(first, policy, mutated, program_meta(ep).get("grad_mode_after"))
