"""Fake kernels in place of the Python decompositions fake mode runs: batch norm and activations by rule, losses and addmm by meta kernel.

(And one of torch's fake kernels corrected: ``masked_select``'s bound on
its count, where the mask has more elements than the tensor it selects from.)

FakeTensorMode computes a batch norm's outputs by running its Python
decomposition on fake tensors (``native_batch_norm_helper``: some twenty ops,
each dispatched and cached as one), 8-14 ms per batch norm of a new shape on
CPU against ~0.9 ms for the convolution before it (``tools/fake_cost.py``);
a CNN's stages meet a new shape at each block, and torch.export pays it too.
At symbolic sizes it does the same for every op without a meta kernel that
takes symbolic sizes: an activation (``relu``, ``gelu``, ``hardswish``, ...)
is 7 to 22 fake ops there, one at static sizes. The outputs' metadata
follows from the inputs' by a few rules, which a kernel here applies where
they are exact (an input laid out densely with static strides that order its
dimensions alone, so a symbolic size can only be the outermost one's;
per-channel weights and statistics), returning ``NotImplemented``
elsewhere: torch's own path then runs, as before.

Some ops have both a meta kernel and a Python decomposition, and fake
mode prefers the decomposition for static sizes (so that AOTAutograd's
traces and its own agree); ``addmm`` costs ~3 ms a new shape that way,
``nll_loss_forward`` 8 ms. For those in :data:`BY_META_KERNEL` the meta kernel
runs instead, with the same outputs and the same failures.
On meta tensors (a repeated layer's replay, :mod:`predispatch.trace.layer_reuse`,
and the aten ops a logged call dispatches) a batch norm's meta kernel is the
same Python decomposition, ~2 ms; :func:`meta_rules` makes its output by the
same rule there.
Views (:mod:`.fake_views`) are in the same table.
tests/test_fake_kernels.py checks each rule, and each op's meta kernel,
against torch's path, the guards it leaves in the shape env included.
"""
from __future__ import annotations

import contextlib

import torch
from torch._prims_common import get_computation_dtype
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch._subclasses import fake_impls, fake_tensor
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from .fake_views import (row_major, row_major_strides, row_major_view, symbolic_permute, symbolic_t,
                         symbolic_transpose, symbolic_unsqueeze)
from .patching import patched

aten = torch.ops.aten


def _channel_vector(t, channels: int) -> bool:
    return t is None or (type(t) is FakeTensor and t.dim() == 1 and type(t.shape[0]) is int
                         and t.shape[0] == channels and t.stride() == (1,))


def _one_layout_order(x) -> bool:
    """Dense, no two strides equal, every stride static: an elementwise op's
    output (TensorIterator's order, its other operands broadcast along every
    dimension but one) takes ``x``'s strides exactly; with a tie the other
    operands' strides decide. A symbolic size may only be the outermost
    dimension's, which no stride is made of (so nothing here guards on it)."""
    strides = x.stride()
    if any(type(s) is not int for s in strides) or len(set(strides)) != len(strides):
        return False
    order = sorted(range(x.dim()), key=lambda d: strides[d])
    expected = 1
    for dim in order:
        if strides[dim] != expected:
            return False
        if dim != order[-1]:
            if type(x.shape[dim]) is not int:
                return False
            expected *= x.shape[dim]
    return True


def _usable(x, weight, bias, stats) -> bool:
    if type(x) is not FakeTensor or x.dim() < 2 or type(x.shape[1]) is not int:
        return False
    channels = x.shape[1]
    return _one_layout_order(x) and all(_channel_vector(t, channels) for t in (weight, bias, *stats)) \
        and all(t is None or t.fake_device == x.fake_device for t in (weight, bias, *stats))


def _like(mode, x, shape, stride, dtype):
    meta = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, x.fake_device)


def _batch_norm_training(mode, x, weight, bias, running_mean, running_var, training, momentum, eps):
    """``_native_batch_norm_legit_functional``: (out, save_mean, save_rstd,
    new running mean, new running var), as the decomposition makes them."""
    if not training or not _usable(x, weight, bias, (running_mean, running_var)):
        return NotImplemented
    channels = x.shape[1]
    # the decomposition divides by n - 1 (n values per channel): by zero where n is 1, but not where n is symbolic
    if not x._has_symbolic_sizes_strides and x.numel() // max(channels, 1) <= 1:
        return NotImplemented
    compute = get_computation_dtype(x.dtype)
    saved = x.dtype if x.fake_device.type == "cpu" else compute
    return (_like(mode, x, x.shape, x.stride(), x.dtype),
            _like(mode, x, (channels,), (1,), saved),
            _like(mode, x, (channels,), (1,), saved),
            _like(mode, x, (channels,), (1,), torch.promote_types(compute, running_mean.dtype)),
            _like(mode, x, (channels,), (1,), torch.promote_types(compute, running_var.dtype)))


