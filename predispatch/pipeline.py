"""``export_predispatch``: the pipeline, stage by stage.

    capture   -> a flat functional pre-dispatch graph + what the trace saw
    history   -> values mutated under no_grad keep their autograd history
    dead code -> replaced values the history stage did not need go
    writes    -> functionalized writes written with differentiable ops
    regions   -> grad/autocast blocks become higher-order ops
    signature -> output renames, write-back modes, the autocast policy
    program   -> a PredispatchProgram (a torch.export.ExportedProgram)
"""
from __future__ import annotations

import torch
from torch.export.graph_signature import InputKind, OutputSpec, TensorArgument

from . import _torch
from .trace import input_aliasing
from .policies.autocast_policy import AutocastPolicy
from .trace.capture import Captured, capture
from .passes.writes import replace_writes
from .errors import ExportError, node_location
from .passes.history import (
    drop_unseen_leaves,
    insert_kept_histories,
    may_require_grad,
    refuse_updates_of_saved_values,
    refuse_views_of_reshaped_inputs,
)
from .policies.op_policy import OpPolicy
from .program.program import PredispatchProgram, module_order, set_program_meta
from .passes.regions import grad_modes, replace_blocks_with_regions
from .ir.region_graphs import mutable_op_nodes


def export_predispatch(module, args, kwargs=None, *, dynamic_shapes=None, op_policy=None,
                       backward_pass_autocast="same_as_forward",
                       on_backward_autocast_mismatch="error") -> PredispatchProgram:
    """Export ``module`` to a functionalized pre-dispatch ``ExportedProgram``.

        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             x.mul_(2)
        ...         return x * x
        >>> ep = export_predispatch(M(), (torch.ones(2),))
        >>> print(ep.graph_module.code)   # wrap_with_set_grad_enabled(False, self.no_grad_0, x)

    See ../shared/CONTRACT.md for guarantees G1-G7.
    """
    autocast = AutocastPolicy.validated(backward_pass_autocast, on_backward_autocast_mismatch)
    op_policy = OpPolicy.default() if op_policy is None else op_policy
    if not isinstance(op_policy, OpPolicy):
        raise ValueError(f"op_policy must be a predispatch.OpPolicy, got {type(op_policy).__name__}")
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"export_predispatch takes a torch.nn.Module, got {type(module).__name__}")
    if not isinstance(args, tuple):
        raise ValueError(f"args must be a tuple of example inputs, got {type(args).__name__}")

    with _torch.lazy_codegen(), sharding_lowered(module, args, kwargs) as layouts:
        captured = capture(module, args, kwargs, dynamic_shapes, op_policy)
        keep_histories(captured, module)
        eliminate_dead_code(captured)  # what the history stage did not need
        replace_writes(captured.gm)  # after: the trace's record names the copy nodes
        replace_blocks_with_regions(captured.gm)
        refuse_remaining_mutations(captured.gm)
        sync_output_names(captured)
        set_program_meta(captured.gm, {
            "write_back": write_back_modes(captured),
            "layouts": layout_changes(captured),
            "input_views": input_aliasing.to_json(captured.record.input_views),
            "autocast_policy": autocast.to_json(),
            "module_order": module_order(module),
            **({"sharding": {name: layout.to_json() for name, layout in layouts.items()}}
               if layouts else {}),
        })
        return _torch.build_exported_program(  # the sharded state still local
            PredispatchProgram, module, captured.artifact, captured.signature,
            args=captured.args, kwargs=captured.kwargs, dynamic_shapes=captured.dynamic_shapes,
            state_dict=captured.original_state_dict,
            verify_additional_inputs=captured.verify_additional_inputs)


def sharding_lowered(module, args, kwargs):
    """A sharded module's DTensors lowered to local shards (see
    :mod:`predispatch.distributed.sharding`); nothing where torch.distributed's DTensor
    was never imported."""
    import contextlib

    if not _torch.distributed_in_use():
        return contextlib.nullcontext({})
    from .distributed import sharding

    return sharding.lowered(module, args, kwargs)


def refuse_remaining_mutations(gm: torch.fx.GraphModule) -> None:
    """G1's safety net. Functionalization turns mutations of parameters,
    buffers, inputs and intermediates into data flow; an in-place op left in
    the graph mutates something else (a plain tensor attribute, lifted as a
    constant), which a functional program cannot express."""
    for node in mutable_op_nodes(gm):
        raise ExportError(
            f"an in-place update ({node.target}) at {node_location(node.meta.get('stack_trace'))} "
            "of a tensor that is neither a parameter, a buffer nor an input (a plain tensor "
            "attribute, a global, a closure's tensor) cannot be exported soundly; register "
            "it with register_buffer or pass it as an input")


