"""What a program runs on: torch's region higher-order ops, aten entry points for generated code, unlifted-module checks."""
from __future__ import annotations

import contextlib
import copy
import functools
import sys

import torch
import torch._dynamo
import torch.fx
from torch._higher_order_ops.wrap import (
    WrapWithAutocast,
    WrapWithSetGradEnabled,
    wrap_with_autocast,
    wrap_with_set_grad_enabled,
)
from torch.fx._lazy_graph_module import _LazyGraphModule, _make_graph_module, _use_lazy_graph_module
from torch.nn.modules import module as _nn_module
from torch.export._unlift import (
    _check_input_constraints_for_module,
    _check_inputs_match,
)


# torch's region higher-order ops (predispatch.program.region_runtime runs their calls) and their own calls
TORCH_REGION_CALLS = {WrapWithSetGradEnabled: WrapWithSetGradEnabled.__call__,
                      WrapWithAutocast: WrapWithAutocast.__call__}


def torch_function_mode_enabled() -> bool:
    """Is a torch-function mode on (a program being traced again)?"""
    return torch._C._is_torch_function_mode_enabled()


def has_module_hooks(m: torch.nn.Module) -> bool:
    """Does calling ``m`` run hooks (its own or global ones)?"""
    g = _nn_module
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or m._backward_pre_hooks or g._global_forward_hooks or g._global_forward_pre_hooks
                or g._global_backward_hooks or g._global_backward_pre_hooks)


def force_recompile(gm: torch.fx.GraphModule) -> None:
    """Generate a lazy graph module's code now."""
    _LazyGraphModule.force_recompile(gm)


def install_unflatten_write_backs(fix) -> None:
    """After ``torch.export.unflatten`` turns a program's mutations into
    ``copy_`` nodes, ``fix(graph, graph_signature)`` may change them."""
    _unflatten = sys.modules["torch.export.unflatten"]  # the module (torch.export.unflatten is its function)
    original = _unflatten._inplace_buffer_and_input_mutations

    def inplace_mutations(graph, graph_signature):
        original(graph, graph_signature)
        fix(graph, graph_signature)

    _unflatten._inplace_buffer_and_input_mutations = inplace_mutations


_ENTRY_POINTS: dict = {}


def op_entry_point(op: torch._ops.OpOverload):
    """An object calling exactly what ``op(...)`` calls, named for generated
    code (``aten_mul_Tensor``), that dynamo writes into its graph as a call
    (``torch.compile`` of the module still sees the op); None for ops that are
    not aten ops returning only tensors."""
    if op not in _ENTRY_POINTS:
        _ENTRY_POINTS[op] = _make_entry_point(op) if _has_entry_point(op) else None
    return _ENTRY_POINTS[op]


def _has_entry_point(op) -> bool:
    schema = op._schema
    return (isinstance(op, torch._ops.OpOverload) and op.namespace == "aten" and not schema.is_mutable
            and len(schema.returns) > 0
            and all(isinstance(r.type, torch.TensorType) for r in schema.returns))


def _make_entry_point(op):
    name = f"{op._schema.name.split('::')[1]}_{op._overloadname}"
    cls = type(name, (), {"__call__": staticmethod(op._op), "__module__": "aten",
                          "__repr__": lambda self: f"<entry point of {op}>"})
    entry = cls()
    entry.__name__ = name
    torch._dynamo.allow_in_graph(entry)
    return entry


def generate_code_with(gm: torch.fx.GraphModule, targets: dict) -> None:
    """Generate ``gm``'s code now with some node targets replaced (``targets``:
    node -> callable), leaving the graph as it was: passes and pattern
    matchers still see the aten ops, and a later recompile is plain."""
    saved = {node: node.target for node in targets}
    try:
        for node, target in targets.items():
            node.target = target
        if isinstance(gm, _LazyGraphModule):
            _LazyGraphModule.force_recompile(gm)
        else:
            gm.recompile()
    finally:
        for node, target in saved.items():
            node.target = target


def call_leaves(unlifted: torch.fx.GraphModule, args, kwargs) -> list:
    """The call's input leaves in the program's order, keyword arguments in
    any order; ValueError for another input structure (as ep.module())."""
    return [x for _, x in _check_inputs_match(args, kwargs, unlifted._in_spec)]


def flat_call_form(unlifted: torch.fx.GraphModule) -> tuple | None:
    """How ``ep.module()``'s calls lay their inputs out where each input is one
    leaf (a tensor or a scalar, as a training step's usually are): (the number
    of positional inputs, the keyword names in the program's order); None
    where they nest."""
    spec = unlifted._in_spec
    if spec.type is not tuple or spec.num_children != 2:
        return None
    args_spec, kwargs_spec = spec.children()
    if args_spec.type is not tuple or kwargs_spec.type is not dict:
        return None
    if not all(c.is_leaf() for c in (*args_spec.children(), *kwargs_spec.children())):
        return None
    return args_spec.num_children, tuple(kwargs_spec.context)