def _batch_norm_inference(mode, x, weight, bias, running_mean, running_var, momentum, eps):
    """``_native_batch_norm_legit_no_training``: (out, save_mean, save_rstd);
    on CPU the saved statistics are empty, as the decomposition makes them."""
    if not _usable(x, weight, bias, (running_mean, running_var)):
        return NotImplemented
    channels = x.shape[1]
    compute = get_computation_dtype(x.dtype)
    if x.fake_device.type == "cpu":
        saved = [_like(mode, x, (0,), (1,), x.dtype) for _ in range(2)]
    else:
        saved = [_like(mode, x, (channels,), (1,), compute) for _ in range(2)]
    return (_like(mode, x, x.shape, x.stride(), x.dtype), *saved)


def _activation(mode, x, *scalars, approximate="none"):
    """An activation's output (``relu``, ``gelu``, ``hardswish``, ...): laid
    out as its input, of its dtype; its scalars (a slope, a range, gelu's
    approximation) change values only."""
    if type(x) is not FakeTensor or not x.dtype.is_floating_point \
            or not (_one_layout_order(x) or _symbolic_row_major(x)) \
            or any(type(s) not in (int, float, bool) for s in scalars) or approximate not in ("none", "tanh"):
        return NotImplemented
    return _like(mode, x, x.shape, x.stride(), x.dtype)


def _contiguous_static_strides(x) -> bool:
    """Contiguous (row-major), every stride static: a symbolic size only in the
    first dimension. ``_one_layout_order`` then holds, and ``contiguous()`` is ``x``."""
    return type(x) is FakeTensor and _one_layout_order(x) and list(x.stride()) == sorted(x.stride(), reverse=True)


def _symbolic_row_major(x) -> bool:
    """At symbolic sizes, each stride known without a guard to be the product
    of the later sizes, no size a static 1: an elementwise op's output, and a
    softmax's, takes ``x``'s strides, as torch's decompositions make them."""
    return (type(x) is FakeTensor and x._has_symbolic_sizes_strides and x.dim() > 0
            and all(type(n) is not int or n > 1 for n in x.shape) and row_major(x))


def _dim_in_range(x, dim) -> bool:
    return type(dim) is int and -max(x.dim(), 1) <= dim < max(x.dim(), 1)


def _symbolic_softmax(mode, x, dim, dtype):
    """A softmax's output at symbolic sizes (static ones: :data:`BY_META_KERNEL`): contiguous, as the input, in ``dtype``."""
    if not (x._has_symbolic_sizes_strides and x.dtype.is_floating_point
            and (_contiguous_static_strides(x) or _symbolic_row_major(x))
            and _dim_in_range(x, dim)):
        return NotImplemented
    return _like(mode, x, x.shape, x.stride(), dtype)


def _symbolic_log_softmax(mode, x, dim, half_to_float):
    return NotImplemented if half_to_float else _symbolic_softmax(mode, x, dim, x.dtype)


def _symbolic_safe_softmax(mode, x, dim, dtype=None):
    if dtype is not None and not dtype.is_floating_point:
        return NotImplemented
    return _symbolic_softmax(mode, x, dim, dtype or x.dtype)


def _symbolic_addmm(mode, bias, mat1, mat2, beta=1, alpha=1):
    """``addmm`` at symbolic sizes: a contiguous (n, p) product, n the one
    symbolic size, of the operands' one dtype; the bias a row of p."""
    if not (type(mat1) is FakeTensor and mat1._has_symbolic_sizes_strides and mat1.dim() == 2
            and type(mat2) is FakeTensor and mat2.dim() == 2 and not mat2._has_symbolic_sizes_strides
            and type(bias) is FakeTensor and bias.dim() == 1 and not bias._has_symbolic_sizes_strides
            and _contiguous_static_strides(mat1) and mat1.shape[1] == mat2.shape[0] and bias.shape[0] == mat2.shape[1]
            and mat1.dtype == mat2.dtype == bias.dtype and mat1.dtype.is_floating_point
            and mat1.fake_device == mat2.fake_device == bias.fake_device
            and all(type(s) in (int, float) for s in (beta, alpha))):
        return NotImplemented
    n, p = mat1.shape[0], mat2.shape[1]
    return _like(mode, mat1, (n, p), (p, 1), mat1.dtype)


