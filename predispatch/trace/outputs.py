"""The forward's outputs: what a program can return, dataclasses registered, the rest refused.

A program returns its outputs flat, with their pytree structure: tensors,
numbers, None and strings in tuples, lists, dicts and registered types. A
dataclass of tensors is registered as torch.export's ``register_dataclass``
would (``ep.module()`` returns the dataclass); any other type (a plain class,
transformers' ``DynamicCache``) is refused naming where in the output it
is, its type and what to return instead, rather than torch's flattening
error from deep inside the trace.
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from .. import _torch
from ..errors import ExportError


def checked_outputs(module: torch.nn.Module, out):
    """``out`` (the forward's result), once every dataclass in it is
    registered; raises ExportError for a value no program can return."""
    registered = set()
    while True:
        bad = next((x for x in _torch.pytree.tree_leaves(out) if not _torch.is_output_leaf(x)), _NONE)
        if bad is _NONE:
            return out
        cls = type(bad)
        if dataclasses.is_dataclass(bad) and cls not in registered:
            torch.export.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
            registered.add(cls)
            continue
        raise ExportError(_unflattenable(module, _where(out, bad), cls))


_NONE = object()


def _where(out, bad) -> str:
    """The path of ``bad`` in ``out`` (``[0].cache``); empty where a type on
    the way was registered without keys (diffusers' outputs are), which
    flattening without paths takes, as torch.export does."""
    try:
        leaves, _ = _torch.pytree.tree_flatten_with_path(out)
    except ValueError:
        return ""
    return next((_torch.pytree.keystr(p) for p, x in leaves if x is bad), "")


def _unflattenable(module: torch.nn.Module, where: str, cls: type) -> str:
    forward = inspect.unwrap(type(module).forward)  # the model's own code, not a decorator's
    try:
        line = f"{inspect.getsourcefile(forward)}:{inspect.getsourcelines(forward)[1]}"
    except (OSError, TypeError):
        line = "unknown location"
    hint = ("; a transformers model returns its cache with use_cache=True: pass use_cache=False "
            "(or set model.config.use_cache = False); one given a cache as past_key_values (peft's "
            "prefix tuning gives its prefix so) returns it whatever use_cache says: export a wrapper "
            "returning only the fields you need (loss, logits)"
            if cls.__module__.startswith("transformers.") and cls.__name__.endswith("Cache") else "")
    return (f"the output{where or ''} of {type(module).__qualname__}.forward ({line}) is a "
            f"{cls.__module__}.{cls.__qualname__}, which a program cannot return: its outputs are "
            "tensors, numbers, None or strings in tuples, lists, dicts, dataclasses or types "
            "registered with torch.utils._pytree.register_pytree_node; return those instead" + hint)
