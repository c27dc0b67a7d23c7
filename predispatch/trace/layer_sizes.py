"""Layers of one code at other sizes, stamped from one template.

A CNN's stages run one block class at other widths and resolutions; a
U-Net's levels and a pyramid's layers do the same. Their calls share no key
(:mod:`predispatch.trace.layer_reuse`: the key holds every size), yet their
graphs differ only in their values' sizes. Two traced calls of one *kind* (the
key with each tensor's sizes set apart: its rank and the order its strides lay
its dimensions out in stay) make a :class:`Resized` template where

* their replays' logs are equal with sizes apart (each tensor's and each
  ``torch.Size`` read) and floats apart (a drop rate of each layer's own,
  found in the graph as :mod:`.layer_constants` finds it);
* their graphs are equal node for node but for their values (and those floats);
* their sizes differ (the dimensions that differ are the template's *free*
  sizes, each at least 2 in both).

A later call of the kind is stamped from it where its own sizes differ from
the first call's at free sizes only, each at least 2 (as torch.compile's
automatic dynamic makes the sizes that changed symbolic and specializes 0 and
1), and its log is the first call's with sizes and those floats apart. Its
nodes are the template's; their values are made again by their ops' fake
kernels, and must agree with the call's replay on what it returns. A size
the layer's code computes with shows in the log as a number (a ``view``'s
shape): such a call is traced. What the two calls could not tell apart, a
number aten computes from a size that was equal in both, is what a size
that was equal in both must keep: the call is stamped only where its sizes
change where theirs did.
"""
from __future__ import annotations

import dataclasses
import operator

import torch

from .. import _torch
from . import layer_constants as lc


@dataclasses.dataclass
class Resized:
    """A template whose nodes' values are made again for each call's sizes."""

    template: object  # the first call's template (layer_reuse._Template)
    log: tuple  # its replay's log: (calls, what it returned, the objects it names by id)
    sized_calls: list  # the log's calls with sizes apart (:func:`sizes_apart`)
    returned: tuple  # what it returned, with sizes apart
    sizes: tuple  # the first call's sizes: its tensors' and state's dimensions in order
    free: frozenset  # the positions among ``sizes`` that differed between the two calls
    varying: frozenset  # the log's float paths where the two calls differ
    holes: dict  # template node -> [(path in its (args, kwargs) form, the log paths holding its value)]
    dispatched: dict = dataclasses.field(default_factory=dict)  # call index -> the first call's outline, sizes apart

    def constants_for(self, sizes: tuple, log: tuple) -> dict | None:
        """template node -> [(path, value)] for a call with these sizes and
        this log; None where it is not this template at other sizes."""
        if len(sizes) != len(self.sizes) or any(
                n < 2 if i in self.free else n != self.sizes[i] for i, n in enumerate(sizes)):
            return None
        calls, _, keep = log
        if sizes_apart(log[1]) != self.returned:
            return None
        differ = _differences(self.sized_calls, calls, apart=False)
        if differ is None or not self.varying.issuperset(differ):
            return None
        for i in {path[0] for path in differ}:  # a float may pick another decomposition (dropout at p=0)
            if i not in self.dispatched:
                self.dispatched[i] = _outline(self.log[0][i], self.log[2])
            if self.dispatched[i] is None or _outline(calls[i], keep) != self.dispatched[i]:
                return None
        return lc.hole_values(self.holes, calls)


def sizes_of(tensors: list) -> tuple | None:
    """The dimensions of a call's tensors (its inputs, then its state) in
    order; None where one is symbolic or a tensor is not dense (a kind holds
    its strides' order, which sets its strides from its sizes only where dense)."""
    sizes = []
    for t in tensors:
        if not all(type(n) is int for n in (*t.shape, *t.stride())) or not _dense(t.shape, t.stride()):
            return None
        sizes.extend(t.shape)
    return tuple(sizes)


def kind_of(raw_key) -> tuple:
    """A key (layer_reuse._key, static) with each tensor's sizes set apart."""
    if isinstance(raw_key, tuple):
        if _is_metadata(raw_key):
            shape, stride, *rest = raw_key
            return (len(shape), _order(stride), *rest)
        return tuple(kind_of(v) for v in raw_key)
    return raw_key


def _is_metadata(x) -> bool:
    """A tensor's metadata as a key holds it: (shape, stride, dtype, device type, requires grad)."""
    return len(x) == 5 and type(x[0]) is tuple and type(x[1]) is tuple and isinstance(x[2], torch.dtype)


def paired(first, first_log: tuple, first_sizes: tuple, second, second_log: tuple,
           second_sizes: tuple) -> Resized | None:
    """The :class:`Resized` template of two traced calls of a kind (templates,
    their replays' logs, their sizes), or None where they differ in more than
    sizes and floats, or in no size."""
    if len(first_sizes) != len(second_sizes):
        return None
    free = frozenset(i for i, (a, b) in enumerate(zip(first_sizes, second_sizes)) if a != b)
    if not free or any(min(first_sizes[i], second_sizes[i]) < 2 for i in free):
        return None
    if len(first.nodes) != len(second.nodes) or len(first_log[0]) != len(second_log[0]) or any(
            a[0] != b[0] for a, b in zip(first_log[0], second_log[0])):  # the cheap checks first
        return None
    returned = sizes_apart(first_log[1])
    varying = _differences(first_log[0], second_log[0]) if returned == sizes_apart(second_log[1]) else None
    if varying is None or lc.outline(first) != lc.outline(second):
        return None
    if not all(_revaluable(n) for n in first.nodes):
        return None
    holes = lc.float_holes(first, first_log[0], second, second_log[0], varying)
    if holes is None:
        return None
    return Resized(first, first_log, sizes_apart(first_log[0]), returned, first_sizes, free, frozenset(varying),
                   holes)