def _symbolic_binary(mode, a, b, *, alpha=1):
    """``add``, ``sub``, ``mul``, ``div`` at symbolic sizes (torch's reference:
    type promotion and broadcasting in Python, each size compared in sympy)
    of a row-major floating tensor and a Python number, or a tensor of its
    dtype, device, sizes (known equal without a guard) and layout: laid out
    as ``a``, of its dtype."""
    if not (_symbolic_row_major(a) and a.dtype.is_floating_point and type(alpha) in (int, float)):
        return NotImplemented
    if type(b) not in (int, float, bool) and not (
            type(b) is FakeTensor and b.fake_mode is mode and b.dtype == a.dtype and b.fake_device == a.fake_device
            and b.dim() == a.dim() and _symbolic_row_major(b)
            and all(statically_known_true(m == n) for m, n in zip(a.shape, b.shape))):
        return NotImplemented
    return _like(mode, a, a.shape, a.stride(), a.dtype)


def _symbolic_mean(mode, x, dims, keepdim=False, dtype=None):
    """``mean`` over some dimensions at symbolic sizes (an RMSNorm's, a global
    pool's; torch's reference runs a sum and a division, each a few cached
    prims) of a row-major input: contiguous, its sizes without the reduced
    ones (ones where ``keepdim``), of ``dtype`` or the input's."""
    n = x.dim()
    if not (_symbolic_row_major(x) and x.dtype.is_floating_point and isinstance(dims, (list, tuple)) and dims
            and all(type(d) is int and -n <= d < n for d in dims) and len({d % n for d in dims}) == len(dims)
            and type(keepdim) is bool and (dtype is None or dtype.is_floating_point)):
        return NotImplemented
    reduced = {d % n for d in dims}
    sizes = [1 if d in reduced else size for d, size in enumerate(x.shape)] if keepdim else \
        [size for d, size in enumerate(x.shape) if d not in reduced]
    return _like(mode, x, sizes, row_major_strides(sizes), dtype or x.dtype)


def _symbolic_nll_loss(mode, x, target, weight, reduction, ignore_index):
    """``nll_loss_forward`` at symbolic sizes (static ones: :data:`BY_META_KERNEL`):
    (the loss: one per row where not reduced, contiguous; the total weight), of
    the input's dtype, for an (n, classes) input, the classes static, and a
    target of the same n, known equal without a guard (the decomposition's
    check adds none then); a weight, of the input's dtype, one per class."""
    if not (type(x) is FakeTensor and x._has_symbolic_sizes_strides and x.dim() == 2 and x.dtype.is_floating_point
            and type(x.shape[1]) is int and type(target) is FakeTensor and target.dim() == 1
            and target.dtype == torch.long and target.fake_device == x.fake_device
            and statically_known_true(x.shape[0] == target.shape[0])
            and (weight is None or (type(weight) is FakeTensor and weight.shape == (x.shape[1],)
                                    and weight.dtype == x.dtype and weight.fake_device == x.fake_device))
            and reduction in (0, 1, 2) and type(ignore_index) is int):
        return NotImplemented
    loss = _like(mode, x, (x.shape[0],), (1,), x.dtype) if reduction == 0 else _like(mode, x, (), (), x.dtype)
    return loss, _like(mode, x, (), (), x.dtype)


KERNELS = {
    aten._native_batch_norm_legit_functional.default: _batch_norm_training,
    aten._native_batch_norm_legit_no_training.default: _batch_norm_inference,
    # each a Python decomposition of 7 to 22 fake ops at symbolic sizes (hardswish, hardsigmoid: at any size)
    **dict.fromkeys((aten.relu.default, aten.gelu.default, aten.hardtanh.default, aten.hardswish.default,
                     aten.hardsigmoid.default, aten.leaky_relu.default, aten.elu.default, aten.mish.default,
                     aten.softplus.default), _activation),
    # at symbolic sizes fake mode runs their Python decompositions (a meta kernel, at static sizes)
    aten._log_softmax.default: _symbolic_log_softmax,
    aten._safe_softmax.default: _symbolic_safe_softmax,
    aten.addmm.default: _symbolic_addmm,
    aten.nll_loss_forward.default: _symbolic_nll_loss,
    aten.mean.dim: _symbolic_mean,
    **dict.fromkeys((aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor), _symbolic_binary),
    # torch's fake implementation of both: the Python reference (a meta kernel runs it as one op here)
    aten.view.default: row_major_view,
    aten._unsafe_view.default: row_major_view,
    # at symbolic sizes: torch's references, each a few cached prims (static sizes: C++ meta kernels)
    aten.permute.default: symbolic_permute,
    aten.transpose.int: symbolic_transpose,
    aten.t.default: symbolic_t,
    aten.unsqueeze.default: symbolic_unsqueeze,
}


