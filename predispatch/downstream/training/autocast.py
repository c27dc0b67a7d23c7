"""The backward's autocast: the state it was traced assuming, and the check at run time.

The backward is traced under the program's ``backward_pass_autocast``; a
backward that runs under another ambient autocast state, in a way that would
change its graph, is reported as the program's ``on_backward_autocast_mismatch``
says (:class:`BackwardCheck`, called in a pre-hook of the compiled backward).
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Callable

import torch
import torch.fx

from ... import _torch
from ...errors import BackwardAutocastMismatchError, BackwardAutocastMismatchWarning
from ...policies.autocast_policy import AutocastPolicy


def ambient_autocast() -> dict[str, torch.dtype]:
    return {d: torch.get_autocast_dtype(d) for d in _torch.autocast_devices()
            if torch.is_autocast_enabled(d)}


def as_autocast_kwargs(state: dict) -> list[dict]:
    """A state as ``torch.amp.autocast`` kwargs (the list form of ``backward_pass_autocast``)."""
    return [{"device_type": d, "dtype": t} for d, t in sorted(state.items())]


@contextlib.contextmanager
def autocast_entered(kwargs_list: list[dict]):
    """Autocast off everywhere, then each ``torch.amp.autocast(**kw)`` entered
    (what AOTAutograd does for a list ``backward_pass_autocast``)."""
    with _torch.disable_autocast(), contextlib.ExitStack() as stack:
        for kw in kwargs_list:
            stack.enter_context(torch.amp.autocast(**kw))
        yield


def assumed_autocast(policy: AutocastPolicy, forward_state: dict) -> dict[str, torch.dtype]:
    bwd = policy.backward_pass_autocast
    if bwd == "same_as_forward":
        return dict(forward_state)
    # What torch.autocast really does with the dicts: it disables itself for
    # a dtype the device does not support (it has warned about it already).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with autocast_entered([] if bwd == "off" else bwd):
            return ambient_autocast()


def _describe(state: dict) -> str:
    if not state:
        return "no autocast"
    return ", ".join(f"autocast({d!r}, {str(t).replace('torch.', '')})" for d, t in sorted(state.items()))


@dataclasses.dataclass(frozen=True)
class BackwardCheck:
    """What the backward assumes, which of its ops autocast would change, per
    device, and (``code_under``) the backward's code when traced op by op
    under a state (``None``: the assumed one). ``traced_code`` is that code
    for the assumed state where the backend ran the graph traced so (None:
    traced again when first needed, a compiler's graph is another)."""

    policy: AutocastPolicy
    assumed: dict
    sensitive_ops: dict  # device -> sorted names of backward ops with an autocast kernel there
    traced_code: str | None = ""
    code_under: Callable[[dict | None], str] | None = None
    _verdicts: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def mismatch(self, found: dict) -> str | None:
        devices = [d for d in set(found) | set(self.assumed)
                   if found.get(d) != self.assumed.get(d) and self.sensitive_ops.get(d)]
        if not devices or not self._changes_backward(found):
            return None
        ops = {d: self.sensitive_ops[d][:5] for d in sorted(devices)}
        return (f"the backward ran under {_describe(found)} but was traced assuming "
                f"{_describe(self.assumed)} (backward_pass_autocast="
                f"{self.policy.backward_pass_autocast!r}); its ops that autocast treats "
                f"differently: {ops}. Export with the backward_pass_autocast the backward really "
                "runs under, run the backward outside that autocast, or set "
                "on_backward_autocast_mismatch='warn' or 'do_nothing'.")

    def _changes_backward(self, found: dict) -> bool:
        """Does tracing the backward under ``found`` give another graph? An op
        with an autocast kernel may still be left alone (its inputs are in the
        autocast dtype already), so only a retrace tells. Cached per state."""
        if self.code_under is None:
            return True
        key = tuple(sorted(found.items()))
        if key not in self._verdicts:
            if self.traced_code is None and None not in self._verdicts:
                self._verdicts[None] = self.code_under(None)
            traced = self._verdicts[None] if self.traced_code is None else self.traced_code
            self._verdicts[key] = self.code_under(found) != traced
        return self._verdicts[key]

    def __call__(self) -> None:
        action = self.policy.on_backward_autocast_mismatch
        if action == "do_nothing":
            return
        found = ambient_autocast() if _torch.any_autocast_enabled() else {}  # one C call where none is on
        if found == self.assumed:
            return
        problem = self.mismatch(found)
        if problem is None:
            return
        if action == "error":
            raise BackwardAutocastMismatchError(problem)
        warnings.warn(problem, BackwardAutocastMismatchWarning, stacklevel=3)


def sensitive_ops(gm: torch.fx.GraphModule) -> dict[str, list[str]]:
    """Per device, the ops of ``gm`` that autocast on that device would cast."""
    found: dict[str, set] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, _torch.OpOverload):
            continue
        val = node.meta.get("val")
        vals = val if isinstance(val, (list, tuple)) else [val]
        devices = {v.device.type for v in vals if isinstance(v, torch.Tensor)}
        for device in devices:
            if _torch.has_autocast_kernel(node.target, device):
                found.setdefault(device, set()).add(str(node.target))
    return {d: sorted(ops) for d, ops in found.items()}
