"""torch's control-flow operators met in the forward: kept as themselves, branches traced by the pipeline.

    torch.cond(pred, true_fn, false_fn, operands)     -> cond(pred, true_graph_0, false_graph_0, (*operands, *reads))
    while_loop(cond_fn, body_fn, carried)             -> while_loop(cond_graph_0, body_graph_0, carried, (*reads,))
    map(f, xs, *args)                                 -> map_impl(body_graph_0, [*xs], [*args, *reads])
    scan(combine_fn, init, xs)                        -> scan(scan_combine_graph_0, [*init], [*xs], (*reads,))

However the user reaches the operator (``torch.cond``, the op itself, a
name imported before the export), its call comes here while the forward is
traced (:func:`predispatch._torch.control_flow.control_flow_calls_to`). A
predicate that is a Python bool (a static shape's comparison) picks its
branch, traced inline, as torch does; a SymBool or a tensor keeps both.
``associative_scan`` is refused for now.
"""
from __future__ import annotations

import torch

from ... import _torch
from ..._torch import control_flow, pytree
from ...errors import ExportError, user_location
from ...ir.control_flow_op import CONTROL_FLOW
from .branches import Call, Carried, Row, trace_branches


def capturing_control_flow():
    """While the forward is traced, control-flow operators' calls are :func:`_capture`'s."""
    return control_flow.control_flow_calls_to(_capture)


def _capture(kind: str, *args, **kwargs):
    where = user_location()
    capture = _CAPTURES.get(kind)
    if capture is None:
        raise ExportError(f"torch's {kind} operator at {where} cannot be exported yet: predispatch keeps "
                          "torch.cond, while_loop, map and scan; write the loop with one of them")
    return capture(where, *args, **kwargs)


def _cond(where, pred, true_fn, false_fn, operands):
    if isinstance(pred, (bool, int, float)):  # a static shape's comparison: torch picks the branch too
        return (true_fn if pred else false_fn)(*operands)
    if isinstance(pred, torch.Tensor) and not _torch.is_traced(pred):
        raise ExportError(f"torch.cond at {where} cannot be exported soundly: its predicate is a tensor "
                          "the export does not trace (a global); compute it from the inputs")
    flat, spec = pytree.tree_flatten(tuple(operands))
    branches = trace_branches(Call("torch.cond", where), ["true branch", "false branch"], [true_fn, false_fn],
                              flat, lambda ops: pytree.tree_unflatten(ops, spec))
    first, second = branches.outputs
    both = first.merged(second)  # the same tree; an int they disagree on: a symbolic int, as torch's
    if both is None:
        shown = [o.rebuilt(["<tensor>"] * len(o.leaves)) for o in (first, second)]
        raise ExportError(f"torch.cond at {where} cannot be exported: its branches return different "
                          f"structures ({shown[0]} and {shown[1]}); return the same structure of "
                          "tensors from both")
    out = _recorded("torch.cond", where, "cond", pred, *branches.gms, (*flat, *branches.extra_inputs()))
    return both.rebuilt(out)


def _while_loop(where, cond_fn, body_fn, carried, additional):
    call = Call("while_loop", where)
    other = next((v for v in (*carried, *additional) if isinstance(v, (bool, float)) or
                  not isinstance(v, (torch.Tensor, int, torch.SymInt))), None)
    if other is not None:
        raise ExportError(f"while_loop at {where} cannot be exported: it carries {type(other).__name__} "
                          f"{other!r}; carry tensors and ints (torch's operator takes those)")
    operands = [*(Carried(v) for v in carried), *additional]
    branches = trace_branches(call, ["condition", "body"], [cond_fn, body_fn], operands, lambda ops: ops)
    condition, body = branches.outputs
    if not condition.is_predicate:
        shown = condition.rebuilt(["<tensor>"] * len(condition.leaves))
        raise ExportError(f"while_loop at {where} cannot be exported: its condition must return one "
                          f"boolean (a tensor or a bool), not {shown}")
    _bare_predicate(branches.gms[0])
    out = _recorded("while_loop", where, "while_loop", *branches.gms, tuple(carried),
                    (*additional, *branches.extra_inputs()))
    return tuple(out)


def _bare_predicate(gm: torch.fx.GraphModule) -> None:
    """The condition's graph returns its predicate itself, as torch's operator takes it."""
    output = gm.graph.output_node()
    output.args = (output.args[0][0],)
    gm.recompile()


def _map(where, f, xs, args):
    xs, args = list(xs), list(args)
    rows = [Row(x) for x in xs]  # the body is traced on one row of each mapped input
    branches = trace_branches(Call("map", where), ["body"], [f], [*rows, *args], lambda ops: ops)
    if not branches.outputs[0].all_tensors:
        raise ExportError(f"map at {where} cannot be exported: its body must return tensors only")
    out = _recorded("map", where, "map", branches.gms[0], xs, [*args, *branches.extra_inputs()])
    return branches.outputs[0].rebuilt(out)


def _scan(where, combine_fn, init, xs, additional_inputs=()):
    init, xs = list(init), list(xs)
    rows = [Row(x) for x in xs]  # the combine function is traced on one row of each scanned input
    branches = trace_branches(Call("scan", where), ["combine function"], [combine_fn],
                              [*init, *rows, *additional_inputs], lambda ops: ops)
    if not branches.outputs[0].all_tensors:
        raise ExportError(f"scan at {where} cannot be exported: its combine function must return tensors only")
    out = _recorded("scan", where, "scan", branches.gms[0], init, xs, (*additional_inputs, *branches.extra_inputs()))
    return branches.outputs[0].rebuilt(out)


def _recorded(op: str, where: str, kind: str, *args):
    """The operator in the graph; torch's rule for its outputs refusing the
    branches (outputs of other dtypes, a body changing what it carries) said
    in terms of the user's call."""
    try:
        return CONTROL_FLOW(kind, *args)
    except (ExportError, *_torch.data_dependence_errors()):
        raise
    except (RuntimeError, AssertionError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"{op} at {where} cannot be exported: torch's rule for the operator's outputs "
                          f"refuses its branches: {first}") from e


_CAPTURES = {"cond": _cond, "while_loop": _while_loop, "map": _map, "scan": _scan}
