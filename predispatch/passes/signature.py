"""The signature stage: outputs named as the graph has them, and the program's record made.

Passes may replace output nodes: output specs follow them by position. The
record (:mod:`predispatch.ir.program_meta`) says how each mutated parameter,
buffer and input is written back (its mode, its layout and storage), which
user inputs the trace saw as views of others, the user outputs eager returns as
views of an input the forward wrote, the backward autocast policy, the module
order and its train/eval mode, the sharding layouts, the data-dependent branches assumed and the
autocast the export ran under: what ``ep.module()`` and the
downstream tools read from the program.
"""
from __future__ import annotations

import torch
from torch.export.graph_signature import (InputSpec, OutputSpec, SymBoolArgument, SymFloatArgument, SymIntArgument,
                                          TensorArgument)

from .. import _torch
from .._torch import pytree
from ..errors import ExportError
from ..ir.assumptions import META_FIELD as ASSUMPTIONS
from ..ir.program_meta import set_program_meta
from ..trace import input_aliasing
from ..trace.capture import Captured
from ..trace.functional_trace import outputs_made_distinct


def record_program_meta(captured, module: torch.nn.Module, autocast_policy, sharding_layouts: dict,
                        grad_mode_after: bool | None = None) -> None:
    """The record of ``captured`` (the capture stage's result, its passes run)
    on its graph; ``grad_mode_after``: the mode a bare switch leaves the caller in."""
    set_program_meta(captured.gm, {
        "write_back": write_back_modes(captured),
        "layouts": layout_changes(captured),
        "input_views": input_aliasing.to_json(captured.record.input_views),
        **({"repeated_inputs": repeated} if (repeated := input_aliasing.repeated_inputs(
            pytree.tree_leaves((captured.args, captured.kwargs)))) else {}),
        **({"output_views": views} if (views := output_views(captured)) else {}),
        "autocast_policy": autocast_policy.to_json(),
        "module_order": module_order(module),
        "training": module.training,
        **({"grad_mode_after": grad_mode_after} if grad_mode_after is not None else {}),
        **({"sharding": {name: layout.to_json() for name, layout in sharding_layouts.items()}}
           if sharding_layouts else {}),
        **({ASSUMPTIONS: [a.to_json() for a in captured.record.assumptions]}
           if captured.record.assumptions else {}),
        **({"ambient_autocast": captured.record.ambient_autocast} if captured.record.ambient_autocast else {}),
        **({"requires_grad_reads": captured.record.requires_grad_reads}
           if captured.record.requires_grad_reads else {}),
    })


def name_inputs_apart_from_state(captured: Captured) -> None:
    """A user input named as a top-level parameter, buffer or constant
    (``forward(self, x)`` of a module with a buffer ``x``) is named apart:
    a write-back's target is a name, and ``ep.module()`` (torch's unlift)
    takes a state's name before an input's, so the input's new value went
    into the buffer."""
    sig = captured.signature
    state = {s.target for s in sig.input_specs if s.kind.name != "USER_INPUT" and s.target}
    placeholders = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    for i, spec in enumerate(sig.input_specs):
        node = placeholders.get(getattr(spec.arg, "name", None))
        if spec.kind.name != "USER_INPUT" or node is None or node.name not in state:
            continue
        old = node.name
        _torch.rename_placeholder(node, f"{old}_input")
        node.target = node.name  # as the graph's namespace made it unique
        sig.input_specs[i] = InputSpec(spec.kind, type(spec.arg)(node.name), spec.target, spec.persistent)
        sig.output_specs[:] = [OutputSpec(o.kind, o.arg, node.name)
                               if o.kind.name == "USER_INPUT_MUTATION" and o.target == old else o
                               for o in sig.output_specs]
    captured.gm.recompile()


# an output the graph names by its node (a SymInt computed in a region is the region's getitem too)
_NAMED_ARGUMENTS = (TensorArgument, SymIntArgument, SymFloatArgument, SymBoolArgument)