_PLAIN_LEAVES = (torch.Tensor, int, float, str)  # leaves of any pytree


def flat_call_leaves(form: tuple, args, kwargs) -> list | None:
    """:func:`call_leaves` of a call laid out as ``form`` (:func:`flat_call_form`)
    says, without torch's walk of key paths; None for a call laid out
    otherwise (:func:`call_leaves` then says how)."""
    num_args, names = form
    if len(args) != num_args or len(kwargs) != len(names):
        return None
    try:
        leaves = [*args, *[kwargs[name] for name in names]]
    except KeyError:
        return None
    return leaves if all(isinstance(x, _PLAIN_LEAVES) for x in leaves) else None


def metadata_check(tensors: list, native: bool = True):
    """A check (a function of a list like ``tensors``, returning a bool) that
    each tensor has the metadata its counterpart in ``tensors`` has now: its
    type, dispatch keys, dtype, device, sizes, strides and requires_grad (in
    grad mode at least: some releases' guard checks it in grad mode only).
    Dynamo's C++ tensor guard, one call for all; a comparison in Python where
    this torch has none (``native=False`` asks for it). Made and checked
    under other thread-local dispatch state (autocast), it fails: it may fail
    where the metadata is the same, never the other way."""
    try:
        from torch._C._dynamo.guards import TensorGuards

        if not native:
            raise NotImplementedError
        guard = TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                             dynamic_dims_strides=[list(t.stride()) for t in tensors])
        if guard.check(*tensors):
            return lambda ts: len(ts) == len(tensors) and guard.check(*ts)
    except Exception:  # a torch whose guard takes other arguments
        pass
    saved = [_metadata(t) for t in tensors]
    return lambda ts: [_metadata(t) for t in ts] == saved


def _metadata(t: torch.Tensor) -> tuple:
    return type(t), t.dtype, t.device, t.shape, t.stride(), t.requires_grad


def check_call_inputs(unlifted: torch.fx.GraphModule, args, kwargs) -> None:
    """RuntimeError naming the input where ``ep.module()`` (``unlifted``) would
    refuse the call: a size outside the program's shapes and dynamic ranges, a
    non-tensor input other than the exported value."""
    _check_input_constraints_for_module(unlifted, args, kwargs)


def copy_unlifted(unlifted: torch.fx.GraphModule, memo: dict) -> torch.fx.GraphModule:
    """A deep copy of ``ep.module()``'s module that :func:`check_call_inputs`
    can still check: a GraphModule's deepcopy drops the range constraints."""
    new = copy.deepcopy(unlifted, memo)
    vars(new).setdefault("range_constraints", unlifted.range_constraints)
    return new


def share_module_state(owner: torch.nn.Module, module: torch.nn.Module) -> None:
    """``owner`` holds ``module``'s own parameters and buffers: the same dicts, so
    that a tensor replaced on one (``load_state_dict(assign=True)``) is on both."""
    vars(owner).update(_parameters=module._parameters, _buffers=module._buffers,
                       _non_persistent_buffers_set=module._non_persistent_buffers_set)


def child_modules(module: torch.nn.Module) -> dict:
    """A module's own submodules, by name, in order."""
    return module._modules


def reorder_child_modules(module: torch.nn.Module, key) -> None:
    """A module's own submodules sorted by ``key(name)`` (stable: ties keep their order)."""
    module._modules = dict(sorted(module._modules.items(), key=lambda kv: key(kv[0])))


def boxed(fn):
    """``fn(args_list)`` marked as taking AOTAutograd's boxed calling convention."""
    fn._boxed_call = True
    return fn


def freeing_inputs(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``gm`` (changed) taking its inputs as one list, which it clears (fx's
    boxed codegen, as torch's ``aot_eager`` runs graphs): each input is
    freed at its last use, as eager's autograd frees a saved tensor once its
    node ran, not held to the graph's end by the caller's list."""
    gm.graph.set_codegen(torch.fx.graph._BoxedCodeGen())
    gm.recompile()
    return gm  # its _boxed_call is True: AOTAutograd passes it the list


def as_boxed(fn):
    """A compiled graph as a function of one list of inputs: ``fn`` itself where
    it takes AOTAutograd's boxed convention (inductor's), else ``fn(*args)``
    (a torch.compile backend's usual return, ``gm.forward``)."""
    if getattr(fn, "_boxed_call", False):
        return fn
    return lambda args: fn(*args)