def keep_histories(captured: Captured, module: torch.nn.Module) -> None:
    """Kept histories first; then leaves whose history no output shows go, as
    a re-export of the program (which holds the kept histories) sees them."""
    requiring = {name for name, p in module.named_parameters(remove_duplicate=False)
                 if p.requires_grad}
    gm, sig = captured.gm, captured.signature
    insert_kept_histories(gm, captured.record.replacements,
                          lambda modes: may_require_grad(gm, sig, requiring, modes),
                          [s.kind.name for s in sig.output_specs], _write_backs(sig))
    refuse_updates_of_saved_values(captured.record.swap_updates, lambda: may_require_grad(gm, sig, requiring),
                                   gm.graph, [s.kind.name for s in sig.output_specs])
    refuse_views_of_reshaped_inputs(gm.graph, _reshaped_covers(captured),
                                    {r.old for r in captured.record.replacements if not r.in_grad_mode})

    def leaf_analyses():
        off = grad_modes(gm.graph)  # a no_grad caller's: grad on inside the blocks that set it only
        return [(may_require_grad(gm, sig, requiring), may_require_grad(gm, sig, requiring, leaves=False,
                                                                        inputs=False)),
                (may_require_grad(gm, sig, requiring, off), may_require_grad(gm, sig, requiring, off, leaves=False,
                                                                             inputs=False))]
    drop_unseen_leaves(gm, leaf_analyses)


def _reshaped_covers(captured: Captured) -> set:
    """The placeholders of user inputs other inputs view that the forward
    gave another shape."""
    record, sig = captured.record, captured.signature
    placeholders = {n.name: n for n in captured.gm.graph.nodes if n.op == "placeholder"}
    covers = {v.of for v in record.input_views.values()}
    reshaped = set()
    for c in covers:
        size = record.layouts.get(f"input:{c}", {}).get("size")
        node = placeholders.get(sig.user_inputs[c])
        if size is not None and node is not None and tuple(size) != tuple(node.meta["val"].shape):
            reshaped.add(node)
    return reshaped


def _write_backs(sig) -> dict[int, str]:
    """Output position -> the name of the placeholder it writes back."""
    placeholder = {s.target: s.arg.name for s in sig.input_specs if s.target is not None}
    placeholder.update({s.arg.name: s.arg.name for s in sig.input_specs if hasattr(s.arg, "name")})
    return {i: placeholder[s.target] for i, s in enumerate(sig.output_specs)
            if s.kind.name.endswith("_MUTATION") and s.target in placeholder}


def eliminate_dead_code(captured: Captured) -> None:
    """Dead code goes, and so do the lifted constants only dead code read (a
    replaced value the history stage did not need kept them in the trace)."""
    gm, signature = captured.gm, captured.signature
    gm.graph.eliminate_dead_code(is_impure_node=_torch.impure_by_op())
    unused = {n.name: n for n in gm.graph.nodes if n.op == "placeholder" and not n.users}
    for spec in [s for s in signature.input_specs
                 if s.kind == InputKind.CONSTANT_TENSOR and s.arg.name in unused]:
        gm.graph.erase_node(unused[spec.arg.name])
        signature.input_specs.remove(spec)
        captured.artifact.aten.constants.pop(spec.target, None)
    gm.recompile()


def sync_output_names(captured: Captured) -> None:
    """Passes may replace output nodes; output specs follow them by position.
    Two mutated inputs with one new value (``x.set_(v); z.set_(v)``) get a
    node each (an alias: the same memory, as eager's tensors share it): the
    signature maps a mutation output's name to one target."""
    _distinct_mutation_outputs(captured)
    outputs = captured.gm.graph.output_node().args[0]
    sig = captured.signature
    sig.output_specs[:] = [
        OutputSpec(s.kind, TensorArgument(node.name), s.target)
        if isinstance(s.arg, TensorArgument) else s
        for s, node in zip(sig.output_specs, outputs)]


def _distinct_mutation_outputs(captured: Captured) -> None:
    graph = captured.gm.graph
    output = graph.output_node()
    outputs, seen = list(output.args[0]), set()
    for i, (node, spec) in enumerate(zip(outputs, captured.signature.output_specs)):
        if not spec.kind.name.endswith("_MUTATION") or not isinstance(node, torch.fx.Node):
            continue
        if node in seen:
            with graph.inserting_before(output):
                outputs[i] = graph.call_function(torch.ops.aten.alias.default, (node,))
            outputs[i].meta.update({k: v for k, v in node.meta.items() if k in ("val", "stack_trace")})
        seen.add(outputs[i])
    output.args = (tuple(outputs),)


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
    import torch.utils._pytree as pytree

    if len(pytree.tree_leaves((captured.args, captured.kwargs))) != len(user_inputs):
        raise ExportError("internal: user inputs of the signature do not match the example inputs")
    return user_inputs.index(name)