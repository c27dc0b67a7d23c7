"""The effects stage: an op with effects on a script object called directly, in the graph's order.

Functionalization orders an op with effects (a torchbind object's method, an
op taking one: a queue pushed to, then popped from) by an effect token:
``with_effects(token, op, *args)`` gives the next token and the op's
results, the first token made in the trace from a lifted empty constant.
A program runs its ops in its graph's order, as torch.export's own program
does once it drops its tokens (``_remove_effect_tokens``): each becomes the
op's own call, which the dead-code stage keeps (an op with effects is
impure); the tokens go, their constant with them. A Python value such a
call returns (a queue's size) is the trace's, read off the example's object
(its fake), which the program would keep for every call: refused, here for
an op, while tracing for a method (``trace/recorder/script_objects.py``).
"""
from __future__ import annotations

import operator

import torch

from .. import _torch
from ..errors import ExportError, node_location
from ..trace.recorder.script_objects import VALUE_RETURNED, is_python_value


def call_effects_directly(gm: torch.fx.GraphModule) -> None:
    """Each ``with_effects`` node replaced by its op's call; its token chain dropped."""
    calls = list(gm.graph.find_nodes(op="call_function", target=_torch.WITH_EFFECTS))
    for node in calls:
        _call_directly(gm.graph, node)
    given = {user for node in calls for user in node.users}  # the tokens they gave
    first = {node.args[0] for node in calls} - given  # the tokens the trace made
    for node in reversed(calls):  # later ones read earlier ones' tokens
        for user in list(node.users):  # the token it gave, read by nothing now
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
    for token in first:
        _drop_token_chain(gm.graph, token)
    if calls:
        gm.recompile()


def _call_directly(graph: torch.fx.Graph, node: torch.fx.Node) -> None:
    _, op, *args = node.args
    results = len(node.meta["val"]) - 1 if isinstance(node.meta.get("val"), (tuple, list)) else None
    if results and any(is_python_value(v) for v in node.meta["val"][1:]):
        raise ExportError(
            f"{op} at {node_location(node.meta.get('stack_trace'))} {VALUE_RETURNED}")
    with graph.inserting_before(node):
        call = graph.call_function(op, tuple(args), dict(node.kwargs))
    call.meta = {k: v for k, v in node.meta.items() if k != "val"}
    if results is not None:
        outputs = tuple(node.meta["val"][1:])
        call.meta["val"] = outputs[0] if results == 1 else (outputs or None)
    for user in list(node.users):
        index = user.args[1] if user.op == "call_function" and user.target is operator.getitem else None
        if index is None or index == 0:
            continue  # the next token
        if results == 1:
            user.replace_all_uses_with(call)
        else:
            with graph.inserting_before(user):
                item = graph.call_function(operator.getitem, (call, index - 1))
            item.meta = dict(user.meta)
            user.replace_all_uses_with(item)
        graph.erase_node(user)


def _drop_token_chain(graph: torch.fx.Graph, token) -> None:
    """The first token's making (``detach_(lift_fresh_copy(constant))``), read by nothing now;
    its constant's placeholder is the dead-code stage's."""
    while isinstance(token, torch.fx.Node) and token.op == "call_function" and not token.users:
        inputs = token.all_input_nodes
        graph.erase_node(token)
        token = inputs[0] if len(inputs) == 1 else None
