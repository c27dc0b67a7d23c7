"""The run-time module's generated code: each op called by its cheapest exact spelling."""
from __future__ import annotations

import copy

import torch

from .. import _torch
from ..ir.autograd_function_op import AUTOGRAD_FUNCTION, run_autograd_function
from .ambient import dtype_guard


# The run-time module's code calls ops by their cheapest exact spelling,
# OpOverload's own C++ entry point; ``_assert_tensor_metadata`` (guarding
# every ``.to()``) by ``ambient.dtype_guard``, which names the cast a call
# breaks and calls the op's Python binding (0.5 us, against 3 us boxed).
# Tracing either records the same op, so a re-export gives the same graph.
DTYPE_GUARD = torch.ops.aten._assert_tensor_metadata.default


def _run_time_call(node: torch.fx.Node, exported_autocast: dict | None):
    target = node.target
    if target is AUTOGRAD_FUNCTION:
        return run_autograd_function
    if target is DTYPE_GUARD:
        return dtype_guard(node, exported_autocast)
    if not isinstance(target, _torch.OpOverload):
        return None
    return _torch.op_entry_point(target)


def use_run_time_calls(gm: torch.fx.GraphModule, exported_autocast: dict | None = None) -> None:
    """Generate the code of ``gm`` and of its region submodules with
    ``_run_time_call``s; their graphs keep the aten ops. The unlifted module
    shares its submodules with the program: those are copied first, so the
    program's code is left as it was."""
    regions = [name for name, child in gm.named_children() if isinstance(child, torch.fx.GraphModule)]
    for name in regions:
        child = getattr(gm, name)
        # not lazy: a deepcopy of a lazy one is lazy again, and dynamo cannot inline that
        setattr(gm, name, torch.fx.GraphModule(child, copy.deepcopy(child.graph), name))
    calls = {node: _run_time_call(node, exported_autocast) for node in gm.graph.nodes if node.op == "call_function"}
    _torch.generate_code_with(gm, {node: call for node, call in calls.items() if call is not None})
    for name in regions:  # after: generating gm's code recompiles its submodules
        use_run_time_calls(getattr(gm, name), exported_autocast)


