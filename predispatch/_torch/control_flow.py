"""torch's control-flow operators: the ops a program keeps, the calls a trace takes over.

``torch.cond``, ``while_loop``, ``map`` and ``scan`` end in a call of their
higher-order op (``cond_op(pred, true_fn, false_fn, operands)``...), made
through ``_hop_compile_and_call``, which traces the branches with dynamo.
While predispatch traces a forward, that compile is skipped (the op is
called directly) and the op's call is handed to predispatch's capture, so a
reference imported before the export (``from torch._higher_order_ops.map
import map``) is captured too.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
from typing import Callable

import torch

from torch.utils import _pytree as pytree

from .data_dependence import checks_named_by_their_conditions
from .functionalization import is_traced
from .patching import patched
from .tracing import outer_trace_suspended

COND = torch.ops.higher_order.cond
WHILE_LOOP = torch.ops.higher_order.while_loop
MAP = torch.ops.higher_order.map_impl
SCAN = torch.ops.higher_order.scan
OPS = {"cond": COND, "while_loop": WHILE_LOOP, "map": MAP, "scan": SCAN}


def _op_classes() -> dict:
    """Each operator's class (whose ``__call__`` every spelling reaches), by kind."""
    from torch._higher_order_ops.associative_scan import AssociativeScanOp
    from torch._higher_order_ops.cond import CondOp
    from torch._higher_order_ops.map import MapImpl
    from torch._higher_order_ops.scan import ScanOp
    from torch._higher_order_ops.while_loop import WhileLoopOp

    return {"cond": CondOp, "while_loop": WhileLoopOp, "map": MapImpl, "scan": ScanOp,
            "associative_scan": AssociativeScanOp}


_MODULES = {f"torch._higher_order_ops.{kind}" for kind in ("cond", "while_loop", "map", "scan", "associative_scan")}


@contextlib.contextmanager
def control_flow_calls_to(capture: Callable):
    """Until exit (the tracing thread): a call of a control-flow operator is
    ``capture(kind, *args)``, its eager compile skipped."""
    import torch._higher_order_ops.utils as hop_utils

    def direct(original):
        def call(fn, args, kwargs=None):
            if getattr(fn, "__module__", None) not in _MODULES:  # another operator's (invoke_subgraph...)
                return original(fn, args, kwargs)
            return fn(*args, **(kwargs or {}))  # the operator's wrapper, defined in its module
        return call

    with contextlib.ExitStack() as stack:
        stack.enter_context(patched(hop_utils, "_hop_compile_and_call", direct))
        for kind, cls in _op_classes().items():
            if "__call__" in vars(cls):
                stack.enter_context(patched(cls, "__call__", functools.partial(_captured, capture, kind)))
        yield


@contextlib.contextmanager
def branch_traced_apart(fake_mode, codes):
    """A branch's own trace in the middle of the forward's (every mode of the
    running trace off, :func:`~.tracing.outer_trace_suspended`), under
    torch.export's non-strict torch-function handler as the forward is: its
    rewrites (an index by a symbolic int made a ``select``, ``torch.tensor``
    of symbolic numbers) hold in branches too. The frames of ``codes`` (the
    user's branch functions) show in its nodes' stack traces, as a module's
    ``forward`` does: the line inside the branch that made a node."""
    from torch._export.non_strict_utils import _NonStrictTorchFunctionHandler
    from torch.fx.proxy import _STACK_TRACE_ANCHORS

    kept = [m for m in torch.overrides._get_current_function_mode_stack()
            if isinstance(m, _NonStrictTorchFunctionHandler)]
    shown = {(code.co_filename, code.co_name) for code in codes} - _STACK_TRACE_ANCHORS
    _STACK_TRACE_ANCHORS.update(shown)
    try:
        with outer_trace_suspended(fake_mode), contextlib.ExitStack() as stack:
            for mode in kept:
                stack.enter_context(mode)
            yield
    finally:
        _STACK_TRACE_ANCHORS.difference_update(shown)


def any_int(fake_mode) -> torch.SymInt:
    """A fresh unbacked symbolic int: what a loop's branches are traced on for
    an int it carries (any value an iteration may give it), as torch traces them."""
    with fake_mode.shape_env.ignore_fresh_unbacked_symbols():
        return fake_mode.shape_env.create_unbacked_symint()


def write_runtime_asserts(gm: torch.fx.GraphModule, fake_mode) -> None:
    """The run-time checks a branch's trace deferred (its ``torch._check``
    on an ``.item()``, the range of a size it made) written into its graph,
    where their symbols are bound, as torch's own branches hold them."""
    from torch.fx.passes.runtime_assert import insert_deferred_runtime_asserts

    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is not None:
        insert_deferred_runtime_asserts(gm, shape_env, "control-flow branch", export=True)
    checks_named_by_their_conditions(gm)


def _captured(capture: Callable, kind: str, original: Callable) -> Callable:
    """The operator's call, captured where it is the forward's (torch's own
    rules call it on fake tensors below the trace: those run as torch's)."""
    def call(self, *args, **kwargs):
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if tensors and not any(is_traced(t) for t in tensors):
            return original(self, *args, **kwargs)
        return capture(kind, *args, **kwargs)
    return call


def fake_outputs(kind: str, mode, args: tuple):
    """What the operator returns on fake tensors (torch's own rule: a cond's
    two branches' outputs merged, a loop's body run once), its tensors run
    fresh, as torch's tracing of a loop runs them: a fake tensor remembers
    the symbol ``.item()`` gave it, which a check in a branch would bind
    otherwise (the check enforced where the operator is called, taken or not)."""
    # the modules (the package's names ``cond``, ``map``... are the functions)
    module = importlib.import_module(f"torch._higher_order_ops.{kind}")
    rule = getattr(module, f"{kind}_fake_tensor_mode")
    with mode:
        args = pytree.tree_map_only(torch.Tensor, _unremembered, args)
    if next(iter(inspect.signature(rule).parameters)) == "mode":  # a rule of the mode (scan's since 2.15)
        return rule(mode, *args)
    with mode:  # a fake kernel (register_fake)
        return rule(*args)


def _unremembered(t: torch.Tensor) -> torch.Tensor:
    """A fake tensor like ``t`` that remembers no value (``.item()``'s symbol, a constant's)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
