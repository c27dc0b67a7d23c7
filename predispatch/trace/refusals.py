"""Constructs a trace cannot capture soundly, refused while the forward runs.

Each is a context manager that wraps what the construct calls, for the
duration of the traced forward, and raises ``ExportError`` naming the
construct and the user's line.
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.autograd.forward_ad

from ..errors import ExportError, is_library_file, user_location
from .._torch.patching import patched


# Global state a function call changes, which a graph does not record: the
# program would run under the caller's state instead. (torch's own calls, e.g.
# torch.autocast's __enter__ setting the autocast state, are not refused.)
_AUTOCAST_CALL = ("an autocast mode set by a function call rather than a block: the program "
                  "would run without it; use `with torch.autocast(...)`")
_RNG_CALL = ("torch's random generator re-seeded with a seed drawn anew on each call, which "
             "the program would replay; seed with torch.manual_seed(an int)")
_AUTOGRAD_CALL = ("autograd run inside the traced code (a gradient, a hook on the backward): a "
                  "pre-dispatch graph records the ops, and the program's backward would not do "
                  "it; compute it outside the exported module (a custom Function's backward: "
                  "differentiate by hand, or recompute with torch.utils.checkpoint)")
_TRANSFORM_CALL = ("a torch.func transform inside the forward: the functional pre-dispatch "
                   "trace cannot capture it")
# (torch.cond, while_loop and map are captured: trace/control_flow; this says why another
# path to dynamo, which cannot trace through the exporter's recording, is refused)
CONTROL_FLOW_CALL = ("a control-flow operator: its branches or body are traced by dynamo, "
                      "which cannot trace through the exporter's recording (torch.export.export "
                      "keeps it, without functional regions)")
_TORCHSCRIPT_CALL = ("a TorchScript module (torch.jit.script or torch.jit.trace) runs its code in "
                     "TorchScript's interpreter, beneath what the trace records, so the program would not "
                     "hold its ops nor read its parameters; call the nn.Module it was made from")
_REFUSED_CALLS = {
    (torch.jit.ScriptModule, "__call__"): _TORCHSCRIPT_CALL,
    (torch.autograd, "grad"): _AUTOGRAD_CALL,
    (torch.autograd, "backward"): _AUTOGRAD_CALL,
    (torch.Tensor, "backward"): _AUTOGRAD_CALL,
    (torch.Tensor, "register_hook"): _AUTOGRAD_CALL,
    (torch.autograd.graph.saved_tensors_hooks, "__init__"): _AUTOGRAD_CALL,
    (torch.autograd.forward_ad, "make_dual"): _AUTOGRAD_CALL,
    **{(module, name): _TRANSFORM_CALL for module in (torch, torch.func)
       for name in ("grad", "grad_and_value", "vjp", "jvp", "jacrev", "jacfwd",
                    "hessian", "linearize")},
    **{(torch, name): _AUTOCAST_CALL for name in (
        "set_autocast_enabled", "set_autocast_dtype", "set_autocast_cpu_enabled",
        "set_autocast_cpu_dtype", "set_autocast_gpu_dtype", "set_autocast_cache_enabled")},
    **{(module, "seed"): _RNG_CALL for module in (torch, torch.random)},
}


@contextlib.contextmanager
def refusing_state_calls():
    """The calls of ``_REFUSED_CALLS`` from the user's code raise ``ExportError``;
    a re-seed from any code (the seeds and forks the program can make are
    recorded instead: :mod:`predispatch.trace.random_state`)."""
    def refusing(why):
        def make(fn):
            def call(*args, **kwargs):
                # called through patched()'s dispatch: the caller is 2 frames up
                if why is not _RNG_CALL and is_library_file(sys._getframe(2).f_code.co_filename):
                    return fn(*args, **kwargs)
                what = "a call" if why is _TORCHSCRIPT_CALL else f"{getattr(fn, '__qualname__', fn)}()"
                raise ExportError(f"{what} at {user_location()} cannot be exported soundly: {why}")
            return call
        return make

    with contextlib.ExitStack() as stack:
        for (module, name), why in _REFUSED_CALLS.items():
            if hasattr(module, name):
                stack.enter_context(patched(module, name, refusing(why)))
        yield


@contextlib.contextmanager
def refusing_new_state(module: torch.nn.Module):
    """A parameter or buffer the forward registers on ``module`` or its
    submodules under a name that held none (``self.register_buffer("cache",
    t)`` in the forward) is module state eager's module gains and the
    program's module would not: refused, naming the line. (A new tensor
    under a registered name is a rebinding, written back:
    :func:`predispatch.trace.translations.buffer_rebinding_checked`.)"""
    exported = {id(m) for m in module.modules()}  # not the tracers' own modules (a constant lifted)

    def registering(table: str):
        def make(register):
            def call(self, name, value, *args, **kwargs):
                if (id(self) in exported and value is not None
                        and self.__dict__.get(table, {}).get(name) is None):
                    _refuse_new_state("buffer" if table == "_buffers" else "parameter",
                                      f"{register.__name__}({name!r}) at {user_location()}")
                return register(self, name, value, *args, **kwargs)
            return call
        return make

    with patched(torch.nn.Module, "register_buffer", registering("_buffers")), \
            patched(torch.nn.Module, "register_parameter", registering("_parameters")):
        yield


def refuse_buffers_gained(before: dict, after: dict, strip=lambda name: name) -> None:
    """A buffer the module tree holds after the forward and did not before
    (``_buffers[name] = t``, a placeholder ``None`` given a tensor), however
    it came: refused as :func:`refusing_new_state` refuses a registration."""
    for name, value in after.items():
        if value is not None and before.get(name) is None:
            _refuse_new_state("buffer", f"buffer {strip(name)!r}, new at the forward's end,")


def _refuse_new_state(kind: str, what: str) -> None:
    raise ExportError(f"{what} cannot be exported soundly: a {kind} the forward registers is module state "
                      f"eager's module gains and the program's would not hold; register it in __init__ "
                      f"(with a tensor of its shape: the forward may then assign it)")

