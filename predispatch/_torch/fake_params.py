"""A module's parameters and buffers as fake tensors for torch.export's front end: the plain ones made directly.

torch.export makes each one by ``fake_mode.from_tensor`` (torch's meta
converter: a description of the tensor, then a meta tensor built from it),
some 0.1-0.2 ms a tensor, a tenth of a stamped layer's cost. A plain tensor (a
dense, whole, contiguous leaf, sharing its memory with no other parameter,
buffer or input) is the same fake tensor made from its sizes, strides and
dtype: an empty meta tensor of them on its device, requiring grad as it
does, marked a parameter where it is one, and put in the converter's memos
as the converter puts the ones it makes (a later ``from_tensor`` of it, or of
a view of its memory, finds it).
"""
from __future__ import annotations

import functools

import torch
from torch.export import _trace as _export_trace

from .patching import patched


def params_buffers_fakified_directly(inputs):
    """While exporting (in this block): torch.export's ``_fakify_params_buffers``
    makes the plain ones directly; ``inputs``: the call's example inputs (a
    parameter sharing memory with one is left to torch's converter)."""
    return patched(_export_trace, "_fakify_params_buffers", functools.partial(_fakified, inputs=inputs))


def _fakified(fakify, inputs):
    @functools.wraps(fakify)
    def run(fake_mode, mod):
        if fake_mode.propagate_real_tensors:  # the fakes carry real values then: torch's way
            return fakify(fake_mode, mod)
        named = {**dict(mod.named_parameters(remove_duplicate=False)), **dict(mod.named_buffers(remove_duplicate=False))}
        shared = _storages_held_twice([*{id(t): t for t in named.values()}.values(),
                                       *(x for x in torch.utils._pytree.tree_leaves(inputs)
                                         if isinstance(x, torch.Tensor))])
        made = {}
        for value in named.values():
            if id(value) not in made:
                made[id(value)] = _fake_of_plain(fake_mode, value) if _plain(value, shared) else \
                    fake_mode.from_tensor(value, static_shapes=True)
        return {name: made[id(value)] for name, value in named.items()}
    return run


def _storage_key(t: torch.Tensor):
    return t.untyped_storage()._cdata


def _storages_held_twice(tensors: list) -> set:
    seen, twice = set(), set()
    for t in tensors:
        if type(t) not in (torch.Tensor, torch.nn.Parameter) or t.layout is not torch.strided:
            continue  # such a one is never plain, and its memory is not compared
        key = _storage_key(t)
        (twice if key in seen else seen).add(key)
    return twice


def _plain(t: torch.Tensor, shared: set) -> bool:
    return (type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout is torch.strided
            and not t.is_quantized and not t.is_inference() and not t._is_view() and t.grad_fn is None
            and t.storage_offset() == 0 and t.is_contiguous()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            and not hasattr(t, "_is_buffer") and getattr(t, "grad_dtype", None) in (None, t.dtype)
            and _storage_key(t) not in shared)


def _fake_of_plain(fake_mode, t: torch.Tensor):
    converter = fake_mode.fake_tensor_converter
    meta = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    fake = converter.from_meta_and_device(fake_mode, meta, t.device)
    if t.requires_grad:
        fake.requires_grad_(True)
    if type(t) is torch.nn.Parameter:
        fake._is_param = True
    converter.set_tensor_memo(t, fake)
    memos = converter.meta_converter
    memos.storage_memo[memos.describer.get_storage_id(t.untyped_storage())] = fake.untyped_storage()
    return fake
