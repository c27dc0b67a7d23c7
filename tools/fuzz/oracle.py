"""The differential oracle: eager first, then the exported program.

    >>> outcome = check(program)
    >>> outcome.status   # "matched" | "rejected" | "invalid" | "failure"

* **invalid** — eager itself raised (in either grad mode, forward or
  backward): the program is discarded.
* **rejected** — ``export_predispatch`` raised ``predispatch.ExportError``:
  a sound refusal, counted by its reason.
* **matched** — ``assert_matches_eager`` passed (outputs, gradients of
  inputs and parameters, buffers, parameters and inputs afterwards, torch's
  CPU generator and the grad mode the call leaves its caller in, in both
  grad modes, graph invariants, re-export stable), and the export left
  torch's generator as it found it. A program that branches on a tensor's
  value is exported with ``data_dependent="specialize"`` and also run on
  other inputs (:func:`check_other_inputs`): those on which eager takes the
  example's branches must match eager, those on which it takes another must
  raise the program's check naming a branch's line (or match eager).
* **failure** — anything else: a mismatch, any other exception, an
  ExportError raised by the re-export of ``ep.module()`` (G7), or, for a
  program with repeated layers, a program with layer reuse on that is not,
  node for node, the program with it off. Never skipped.

A branch on a random draw is checked against the program's own draw (the
export's real values draw from the generator as it was then): where the
program draws, its check raising on the example itself is a refusal (at run
time), not a failure.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import linecache
import logging
import os
import re
import sys
import traceback
import warnings

import torch

import predispatch
from predispatch.trace import layer_reuse
from predispatch.testing import assert_same_program
from predispatch.testing.eager import assert_matches_eager, fresh_inputs, run_module
from predispatch._torch import pytree

from .generator import Program

MATCHED, REJECTED, INVALID, FAILURE = "matched", "rejected", "invalid", "failure"


@dataclasses.dataclass
class Outcome:
    status: str
    reason: str = ""  # a short category: rejection reason, eager error, failure kind
    detail: str = ""  # the full message / traceback
    exc: BaseException | None = None
    branches: "OtherInputs | None" = None  # a branching program: what its other inputs showed


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
    # data_dependent="specialize": torch logs each guard its real values decide
    logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


# --------------------------------------------------------------------------
# Programs that branch on a tensor's value: other inputs, the same branches or others.

DATA_DEPENDENT = "data-dependent branch"  # predispatch's run-time check (design/data-dependent.md)
OTHER_SEEDS = range(2, 8)  # other inputs: the example's memory filled from these seeds
BRANCH_LINE = re.compile(r"\s*(if |.* if .* else )")


@dataclasses.dataclass
class OtherInputs:
    """What :func:`check_other_inputs` ran: inputs on which eager takes the
    example's branches (each matched eager) and inputs on which it takes
    another (each raised the check, or matched eager without it)."""

    kept: int = 0
    flipped_raised: int = 0
    flipped_matched: int = 0


def other_inputs(args, seed: int):
    """Copies of ``args`` (sharing memory as they do) with every floating
    storage filled anew from ``seed``."""
    copies, _ = fresh_inputs(args, None, False)
    g = torch.Generator().manual_seed(seed)
    filled = set()
    for t in pytree.tree_leaves(copies):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            storage = t.untyped_storage()
            if storage.data_ptr() not in filled:
                filled.add(storage.data_ptr())
                whole = torch.empty(0, dtype=t.dtype).set_(storage)
                whole.copy_(torch.randn(whole.shape, generator=g))
    return copies


def eager_path(module, args, inputs_require_grad: bool) -> list[tuple[int, int]] | None:
    """The (line, bytecode offset) of each instruction of the module's own
    source its eager forward runs, in order (which branches it takes, of an
    ``if`` or of ``a if c else b`` on one line), from torch's generator
    seeded as the kit seeds it; None if the forward raises."""
    filename = type(module).forward.__code__.co_filename
    lines: list[tuple[int, int]] = []

    def local(frame, event, arg):
        if event == "opcode":
            lines.append((frame.f_lineno, frame.f_lasti))
        return local

    def tracer(frame, event, arg):
        if frame.f_code.co_filename != filename:
            return None
        frame.f_trace_opcodes = True
        return local

    module = copy.deepcopy(module)
    inputs, _ = fresh_inputs(args, None, inputs_require_grad)
    before = sys.gettrace()
    torch.manual_seed(0)
    sys.settrace(tracer)
    try:
        with torch.enable_grad():
            module(*inputs)
    except Exception:
        return None
    finally:
        sys.settrace(before)
    return lines


def _fresh_program(ep):
    """``ep.module()`` with a state of its own (``ep.module()`` shares ``ep``'s)."""
    with warnings.catch_warnings():  # torch's treespec warns about itself when copied
        warnings.simplefilter("ignore", FutureWarning)
        return copy.deepcopy(ep.module())


def _branch_lines(module, path) -> set[int]:
    filename = type(module).forward.__code__.co_filename
    return {n for n, _ in path if BRANCH_LINE.match(linecache.getline(filename, n))}


def check_other_inputs(module, args, ep, *, inputs_require_grad=True, rtol=None, atol=None,
                       most=1, seeds=OTHER_SEEDS) -> OtherInputs:
    """Runs ``ep`` (exported from ``module`` on ``args`` with
    ``data_dependent="specialize"``) on other inputs, at most ``most`` of
    each kind: where eager takes the example's branches the program must
    match eager (``assert_matches_eager``); where eager takes another, it
    must raise its check (a ``RuntimeError`` naming a branch's line, file
    and line number) or match eager. Raises ``AssertionError`` otherwise."""
    example = eager_path(module, args, inputs_require_grad)
    filename = type(module).forward.__code__.co_filename
    named = [f"{os.path.basename(filename)}:{n} in " for n in sorted(_branch_lines(module, example or []))]
    seen = OtherInputs()
    # grad mode on only: the example ran in both, and the branches taken do not depend on it
    compare = dict(export=lambda *a, **k: ep, inputs_require_grad=inputs_require_grad, rtol=rtol, atol=atol,
                   check_reexport=False, grad_modes=(True,))
    for seed in seeds:
        if seen.kept >= most and seen.flipped_raised + seen.flipped_matched >= most:
            break
        inputs = other_inputs(args, seed)
        path = eager_path(module, inputs, inputs_require_grad)
        if path is None:
            continue  # eager raises on these
        if path == example:
            if seen.kept < most:
                try:
                    assert_matches_eager(module, inputs, **compare)
                except Exception as e:
                    raise AssertionError(f"inputs from seed {seed} keep the example's branches in eager; "
                                         f"the program: {type(e).__name__}: {e}") from e
                seen.kept += 1
            continue
        if seen.flipped_raised + seen.flipped_matched >= most:
            continue
        program = _fresh_program(ep)
        call_inputs, _ = fresh_inputs(inputs, None, inputs_require_grad)
        torch.manual_seed(0)
        try:
            with torch.enable_grad():
                program(*call_inputs)
        except RuntimeError as e:
            message = str(e)
            if DATA_DEPENDENT not in message or not any(where in message for where in named):
                raise AssertionError(f"inputs from seed {seed} take another branch in eager; the program "
                                     f"raised, not its check naming one of {named}: {type(e).__name__}: {e}") from e
            seen.flipped_raised += 1
            continue
        try:
            assert_matches_eager(module, inputs, **compare)
        except Exception as e:
            raise AssertionError(f"inputs from seed {seed} take another branch in eager; the program "
                                 f"did not raise its check and differs from eager: {type(e).__name__}: {e}") from e
        seen.flipped_matched += 1
    return seen


def assert_branches_checked(module, args, *, inputs_require_grad=True, rtol=None, atol=None) -> OtherInputs:
    """A program that branches on a tensor's value, as the oracle checks it:
    exported with ``data_dependent="specialize"``, it matches eager on its
    example (``assert_matches_eager``, without the re-export: it keeps the
    checks, not graph for graph) and on other inputs
    (:func:`check_other_inputs`)."""
    with _quiet():
        ep = assert_matches_eager(module, args, inputs_require_grad=inputs_require_grad, rtol=rtol, atol=atol,
                                  check_reexport=False, data_dependent="specialize")
        return check_other_inputs(module, args, ep, inputs_require_grad=inputs_require_grad, rtol=rtol, atol=atol)


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


def _draws(program) -> bool:
    """Does the program draw random numbers?"""
    return bool(re.search(r"torch\.rand|bernoulli|dropout|normal_\(|uniform_\(", program.module_source))


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

        exported = []

        def export(*a, **k):
            generator = torch.get_rng_state()
            ep = predispatch.export_predispatch(*a, **k)
            exported.append(ep)
            if not torch.equal(generator, torch.get_rng_state()):
                raise AssertionError("export changed torch's random generator: it leaves it as it found it")
            return ep

        options = getattr(program, "export_options", {})
        branches = bool(options)
        try:
            ep = assert_matches_eager(module, args, export=export,
                                      inputs_require_grad=program.inputs_require_grad,
                                      check_reexport=not branches, **options, **program.tolerance)
        except predispatch.ExportError as e:
            if not exported:
                return Outcome(REJECTED, category(e), str(e), e)
            return Outcome(FAILURE, "re-export of ep.module() raised " + category(e),
                           traceback.format_exc(), e)
        except RuntimeError as e:
            if branches and DATA_DEPENDENT in str(e) and _draws(program):
                return Outcome(REJECTED, "run-time check: a branch on what the export drew otherwise",
                               str(e), e)
            return Outcome(FAILURE, category(e), traceback.format_exc(), e)
        except Exception as e:
            return Outcome(FAILURE, category(e), traceback.format_exc(), e)
        if branches:
            try:
                seen = check_other_inputs(module, args, ep, inputs_require_grad=program.inputs_require_grad,
                                          **program.tolerance)
            except Exception as e:
                which = "keeping" if "keep the example's" in str(e) else "taking another"
                return Outcome(FAILURE, f"other inputs {which} branch: " + category(e.__cause__ or e),
                               traceback.format_exc(), e)
            return Outcome(MATCHED, branches=seen)
        if getattr(program, "repeated_layers", False):
            try:
                assert_same_without_reuse(module, args)
            except Exception as e:
                return Outcome(FAILURE, "layer reuse changed the program: " + category(e), traceback.format_exc(), e)
    return Outcome(MATCHED)
