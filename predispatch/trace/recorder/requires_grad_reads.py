"""``t.requires_grad`` of a tensor the forward made, answered as eager's.

Above autograd, a traced tensor made by an op has no history, and reads
``requires_grad`` False where eager's requires grad: ``self.w.reshape(-1)``
of a parameter that does. A branch on it then takes the other path, and may
lose a gradient: torch's ``F.linear_cross_entropy`` passes
``weight.requires_grad`` to its op as "compute the weight's gradient". The
answer is eager's, read from the graph made so far: a tensor requires grad
where an op made it in grad mode from one that does (a floating result of a
differentiable op), or it was made to (``requires_grad_()``). A parameter's
or input's own flag answers for it while it is set; where it is not, an
in-place update in grad mode from a tensor that requires grad makes it
require grad, as in eager.
"""
from __future__ import annotations

import functools

import torch
import torch.fx

from ... import _torch
from ...errors import user_location
from ...ir import ops

_aten = torch.ops.aten
# ops whose results eager's autograd never tracks, whatever their inputs
_NOT_DIFFERENTIABLE = frozenset({
    _aten.detach.default, _aten.zeros_like.default, _aten.ones_like.default, _aten.empty_like.default,
    _aten.full_like.default, _aten.rand_like.default, _aten.randn_like.default, _aten.randint_like.default,
    _aten.new_zeros.default, _aten.new_ones.default, _aten.new_empty.default, _aten.new_full.default,
    _aten.new_empty_strided.default, _aten.lift_fresh_copy.default,
})


def answered_as_eager(tensors, state):
    """While the forward is traced, ``t.requires_grad`` of a traced tensor is
    eager's; ``tensors``: the parameters, buffers and inputs. Each read whose
    answer a call's tensors decide (theirs, or one made from them) is noted
    in the record with the tensors (``requires_grad_reads``): the program
    holds the branch the example's took, and checks each call's."""
    keys = {n: key for x in tensors if (key := state.graph_inputs.get(id(x))) is not None
            and (n := _torch.current_node(x)) is not None}  # their placeholders, before any update
    return _torch.requires_grad_answered(functools.partial(_as_eager, tensors, keys, state.record))


def _as_eager(tensors, keys: dict, record, t) -> bool:
    node = _torch.current_node(t)
    if _torch.TENSOR_REQUIRES_GRAD.__get__(t):  # a parameter's or input's flag, a tensor made to require grad
        answer = True
    elif node is None:
        return False
    else:
        # where the state and inputs that require grad are now (read rarely: looked up when read)
        roots = {n for x in tensors if isinstance(x, _torch.FunctionalTensor)
                 and _torch.TENSOR_REQUIRES_GRAD.__get__(x) and (n := _torch.current_node(x)) is not None}
        answer = _requiring_grad(node, roots)
    if node is not None:
        _note_read(record, _decided_by(node, keys), answer)
    return answer


def _note_read(record, sources: set, answer: bool) -> None:
    """A read the call's tensors ``sources`` decide (none made to require grad: that one's answer is fixed)."""
    if sources and _MADE_TO_REQUIRE_GRAD not in sources:
        read = {"where": user_location(), "sources": sorted(sources), "answer": answer}
        if read not in record.requires_grad_reads:
            record.requires_grad_reads.append(read)


_MADE_TO_REQUIRE_GRAD = object()


def _decided_by(target: torch.fx.Node, keys: dict) -> set:
    """The keys of the parameters, buffers and inputs whose ``requires_grad``
    decides eager's ``requires_grad`` of ``target`` (as :func:`_requiring_grad`
    reads the graph, from every one of them), with ``_MADE_TO_REQUIRE_GRAD``
    where a tensor made to require grad does."""
    if target in keys:  # the tensor's own flag (read before any update of it)
        return {keys[target]}
    grad_mode, reach = True, {}
    for node in target.graph.nodes:
        if node in keys:
            reach[node] = {keys[node]}
        elif node.op == "call_function":
            if node.target is _torch.SET_GRAD_ENABLED:
                grad_mode = bool(node.args[0])
            elif node.target is ops.REQUIRES_GRAD:
                reach[node] = {_MADE_TO_REQUIRE_GRAD}
            elif grad_mode and _differentiable(node):
                reach[node] = set().union(*(reach.get(i, ()) for i in node.all_input_nodes))
        if node is target:
            return reach.get(node, set())
    return set()


def _requiring_grad(target: torch.fx.Node, roots: set) -> bool:
    """Does eager's tensor of ``target`` require grad? The graph read in order
    up to it, each node's grad mode the last switch's before it; ``roots``:
    the nodes of the state and inputs that require grad."""
    grad_mode, requiring = True, set(roots)
    for node in target.graph.nodes:
        if node.op == "call_function":
            if node.target is _torch.SET_GRAD_ENABLED:
                grad_mode = bool(node.args[0])
            elif node.target is ops.REQUIRES_GRAD or (
                    grad_mode and _differentiable(node) and any(i in requiring for i in node.all_input_nodes)):
                requiring.add(node)
        if node is target:
            return node in requiring
    return False


def _differentiable(node: torch.fx.Node) -> bool:
    if node.target in _NOT_DIFFERENTIABLE:
        return False
    return any(isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
               for v in _torch.pytree.tree_leaves(node.meta.get("val")))
