"""User inputs that share memory (``f(x, x)``, ``f(x, x[0])``), one of them mutated.

A program treats its inputs as distinct tensors; eager's ``f(x, x[0])`` that
updates ``x[0]`` in place changes ``x`` too. When example inputs share
elements of memory and one of them is mutated, the trace is made again with
each input of that group a view of one base covering them all, as
AOTAutograd's synthetic bases: every write goes through the base. The base
is the group's input that lays its elements densely from its storage's
start and reaches every other's (``x`` of ``f(x, x[0])``; the same tensor
twice: that tensor), written back once, its views' layout changes written
back each; where no input is such a base (``x[:3]`` and ``x[1:]``, two
``x[1:]``), a synthetic base, the storage from the first element an input
reaches to the last, made in the graph from the inputs' values, and each
input of the group written back. Inputs that share a storage but no element
(interleaved columns) are distinct. The program then holds for inputs
aliasing that way only, so ``ep.module()`` checks each call's inputs against
the pattern seen at export, when the program mutates a user input: a call
whose inputs alias otherwise (or, exported with distinct inputs, alias at
all) raises instead of computing as if they did not.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .. import _torch
from ..errors import ExportError


@dataclasses.dataclass(frozen=True)
class View:
    """Input ``of`` seen through ``as_strided(size, stride, offset)``. With
    ``base`` (``(start, end)``: elements of the storage the group shares), the
    view is of a synthetic base instead, those elements of the storage made
    from the values of the group's inputs (the view at ``offset - start``);
    ``of`` is then the group's first input."""

    of: int
    size: tuple
    stride: tuple
    offset: int
    base: tuple | None = None


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The storage elements ``t`` can reach: [first, last]."""
    last = t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)
    return t.storage_offset(), last


def storage(t: torch.Tensor):
    """Comparable handle of ``t``'s storage (fake tensors too)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage())


# the elements of two tensors compared one by one up to this many each; beyond, spans that meet overlap
_ELEMENTS_COMPARED = 1 << 16


def share_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` share an element of memory (see :func:`_overlap`)?"""
    return _overlap(a, b)


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` share an element of memory? Interleaved views of
    one base (``x[:, 0:2]``, ``x[:, 2:4]``) share none although their spans
    meet. Where the elements are too many to compare (or symbolic, or of
    different dtypes), spans that meet count as overlapping."""
    if a is b:
        return True
    if a.numel() == 0 or b.numel() == 0 or storage(a) != storage(b):
        return False
    (a0, a1), (b0, b1) = _byte_span(a), _byte_span(b)
    if not (a0 <= b1 and b0 <= a1):
        return False
    elements = _elements(a), _elements(b)
    if a.dtype != b.dtype or None in elements:
        return True
    return not elements[0].isdisjoint(elements[1])


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    first, last = _span(t)
    return first * t.element_size(), (last + 1) * t.element_size() - 1


def _elements(t: torch.Tensor) -> frozenset[int] | None:
    """The storage offsets of ``t``'s elements; None where too many or symbolic."""
    layout = (tuple(t.shape), tuple(t.stride()), t.storage_offset())
    if t.numel() > _ELEMENTS_COMPARED or not all(isinstance(v, int) for v in (*layout[0], *layout[1], layout[2])):
        return None
    return _offsets(*layout)


@functools.lru_cache(maxsize=64)  # a program checks the same layouts at every call
def _offsets(size: tuple, stride: tuple, offset: int) -> frozenset[int]:
    offsets = {offset}
    for n, s in zip(size, stride):
        offsets = {o + k * s for o in offsets for k in range(n)}
    return frozenset(offsets)


def _dense_from_start(t: torch.Tensor) -> bool:
    """Does ``t`` lay its elements densely from its storage's first one (a
    contiguous tensor, or a permutation of one)? Functionalization replays
    the views of such a tensor from its current value as eager takes them
    from its memory; a view of a tensor starting elsewhere, or with gaps,
    would be replayed from a value laid out otherwise once it is written."""
    if t.storage_offset() != 0:
        return False
    expected = 1
    for s, n in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n != 1):
        if s != expected:
            return False
        expected *= n
    return True


