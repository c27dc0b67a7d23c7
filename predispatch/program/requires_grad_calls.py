"""The ``requires_grad`` the forward read, checked at each call.

A Python branch on ``t.requires_grad`` (an input's, a parameter's, or a
tensor's made from them: ``F.linear_cross_entropy`` passes
``weight.requires_grad`` to its op as "compute the weight's gradient") is
traced as the example's tensors took it. Where a call's tensors answer
otherwise, eager takes another path, and the program would compute what it
computes, silently: ``ep.module()`` (and ``compile_training``, for each
kind of call) raises instead, naming the line. The answer is made again
from the call's parameters, buffers and inputs the read depended on (see
:mod:`predispatch.trace.recorder.requires_grad_reads`); the grad mode of a
read the caller's mode decides is the traced one (grad on).
"""
from __future__ import annotations

import torch

from .. import _torch


class RequiresGradCallError(RuntimeError):
    """A call whose tensors' ``requires_grad`` would take another branch than traced."""


def check_requires_grad_reads(reads: list, tensors: dict) -> None:
    """``tensors``: key (``"input:<flat position>"``, ``"param:<name>"``, ...) -> the call's tensor."""
    for read in reads:
        now = any(isinstance(t := tensors.get(key), torch.Tensor) and t.requires_grad for key in read["sources"])
        if now != read["answer"]:
            raise RequiresGradCallError(
                f"the forward read requires_grad at {read['where']}; the example's tensors answered "
                f"{read['answer']}, this call's ({', '.join(read['sources'])}) answer {now}: eager takes another "
                "path there, and the program holds the example's. Export with example tensors that require "
                "grad as the calls' do")


_torch.mark_side_effectful(check_requires_grad_reads)


def check_requires_grad_at_calls(unlifted: torch.fx.GraphModule, reads: list | None) -> None:
    """``ep.module()`` first checks the reads against the call's tensors."""
    if not reads:
        return
    graph = unlifted.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    attrs = {n.target: n for n in graph.nodes if n.op == "get_attr"}  # the state's, read once each
    keys = {key for read in reads for key in read["sources"]}
    with graph.inserting_before(next(n for n in graph.nodes if n.op not in ("placeholder", "get_attr"))):
        tensors = {key: _node_of(graph, inputs, attrs, key) for key in sorted(keys)}
        graph.call_function(check_requires_grad_reads, ([dict(r) for r in reads], tensors))
    unlifted.recompile()


def _node_of(graph: torch.fx.Graph, inputs: list, attrs: dict, key: str) -> torch.fx.Node:
    position, name = _parsed(key)
    if position is not None:
        return inputs[position]
    return attrs[name] if name in attrs else graph.get_attr(name)


def call_tensors(module: torch.nn.Module, leaves: list, reads: list) -> dict:
    """The tensors of a call (flat ``leaves``, ``module``'s state) the reads name, by key."""
    def tensor(key: str):
        position, name = _parsed(key)
        if position is not None:
            return leaves[position]
        return module.get_parameter(name) if key.startswith("param:") else module.get_buffer(name)
    return {key: tensor(key) for read in reads for key in read["sources"]}


def _parsed(key: str) -> tuple[int | None, str]:
    """(an input's flat position, or None; the state's name) of a key as the record writes it."""
    kind, name = key.split(":", 1)
    return (int(name), name) if kind == "input" else (None, name)
