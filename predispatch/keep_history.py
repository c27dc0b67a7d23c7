"""Keep eager's autograd history for tensors mutated under no_grad.

In eager mode a tensor that requires grad and is mutated in place under
``torch.no_grad()`` keeps its ``grad_fn``: later uses send their gradient
through what it was before the mutation. Functionalization turns the new
value into a fresh tensor computed under no_grad, which would silently drop
that gradient. After each grad-disabled span we therefore rebind such values
to ``predispatch.keep_history(old, new)``: the value of ``new``, the autograd
history of ``old`` (identity gradient to ``old``, none to ``new``).
"""
from __future__ import annotations

import torch
import torch.fx
from torch.export.graph_signature import InputKind

from . import _torch
from .errors import ExportError
from .trace_events import NO_GRAD_VIEW_REPLAY


@torch.library.custom_op("predispatch::keep_history", mutates_args=())
def keep_history(old: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``new``'s value with ``old``'s autograd history."""
    return new.clone()


@keep_history.register_fake
def _(old, new):
    return torch.empty_like(new)


def _backward(ctx, grad):
    return grad, None


keep_history.register_autograd(_backward)

KEEP_HISTORY = torch.ops.predispatch.keep_history.default
_NO_HISTORY = (torch.ops.aten.detach.default,)  # ops whose result never requires grad


def _is_float(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in vals)


def may_require_grad(gm: torch.fx.GraphModule, signature, params_requiring_grad: set[str]):
    """Nodes whose value may require grad at run time, over the flat graph.

    Parameters as in the module, floating user inputs always (the program may
    be called with inputs that require grad), buffers and constants never;
    a computed value if it is floating, grad mode is on and an input may."""
    specs = {s.arg.name: s for s in signature.input_specs if hasattr(s.arg, "name")}
    grad_on, result = True, set()
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            spec = specs.get(node.name)
            kind = spec.kind if spec is not None else None
            requires = (kind == InputKind.PARAMETER and spec.target in params_requiring_grad) or (
                kind == InputKind.USER_INPUT and _is_float(node))
        elif node.target is _torch.SET_GRAD_ENABLED:
            grad_on = bool(node.args[0])
            continue
        elif node.op == "call_function":
            requires = grad_on and node.target not in _NO_HISTORY and _is_float(node) and any(
                i in result for i in node.all_input_nodes)
        else:
            requires = False
        if requires:
            result.add(node)
    return result


def _insert_keep_history(graph, old, new, after, position) -> torch.fx.Node | None:
    """``keep_history(old, new)`` right after ``after``; later uses of ``new``
    read it. None if nothing reads ``new`` later (no node, no region output)."""
    after_at = position.get(after, len(position))
    if not any(position.get(u, after_at + 1) > after_at for u in new.users):
        return None
    with graph.inserting_after(after):
        kept = graph.create_node("call_function", KEEP_HISTORY, (old, new), name="keep_history")
    kept.meta.update({k: v for k, v in new.meta.items() if k in ("val", "stack_trace", "nn_module_stack")})
    for user in list(new.users):
        if (user is not kept and position.get(user, after_at + 1) > after_at
                and not user.meta.get(NO_GRAD_VIEW_REPLAY)):
            user.replace_input_with(new, kept)
    return kept


def _alive(node: torch.fx.Node, graph: torch.fx.Graph) -> bool:
    return node.graph is graph and not getattr(node, "_erased", False)


def _same_layout(a: torch.fx.Node, b: torch.fx.Node) -> bool:
    va, vb = a.meta.get("val"), b.meta.get("val")
    return (isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor)
            and va.dtype == vb.dtype and va.shape == vb.shape)


def keep_history_pass(gm: torch.fx.GraphModule, replacements, analyze) -> list[torch.fx.Node]:
    """Insert keep_history after each span that replaced a value that may
    require grad; later uses read it. ``analyze()`` gives the nodes that may
    require grad; it is asked again after each insertion (a value computed
    from a kept one may now require grad). Returns the inserted nodes."""
    graph = gm.graph
    may_grad = analyze()
    position = {n: i for i, n in enumerate(graph.nodes)}
    history_of = {}  # a replaced value -> the node whose autograd history it carries
    kept = []
    for r in replacements:
        if not (_alive(r.old, graph) and _alive(r.new, graph) and _alive(r.exit, graph)):
            continue
        if r.detached_alias_at is not None and any(o in may_grad for o in r.operands):
            # eager gives the alias itself the autograd history of this update,
            # which functionalization's detach view replay drops
            raise ExportError(
                "an in-place update of a detached alias (x.detach().add_(y)) with an operand "
                "that requires grad cannot be exported soundly: eager gives the alias a "
                f"gradient history that the functional graph cannot carry; at {r.detached_alias_at}")
        old = history_of.get(r.old, r.old)  # mutated again later: chain to the first old
        if not (old in may_grad or old in kept) or not _same_layout(old, r.new):
            continue
        node = _insert_keep_history(graph, old, r.new, r.exit, position)
        history_of[r.new] = old if node is None else node  # None: no later use needs it
        if node is not None:
            kept.append(node)
            position = {n: i for i, n in enumerate(graph.nodes)}
            may_grad = analyze()
    return kept