def _fast_kernel(mode, func, args, kwargs):
    kernel = KERNELS.get(func)
    if kernel is None or mode.propagate_real_tensors:
        return NotImplemented
    if any(type(a) is FakeTensor and (a.constant is not None or a.fake_mode is not mode) for a in args):
        return NotImplemented  # constant propagation, another mode's tensor: torch's path decides
    return kernel(mode, *args, **kwargs)  # keywords: a schema's keyword-only arguments (gelu's approximation)


def _meta_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps, cudnn_enabled):
    """``aten.batch_norm`` on meta tensors (a layer's replay, :mod:`predispatch.trace.layer_reuse`):
    the output laid out as the input, of its dtype, as the meta kernels' Python decomposition
    makes it (some twenty meta ops, ~2 ms), where the rule is exact: as :func:`_usable`, every
    tensor of one floating dtype."""
    if not (type(x) is torch.Tensor and x.device.type == "meta" and x.dim() >= 2 and x.dtype.is_floating_point
            and _one_layout_order(x)):
        return NotImplemented
    channels = x.shape[1]
    if any(t is not None and not (type(t) is torch.Tensor and t.device.type == "meta" and t.dim() == 1
                                  and t.shape[0] == channels and t.stride() == (1,) and t.dtype == x.dtype)
           for t in (weight, bias, running_mean, running_var)):
        return NotImplemented
    if training and x.numel() // max(channels, 1) <= 1:  # the decomposition divides by n - 1
        return NotImplemented
    if not training and (running_mean is None or running_var is None):
        return NotImplemented
    return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")


META_KERNELS = {aten.batch_norm.default: _meta_batch_norm}


def by_meta_rule(func, args, kwargs):
    """``func``'s outputs on meta tensors by the rule of :data:`META_KERNELS`;
    ``NotImplemented`` where there is none or it is not exact there."""
    kernel = META_KERNELS.get(func)
    return NotImplemented if kernel is None else kernel(*args, **kwargs)


class _MetaRules(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = by_meta_rule(func, args, kwargs or {})
        return func(*args, **(kwargs or {})) if out is NotImplemented else out


def meta_rules() -> TorchDispatchMode:
    """A mode under which the ops of :data:`META_KERNELS` on meta tensors run by their rules."""
    return _MetaRules()


# ops fake mode runs by their meta kernel (one op, no nested fake ops) rather than by torch's Python decomposition
BY_META_KERNEL = frozenset({
    aten.addmm.default,
    aten._log_softmax.default,
    aten._safe_softmax.default,
    aten.nll_loss_forward.default,
})


def _masked_select_of_the_broadcast(original):
    """``masked_select`` of a mask with more elements than the tensor it selects
    from (they broadcast to the mask's shape): torch's fake kernel bounds the
    count by the tensor's ``numel()``, and the program failed on its own example.
    Its rule on the two expanded to their common shape, the one eager's kernel
    selects from."""
    def impl(mode, func, x, mask):
        shape = torch.broadcast_shapes(x.shape, mask.shape)
        return original(mode, func, *(t if t.shape == shape else t.expand(shape) for t in (x, mask)))
    return impl


@contextlib.contextmanager
def _fake_impl_wrapped(op, wrap):
    """torch's fake implementation of ``op`` (``register_op_impl``) wrapped by ``wrap`` for the block."""
    impls = fake_impls.op_implementations_dict
    original = impls[op]
    impls[op] = wrap(original)
    try:
        yield
    finally:
        impls[op] = original


@contextlib.contextmanager
def fast_fake_kernels():
    """While tracing, FakeTensorMode makes the outputs of the ops in
    :data:`KERNELS` by their rules where these are exact, and those of the
    ops in :data:`BY_META_KERNEL` by their meta kernels (its cache keeps them
    as it keeps any); other threads run torch's own path. And
    ``masked_select`` bounds its count by the broadcast it selects from
    (in every thread: torch's bound is wrong there)."""

    def by_rule(original):
        def _dispatch_impl(self, func, types, args, kwargs):
            if func in KERNELS:
                out = _fast_kernel(self, func, args, kwargs)
                if out is not NotImplemented:
                    return out
            return original(self, func, types, args, kwargs)
        return _dispatch_impl

    def by_meta_kernel(original):
        return lambda func: func not in BY_META_KERNEL and original(func)

    with patched(FakeTensorMode, "_dispatch_impl", by_rule), \
            patched(fake_tensor, "torch_decomp_decompositions", by_meta_kernel), \
            _fake_impl_wrapped(aten.masked_select.default, _masked_select_of_the_broadcast):
        yield
