"""torch.export's non-strict front end and the tail that builds an ExportedProgram."""
from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.fx
from torch.export import _trace as _export_trace
from torch._export.non_strict_utils import _enable_graph_inputs_of_type_nn_module
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from torch._functorch._aot_autograd.frontend_utils import (
    _detect_attribute_assignment as restoring_module_attributes,
)
from torch._functorch._aot_autograd.graph_capture_wrappers import create_functional_call
from torch._functorch._aot_autograd.input_output_analysis import (
    _graph_input_names as graph_input_names,
    _graph_output_names as graph_output_names,
)
from torch._functorch._aot_autograd.schemas import GraphSignature
from torch._functorch._aot_autograd.utils import create_tree_flattened_fn

from .data_dependence import checks_named_by_their_conditions
from .fake_params import params_buffers_fakified_directly
from .patching import patched


# torch.export's non-strict front end (fake inputs, dynamic shapes, guards,
# signature, constants, placeholder names, module call graph): reused as is.
export_trace = _export_trace


compiling_state_context = _export_trace._compiling_state_context


reparametrize_module = torch.nn.utils.stateless._reparametrize_module


UserError = _export_trace.UserError


UserErrorType = _export_trace.UserErrorType


ConstraintViolationError = _export_trace.ConstraintViolationError


ValueRangeError = _export_trace.ValueRangeError


def _lazy_program_graph_module(make):
    """The program's GraphModule generates its Python code on first use:
    ``ep.module()`` copies the graph into a module of its own, so an export
    followed by ``module()`` never needs the program's code."""
    @functools.wraps(make)
    def run(root, graph):
        return lazy_graph_module(root, graph, "GraphModule")
    return run


def build_exported_program(cls, module, artifact, signature, *, args, kwargs, dynamic_shapes,
                           state_dict, verify_additional_inputs):
    """An ``ExportedProgram`` (of class ``cls``) from a finished artifact."""
    from torch._export.verifier import TrainingIRVerifier
    from torch.export import exported_program as _exported_program

    t = _export_trace
    t._EXPORT_MODULE_HIERARCHY = t._get_module_hierarchy(module)
    artifact.aten.sig = signature
    forward_arg_names = t._get_forward_arg_names(module, args, kwargs)
    artifact.aten.gm.meta["inline_constraints"] = t._get_inline_constraints(artifact.fake_mode)
    range_constraints = t._get_range_constraints(module, artifact, args, kwargs, dynamic_shapes)
    gm, module_call_graph = t._get_module_call_graph(artifact, (), False, forward_arg_names)
    with patched(_exported_program, "_create_graph_module_for_export", _lazy_program_graph_module):
        ep = cls(
            root=gm, graph=gm.graph, graph_signature=signature, state_dict=state_dict,
            range_constraints=range_constraints, module_call_graph=module_call_graph,
            example_inputs=(args, kwargs), constants=artifact.aten.constants,
            verifiers=[TrainingIRVerifier])
    verify_additional_inputs(ep)
    return ep


def _has_unbacked_symbols(shape_env) -> bool:
    from torch.utils._sympy.symbol import SymT, symbol_is_type

    return any(symbol_is_type(s, (SymT.UNBACKED_INT, SymT.UNBACKED_FLOAT))
               for s in shape_env.var_to_range)


def _unbacked_bindings_recomputed_where_any(recompute):
    """torch.export's pass recomputing each node's unbacked bindings; where
    the shape environment has no unbacked symbol every node's comes out
    empty, so it only drops the old ones (instead of walking every value's
    sizes and strides: a tenth of an export's passes on a large model)."""
    from torch._export.utils import _get_shape_env_from_gm

    @functools.wraps(recompute)
    def run(gm):
        shape_env = _get_shape_env_from_gm(gm)
        if shape_env is None or _has_unbacked_symbols(shape_env):
            return recompute(gm)
        for node in gm.graph.nodes:
            node.meta.pop("unbacked_bindings", None)
    return run


def produce_aten_artifact(**kwargs):
    """torch.export's ``_produce_aten_artifact`` (its passes after the trace),
    with torch-function modes off: torch.export's own mode, still on around its
    aten stage, would see each of the passes' metadata reads (a sixth of their
    time). Not where run-time asserts are to be written: the pass writing
    them builds their conditions through fx proxies' own torch-function
    handling (``torch.sym_not`` of a proxy is a ``call_method`` without it)."""
    from torch._export.utils import _get_shape_env_from_gm

    shape_env = _get_shape_env_from_gm(kwargs["gm"])
    asserts = shape_env is not None and shape_env.deferred_runtime_asserts
    with patched(_export_trace, "_replace_unbacked_bindings", _unbacked_bindings_recomputed_where_any), \
            (contextlib.nullcontext() if asserts else torch._C.DisableTorchFunction()):
        artifact = _export_trace._produce_aten_artifact(**kwargs)
    checks_named_by_their_conditions(artifact.gm)
    return artifact


