"""Fake kernels of views: ``view`` of a row-major tensor, and reorderings and new dimensions at symbolic sizes.

FakeTensorMode computes a ``view``'s output by torch's Python reference
(``_reshape_view_helper``: ~1 ms a new shape; at symbolic sizes ~6,000
Python calls, guarding on the sizes as it goes), and at symbolic sizes a
``permute``, ``transpose`` or ``unsqueeze`` by references that dispatch a few
prims, each cached by fake mode with its sympy comparisons. The views here
are made by C++ meta kernels (``view``; ``as_strided`` from the sizes and
strides they take), where that gives torch's outputs and guards:
tests/test_fake_kernels.py checks each against torch's path.
:mod:`.fake_kernels` holds them in its table.
"""
from __future__ import annotations

import torch
from torch._prims_common import make_contiguous_strides_for
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.experimental import _config as fx_config
from torch.fx.experimental.symbolic_shapes import statically_known_true

aten = torch.ops.aten


def row_major_view(mode, x, size):
    """``view`` / ``_unsafe_view`` of a tensor laid out row-major (each stride
    the product of the later sizes): by its C++ meta kernel, as eager views
    it. torch's fake implementation runs the Python reference
    (``_reshape_view_helper``: ~1 ms a new shape, a view per attention head
    split and merge; ~6,000 Python calls at symbolic sizes). At static sizes
    both give row-major strides (they may differ on sizes of one, where
    torch's path runs). At symbolic sizes, where the reference's steps guard
    on the sizes, the rule takes the views it makes without a guard: runs of
    whole dimensions merged, static ones split (:func:`_merged_and_split`)."""
    if type(x) is not FakeTensor or x.layout is not torch.strided or fx_config.backed_size_oblivious:
        return NotImplemented
    if not x._has_symbolic_sizes_strides:
        if any(type(s) is not int for s in size) or x.stride() != make_contiguous_strides_for(x.shape):
            return NotImplemented
        try:
            with fake_tensor.in_kernel_invocation_manager(mode):
                out = aten.view.default(x, size)
        except RuntimeError:
            return NotImplemented  # a size that does not fit: torch's path raises its own error
    else:  # the C++ kernel reads numel() (torch 2.13): the row-major strides of the new sizes set directly
        new = _inferred(size, x.numel())
        if not (row_major(x) and _merged_and_split(tuple(x.shape), new)):
            return NotImplemented
        with fake_tensor.in_kernel_invocation_manager(mode):
            out = aten.as_strided.default(x, new, row_major_strides(new), x.storage_offset())
    return mode.wrap_meta_outputs_with_default_device_logic(out, aten.view.default, (x,), device=None)


def row_major(x) -> bool:
    """Each stride known, without a guard, to be the product of the later sizes."""
    expected = 1
    for size, stride in zip(reversed(x.shape), reversed(x.stride())):
        if not statically_known_true(stride == expected):
            return False
        expected = expected * size
    return True


def row_major_strides(sizes) -> list:
    """Each size's stride laid out row-major: the product of the later sizes
    (as written, symbolic ones too: ``make_contiguous_strides_for`` writes
    ``Max(1, s)`` for a symbolic size, which torch's references do not)."""
    strides, inner = [], 1
    for size in reversed(sizes):
        strides.insert(0, inner)
        inner = inner * size
    return strides


def _inferred(size, numel) -> tuple | None:
    """``size`` with its -1 made the size it stands for, where that divides
    ``numel`` without a guard; None where it does not, or a size is not an int."""
    if any(not isinstance(s, (int, torch.SymInt)) for s in size):
        return None
    if -1 not in size:
        return tuple(size)
    known = 1
    for s in size:
        known = known if s == -1 else known * s
    rest = numel // known
    return tuple(rest if s == -1 else s for s in size) if statically_known_true(rest * known == numel) else None


def _merged_and_split(old: tuple, new: tuple | None) -> bool:
    """Is ``new`` ``old`` with runs of whole dimensions merged (their product
    known equal to the new size without a guard) and static ones split
    evenly, no size 1 or 0 among them?"""
    if new is None or any(type(s) is int and s < 2 for s in (*old, *new)):
        return False
    i, carried = 0, None  # carried: what is left of a static size split
    for length in new:
        product = None
        while True:
            if carried is not None:
                size, carried = carried, None
            elif i < len(old):
                size, i = old[i], i + 1
            else:
                return False
            product = size if product is None else product * size
            if statically_known_true(product == length):
                break
            if type(product) is int and type(length) is int and product > length:
                if product % length:
                    return False
                carried = product // length
                break
    return carried is None and i == len(old)


def _restrided(mode, x, sizes, strides):
    """A view of ``x`` (its memory, from its offset) at ``sizes`` and ``strides``,
    made by the C++ ``as_strided`` meta kernel."""
    with fake_tensor.in_kernel_invocation_manager(mode):
        out = aten.as_strided.default(x, sizes, strides, x.storage_offset())
    return mode.wrap_meta_outputs_with_default_device_logic(out, aten.as_strided.default, (x,), device=None)


def _symbolic_strided(x) -> bool:
    return (type(x) is FakeTensor and x.layout is torch.strided and x._has_symbolic_sizes_strides and x.dim() > 0
            and not fx_config.backed_size_oblivious)


def symbolic_permute(mode, x, dims):
    """``permute`` at symbolic sizes (torch's reference runs it through
    ``prims.transpose`` and ``as_strided``, each an op fake mode caches, some
    20,000 Python calls with their sympy comparisons): sizes and strides
    reordered, no guard."""
    n = x.dim() if _symbolic_strided(x) else 0
    if not n or len(dims) != n or any(type(d) is not int or not -n <= d < n for d in dims) \
            or sorted(d % n for d in dims) != list(range(n)):
        return NotImplemented
    order = [d % n for d in dims]
    return _restrided(mode, x, [x.shape[d] for d in order], [x.stride()[d] for d in order])


def symbolic_transpose(mode, x, dim0, dim1):
    n = x.dim() if _symbolic_strided(x) else 0
    if not n or any(type(d) is not int or not -n <= d < n for d in (dim0, dim1)):
        return NotImplemented
    order = list(range(n))
    order[dim0 % n], order[dim1 % n] = order[dim1 % n], order[dim0 % n]
    return symbolic_permute(mode, x, order)


def symbolic_t(mode, x):
    return symbolic_transpose(mode, x, 0, 1) if _symbolic_strided(x) and x.dim() == 2 else NotImplemented


def symbolic_unsqueeze(mode, x, dim):
    """``unsqueeze`` at symbolic sizes: a size 1 inserted, its stride the next
    dimension's extent (1 at the end), as the C++ kernel makes it."""
    n = x.dim() if _symbolic_strided(x) else 0
    if not n or type(dim) is not int or not -n - 1 <= dim <= n:
        return NotImplemented
    d = dim % (n + 1)
    sizes, strides = list(x.shape), list(x.stride())
    stride = sizes[d] * strides[d] if d < n else 1
    return _restrided(mode, x, sizes[:d] + [1] + sizes[d:], strides[:d] + [stride] + strides[d:])