def views_of_covering_inputs(inputs: list, mutated=None) -> dict[int, View]:
    """Inputs (by position) that overlap another in memory -> how each is seen
    from the input whose span covers all of its group; ExportError where
    none covers (``x[:2]`` and ``x[1:]``). The same tensor twice: a view.
    Given ``mutated`` (positions), only groups holding one of them count:
    inputs that alias but are only read compute the same either way."""
    tensors = _tensors(inputs)
    views: dict[int, View] = {}
    for group in _groups(tensors, mutated):
        spans = {j: _span(tensors[j]) for j in group}
        low, high = min(s[0] for s in spans.values()), max(s[1] for s in spans.values())
        cover = next((j for j in group if spans[j] == (low, high)), None)
        if cover is None:
            raise ExportError(
                "inputs that partially overlap in memory (e.g. x[:2] and x[1:]) are passed: no one "
                "input holds all the memory they share, so none can be seen as a view of another")
        views.update(_seen_from(cover, group, tensors))
    return views


def aliased_inputs(inputs: list, mutated=None) -> dict[int, View]:
    """How the trace sees the inputs (by position) that share memory with
    another, in groups holding an input in ``mutated`` (positions; None:
    every group): each a view of one base covering the group, as
    AOTAutograd's synthetic bases. The base is the group's input whose
    elements lie densely from its storage's start and hold every other's
    (``f(x, x[0])``: ``x``); where none does (``x[:3]`` and ``x[1:]``, two
    ``x[1:]``), a synthetic base, the group's storage from the first element
    an input reaches to the last, made from the inputs' values, which every
    input of the group is a view of. The same tensor twice: one."""
    tensors = _tensors(inputs)
    views: dict[int, View] = {}
    for group in _groups(tensors, mutated):
        _refuse_mixed_dtypes(group, tensors)
        distinct = [j for j in group if not any(tensors[k] is tensors[j] for k in group if k < j)]
        low, high = min(_span(tensors[j])[0] for j in group), max(_span(tensors[j])[1] for j in group)
        cover = distinct[0] if len(distinct) == 1 else next(
            (j for j in distinct if _dense_from_start(tensors[j]) and _span(tensors[j])[1] == high), None)
        if cover is not None:
            views.update(_seen_from(cover, group, tensors))
        else:
            views.update({j: View(group[0], *_layout(tensors[j]), base=(low, high + 1)) for j in group})
    return views


def _seen_from(cover: int, group: list[int], tensors: dict) -> dict[int, View]:
    return {j: View(cover, *_layout(tensors[j])) for j in group if j != cover}


def _layout(t: torch.Tensor) -> tuple[tuple, tuple, int]:
    return tuple(t.shape), tuple(t.stride()), t.storage_offset()


def _tensors(inputs: list) -> dict[int, torch.Tensor]:
    return {i: t for i, t in enumerate(inputs)
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0}


def _groups(tensors: dict, mutated) -> list[list[int]]:
    """The groups of positions sharing memory, more than one input each
    (given ``mutated``, those holding one of them)."""
    groups, seen = [], set()
    for i in tensors:
        if i in seen:
            continue
        group = _group(i, tensors)
        seen |= set(group)
        if len(group) > 1 and (mutated is None or set(group) & set(mutated)):
            groups.append(group)
    return groups


def _refuse_mixed_dtypes(group: list[int], tensors: dict) -> None:
    dtypes = {tensors[j].dtype for j in group}
    if len(dtypes) > 1:
        raise ExportError(
            f"user inputs {', '.join(map(str, group))} share memory as different dtypes "
            f"({', '.join(sorted(str(d).removeprefix('torch.') for d in dtypes))}: a view(dtype) of another) "
            "and one of them is mutated in the forward: the program cannot see one's elements in the "
            "other's; pass distinct tensors")


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
    return {str(i): {k: v for k, v in dataclasses.asdict(view).items() if k != "base" or v is not None}
            for i, view in views.items()}