@contextlib.contextmanager
def module_stacks_renamed_once():
    """torch.export's wrapper renames every node's module stack after the
    trace (its root stripped), through a pytree map per node: a tenth of an
    export's time outside the trace on a large model. In this block, the
    stacks of the graph module given to the function it yields are held back
    from that renaming, and renamed on exit by the same functions once per
    distinct stack, each node given its own dict in its place among the
    node's metadata."""
    held = {}

    def hold(gm):
        for node in gm.graph.nodes:
            if "nn_module_stack" in node.meta:
                position = list(node.meta).index("nn_module_stack")
                held[node] = (node.meta.pop("nn_module_stack"), position)

    yield hold
    renamed = {}
    for node, (stack, position) in held.items():
        key = tuple(stack.items())
        if key not in renamed:
            renamed[key] = {_export_trace._fixup_key(k): v for k, v in _stack_unrooted(stack).items()}
        meta = node.meta
        if position == len(meta):
            meta["nn_module_stack"] = dict(renamed[key])
            continue
        items = list(meta.items())
        items.insert(position, ("nn_module_stack", dict(renamed[key])))
        meta.clear()
        meta.update(items)


def _stack_unrooted(stack: dict) -> dict:
    """``pytree.tree_map(_strip_root, stack)``, directly where every entry is
    a plain (path, class) tuple, as the tracer makes them."""
    strip = _export_trace._strip_root
    if all(type(v) is tuple and all(type(x) is str or isinstance(x, type) for x in v) for v in stack.values()):
        return {k: tuple(strip(x) for x in v) for k, v in stack.items()}
    return torch.utils._pytree.tree_map(strip, stack)


def lazy_graph_module(root: torch.nn.Module, graph: torch.fx.Graph, class_name: str) -> torch.fx.GraphModule:
    """A GraphModule whose Python code is generated on first use, not now:
    outlining a region must not cost a code generation and compile."""
    with _use_lazy_graph_module(True):
        return _make_graph_module(root, graph, class_name=class_name)


def lazy_codegen():
    """While exporting, graph modules made (by make_fx, by torch.export's
    passes) and recompiled generate their Python code on first use only: the
    program's own GraphModule is generated once, at the end."""
    return _use_lazy_graph_module(True)


def free_module_name(root: torch.nn.Module, base: str) -> str:
    """``base_0``, ``base_1``, ...: the first name ``root`` does not hold."""
    i = 0
    while hasattr(root, f"{base}_{i}"):
        i += 1
    return f"{base}_{i}"


def rename_placeholder(node: torch.fx.Node, name: str) -> None:
    """A placeholder's name and argument name (the graph's namespace kept unique)."""
    node.target = name
    node._rename(name)


def process_export_inputs(module, args, kwargs, dynamic_shapes) -> tuple:
    """torch.export's checks and normalization of the example inputs:
    (args, kwargs, input tree spec, dynamic shapes, verify_additional_inputs)."""
    return _export_trace._process_export_inputs(module, args, kwargs, dynamic_shapes)


def original_state_dict(module) -> dict:
    """The module's state before the trace, as torch.export keeps it in the program."""
    return _export_trace._get_original_state_dict(module)


def non_strict_export(module, args, kwargs, dynamic_shapes, in_spec, aten_stage):
    """torch.export's non-strict front end (fake inputs, dynamic shapes, lifting,
    placeholder names) around ``aten_stage``, our trace in place of its own.

    The program's input spec is the one of the example inputs themselves:
    torch.export takes it from the inputs the traced forward got, where a
    module passed as an input is a copy our trace's functional call made
    (holding fake parameters), which the spec names by a weak reference,
    dead once the export is done (``copy.deepcopy(ep.module())`` then
    raised torch's raw ``TypeError``)."""
    with params_buffers_fakified_directly((args, kwargs)):
        artifact = _export_trace._non_strict_export(
            mod=module, args=args, kwargs=kwargs, dynamic_shapes=dynamic_shapes,
            preserve_module_call_signature=(), orig_in_spec=in_spec,
            prefer_deferred_runtime_asserts_over_guards=False, _to_aten_func=aten_stage)
    if artifact.in_spec != in_spec:  # a module among the inputs: a node of its own in the spec
        with _enable_graph_inputs_of_type_nn_module((args, kwargs)):
            own = torch.utils._pytree.tree_flatten((args, kwargs))[1]
        if own == artifact.in_spec:
            artifact = dataclasses.replace(artifact, in_spec=own)
    return artifact


def backend_decompositions_ignored():
    """torch.export's own guard against decompositions a backend registered."""
    return _export_trace._ignore_backend_decomps()


def program_with(ep, gm: torch.fx.GraphModule, signature):
    """A copy of ``ep`` holding ``gm`` and ``signature`` (the rest of the program as it was)."""
    return ep._update(gm, signature)


def is_output_leaf(x) -> bool:
    """Can a program return ``x`` as one of its flat outputs (a tensor, a
    number, None, a string, a symbolic size...), as AOTAutograd checks them?"""
    from torch._functorch._aot_autograd.utils import KNOWN_TYPES

    try:
        from torch._library.opaque_object import is_opaque_value
    except ImportError:  # a release without opaque values
        return isinstance(x, tuple(KNOWN_TYPES))
    return isinstance(x, tuple(KNOWN_TYPES)) or is_opaque_value(x)
