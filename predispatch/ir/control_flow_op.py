"""How a control-flow operator reaches the graph: torch's own op, with subgraphs traced by predispatch.

    cond = torch.ops.higher_order.cond(gt, self.true_graph_0, self.false_graph_0, (x, p_w))

torch's op, traced, would trace its branches again with make_fx (its proxy
rule), below predispatch's pipeline: no regions, no kept composites. The
capture (:mod:`predispatch.trace.control_flow`) traces them itself and calls
:data:`CONTROL_FLOW` ``(kind, *op_args)``, a trace-time carrier whose rule in
make_fx's proxy mode records torch's op (``kind``: "cond", "while_loop",
"map", "scan") with those subgraphs as they are. Its other rules only carry it
there: functionalization (the subgraphs are functional already), autograd
(below it, as any op traced above autograd), fake tensors (torch's own rule
for the op). The program holds only torch's op; at run time, in
``run_decompositions`` and after ``torch.export.load`` it is torch's.
"""
from __future__ import annotations

import torch

from .. import _torch
from .._torch import control_flow


class _ControlFlowOp(_torch.HigherOrderOperator):
    """``(kind, *op_args) -> outputs``: see the module docs."""

    def __init__(self):
        super().__init__("predispatch_control_flow")

    def __call__(self, kind, *args):
        return super().__call__(kind, *args)


CONTROL_FLOW = _ControlFlowOp()

# the names torch.export gives each operator's subgraphs, in the op's argument order
SUBGRAPH_NAMES = {"cond": ("true_graph", "false_graph"), "while_loop": ("cond_graph", "body_graph"),
                  "map": ("body_graph",), "scan": ("scan_combine_graph",)}


@CONTROL_FLOW.py_impl(_torch.FakeTensorMode)
def _fake(mode, kind, *args):
    return control_flow.fake_outputs(kind, mode, args)


@CONTROL_FLOW.py_impl(_torch.DispatchKey.Autograd)
def _autograd(kind, *args):
    with _torch.below_autograd():
        return CONTROL_FLOW(kind, *args)


@CONTROL_FLOW.py_functionalize_impl
def _functionalize(ctx, kind, *args):
    unwrapped = ctx.unwrap_tensors(args)
    with ctx.redispatch_to_next():
        out = CONTROL_FLOW(kind, *unwrapped)
    return ctx.wrap_tensors(out)


@CONTROL_FLOW.py_impl(_torch.ProxyTorchDispatchMode)
def _proxy(mode, kind, *args):
    with _torch.torch_function_modes_suspended():  # the values below the tracer
        out = CONTROL_FLOW(kind, *args)
    root = mode.tracer.root
    i = 0
    while any(hasattr(root, f"{name}_{i}") for name in SUBGRAPH_NAMES[kind]):
        i += 1
    graphs = [a for a in args if isinstance(a, torch.fx.GraphModule)]
    named = {f"{name}_{i}": gm for name, gm in zip(SUBGRAPH_NAMES[kind], graphs)}
    return _torch.record_higher_order_call(mode, control_flow.OPS[kind], args, {}, out, named)


def control_flow_kind(target) -> str | None:
    """"cond", "while_loop", "map" or "scan" for torch's operator, else None."""
    return next((kind for kind, op in control_flow.OPS.items() if target is op), None)


def subgraph_inputs(node: torch.fx.Node) -> list[tuple]:
    """A control-flow node's subgraphs (get_attr nodes), each with the values
    its placeholders take (None where they are not the node's: a map's rows)."""
    kind = control_flow_kind(node.target)
    if kind == "cond":
        return [(node.args[1], node.args[3]), (node.args[2], node.args[3])]
    if kind == "while_loop":
        passed = (*node.args[2], *node.args[3])
        return [(node.args[0], passed), (node.args[1], passed)]
    if kind in ("map", "scan"):  # the body takes rows: its placeholders keep their names
        return [(node.args[0], None)]
    return []


def module_stacks_into_branches(gm: torch.fx.GraphModule) -> None:
    """Each node of a control-flow operator's subgraphs (their regions too)
    runs in the module that called the operator: its ``nn_module_stack`` is
    the operator node's (a branch is traced as a function of its own, whose
    stack would name predispatch's wrapper rather than the user's modules)."""
    for node in gm.graph.nodes:
        if node.op != "call_function" or control_flow_kind(node.target) is None:
            continue
        stack = node.meta.get("nn_module_stack")
        for sub, _passed in subgraph_inputs(node):
            for inner in getattr(gm, sub.target).modules():
                for n in inner.graph.nodes if isinstance(inner, torch.fx.GraphModule) and stack else ():
                    if n.op not in ("placeholder", "output", "get_attr"):
                        n.meta["nn_module_stack"] = dict(stack)
    for sub in gm.children():  # a nested operator's branches, after its own node was stamped; regions'
        if isinstance(sub, torch.fx.GraphModule):
            module_stacks_into_branches(sub)