def sync_output_names(captured: Captured) -> None:
    """Passes may replace output nodes; output specs follow them by position.
    Two mutated inputs with one new value (``x.set_(v); z.set_(v)``) get a
    node each (an alias: the same memory, as eager's tensors share it): the
    signature maps a mutation output's name to one target."""
    _distinct_mutation_outputs(captured)
    outputs = captured.gm.graph.output_node().args[0]
    sig = captured.signature
    sig.output_specs[:] = [
        OutputSpec(s.kind, type(s.arg)(node.name), s.target)
        if isinstance(s.arg, _NAMED_ARGUMENTS) and isinstance(node, torch.fx.Node) else s
        for s, node in zip(sig.output_specs, outputs)]


def _distinct_mutation_outputs(captured: Captured) -> None:
    specs = captured.signature.output_specs
    outputs_made_distinct(captured.gm, [i for i, spec in enumerate(specs) if spec.kind.name.endswith("_MUTATION")])


def module_order(module: torch.nn.Module) -> list[str]:
    """The paths of the submodules holding state, in the module's order."""
    return [path for path, m in module.named_modules(remove_duplicate=False)
            if path and (any(_torch.state_tables(m)) or _torch.child_modules(m))]


def _mutation_targets(captured: Captured) -> dict[str, str]:
    """The recorder's key (``"param:<fqn>"``, ``"input:<flat index>"``) -> the
    mutated state's name as in the output specs (a user input's placeholder)."""
    # one USER_INPUT spec per flat input leaf, constants (bool, int, None, str) included
    user_inputs = [getattr(s.arg, "name", None) for s in captured.signature.input_specs
                   if s.kind.name == "USER_INPUT"]
    targets = {}
    for spec in captured.signature.output_specs:
        if spec.kind.name == "PARAMETER_MUTATION":
            targets[f"param:{spec.target}"] = spec.target
        elif spec.kind.name == "BUFFER_MUTATION":
            targets[f"buffer:{spec.target}"] = spec.target
        elif spec.kind.name == "USER_INPUT_MUTATION":
            targets[f"input:{_flat_input_index(captured, spec.target, user_inputs)}"] = spec.target
    return targets


def write_back_modes(captured: Captured) -> dict[str, str]:
    """Mutation target name (as in the output specs) -> how its data was mutated."""
    kinds = captured.record.mutation_kinds
    return {target: kinds[key] for key, target in _mutation_targets(captured).items() if key in kinds}


def layout_changes(captured: Captured) -> dict[str, dict]:
    """Mutation target name -> its layout change (:class:`LayoutChange` as JSON),
    the storage it took named as a target too (a user input's placeholder,
    a parameter's or buffer's name)."""
    targets, names = _mutation_targets(captured), _state_and_input_names(captured)
    return {targets[key]: {**change, "source": names.get(change["source"])}
            for key, change in captured.record.layouts.items() if key in targets}


def output_views(captured: Captured) -> dict[str, dict]:
    """User output (its flat position, as a string) -> the view of a
    parameter, buffer or input ``ep.module()`` makes it again as
    (:class:`predispatch.trace.functional_trace.OutputView` as JSON), the
    tensor it views named as a write-back target."""
    names = _state_and_input_names(captured)
    return {str(index): {**view, "of": names[view["of"]]}
            for index, view in sorted(captured.record.output_views.items()) if view["of"] in names}


def _state_and_input_names(captured: Captured) -> dict[str, str]:
    """Every input's recorder key -> its name as a write-back target."""
    sig = captured.signature
    user_inputs = [getattr(s.arg, "name", None) for s in sig.input_specs if s.kind.name == "USER_INPUT"]
    names = {f"input:{i}": name for i, name in enumerate(user_inputs)}
    for spec in sig.input_specs:
        if spec.kind.name in ("PARAMETER", "BUFFER"):
            names[f"{spec.kind.name.lower().replace('parameter', 'param')}:{spec.target}"] = spec.target
    return names


def _flat_input_index(captured: Captured, name: str, user_inputs: list) -> int:
    """The position of input ``name`` among the flat example inputs (the
    recorder's key for it)."""
    if len(_torch.pytree.tree_leaves((captured.args, captured.kwargs))) != len(user_inputs):
        raise ExportError("internal: user inputs of the signature do not match the example inputs")
    return user_inputs.index(name)