"""Layers that differ only in float constants, stamped from one template.

Stochastic depth gives each layer its own drop rate: the same ops on the same
tensors, another float at a few of them. Two calls of a key whose replay logs
differ only in float arguments, and whose traced graphs differ only in float
arguments, make a :class:`Parametric` template: each float of the first
call's graph that the second call's has otherwise (a *hole*) is traced back
to the logged floats that hold its value in both calls (a rate passed to the
op unchanged; ``dropout(p)`` puts ``1 - p`` in the graph, which has no such
source: its layers are traced). A later call whose log differs from the first
call's only at floats that differed between the two is stamped from the first
call's template, its own values in the holes, where its differing torch calls
dispatch the same aten ops as the first call's: a value may pick another
decomposition (dropout at ``p=0`` is no op), and then the call is traced.

Logs are :class:`predispatch.trace.layer_reuse._CallLog`'s encodings: a float
is ``(float, value)``, every other leaf compared as it is.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _torch


@dataclasses.dataclass
class Parametric:
    """A template whose holes take each call's floats."""

    template: object  # the first call's template (layer_reuse._Template)
    log: tuple  # its replay's log: (calls, what it returned, the objects it names by id)
    varying: frozenset  # the log's float paths where the two calls differ
    holes: dict  # template node -> [(path in its (args, kwargs) form, the log paths holding its value)]
    dispatched: dict = dataclasses.field(default_factory=dict)  # call index -> the first call's aten outline

    def constants_for(self, log: tuple) -> dict | None:
        """template node -> [(path, value)] for a call with this log; None
        where it is not this template with other floats."""
        (first_calls, returned, first_keep), (calls, _, keep) = self.log, log
        differ = log_differences(first_calls, calls) if log[1] == returned else None
        if differ is None or not self.varying.issuperset(differ):
            return None
        for i in {path[0] for path in differ}:
            if i not in self.dispatched:
                self.dispatched[i] = dispatch_outline(first_calls[i], first_keep)
            if self.dispatched[i] is None or dispatch_outline(calls[i], keep) != self.dispatched[i]:
                return None
        return hole_values(self.holes, calls)


def hole_values(holes: dict, calls: list) -> dict | None:
    """template node -> [(path, value)]: each hole's value in a call's log,
    where the log paths that held it in the traced calls hold one value here."""
    constants = {}
    for node, node_holes in holes.items():
        filled = []
        for path, sources in node_holes:
            values = {value_at(calls, s) for s in sources}
            if len(values) != 1:
                return None
            filled.append((path, values.pop()))
        constants[node] = filled
    return constants


def paired(first, first_log: tuple, second, second_log: tuple) -> Parametric | None:
    """The parametric template of two traced calls of a key (templates and
    their replays' logs), or None where they differ in more than floats."""
    first_calls, second_calls = first_log[0], second_log[0]
    varying = log_differences(first_calls, second_calls) if first_log[1] == second_log[1] else None
    if not varying or len(first.nodes) != len(second.nodes) or outline(first) != outline(second):
        return None
    holes = float_holes(first, first_calls, second, second_calls, varying)
    return Parametric(first, first_log, frozenset(varying), holes) if holes else None


def float_holes(first, first_calls: list, second, second_calls: list, varying: list) -> dict | None:
    """template node -> [(path in its (args, kwargs) form, the log paths holding
    its value in both calls)] for each float where two templates' nodes differ;
    None where they differ otherwise, or a float has no source among ``varying``."""
    index_a, index_b = _node_index(first), _node_index(second)
    holes = {}
    for a, b in zip(first.nodes, second.nodes):
        form_a, form_b = _form((a.args, a.kwargs), index_a), _form((b.args, b.kwargs), index_b)
        differ = []
        if a.op != b.op or a.target != b.target or not _float_differences(form_a, form_b, (), differ):
            return None
        for path in differ:
            ga, gb = _value_at_form(form_a, path), _value_at_form(form_b, path)
            sources = [s for s in varying if value_at(first_calls, s) == ga and value_at(second_calls, s) == gb]
            if not sources:
                return None
            holes.setdefault(a, []).append((path, sources))
    return holes