def _differences(calls_a: list, calls_b: list, apart: bool = True) -> list | None:
    """The float paths two logs differ at with sizes apart (:func:`lc.log_differences`),
    call by call, stopping at the first that differs otherwise (``apart``: ``calls_a``
    has its sizes apart already where False)."""
    if len(calls_a) != len(calls_b):
        return None
    differ = []
    for i, (a, b) in enumerate(zip(calls_a, calls_b)):
        one = lc.log_differences([sizes_apart(a) if apart else a], [sizes_apart(b)])
        if one is None:
            return None
        differ.extend((i, *path[1:]) for path in one)
    return differ


def _revaluable(node) -> bool:
    """A node whose value its op makes again at other sizes: an aten op's, an
    item of one's, or no value (a grad-mode read's marker)."""
    val = node.meta.get("val")
    if "eager_input_vals" in node.meta or isinstance(val, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return False
    return node.target is operator.getitem or _torch.is_functional_overload(node.target) or "val" not in node.meta


def values_at(resized: Resized, in_values: list, constants: dict) -> dict | None:
    """template node -> its value at this call's sizes (``in_values``: the
    values of the nodes the template reads, in its order), made by each op's
    fake kernel; None where one fails or a value's dtype or device is not the
    template's (another kernel's choice)."""
    template = resized.template
    values = {}
    for node, value in zip(template.inputs, in_values):
        values.setdefault(node, value)
    try:
        with _torch.fake_kernels_only():
            for node in template.nodes:
                if "val" not in node.meta:
                    continue
                args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: values[n])
                for path, value in constants.get(node, ()):
                    args, kwargs = lc.put((args, kwargs), path, value)
                values[node] = node.target(*args, **kwargs)
                if not _alike(values[node], node.meta["val"]):
                    return None
    except Exception:  # noqa: BLE001 (these sizes do not fit the op: traced, where torch says why)
        return None
    return values


def _alike(new, old) -> bool:
    if isinstance(old, torch.Tensor):
        return isinstance(new, torch.Tensor) and (new.dtype, new.device, new.dim()) == (old.dtype, old.device, old.dim())
    if isinstance(old, (tuple, list)):
        return isinstance(new, (tuple, list)) and len(new) == len(old) and all(map(_alike, new, old))
    return type(new) is type(old)


def returns_as_replayed(values: list, returned: tuple) -> bool:
    """Whether the output values' sizes and strides are those the call's replay returned."""
    replayed = list(_tensor_entries(returned))
    made = [v for v in values if isinstance(v, torch.Tensor)]
    return len(made) == len(replayed) and all(
        (tuple(v.shape), tuple(v.stride())) == (tuple(e[1]), tuple(e[2])) for v, e in zip(made, replayed))


def _tensor_entries(x):
    if type(x) is tuple and _is_tensor(x):
        yield x
    elif type(x) is tuple:
        for v in x:
            yield from _tensor_entries(v)


# ---------------------------------------------------------------- sizes apart


def sizes_apart(encoded):
    """A log's encoding (layer_reuse._CallLog) with sizes set apart: each
    tensor's shape and strides as its rank and its strides' order, each
    ``torch.Size`` as its length. Numbers stay: a size the code computes with
    shows as one."""
    if type(encoded) is not tuple or not encoded:
        return [sizes_apart(c) for c in encoded] if type(encoded) is list else encoded
    head = encoded[0]
    if _is_tensor(encoded):  # (number, shape, stride, offset, dtype, requires grad, layout, conj, neg)
        number, shape, stride, *rest = encoded
        return (number, len(shape), _order(stride), *rest)
    if head is torch.Size:
        return (torch.Size, len(encoded[1]))
    return tuple(sizes_apart(v) for v in encoded)


def _is_tensor(encoded: tuple) -> bool:
    """A tensor as a log encodes it: (its number, shape, stride, and six more)."""
    return len(encoded) == 9 and type(encoded[0]) is int and type(encoded[1]) is tuple


def _order(stride) -> tuple:
    return tuple(sorted(range(len(stride)), key=lambda d: (stride[d], -d)))


def _dense(shape, stride) -> bool:
    expected = 1
    for d in sorted(range(len(shape)), key=lambda d: (stride[d], -d)):
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def _outline(call: tuple, keep: list) -> list | None:
    """The aten ops a logged call dispatches, floats and sizes apart."""
    outline = lc.dispatch_outline(call, keep)
    return None if outline is None else _sizes_apart_in_outline(outline)


def _sizes_apart_in_outline(x):
    if type(x) is tuple and x and x[0] == "tensor":
        _, shape, stride, dtype = x
        return ("tensor", len(shape), _order(stride), dtype)
    if isinstance(x, (tuple, list)):
        return type(x)(_sizes_apart_in_outline(v) for v in x)
    return x
