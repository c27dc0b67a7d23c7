"""Tensors that require grad and are neither a parameter, a buffer nor an input: refused.

An ``nn.Parameter`` kept in a plain dict, a tensor attribute made with
``requires_grad=True``, a global: the trace meets the tensor itself (not a
traced input), and the program holds it as a constant, which no gradient
reaches. Eager's output requires grad through it and the tensor gets its
gradient: used in grad mode, it is refused, naming it and the line (under
no_grad eager differentiates nothing through it either)."""
from __future__ import annotations

import torch

from ... import _torch
from ...errors import ExportError, user_location


class UnregisteredGradTensor(ExportError):
    """Raised where the forward uses one; :func:`named_in` then names it."""

    def __init__(self, tensor: torch.Tensor, where: str):
        self.tensor, self.where = tensor, where
        super().__init__(message(tensor, where, None))


def message(tensor: torch.Tensor, where: str, name: str | None) -> str:
    what = f"the tensor of attribute {name}" if name else \
        "a tensor held outside the module's attributes (a global, a closure's)"
    return (f"{what} (shape {tuple(tensor.shape)}), used at {where}, requires grad but is neither a "
            "parameter, a buffer nor an input: the program would hold it as a constant and its "
            "gradient would be lost. Register it (an nn.Parameter attribute, register_parameter, "
            "nn.ParameterDict / ParameterList), pass it as an input, or detach it if it needs no "
            "gradient")


_NO_GRADIENT = frozenset({torch.Tensor.detach, torch.detach, torch.Tensor.detach_})


def refuse_unregistered_grad_tensors(func, untraced: list, out) -> None:
    """``func`` read the tensors ``untraced`` (its arguments the trace does not
    hold) and gave ``out``: refused where one is a real tensor requiring grad,
    in grad mode, and ``out`` a tensor a gradient could flow through (not a
    size, a comparison's mask, a detached copy)."""
    grad_tensors = [a for a in untraced if a.requires_grad and not _torch.is_fake(a)]
    if not grad_tensors or not torch.is_grad_enabled() or func in _NO_GRADIENT or not any(
            isinstance(o, torch.Tensor) and (o.is_floating_point() or o.is_complex())
            for o in _torch.pytree.tree_leaves(out)):
        return
    raise UnregisteredGradTensor(grad_tensors[0], user_location())


def named_in(module: torch.nn.Module, e: UnregisteredGradTensor, strip=lambda name: name) -> ExportError:
    """``e`` again, naming the attribute of ``module`` that holds its tensor
    (``d['w']`` in a dict, ``layers[0]`` in a list), where one does."""
    for path, m in module.named_modules(remove_duplicate=False):
        for attr, value in vars(m).items():
            found = _holding(value, e.tensor, attr)
            if found is not None:
                name = strip(f"{path}.{found}" if path else found)
                return ExportError(message(e.tensor, e.where, repr(name)))
    return ExportError(str(e))


def _holding(value, tensor: torch.Tensor, name: str) -> str | None:
    if value is tensor:
        return name
    items = value.items() if isinstance(value, dict) else enumerate(value) \
        if isinstance(value, (list, tuple)) else ()
    for key, v in items:
        if v is tensor:
            return f"{name}[{key!r}]"
    return None
