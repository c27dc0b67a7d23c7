"""``compile_training``: trace a program's forward and backward ahead of time,
and check at run time that the backward runs under the autocast state it was
traced for (contract §3).

    >>> train = compile_training(ep)
    >>> out = train(x); out.sum().backward()
    >>> train.forward_graph, train.backward_graph     # torch.fx.GraphModules

The backward is traced under the program's ``backward_pass_autocast``
(AOTAutograd's ``backward_pass_autocast`` config): "same_as_forward" = the
autocast state ``compile_training`` ran under, "off", or a list of
``torch.amp.autocast`` kwargs. Both graphs are run with autocast disabled:
the casts they need are in the graphs already. When a backward runs under an
ambient autocast state that differs from that assumption on a device where
the backward graph has ops autocast would treat differently, the program's
``on_backward_autocast_mismatch`` says what to do.
"""
from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.fx
import torch.utils._pytree as pytree

from . import _torch
from .autocast_policy import AutocastPolicy, autocast_policy
from .errors import BackwardAutocastMismatchError, BackwardAutocastMismatchWarning


# --------------------------------------------------------------------------
# Autocast states: device -> dtype when autocast is on there (absent = off).


def ambient_autocast() -> dict[str, torch.dtype]:
    return {d: torch.get_autocast_dtype(d) for d in _torch.autocast_devices()
            if torch.is_autocast_enabled(d)}


def assumed_autocast(policy: AutocastPolicy, forward_state: dict) -> dict[str, torch.dtype]:
    bwd = policy.backward_pass_autocast
    if bwd == "same_as_forward":
        return dict(forward_state)
    if bwd == "off":
        return {}
    state = {}
    for kw in bwd:
        device = kw["device_type"]
        if kw.get("enabled", True):
            state[device] = kw.get("dtype") or torch.get_autocast_dtype(device)
        else:
            state.pop(device, None)
    return state


def _describe(state: dict) -> str:
    if not state:
        return "no autocast"
    return ", ".join(f"autocast({d!r}, {str(t).replace('torch.', '')})" for d, t in sorted(state.items()))


@dataclasses.dataclass(frozen=True)
class BackwardCheck:
    """What the backward assumes, and which of its ops autocast would change, per device."""

    policy: AutocastPolicy
    assumed: dict
    sensitive_ops: dict  # device -> sorted names of backward ops with an autocast kernel there

    def mismatch(self, found: dict) -> str | None:
        devices = [d for d in set(found) | set(self.assumed)
                   if found.get(d) != self.assumed.get(d) and self.sensitive_ops.get(d)]
        if not devices:
            return None
        ops = {d: self.sensitive_ops[d][:5] for d in sorted(devices)}
        return (f"the backward ran under {_describe(found)} but was traced assuming "
                f"{_describe(self.assumed)} (backward_pass_autocast="
                f"{self.policy.backward_pass_autocast!r}); its ops that autocast treats "
                f"differently: {ops}. Export with the backward_pass_autocast the backward really "
                "runs under, run the backward outside that autocast, or set "
                "on_backward_autocast_mismatch='warn' or 'do_nothing'.")

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
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        devices = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
        for device in devices:
            if _torch.has_autocast_kernel(node.target, device):
                found.setdefault(device, set()).add(str(node.target))
    return {d: sorted(ops) for d, ops in found.items()}


# --------------------------------------------------------------------------


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


class CompiledTraining(torch.nn.Module):
    """The module :func:`compile_training` returns."""

    forward_graph: torch.fx.GraphModule
    backward_graph: torch.fx.GraphModule

    def __init__(self, flat: _FlatModule, compiled, graphs: dict, check: BackwardCheck):
        super().__init__()
        self.flat = flat
        self._compiled = compiled
        self.forward_graph = graphs["forward"]
        self.backward_graph = graphs.get("backward")
        self.backward_check = check

    def forward(self, *args, **kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if spec != self.flat.in_spec:
            raise ValueError(f"inputs do not match the program's input structure {self.flat.in_spec}")
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        outputs = list(self._compiled(*tensors))
        self._check_before_backward(outputs)
        return pytree.tree_unflatten(outputs, self.flat.out_spec)

    def _check_before_backward(self, outputs) -> None:
        """Run the check when the backward starts, in the engine's autocast
        state (AOTAutograd may run its compiled backward with autocast off)."""
        done = []

        def prehook(grad_outputs):
            if not done:
                done.append(True)
                self.backward_check()

        for out in outputs:
            if isinstance(out, torch.Tensor) and out.grad_fn is not None:
                out.grad_fn.register_prehook(prehook)


def _run_without_autocast(gm: torch.fx.GraphModule):
    def run(args):  # AOTAutograd's boxed calling convention
        with _torch.disable_autocast():
            return gm(*args)

    run._boxed_call = True
    return run


def compile_training(ep) -> CompiledTraining:
    """Trace ``ep``'s joint forward/backward ahead of time (see module docs)."""
    policy = autocast_policy(ep)
    if ep.example_inputs is None:
        raise ValueError("compile_training needs the program's example inputs (ep.example_inputs)")
    args, kwargs = ep.example_inputs
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    constants = {i: x for i, x in enumerate(leaves) if not isinstance(x, torch.Tensor)}
    flat = _FlatModule(ep.module(), in_spec, constants)
    examples = [_example(x) for x in leaves if isinstance(x, torch.Tensor)]

    forward_state = ambient_autocast()
    graphs: dict = {}
    check_box: list[BackwardCheck] = []

    def fw_compiler(gm, _inputs):
        graphs["forward"] = gm
        return _run_without_autocast(gm)

    def bw_compiler(gm, _inputs):
        graphs["backward"] = gm
        check_box.append(BackwardCheck(policy, assumed_autocast(policy, forward_state), sensitive_ops(gm)))
        return _run_without_autocast(gm)

    bwd = policy.backward_pass_autocast
    with _torch.backward_pass_autocast(bwd if isinstance(bwd, str) else list(bwd)):
        compiled = _torch.aot_module_simplified(flat, examples, fw_compiler=fw_compiler,
                                                bw_compiler=bw_compiler)
    check = check_box[0] if check_box else BackwardCheck(policy, assumed_autocast(policy, forward_state), {})
    return CompiledTraining(flat, compiled, graphs, check)


def _example(t: torch.Tensor) -> torch.Tensor:
    """Floating inputs are traced as requiring grad, so the backward computes
    their gradients whether or not a call's inputs require grad."""
    t = t.detach().clone()
    return t.requires_grad_(t.is_floating_point() or t.is_complex())
