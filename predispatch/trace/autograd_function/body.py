"""A Function's forward or backward as a graph: the capture stage of a function body.

The pipeline (:mod:`predispatch.pipeline`) traces each subgraph of a
Function met in the forward with the stages a module's export runs; its
capture stage is :func:`capture_function_body`: the function wrapped as a
module, traced on fake inputs by the module's own trace (the recorder, the
functional trace), placeholders named after the function's parameters, and
the tensor constants its code makes lifted to inputs. (The trace meets a
Function first: :mod:`.subgraphs` hands the call to the pipeline.)
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch
from torch.export.graph_signature import InputKind, InputSpec, OutputKind, OutputSpec, TensorArgument

from ... import _torch
from ...errors import ExportError, node_location
from ...ir.autograd_function_op import placeholders
from ..capture import history_nodes
from ..functional_trace import functional_trace
from ...ir.records import TraceRecord
from ..recorder.session import recording
from .subgraphs import FunctionBody, RelaidInput


class _Body(torch.nn.Module):
    """A function as a module, for the trace that traces modules."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


@dataclasses.dataclass
class CapturedBody:
    """What the capture stage of a function body leaves: its graph, a
    signature of user inputs and outputs (what the passes read), the module
    it traced and its tensor constants (its last inputs)."""

    gm: torch.fx.GraphModule
    signature: object
    module: torch.nn.Module
    constants: list


def capture_function_body(body: FunctionBody, record: TraceRecord) -> CapturedBody:
    module = _Body(body.fn)
    _torch.forget_real_values(body.fake_inputs)  # made for the trace: no branch is decided by their memory
    with _torch.autocast_cache_enabled(body.autocast_cache), recording(module, record, str), \
            _torch.autocast_cache_enabled(False):  # as make_fx traces
        gm, signature, _views = functional_trace(module, body.fake_inputs, {},
                                                 keep=lambda: history_nodes(record), on_retrace=record.clear,
                                                 record=record, on_layout_change=_refuse_relaid)
    body.updated[:] = _updates_last(gm, signature)
    for node, name in zip(placeholders(gm), body.names):
        _torch.rename_placeholder(node, name)
    constants = _lift_constants(gm)
    outputs = gm.graph.output_node().args[0]
    signature = SimpleNamespace(
        input_specs=[InputSpec(InputKind.USER_INPUT, TensorArgument(n.name), None) for n in placeholders(gm)],
        output_specs=[OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(getattr(o, "name", "")), None)
                      for o in outputs])
    return CapturedBody(gm, signature, module, constants)


def _refuse_relaid(key: str, change) -> None:
    raise RelaidInput(key)


def _updates_last(gm: torch.fx.GraphModule, signature) -> list[int]:
    """The new values of the inputs the body updates in place (the trace's
    first outputs) moved after its own outputs: the positions of those
    inputs, in the order of their values."""
    updates = signature.user_inputs_to_mutate
    if not updates:
        return []
    output = gm.graph.output_node()
    values = list(output.args[0])
    names = [n.name for n in placeholders(gm)]
    positions = [names.index(updates[v.name]) for v in values[:len(updates)]]
    output.args = ((*values[len(updates):], *values[:len(updates)]),)
    gm.recompile()
    return positions


def _lift_constants(gm: torch.fx.GraphModule) -> list[torch.Tensor]:
    """Tensor constants of the Function's code (``torch.tensor(data)``) become
    placeholders after the others: the op takes them as inputs, which
    torch.export lifts as the program's constants (a subgraph's own tensor
    attributes would be neither lifted nor serialized)."""
    constants = []
    for node in [n for n in gm.graph.nodes if n.op == "get_attr"]:
        value = getattr(gm, node.target)
        if not isinstance(value, torch.Tensor):
            continue
        if _torch.is_fake(value):  # a tensor of the export's trace, not a constant of the Function's code
            raise ExportError(
                f"an autograd.Function reads a tensor of the forward through its closure, not as an input of "
                f"apply(), at {node_location(node.meta.get('stack_trace'))}: a program cannot hold it (nor see "
                "a write to it); pass it to apply()")
        with gm.graph.inserting_after(placeholders(gm)[-1]) if placeholders(gm) else \
                gm.graph.inserting_before(next(iter(gm.graph.nodes))):
            lifted = gm.graph.placeholder(f"constant_{len(constants)}")
        lifted.meta.update(node.meta)
        node.replace_all_uses_with(lifted)
        gm.graph.erase_node(node)
        delattr(gm, node.target)
        constants.append(value)
    return constants
