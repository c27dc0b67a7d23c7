"""Tensors a Function's forward or backward updates in place: where the op keeps their new values, what is refused.

Each subgraph is functional: the pipeline traces an update of one of its
inputs as a new value, which the capture moves to the subgraph's last
outputs (:class:`.subgraphs.FunctionBody`'s ``updated``).

* The forward's updates of its inputs become op outputs after the
  Function's own (``updates``; :mod:`.results` writes them to the caller's
  tensors), but for inputs marked dirty, which are the Function's outputs.
* The backward's updates of its gradients and saved tensors stay its
  results after the gradients (``backward_updates``): at run time the op's
  autograd.Function writes them to the tensors its backward was given, as
  eager's backward writes them (a saved input is the caller's tensor).

Refused, where the program could not write what eager writes: a saved
tensor the backward updates that is an input the forward updated (eager's is
the caller's tensor, the op's its new value), and an update of memory
another input of the same subgraph reads (the subgraph's inputs are
separate tensors to its trace).
"""
from __future__ import annotations

import torch

from ... import _torch
from .ctx import refused


def place_forward_updates(fwd: torch.fx.GraphModule, state: dict, updated: list[int]) -> None:
    """The new values of the inputs the forward updates (its graph's last
    outputs) made the op's outputs after the Function's own, non-differentiable;
    those marked dirty, the Function's outputs already, dropped. The op's
    outputs: ``num_outputs``; those inputs: ``updates``; all the forward
    updates: ``updated``."""
    n = state["tensor_outputs"]
    dirty = {r.input for r in state["returned"] if r.dirty}
    values = list(fwd.graph.output_node().args[0])
    own, saved, new = values[:n], values[n:len(values) - len(updated)], values[len(values) - len(updated):]
    kept = [(j, v) for j, v in zip(updated, new) if j not in dirty]
    values = list(own)
    for _, v in kept:  # each output its own tensor: one marked non-differentiable is not another
        if v in values:
            with fwd.graph.inserting_before(fwd.graph.output_node()):
                alias = fwd.graph.call_function(torch.ops.aten.alias.default, (v,))
            alias.meta.update(v.meta)
            v = alias
        values.append(v)
    fwd.graph.output_node().args = ((*values, *saved),)
    fwd.recompile()
    state["updates"] = [j for j, _ in kept]
    state["updated"] = list(updated)
    state["num_outputs"] = n + len(kept)
    state["non_differentiable"] = [*state["non_differentiable"], *range(n, n + len(kept))]


def refuse_unsound_updates(tensors: list, fwd: torch.fx.GraphModule, state: dict, name: str, where: str) -> None:
    """Refuse what the module docs say is refused (``tensors``: the op's
    inputs in the caller's trace; ``state["saved_updated"]``: the saved
    tensors the backward updates, by position)."""
    for j in state["updated"]:
        if any(i != j and _torch.shares_storage(t, tensors[j]) for i, t in enumerate(tensors)):
            raise refused(name, where, (
                "its forward updates in place an input that shares memory with another of its "
                "inputs, which its graph would read as it was: cannot be exported soundly; pass "
                "a clone"))
    values = list(fwd.graph.output_node().args[0])
    n, own = state["num_outputs"], state["tensor_outputs"]
    new = {values[r.output] for r in state["returned"] if r.dirty} | set(values[own:n])
    new = {v.meta["val"] for v in new if v.op != "placeholder"}  # (an input returned dirty as it came is the caller's)
    inputs = [p.meta["val"] for p in fwd.graph.nodes if p.op == "placeholder"][:len(tensors)]
    saved = [v.meta.get("val") for v in values[n:]]
    for s in state["saved_updated"]:
        if any(_torch.same_storage(saved[s], v) for v in new):
            raise refused(name, where, (
                "its backward updates in place a tensor it saved that is an input its forward "
                "updated in place: eager's backward writes the caller's tensor, the program's a "
                "copy; save and update a clone"))
        if _shares_memory_with_another(s, saved, inputs, tensors):
            raise refused(name, where, (
                "its backward updates in place a tensor it saved that shares memory with another "
                "tensor it saved, which its graph would read as it was: cannot be exported "
                "soundly; save and update a clone"))


def _shares_memory_with_another(s: int, saved: list, inputs: list, tensors: list) -> bool:
    """Does saved tensor ``s`` share memory with another saved tensor at run
    time: in the forward's trace, or as views of inputs sharing memory?"""
    def input_of(value):
        return next((j for j, x in enumerate(inputs) if _torch.same_storage(value, x)), None)

    mine = input_of(saved[s])
    for k, other in enumerate(saved):
        if k == s or not isinstance(other, torch.Tensor):
            continue
        if _torch.same_storage(saved[s], other):
            return True
        theirs = input_of(other)
        if mine is not None and theirs is not None and _torch.shares_storage(tensors[mine], tensors[theirs]):
            return True
    return False
