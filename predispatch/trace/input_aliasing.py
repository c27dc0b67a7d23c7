"""User inputs that share memory (``f(x, x)``, ``f(x, x[0])``), one of them mutated.

A program treats its inputs as distinct tensors; eager's ``f(x, x[0])`` that
updates ``x[0]`` in place changes ``x`` too. When the example inputs overlap
in memory and one of them is mutated, the trace is made again with each
overlapping input a view of the one covering them all (the same tensor
twice: that tensor), as eager sees them: a mutation through either is a
mutation of the covering input, written back once, to it. The program then
holds for inputs aliasing that way only, so ``ep.module()`` checks each
call's inputs against the pattern seen at export, when the program mutates a
user input: a call whose inputs alias otherwise (or, exported with distinct
inputs, alias at all) raises instead of computing as if they did not.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _torch
from ..errors import ExportError


@dataclasses.dataclass(frozen=True)
class View:
    """Input ``of`` seen through ``as_strided(size, stride, offset)``."""

    of: int
    size: tuple
    stride: tuple
    offset: int


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The storage elements ``t`` can reach: [first, last]."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.storage_offset(), last


def storage(t: torch.Tensor):
    """Comparable handle of ``t``'s storage (fake tensors too)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0 or storage(a) != storage(b):
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 <= b1 and b0 <= a1


def views_of_covering_inputs(inputs: list, mutated=None) -> dict[int, View]:
    """Inputs (by position) that overlap another in memory -> how each is seen
    from the input whose span covers all of its group; ExportError where
    none covers (``x[:2]`` and ``x[1:]``). The same tensor twice: a view.
    Given ``mutated`` (positions), only groups holding one of them count:
    inputs that alias but are only read compute the same either way."""
    tensors = {i: t for i, t in enumerate(inputs)
               if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0}
    views: dict[int, View] = {}
    seen: set[int] = set()
    for i in tensors:
        if i in seen:
            continue
        group = _group(i, tensors)
        seen |= set(group)
        if len(group) == 1 or (mutated is not None and not set(group) & set(mutated)):
            continue
        spans = {j: _span(tensors[j]) for j in group}
        low, high = min(s[0] for s in spans.values()), max(s[1] for s in spans.values())
        cover = next((j for j in group if spans[j] == (low, high)), None)
        if cover is None:
            raise ExportError(
                "inputs that partially overlap in memory (e.g. x[:2] and x[1:]) are passed and "
                "one is mutated in the forward: no one input holds all the memory they share, so "
                "the program cannot see their aliasing; pass the tensor they are views of instead")
        for j in group:
            if j != cover:
                t = tensors[j]
                views[j] = View(cover, tuple(t.shape), tuple(t.stride()), t.storage_offset())
    return views


def _group(i: int, tensors: dict) -> list[int]:
    """``i`` and every input overlapping it, directly or through another."""
    group, todo = [i], [i]
    while todo:
        a = tensors[todo.pop()]
        for j, b in tensors.items():
            if j not in group and _overlap(a, b):
                group.append(j)
                todo.append(j)
    return sorted(group)


def refuse_moved_cover(cover: int, where: str | None) -> None:
    """An input that others view, given other memory by the module's
    ``set_()`` (at ``where``; None: not), its old memory written in the
    forward: eager leaves what the forward wrote there, where the other
    inputs see it, and the program holds the old memory's values nowhere
    once the input moved on."""
    if where is not None:
        raise ExportError(
            f"user input {cover}, which other inputs of the call view (f(x, x[0])), is given "
            f"other memory (set_()) at {where}: the views keep its old memory and what the "
            "forward wrote there, which the program cannot write back once the input moved "
            "on; pass distinct tensors, or set_ a clone")


def refuse_relaid_cover(cover: int, view: int, reshaped: bool, where: str | None) -> None:
    """Input ``view`` returned as it is, the input ``cover`` it views given
    another shape by the module (``reshaped``; ``where``: the set_() that
    did, if one did): eager regenerates the view's history through the
    cover's new layout, for the cover's gradient of the new shape, which
    the program's write-back cannot reproduce."""
    if reshaped:
        raise ExportError(
            f"user input {view}, a view of user input {cover} (f(x, x[0])), is returned as it is "
            f"while input {cover} is given another shape{f' at {where}' if where else ''}: eager "
            "regenerates the view's history through the new layout, which the program cannot "
            "reproduce; pass distinct tensors, or return a copy of the view")


def to_json(views: dict[int, View]) -> dict:
    return {str(i): dataclasses.asdict(v) for i, v in views.items()}


def check_inputs_alias_as_exported(views: dict, mutated: list, *inputs) -> None:
    """Raise unless ``inputs`` (a call's flat user inputs) overlap exactly as
    the example inputs did (``views``: :func:`to_json` of the export's), in
    the groups holding an input the program mutates (``mutated``: positions)."""
    if any(_is_traced(t) for t in inputs):
        return  # the program is being exported again: its example inputs decide
    expected = {int(i): View(**v) for i, v in views.items()}
    # the groups traced as aliasing count too (one mutated at first, maybe not in the end)
    traced = {p for i, v in expected.items() for p in (i, v.of)}
    try:
        found = views_of_covering_inputs(list(inputs), sorted({*mutated, *traced}))
    except ExportError:
        found = None
    if found != expected:
        raise RuntimeError(
            "the inputs of this call share memory otherwise than the example inputs it was "
            f"exported with did (exported: {_describe(expected)}; this call: "
            f"{_describe(found)}), and the program mutates an input: it would compute as if "
            "they aliased as at export; export it again with inputs that alias as these do")


def _describe(views) -> str:
    if views is None:
        return "inputs partially overlapping"
    if not views:
        return "no input overlaps another"
    return ", ".join(f"input {i} is a view of input {v.of}" for i, v in sorted(views.items()))


def _is_traced(t) -> bool:
    return _torch.is_traced(t)
