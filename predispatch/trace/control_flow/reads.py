"""What a branch reads besides its operands: parameters, buffers and traced tensors of its closure.

torch.export lifts them as extra operands of the operator (its subgraphs
take every tensor they read as an input). A branch is traced apart from the
forward, so each such tensor the branch can reach — the state of the modules
it is a method of or closes over, the traced tensors in its closure cells —
is given to it as an input of its own, swapped in where the branch finds it
(:func:`swapped_in`); the capture keeps those the traced branches used.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types

import torch

from ... import _torch
from ...errors import is_library_file


@dataclasses.dataclass
class Read:
    """A tensor of the forward's trace a branch may read: ``outer``, found
    in ``places`` (a closure cell; a cell and the key of the list, tuple or
    dict it holds; a module and the state's dotted name)."""

    name: str  # the branch's placeholder for it
    outer: torch.Tensor
    places: list = dataclasses.field(default_factory=list)


def reads_of(functions) -> list[Read]:
    """The traced tensors ``functions`` can reach besides their arguments, each once."""
    found: dict[int, Read] = {}

    def note(tensor, name, place):
        read = found.setdefault(id(tensor), Read(name, tensor))
        read.places.append(place)

    for kind, obj, name in _sources(functions):
        if kind == "cell":
            note(obj.cell_contents, name, obj)
            continue
        if kind == "held":  # a tensor in a list, tuple or dict of a closure cell
            cell, key = obj
            note(cell.cell_contents[key], name, (cell, key))
            continue
        for prefix, named in (("p", obj.named_parameters()), ("b", obj.named_buffers())):
            for dotted, t in named:
                if _torch.is_traced(t):
                    note(t, f"{prefix}_{dotted.replace('.', '_')}", (obj, dotted))
    return list(found.values())


def _sources(functions, depth: int = 0):
    """(``"module"``, module, "") and (``"cell"``, cell, its variable name):
    where a function finds state, through its ``self``, its closure, the
    functions it closes over and ``functools.partial``."""
    for fn in functions:
        if not callable(fn):
            continue
        if isinstance(fn, torch.nn.Module):
            yield "module", fn, ""
            continue
        if isinstance(fn, functools.partial):  # torch's map wraps the body so: f=body
            yield from _sources([fn.func, *fn.args, *fn.keywords.values()], depth)
            continue
        owner = getattr(fn, "__self__", None)
        if isinstance(owner, torch.nn.Module):
            yield "module", owner, ""
        code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars if code else (), cells):
            try:
                value = cell.cell_contents
            except ValueError:  # not yet bound
                continue
            if isinstance(value, torch.Tensor) and _torch.is_traced(value) or isinstance(value, torch.SymInt):
                yield "cell", cell, name  # a traced tensor, or a symbolic size (an int input's)
            elif isinstance(value, (list, tuple, dict)):
                for key, held in (value.items() if isinstance(value, dict) else enumerate(value)):
                    if isinstance(held, torch.Tensor) and _torch.is_traced(held):
                        yield "held", (cell, key), f"{name}_{key}"
            elif isinstance(value, torch.nn.Module):
                yield "module", value, ""
            elif isinstance(value, (types.FunctionType, types.MethodType, functools.partial)) and depth < 4:
                yield from _sources([value], depth + 1)


def user_functions(fn, depth: int = 0) -> list:
    """The user's functions ``fn`` is or wraps (torch's own wrappers, such as
    while_loop's ``flat_body_fn``, hold the user's in their closure; a
    module's ``forward``; ``functools.partial``), outermost first."""
    if isinstance(fn, torch.nn.Module):
        fn = fn.forward
    if isinstance(fn, functools.partial):
        return user_functions(fn.func, depth)
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    if code is None or depth > 4:
        return []
    if not is_library_file(code.co_filename):
        return [fn]
    found = []
    for cell in getattr(getattr(fn, "__func__", fn), "__closure__", None) or ():
        try:
            value = cell.cell_contents
        except ValueError:  # not yet bound
            continue
        if callable(value) and not isinstance(value, type):
            found += user_functions(value, depth + 1)
    return found


@contextlib.contextmanager
def swapped_in(reads: list[Read], inner: list[torch.Tensor]):
    """Until exit, each read's places hold the branch's own input for it."""
    with contextlib.ExitStack() as stack:
        by_module: dict[int, tuple] = {}
        for read, value in zip(reads, inner):
            for place in read.places:
                if isinstance(place, types.CellType):
                    stack.enter_context(_cell_holding(place, value))
                elif isinstance(place[0], types.CellType):
                    stack.enter_context(_cell_holding(place[0], _with(place[0].cell_contents, place[1], value)))
                else:
                    module, dotted = place
                    by_module.setdefault(id(module), (module, {}))[1][dotted] = value
        for module, state in by_module.values():
            stack.enter_context(_torch.reparametrize_module(module, state, strict=False))
        yield


def _with(container, key, value):
    """A copy of a list, tuple or dict with ``value`` at ``key``: the
    user's container itself is left as it is."""
    if isinstance(container, dict):
        return {**container, key: value}
    items = list(container)
    items[key] = value
    return type(container)(items) if isinstance(container, list) else tuple(items)


@contextlib.contextmanager
def _cell_holding(cell: types.CellType, value):
    previous = cell.cell_contents
    cell.cell_contents = value
    try:
        yield
    finally:
        cell.cell_contents = previous