@dataclasses.dataclass
class FromOneCall:
    """A parametric template of one traced call: where its floats go is read
    from the aten ops its torch calls dispatch (on meta tensors), not from a
    second trace. A later call whose log differs from the first's only at
    floats is stamped from the template with each template float replaced by
    what the same place of the dispatched ops holds in that call, where

    * its differing calls dispatch the same aten ops as the first call's
      (floats apart);
    * each float value that changes is one the first call's dispatched ops
      hold only at places that change to one same value (a value also held
      where it stays is a coincidence of two sources: traced);
    * the template's nodes hold that value as many times as those ops do
      (a graph float of another source with the same value: traced).

    This takes a rate passed through (``bernoulli_(keep)``) and one
    transformed on the way (``dropout(p)`` dispatching ``bernoulli_(1 - p)``)
    alike."""

    template: object  # layer_reuse._Template
    log: tuple  # its replay's log: (calls, what it returned, the objects it names by id)
    outlines: list  # per logged call: (its aten outline, its dispatched floats in order)
    counts: dict  # float value -> how often the first call's dispatched ops hold it
    sites: dict  # float value -> [(template node, path in its (args, kwargs) form)]

    def constants_for(self, log: tuple) -> dict | None:
        """template node -> [(path, value)] for a call with this log; None
        where it is not this template with other floats."""
        (first_calls, returned, _), (calls, _, keep) = self.log, log
        differ = log_differences(first_calls, calls) if log[1] == returned else None
        if not differ:
            return None
        new_values: dict = {}
        for i in sorted({path[0] for path in differ}):
            outline, floats = self.outlines[i]
            dispatched = _dispatched(calls[i], keep)
            if dispatched is None or dispatched[0] != outline:
                return None
            for old, new in zip(floats, dispatched[1]):
                if new_values.setdefault(old, new) != new:
                    return None
        changed = {old: new for old, new in new_values.items() if new != old}
        if any(self.counts[old] != len(self.sites.get(old, ())) or _held_unchanged(self, old, differ)
               for old in changed):
            return None
        constants: dict = {}
        for old, new in changed.items():
            for node, path in self.sites[old]:
                constants.setdefault(node, []).append((path, new))
        return constants


def differs_in_floats_only(first_log: tuple, log: tuple) -> bool:
    """Whether two replays' logs differ, and only at floats."""
    return first_log[1] == log[1] and bool(log_differences(first_log[0], log[0]))


def _held_unchanged(parametric: FromOneCall, value: float, differ: list) -> bool:
    """Whether a call that does not differ dispatches ``value`` (a place where it stays)."""
    differing = {path[0] for path in differ}
    return any(value in floats for i, (_, floats) in enumerate(parametric.outlines) if i not in differing)


def from_one_call(template, log: tuple) -> FromOneCall | None:
    """The :class:`FromOneCall` of a traced call, or None where one of its
    logged calls cannot be dispatched again (an argument not made again)."""
    calls, _, keep = log
    outlines = [_dispatched(call, keep) for call in calls]
    if None in outlines:
        return None
    counts: dict = {}
    for _, floats in outlines:
        for v in floats:
            counts[v] = counts.get(v, 0) + 1
    index, sites = _node_index(template), {}
    for node in template.nodes:
        for path, v in _float_leaves(_form((node.args, node.kwargs), index), ()):
            sites.setdefault(v, []).append((node, path))
    return FromOneCall(template, log, outlines, counts, sites)


def _float_leaves(form, path: tuple):
    """(path, value) of each ``(float, value)`` leaf of a :func:`_form`."""
    if type(form) is not tuple:
        return
    if len(form) == 2 and form[0] is float:
        yield path, form[1]
        return
    for i, x in enumerate(form):
        yield from _float_leaves(x, (*path, i))


def _dispatched(call: tuple, keep: list) -> tuple | None:
    """(the aten outline, the floats in order) of what a logged call dispatches."""
    ops = _dispatched_ops(call, keep)
    if ops is None:
        return None
    floats: list = []
    for _, a, k in ops:
        _collect_floats((a, k), floats)
    return [(op, _masked((a, k))) for op, a, k in ops], floats


def _collect_floats(x, into: list) -> None:
    if type(x) is float:
        into.append(x)
    elif isinstance(x, (tuple, list)):
        for v in x:
            _collect_floats(v, into)
    elif isinstance(x, dict):
        for v in x.values():
            _collect_floats(v, into)


def filled(node: torch.fx.Node, constants: list) -> None:
    """``node`` (a copy of a template's) with the call's values in its holes."""
    args_kwargs = (node.args, node.kwargs)
    for path, value in constants:
        args_kwargs = put(args_kwargs, path, value)
    node.args, node.kwargs = _torch.without_default_arguments(node.target, *args_kwargs)


# ---------------------------------------------------------------- comparing with floats apart


def log_differences(calls_a: list, calls_b: list) -> list | None:
    """The paths (call index, path in its arguments) of the floats two logs
    differ at; None where they differ otherwise (a result, a function, a tensor)."""
    if len(calls_a) != len(calls_b):
        return None
    differ: list = []
    for i, ((fa, called_a, out_a), (fb, called_b, out_b)) in enumerate(zip(calls_a, calls_b)):
        if fa != fb or out_a != out_b or not _float_differences(called_a, called_b, (i,), differ):
            return None
    return differ


def _float_differences(a, b, path: tuple, differ: list) -> bool:
    """Whether two encodings are equal but for ``(float, value)`` leaves; the
    paths of those that differ added to ``differ``."""
    if a == b:
        return True
    if type(a) is not tuple or type(b) is not tuple or len(a) != len(b):
        return False
    if len(a) == 2 and a[0] is float and b[0] is float:
        differ.append(path)
        return True
    return all(_float_differences(x, y, (*path, i), differ) for i, (x, y) in enumerate(zip(a, b)))


