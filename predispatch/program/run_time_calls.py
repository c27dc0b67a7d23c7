"""The run-time module's generated code: each op called by its cheapest exact spelling."""
from __future__ import annotations

import copy

import torch

from .. import _torch
from ..ir.autograd_function_op import AUTOGRAD_FUNCTION, run_autograd_function


# The run-time module's code calls ops by their cheapest exact spelling:
# ``_assert_tensor_metadata`` (guarding every ``.to()``; 3 us boxed) by its
# Python binding (0.5 us; one overload, so the binding cannot pick another),
# other aten ops by OpOverload's own C++ entry point. Tracing either records
# the same op, so a re-export gives the same graph.
_BINDINGS = {
    torch.ops.aten._assert_tensor_metadata.default: _torch.ASSERT_TENSOR_METADATA_BINDING,
}


def _run_time_call(target):
    if target is AUTOGRAD_FUNCTION:
        return run_autograd_function
    if not isinstance(target, _torch.OpOverload):
        return None
    return _BINDINGS.get(target) or _torch.op_entry_point(target)


def use_run_time_calls(gm: torch.fx.GraphModule) -> None:
    """Generate the code of ``gm`` and of its region submodules with
    ``_run_time_call``s; their graphs keep the aten ops. The unlifted module
    shares its submodules with the program: those are copied first, so the
    program's code is left as it was."""
    regions = [name for name, child in gm.named_children() if isinstance(child, torch.fx.GraphModule)]
    for name in regions:
        child = getattr(gm, name)
        # not lazy: a deepcopy of a lazy one is lazy again, and dynamo cannot inline that
        setattr(gm, name, torch.fx.GraphModule(child, copy.deepcopy(child.graph), name))
    calls = {node: _run_time_call(node.target) for node in gm.graph.nodes if node.op == "call_function"}
    _torch.generate_code_with(gm, {node: call for node, call in calls.items() if call is not None})
    for name in regions:  # after: generating gm's code recompiles its submodules
        use_run_time_calls(getattr(gm, name))


