"""The differential oracle: eager first, then the exported program.

    >>> outcome = check(program)
    >>> outcome.status   # "matched" | "rejected" | "invalid" | "failure"

* **invalid** — eager itself raised (in either grad mode, forward or
  backward): the program is discarded.
* **rejected** — ``export_predispatch`` raised ``predispatch.ExportError``:
  a sound refusal, counted by its reason.
* **matched** — ``assert_matches_eager`` passed (outputs, gradients of
  inputs and parameters, buffers, parameters and inputs afterwards, in both
  grad modes, graph invariants, re-export stable).
* **failure** — anything else: a mismatch, any other exception, an
  ExportError raised by the re-export of ``ep.module()`` (G7), or, for a
  program with repeated layers, a program with layer reuse on that is not,
  node for node, the program with it off. Never skipped.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import re
import traceback
import warnings

import torch

import predispatch
from predispatch.trace import layer_reuse
from predispatch.testing import assert_same_program
from predispatch.testing.eager import assert_matches_eager, run_module

from .generator import Program

MATCHED, REJECTED, INVALID, FAILURE = "matched", "rejected", "invalid", "failure"


@dataclasses.dataclass
class Outcome:
    status: str
    reason: str = ""  # a short category: rejection reason, eager error, failure kind
    detail: str = ""  # the full message / traceback
    exc: BaseException | None = None


def category(exc: BaseException) -> str:
    """A short, stable label for an exception: its type and the gist of its
    first line, with names, numbers, shapes and locations taken out."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    if isinstance(exc, AssertionError):
        # assert_close: "[grad_mode=True] output 0: Tensor-likes are not close!"
        m = re.match(r"(\[grad_mode=\w+\] )?([a-z_ ]+?)(\s*\d+|\[[^\]]*\])?( after the call)?:", first)
        if m:
            return f"mismatch: {m.group(2).strip()}{m.group(4) or ''}"
        if first.startswith("G7"):
            return "G7: re-export changed the graph"
        if "G1/G3" in first:
            return "G1/G3 invariants: " + (text.splitlines()[1].split(":", 1)[-1].strip() if len(text.splitlines()) > 1 else "")
    first = re.split(r" at (?:/|<|unknown)", first)[0]
    first = re.sub(r"<fuzz-program-\d+>:\d+", "<line>", first)
    first = re.sub(r"\b(v\d+|self\.\w+|[xyz])\b", "_", first)
    first = re.sub(r"\d+", "N", first)
    first = re.sub(r"\[[^\]]*\]", "[..]", first)
    return f"{type(exc).__name__}: {first[:140]}"


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def assert_same_without_reuse(module, args) -> None:
    """The program with layer reuse on is, node for node, the program with it off."""
    programs = []
    for enabled in (True, False):
        with layer_reuse.reuse_layers(enabled):
            programs.append(predispatch.export_predispatch(module, args))
    assert_same_program(*programs, what="layer reuse on vs off")


def run_eager(module, args, inputs_require_grad: bool) -> None:
    """Eager in each grad mode, as the kit runs it (forward, loss, backward)."""
    for grad_mode in (True, False):
        run_module(copy.deepcopy(module), args, None, grad_mode=grad_mode,
                   inputs_require_grad=inputs_require_grad)


def global_state() -> tuple:
    """Grad mode, CPU autocast state and nesting, and the mode stacks: a
    program must leave them as it found them, even when it raises (G7)."""
    nesting = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return (("grad enabled", torch.is_grad_enabled()),
            ("cpu autocast enabled", torch.is_autocast_enabled("cpu")),
            ("cpu autocast dtype", torch.get_autocast_dtype("cpu")),
            ("autocast cache enabled", torch.is_autocast_cache_enabled()),
            ("autocast nesting", nesting),
            ("torch function modes", torch._C._len_torch_function_stack()),
            ("dispatch modes", torch._C._len_torch_dispatch_stack()))


def _restore(state: tuple) -> None:
    values = dict(state)
    torch.set_grad_enabled(values["grad enabled"])
    torch.set_autocast_enabled("cpu", values["cpu autocast enabled"])
    torch.set_autocast_dtype("cpu", values["cpu autocast dtype"])
    torch.set_autocast_cache_enabled(values["autocast cache enabled"])
    while torch.autocast_decrement_nesting() > values["autocast nesting"]:
        pass
    if values["autocast nesting"] == 0:
        torch.clear_autocast_cache()


def check(program: Program) -> Outcome:
    """The program's outcome; a program that leaves grad mode, autocast or
    a mode stack changed behind it fails (and the state is restored, so
    later programs are not affected)."""
    before = global_state()
    outcome = _check(program)
    after = global_state()
    if after != before:
        leaked = ", ".join(f"{k}: {a} -> {b}" for (k, a), (_, b) in zip(before, after) if a != b)
        _restore(before)
        if outcome.status != FAILURE:
            return Outcome(FAILURE, "leaked global state: " + leaked.split(":")[0],
                           f"after the {outcome.status} check: {leaked}")
    return outcome


def _check(program: Program) -> Outcome:
    with _quiet():
        try:
            module, args = program.build()
        except Exception as e:  # a generator bug: the source does not build
            return Outcome(FAILURE, "program does not build: " + category(e), traceback.format_exc(), e)
        try:
            run_eager(module, args, program.inputs_require_grad)
        except Exception as e:
            return Outcome(INVALID, category(e), traceback.format_exc(), e)

        exported_once = []

        def export(*a, **k):
            ep = predispatch.export_predispatch(*a, **k)
            exported_once.append(True)
            return ep

        try:
            assert_matches_eager(module, args, export=export,
                                 inputs_require_grad=program.inputs_require_grad,
                                 **program.tolerance)
        except predispatch.ExportError as e:
            if not exported_once:
                return Outcome(REJECTED, category(e), str(e), e)
            return Outcome(FAILURE, "re-export of ep.module() raised " + category(e),
                           traceback.format_exc(), e)
        except Exception as e:
            return Outcome(FAILURE, category(e), traceback.format_exc(), e)
        if getattr(program, "repeated_layers", False):
            try:
                assert_same_without_reuse(module, args)
            except Exception as e:
                return Outcome(FAILURE, "layer reuse changed the program: " + category(e), traceback.format_exc(), e)
    return Outcome(MATCHED)