def value_at(calls: list, path: tuple) -> float:
    return _value_at_form(calls[path[0]][1], path[1:])


def _value_at_form(form, path: tuple) -> float:
    for i in path:
        form = form[i]
    return form[1]


def _form(arg, index: dict):
    """A node's arguments encoded as a log encodes a call's: nodes by their
    place in the template (or the call's inputs), floats as ``(float, value)``."""
    if isinstance(arg, torch.fx.Node):
        return ("node", index.get(arg, arg.name))  # not the call's: a symbolic size made before, shared
    if isinstance(arg, (tuple, list)):
        return (type(arg), *(_form(a, index) for a in arg))
    if isinstance(arg, dict):
        return (dict, tuple(arg), *(_form(v, index) for v in arg.values()))
    return (type(arg), arg)


def put(x, path: tuple, value):
    """``x`` with the leaf at a :func:`_form` path replaced by ``value``."""
    if not path:
        return value
    i, rest = path[0], path[1:]
    if isinstance(x, dict):
        key = list(x)[i - 2]
        return {**x, key: put(x[key], rest, value)}
    items = list(x)
    items[i - 1] = put(items[i - 1], rest, value)
    return type(x)(items)


def _node_index(template) -> dict:
    index = {}
    for i, node in enumerate(template.inputs):
        index.setdefault(node, ("input", i))
    index.update((node, i) for i, node in enumerate(template.nodes))
    return index


def outline(template) -> tuple:
    """What a stamp takes from a template besides its nodes' arguments, its
    nodes as their places: equal for two calls a stamp of one may stand for."""
    index = _node_index(template)

    def form(x):
        return _form(x, index)
    return (form(template.inputs), [(kind, form(value)) for kind, value in template.outputs], str(template.out_spec),
            form([(kind, old, new) for kind, old, new in template.writes]), form(template.updates),
            template.viewed, {index[n]: f for n, f in template.torch_fns.items()}, template.increments,
            template.depth, [(index[n], stack) for n, stack in _inner_classes(template)],
            {_relative(p, template.module_path): n for p, n in template.module_calls.items()})


def _inner_classes(template):
    return ((n, tuple(cls for _, (_, cls) in stack)) for n, stack in template.inner_stacks.items())


def _relative(path: str, root: str) -> str:
    return path[len(root):]


# ---------------------------------------------------------------- the ops a call dispatches


def dispatch_outline(call: tuple, keep: list) -> list | None:
    """The aten ops a logged call dispatches, floats apart (their tensors as
    metadata); None where its arguments cannot be made again or it fails."""
    ops = _dispatched_ops(call, keep)
    return None if ops is None else [(op, _masked((a, k))) for op, a, k in ops]


def _dispatched_ops(call: tuple, keep: list) -> list | None:
    """(op, args, kwargs) of each aten op a logged call dispatches, made again
    from its log; None where its arguments cannot be made again or it fails."""
    func, called, _ = call
    objects = {id(o): o for o in keep}
    try:
        tensors: dict = {}
        return _torch.dispatched_ops(lambda: (_decoded(called[0], tensors, objects),
                                              _decoded(called[1], tensors, objects)), func)
    except Exception:  # noqa: BLE001 (an argument not made again, a call failing on its own)
        return None


def _masked(x):
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.stride(), x.dtype)
    if isinstance(x, float):
        return float
    if isinstance(x, (tuple, list)):
        return (type(x), *(_masked(v) for v in x))
    if isinstance(x, dict):
        return (dict, *((k, _masked(v)) for k, v in x.items()))
    return (type(x), x) if isinstance(x, (int, bool, str, type(None), torch.dtype, torch.device)) else (type(x),)


class _NotMade(Exception):
    pass


def _decoded(x, tensors: dict, objects: dict):
    """A logged argument made again: tensors as meta tensors with its metadata."""
    head = x[0]
    if head is tuple or head is list:
        return head(_decoded(v, tensors, objects) for v in x[1:])
    if head is dict:
        return {k: _decoded(v, tensors, objects) for k, v in x[1:]}
    if type(head) is int:
        if head not in tensors:
            tensors[head] = _meta_tensor(*x[1:])
        return tensors[head]
    if head == "object" and x[1] in objects:
        return objects[x[1]]
    if head is torch.Size and all(type(d) is int for d in x[1]):
        return torch.Size(x[1])
    if head in (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format):
        return x[1]
    raise _NotMade(head)


def _meta_tensor(shape, stride, offset, dtype, requires_grad, layout, conj, neg) -> torch.Tensor:
    if layout != torch.strided or conj or neg:
        raise _NotMade(layout)
    extent = offset + sum((n - 1) * s for n, s in zip(shape, stride)) + 1 if all(shape) else offset
    return torch.empty(extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)