def check_inputs_alias_as_exported(views: dict, mutated: list, *inputs) -> None:
    """Raise unless ``inputs`` (a call's flat user inputs) overlap exactly as
    the example inputs did (``views``: :func:`to_json` of the export's), in
    the groups holding an input the program mutates (``mutated``: positions)."""
    if any(_is_traced(t) for t in inputs):
        _note_views_built(views, inputs)  # the program is being exported again: its example inputs decide
        return
    expected = _from_json(views)
    # the groups traced as aliasing count too (one mutated at first, maybe not in the end)
    traced = {p for i, v in expected.items() for p in (i, v.of)}
    try:
        found = aliased_inputs(list(inputs), sorted({*mutated, *traced}))
    except ExportError:
        found = None
    if found != expected:
        raise RuntimeError(
            "the inputs of this call share memory otherwise than the example inputs it was "
            f"exported with did (exported: {_describe(expected)}; this call: "
            f"{_describe(found)}), and the program mutates an input: it would compute as if "
            "they aliased as at export; export it again with inputs that alias as these do")


def repeated_inputs(leaves: list) -> dict[str, int]:
    """Per input leaf that is the same tensor as an earlier one (``f(x, x)``),
    that one's position: the trace reads one tensor for both (torch makes
    one fake tensor per tensor), so the program holds only for calls that
    repeat it too."""
    first: dict[int, int] = {}
    repeated = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if id(x) in first:
                repeated[str(i)] = first[id(x)]
            first.setdefault(id(x), i)
    return repeated


def check_inputs_repeated_as_exported(repeated: dict, *inputs) -> None:
    """Raise unless each input the example inputs gave as the same tensor as
    an earlier one (``repeated``: :func:`repeated_inputs`) is that one in
    this call too, or a tensor of its memory and layout."""
    if any(_is_traced(t) for t in inputs):
        return
    for i, j in repeated.items():
        a, b = inputs[int(i)], inputs[j]
        if a is not b and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _same_memory(a, b)):
            raise RuntimeError(
                f"inputs {j} and {i} of this call are two tensors, where the example inputs the program was "
                f"exported with gave one tensor for both (f(x, x)): the program reads one tensor for both; "
                "export it again with distinct tensors to call it with distinct ones")


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (storage(a) == storage(b) and a.storage_offset() == b.storage_offset()
            and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)


def _from_json(views: dict) -> dict[int, View]:
    return {int(i): View(v["of"], tuple(v["size"]), tuple(v["stride"]), v["offset"],
                         tuple(v["base"]) if v.get("base") is not None else None)
            for i, v in views.items()}


_BUILT = "_predispatch_seen_through_synthetic_base"


def _note_views_built(views: dict, inputs) -> None:
    """A program exported again: each traced input it sees through a
    synthetic base it builds itself is marked with that view."""
    for i, v in _from_json(views).items():
        if v.base is not None and _is_traced(inputs[i]):
            setattr(inputs[i], _BUILT, v)


def views_built_by_program(inputs: list) -> dict[int, View]:
    """The traced user inputs (by position) that the module, a program
    exported again, sees through a synthetic base it builds itself: how
    (the trace need not build one for them: it would be built twice)."""
    return {i: getattr(t, _BUILT) for i, t in enumerate(inputs) if hasattr(t, _BUILT)}


def _describe(views) -> str:
    if views is None:
        return "inputs sharing memory as different dtypes"
    if not views:
        return "no input overlaps another"
    return ", ".join(f"input {i} is a view of {_base_of(v, views)} (size {list(v.size)}, stride "
                     f"{list(v.stride)}, offset {v.offset})" for i, v in sorted(views.items()))


def _base_of(view: View, views: dict) -> str:
    if view.base is None:
        return f"input {view.of}"
    group = [j for j, v in sorted(views.items()) if v.base is not None and v.of == view.of]
    return f"the memory inputs {', '.join(map(str, group))} share"


def _is_traced(t) -> bool:
    return _torch.is_traced(t)
