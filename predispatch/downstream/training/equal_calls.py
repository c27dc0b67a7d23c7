"""Equal calls merged: an aten op called twice on the same values computes it once.

The joint graph of a training step repeats work eager repeats: under
autocast, the three projections of an attention each cast the same
activation to bf16, and the forward saves each cast for the backward. One
cast serves them all (the values are equal: a pure op of equal arguments),
saves one tensor instead of three, and the backward is unchanged, node for
node (it reads the saved values, which are equal). inductor's backend gets
this from AOTAutograd's own pass; the op-by-op backends get it here,
without importing inductor.

What is merged: aten ops whose schema writes nothing (views too: two equal
views of one tensor are one), that draw nothing and whose result is defined (not ``empty``'s
memory), and ``getitem`` of them. A write (an op whose schema mutates, or
a call that is not an aten op) starts a new epoch: a call after it is not
merged with one before. A value a graph output shares memory with is not
merged: eager returns tensors of their own.
"""
from __future__ import annotations

import operator

import torch
import torch.fx

from ... import _torch

_UNDEFINED = frozenset({"empty", "empty_like", "empty_strided", "empty_permuted", "new_empty",
                        "new_empty_strided"})  # their memory is whatever was there: two are not equal


def _writes_nothing(target) -> bool:
    """An aten op whose schema writes nothing."""
    return _torch.op_library(target) == "aten" and _torch.is_functional_overload(target)


def _mergeable(node: torch.fx.Node) -> bool:
    target = node.target
    if target is operator.getitem:
        return True
    return (_writes_nothing(target) and torch.Tag.nondeterministic_seeded not in target.tags
            and _torch.op_name_parts(target)[1] not in _UNDEFINED)


def _writes(node: torch.fx.Node) -> bool:
    """May ``node`` change a value another node reads (so calls after it differ)?"""
    if node.op != "call_function" or node.target is operator.getitem or _is_arithmetic(node.target):
        return False
    return not _writes_nothing(node.target)


def _is_arithmetic(target) -> bool:
    """Python arithmetic on sizes (``operator.mul``, ``math.floor``): writes nothing."""
    return getattr(target, "__module__", None) in ("_operator", "math")


def _hashable(value):
    """An argument as a key: equal keys, equal arguments; TypeError where it has none."""
    if isinstance(value, torch.fx.Node):
        return ("node", value)  # an earlier merged call's users read the one kept: same node, same value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, *(_hashable(v) for v in value))
    if isinstance(value, dict):
        return ("dict", *((k, _hashable(v)) for k, v in sorted(value.items())))
    if isinstance(value, float) and value != value:
        raise TypeError("nan")  # never equal to itself: no key
    hash(value)
    return (type(value).__name__, value)


def _tensors(val) -> list:
    """The tensors of a node's value (one, or a multi-output op's)."""
    if isinstance(val, torch.Tensor):
        return [val]
    return [t for t in val if isinstance(t, torch.Tensor)] if isinstance(val, (list, tuple)) else []


def _returned(graph: torch.fx.Graph) -> tuple[set, set]:
    """The memory of the values the graph returns, and the multi-output calls it returns a result of."""
    outputs = graph.output_node().all_input_nodes
    memory = {_torch.memory_of(t) for n in outputs for t in _tensors(n.meta.get("val"))}
    return memory, {n.args[0] for n in outputs if n.target is operator.getitem}


def merge_equal_calls(graph: torch.fx.Graph) -> int:
    """Each call equal to an earlier one (same op, same arguments, no write
    between them) replaced by it; returns how many were."""
    returned, calls_returned = _returned(graph)
    seen: dict = {}
    epoch = merged = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if _writes(node):
            epoch += 1
            continue
        memory = {_torch.memory_of(t) for t in _tensors(node.meta.get("val"))}
        if not _mergeable(node) or node in calls_returned or memory & returned:
            continue
        try:
            key = (epoch, node.target, _hashable(node.args), _hashable(node.kwargs))
            earlier = seen.setdefault(key, node)
        except TypeError:  # an argument without equality (a nan, an object)
            continue
        if earlier is not node:
            node.replace_all_uses_with(earlier)
            graph.erase_node(node)
            merged += 1
    return merged
