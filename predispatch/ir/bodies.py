"""Calling a region's or a Function's subgraph, once per call of the program.

nn.Module.__call__'s bookkeeping costs a few microseconds a call: a body
without hooks is called through its ``forward``.
"""
from __future__ import annotations

import torch

from .. import _torch


def call_body(body, args, kwargs):
    """``body(*args, **kwargs)``, skipping nn.Module.__call__ unless hooks need it."""
    if isinstance(body, torch.nn.Module):
        if not _torch.has_module_hooks(body):
            return body.forward(*args, **kwargs)
        _torch.force_recompile(body)  # else its first call runs the hooks twice
    return body(*args, **kwargs)
