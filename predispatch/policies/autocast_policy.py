"""The backward-pass autocast policy recorded in a program (contract G6).

    >>> ep = export_predispatch(m, (x,), backward_pass_autocast="off",
    ...                         on_backward_autocast_mismatch="warn")
    >>> autocast_policy(ep)
    AutocastPolicy(backward_pass_autocast='off', on_backward_autocast_mismatch='warn')

It is stored, JSON-encoded, in a node's ``meta["custom"]`` (which
torch.export serialization keeps), so it survives save and load.
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _torch
from ..ir.program_meta import program_meta

BACKWARD_MODES = ("same_as_forward", "off")
MISMATCH_ACTIONS = ("error", "warn", "do_nothing")
AUTOCAST_KWARGS = ("device_type", "dtype", "enabled", "cache_enabled")


@dataclasses.dataclass(frozen=True)
class AutocastPolicy:
    """The backward autocast policy of a program, as :func:`autocast_policy` reads it.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(2, 2), (torch.ones(1, 2),),
        ...                                     backward_pass_autocast="off")
        >>> policy = predispatch.autocast_policy(ep)
        >>> policy.backward_pass_autocast, policy.on_backward_autocast_mismatch
        ('off', 'error')

    ``backward_pass_autocast``: "same_as_forward", "off", or a list of
    ``torch.amp.autocast`` kwargs dicts; ``on_backward_autocast_mismatch``:
    "error", "warn" or "do_nothing" (see :func:`export_predispatch`)."""

    backward_pass_autocast: object = "same_as_forward"
    on_backward_autocast_mismatch: str = "error"

    @classmethod
    def validated(cls, backward_pass_autocast, on_backward_autocast_mismatch) -> "AutocastPolicy":
        return cls(_check_backward(backward_pass_autocast), _check_action(on_backward_autocast_mismatch))

    def to_json(self) -> dict:
        bwd = self.backward_pass_autocast
        if not isinstance(bwd, str):
            bwd = [{k: (str(v).replace("torch.", "") if isinstance(v, torch.dtype) else v)
                    for k, v in kw.items()} for kw in bwd]
        return {"backward_pass_autocast": bwd,
                "on_backward_autocast_mismatch": self.on_backward_autocast_mismatch}

    @classmethod
    def from_json(cls, data: dict) -> "AutocastPolicy":
        bwd = data.get("backward_pass_autocast", "same_as_forward")
        if not isinstance(bwd, str):
            bwd = [{k: (getattr(torch, v) if k == "dtype" and isinstance(v, str) else v)
                    for k, v in kw.items()} for kw in bwd]
        return cls(bwd, data.get("on_backward_autocast_mismatch", "error"))

    def describe(self) -> str:
        return (f"backward_pass_autocast={self.backward_pass_autocast!r}, "
                f"on_backward_autocast_mismatch={self.on_backward_autocast_mismatch!r}")


def _check_backward(value):
    if isinstance(value, str):
        if value not in BACKWARD_MODES:
            raise ValueError(f"backward_pass_autocast must be one of {BACKWARD_MODES!r} "
                             f"or a list of torch.amp.autocast kwargs dicts, got {value!r}")
        return value
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"backward_pass_autocast must be one of {BACKWARD_MODES!r} or a list "
                         f"of torch.amp.autocast kwargs dicts, got {type(value).__name__}")
    out = []
    for kw in value:
        if not isinstance(kw, dict):
            raise ValueError("backward_pass_autocast list items must be dicts of torch.amp.autocast "
                             f"kwargs ({', '.join(AUTOCAST_KWARGS)}), got {kw!r}")
        unknown = set(kw) - set(AUTOCAST_KWARGS)
        if unknown or "device_type" not in kw:
            raise ValueError("each backward_pass_autocast dict needs 'device_type' and may have "
                             f"only {AUTOCAST_KWARGS!r}; got keys {sorted(kw)!r}")
        _check_autocast_values(kw)
        out.append(dict(kw))
    return out


def _check_autocast_values(kw: dict) -> None:
    """The values ``torch.amp.autocast`` accepts. A dtype it does not support
    on the device passes: autocast disables itself then, and so does the policy."""
    devices = _torch.autocast_devices()
    allowed = {"device_type": (lambda v: v in devices, f"one of {devices!r}"),
               "dtype": (lambda v: v is None or isinstance(v, torch.dtype), "a torch.dtype or None"),
               "enabled": (lambda v: isinstance(v, bool), "True or False"),
               "cache_enabled": (lambda v: v is None or isinstance(v, bool), "True, False or None")}
    for key, value in kw.items():
        ok, what = allowed[key]
        if not ok(value):
            raise ValueError(f"backward_pass_autocast: {key!r} must be {what}, got {value!r}")


def _check_action(value):
    if value not in MISMATCH_ACTIONS:
        raise ValueError(f"on_backward_autocast_mismatch must be one of {MISMATCH_ACTIONS!r}, got {value!r}")
    return value


def autocast_policy(ep) -> AutocastPolicy:
    """The backward autocast policy recorded in an exported program.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(2, 2), (torch.ones(1, 2),),
        ...                                     on_backward_autocast_mismatch="warn")
        >>> predispatch.autocast_policy(ep)
        AutocastPolicy(backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='warn')

    The policy is kept through ``torch.export.save`` and loading back, and
    printed by :func:`format_program`; :func:`compile_training` enforces it.
    """
    return AutocastPolicy.from_json(program_meta(ep).get("autocast_policy", {}))
