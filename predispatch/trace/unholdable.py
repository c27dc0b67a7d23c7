"""What a capture made that no program can hold: refused, naming the line.

Checks of the capture stage's graph, signature and constants, each of a
construct torch traces without complaint and the program could not run or
would run otherwise than eager.
"""
from __future__ import annotations

import keyword

import torch

from .. import _torch
from ..errors import ExportError, node_location
from . import input_aliasing


def refuse_what_no_program_holds(module: torch.nn.Module, aten) -> None:
    """``aten``: torch.export's aten stage of ``module``'s capture (graph, signature, constants)."""
    _ops_code_cannot_name(aten.gm)
    _traced_tensors_held_as_constants(aten.gm, aten.sig, aten.constants)
    _writes_to_state_sharing_memory(module, aten.gm, aten.sig)


def _ops_code_cannot_name(gm: torch.fx.GraphModule) -> None:
    """An op whose overload is a Python keyword (``aten.random.from``, of
    ``x.random_(0, 10)``): the program's code (torch.fx's) names each op as
    ``torch.ops.<ns>.<op>.<overload>``, which then does not parse, and the
    program could not run (torch.export fails there too)."""
    for node in gm.graph.nodes:
        overload = getattr(node.target, "_overloadname", None)
        if node.op == "call_function" and overload and keyword.iskeyword(overload):
            raise ExportError(
                f"{node.target} at {node_location(node.meta.get('stack_trace'))}: the program's code cannot name "
                f"this op (its overload '{overload}' is a Python keyword), so it could not run; write it another "
                "way (x.random_(a, b) as x.copy_(torch.randint_like(x, a, b)))")


def _traced_tensors_held_as_constants(gm: torch.fx.GraphModule, signature, constants: dict) -> None:
    """A constant that is a tensor of the trace (a buffer an autograd.Function's
    forward writes through its closure, not through apply()'s inputs): the
    program would hold a placeholder of the trace, with no value."""
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    for spec in signature.input_specs:
        value = constants.get(spec.target) if spec.kind.name == "CONSTANT_TENSOR" else None
        if value is not None and _torch.is_fake(value):
            node = placeholders.get(getattr(spec.arg, "name", None))
            users = [u for u in (node.users if node is not None else ()) if u.meta.get("stack_trace")]
            where = node_location(users[0].meta["stack_trace"] if users else None)
            raise ExportError(
                f"a tensor the forward computes or holds is read as a constant at {where}: it was made or "
                "reached outside the traced calls, and the program would hold no value for it: made by a "
                "legacy constructor (torch.Tensor([...]), torch.LongTensor([...]): use torch.tensor([...])), or "
                "written by an autograd.Function's forward through its closure, not an input of apply() (pass "
                "it to apply())")


def _writes_to_state_sharing_memory(module, gm: torch.fx.GraphModule, signature) -> None:
    """A parameter or buffer written in place that shares memory with another
    (``register_buffer("row", self.b[1])``): the program lifts each as an
    input of its own, so a write through one would not show in the other."""
    by_storage: dict = {}  # a plain tensor's storage -> the state names and tensors on it
    for name, t in (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)):
        if type(t) in (torch.Tensor, torch.nn.Parameter) and t.device.type != "meta":
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append((name, t))
    shared = {name: group for group in by_storage.values() if len(group) > 1 for name, _ in group}
    outputs = gm.graph.output_node().args[0]
    for spec, node in zip(signature.output_specs, outputs):
        if spec.kind.name not in ("BUFFER_MUTATION", "PARAMETER_MUTATION") or spec.target not in shared:
            continue
        group = shared[spec.target]
        t = dict(group)[spec.target]
        for name, other in group:
            if other is not t and input_aliasing.share_elements(t, other):
                where = node_location(node.meta.get("stack_trace") if isinstance(node, torch.fx.Node) else None)
                raise ExportError(
                    f"'{spec.target}', written in place at {where}, shares memory with '{name}' (one a view of "
                    "the other, or of one tensor): a program takes each as an input of its own, so the write "
                    "would not show in the other; register one tensor, and take the view in forward")
