"""predispatch's own ops, in the programs it makes.

* ``keep_history(old, new)``: ``new``'s value, ``old``'s autograd history
  (a tensor updated without autograd seeing it, see :mod:`predispatch.passes.history`);
* ``keep_history_if_no_grad(old, new)``: ``new``'s history in grad mode,
  ``old``'s under no_grad (an update in code that runs in the caller's mode);
* ``requires_grad(t)``: ``t.requires_grad_()`` made functional (``t``'s value,
  its history if it has one, else a new leaf);
* ``autocast_cached(source, first, current)``: ``first`` where eager's autocast
  would read its cached cast of ``source``, else ``current``.

Each records its history whatever the grad mode, as eager keeps a tensor's
history across modes: their autograd kernels are their own.
"""
from __future__ import annotations

import torch

from .. import _torch

_LIB = torch.library.Library("predispatch", "FRAGMENT")
_LIB.define("keep_history(Tensor old, Tensor new) -> Tensor")
_LIB.define("keep_history_if_no_grad(Tensor old, Tensor new) -> Tensor")


def _value_of_new(old, new):
    return new.clone()


class _History(torch.autograd.Function):
    """``new``'s value; the gradient goes to ``old`` (``of_old``) or to ``new``."""

    @staticmethod
    def forward(ctx, old, new, op, keyset, of_old):
        ctx.of_old = of_old
        ctx.set_materialize_grads(False)  # no gradient is none: not zeros of new's shape for old
        return _torch.redispatch_below_autograd(op, keyset, old, new)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, None, None, None) if ctx.of_old else (None, grad, None, None, None)

    @staticmethod
    def jvp(ctx, old_tangent, new_tangent, *_):
        """Forward-mode AD ignores grad mode (an update under no_grad changes
        eager's tangent too): ``new``'s tangent."""
        return new_tangent


def _recording(fn, *args):
    """``fn(*args)`` with autograd recording, whatever the grad mode."""
    if torch.is_grad_enabled():  # no mode change while traced (make_fx would record it)
        return fn(*args)
    with torch.enable_grad():
        return fn(*args)


def _without_false_history(t):
    """A view made under no_grad says it requires grad (its base does) and
    has no history: as an operand it brings none."""
    return t.detach() if t.requires_grad and t.grad_fn is None and t._is_view() else t


def _autograd_kernel(op_name: str, new_history_in_grad_mode: bool):
    """The ops' autograd: unlike a custom op's, it records the history under
    no_grad too, as eager keeps a tensor's history across an update made
    under no_grad, whatever the mode of the code that reads it later."""
    def kernel(keyset, old, new):
        op = getattr(torch.ops.predispatch, op_name).default
        old, new = _without_false_history(old), _without_false_history(new)
        of_old = not (new_history_in_grad_mode and torch.is_grad_enabled())
        # the history not taken is cut (a Function's input would make the result
        # require grad and reach its leaves): eager's tensor has the history it keeps
        if of_old and new.requires_grad:
            new = new.detach()
        elif not of_old and old.requires_grad:
            old = old.detach()
        return _recording(_History.apply, old, new, op, keyset, of_old)
    return kernel


for _name, _new_history in (("keep_history", False), ("keep_history_if_no_grad", True)):
    _LIB.impl(_name, _value_of_new, "CompositeExplicitAutograd")
    _LIB.impl(_name, _autograd_kernel(_name, _new_history), "Autograd", with_keyset=True)

_LIB.define("requires_grad(Tensor t) -> Tensor")


def _requires_grad_kernel(keyset, t):
    """``t.requires_grad_()``, functional: ``t``'s value and, as in eager,
    ``t``'s history if it has one (in any mode), else a new leaf."""
    if not _without_false_history(t).requires_grad:
        return t.detach().clone().requires_grad_()
    return _recording(torch.clone, t)


_LIB.impl("requires_grad", lambda t: t.clone(), "CompositeExplicitAutograd")
_LIB.impl("requires_grad", _requires_grad_kernel, "Autograd", with_keyset=True)
REQUIRES_GRAD = torch.ops.predispatch.requires_grad.default


_LIB.define("autocast_cached(Tensor source, Tensor first, Tensor current) -> Tensor")


def _cached_cast_of(keyset, source, first, current):
    """``first`` where eager's autocast cast cache holds ``source`` (the cache
    on, ``source`` a float32 leaf that requires grad, not a view), else
    ``current``: the value a cast of an updated parameter reads inside an
    autocast block (see :mod:`predispatch.trace.autocast_cache`). Autograd decides,
    as only autograd knows what requires grad."""
    cached = (torch.is_autocast_cache_enabled() and source.is_leaf and source.requires_grad
              and source.dtype == torch.float32 and not source._is_view())
    return torch.clone(first if cached else current)


_LIB.impl("autocast_cached", lambda source, first, current: current.clone(), "CompositeExplicitAutograd")
_LIB.impl("autocast_cached", _cached_cast_of, "Autograd", with_keyset=True)
AUTOCAST_CACHED = torch.ops.predispatch.autocast_cached.default

KEEP_HISTORY = torch.ops.predispatch.keep_history.default
# in code that runs in the caller's grad mode: an update there keeps the old history
# only when the caller has grad off
KEEP_HISTORY_IF_NO_GRAD = torch.ops.predispatch.keep_history_if_no_grad.default
