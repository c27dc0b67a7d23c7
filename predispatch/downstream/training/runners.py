"""The compiled graphs at run time: autocast off inside them, and eager's ``None`` gradients.

The backward graph takes zeros for an output that got no gradient; a
gradient computed from such zeros only is ``None``, as eager's autograd
gives (:func:`run_backward`).
"""
from __future__ import annotations

import torch
import torch.fx

from ... import _torch
from ...ir import generator_ops


def run_forward(compiled):
    """The compiled forward (a function of one list of inputs), run with
    autocast's dispatch keys skipped: its casts are in the graph."""
    def run(args):  # AOTAutograd's boxed calling convention
        with _torch.autocast_skipped():
            return compiled(args)

    return _torch.boxed(run)


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _tangents_needed(gm: torch.fx.GraphModule) -> list[frozenset]:
    """Per output of the backward graph ``gm``, the positions (among its
    placeholders) of the tangents it is computed from."""
    needs = {n: frozenset([i]) if _torch.is_tangent(n) else frozenset()
             for i, n in enumerate(_placeholders(gm))}
    for node in gm.graph.nodes:
        if node.op not in ("placeholder", "output"):
            needs[node] = frozenset().union(*(needs[n] for n in node.all_input_nodes))
    (outputs,) = gm.graph.output_node().args
    return [needs[o] if isinstance(o, torch.fx.Node) else frozenset() for o in outputs]


class _Zeros:
    """Zeros for the tangents of a backward graph, laid out as it was traced
    for them; with symbolic sizes, as the sizes of this call bind them."""

    def __init__(self, gm: torch.fx.GraphModule):
        self.values = [n.meta.get("val") for n in _placeholders(gm)]
        self.symbolic = any(_torch.is_symbolic(v) for v in self.values)

    def __call__(self, i: int, args: list) -> torch.Tensor:
        val = self.values[i]
        shape, stride = val.shape, val.stride()
        if self.symbolic:
            bound = _torch.size_bindings(self.values, args)
            shape = [_torch.concrete(n, bound) for n in shape]
            stride = [_torch.concrete(n, bound) for n in stride]
        return torch.empty_strided(shape, stride, dtype=val.dtype, device=val.device).zero_()


def run_backward(gm: torch.fx.GraphModule, compiled):
    """The backward graph ``gm`` (``compiled``: it compiled, a function of one
    list of inputs), giving the gradients eager's autograd gives.

    Autograd calls the compiled backward with ``None`` for an output that got
    no gradient (:func:`_torch.pass_absent_gradients`, set on each call's
    node): an output left out of the loss, or the new value of a parameter or
    input written back under no_grad, which nothing differentiates. The graph
    takes zeros there; but a gradient computed from such tangents only is
    ``None``, since eager's autograd never reaches that parameter or input
    (left zeros, an optimizer would update a parameter eager's skips). A
    gradient that needs no tangent at all is left as computed."""
    tangents = [i for i, n in enumerate(_placeholders(gm)) if _torch.is_tangent(n)]
    needs, zeros = _tangents_needed(gm), _Zeros(gm)

    def run(args):  # AOTAutograd's boxed calling convention
        absent = {i for i in tangents if args[i] is None}
        for i in absent:
            args[i] = zeros(i, args)
        with _torch.autocast_skipped():
            grads = compiled(args)
        if not absent:
            return grads
        return type(grads)(None if need and need <= absent else g for g, need in zip(grads, needs))

    return _torch.boxed(run)


def without_dead_random_ops(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torch's default partitioner copies the forward's random ops into the
    backward, unused; run, each would draw from the generator once more per
    step than eager does (the next step's dropout masks would differ); so
    does it the forward's generator ops (a seed, a restore), and the reads
    of generator states they used."""
    for node in reversed(list(gm.graph.nodes)):  # users first: a read only they used goes too
        if (node.op == "call_function" and not node.users
                and (torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())
                     or node.target in generator_ops.READS)):
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()  # what computed their inputs (a layer norm recomputed for a dropout's shape)
    gm.recompile()
    return gm


class SharedBackwardFreedError(RuntimeError):
    """A backward reached a call's compiled backward after an earlier
    backward freed it (see :func:`run_as_eager_nodes`)."""


def run_as_eager_nodes(node) -> None:
    """The backward ``node`` of one compiled call, run where eager's nodes
    would run. It stands for all of the call's ops, where eager has a node
    per op: a backward from one output reaches every input the call took,
    and frees the node for all outputs at once. So, once freed by an
    earlier backward:

    - reached with no gradient at all (``None`` for every output; through
      the history of a buffer the call wrote, from a later step's backward),
      it returns ``None`` for every input, as eager's nodes there compute
      nothing;
    - reached with a gradient (two outputs' losses given backward() one
      after the other), the error says why, and what to do."""
    ran = []  # a backward of this call has finished: only then can an earlier one have freed it

    def run(apply, grads: list):
        unreached = all(g is None for g in grads)  # before apply, which may empty the list
        try:
            result = apply(grads)
        except RuntimeError:
            # AOTAutograd frees what the call saved before its backward runs: a
            # failing first backward (a kernel's error) finds it freed too
            if not ran or not _torch.saved_tensors_freed(node):
                raise
            if unreached:
                return (None,) * _torch.inputs_of_node(node)
            raise SharedBackwardFreedError(
                "compile_training: this backward reaches a call of the compiled module whose backward an earlier "
                "backward already ran and freed. The call's outputs share one backward (the compiled graph), where "
                "eager's ops have one each: give backward() the sum of the losses at once, or retain_graph=True "
                "to the earlier backward()") from None
        ran.append(True)
        return result

    _torch.backward_node_wrapped(node, run)
