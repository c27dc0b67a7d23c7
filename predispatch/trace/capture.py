"""The capture stage of a module's export: a flat functional pre-dispatch graph.

torch.export's non-strict front end makes the fake inputs, solves dynamic
shapes, lifts parameters, buffers and constants and names placeholders; its
aten stage is replaced by ours: :func:`functional_trace` (a FunctionalTensorMode
on the PreDispatch key, the graph ``aot_export_module(pre_dispatch=True)``
makes, in one pass instead of two) under the op policy, with grad mode on (so
the graph is traced for training), the compiling flag set (so models take
their export-friendly branches), and the recorder of
:mod:`predispatch.trace.recorder` inside the forward.

The graph still holds ``_set_grad_enabled`` / ``_enter_autocast`` /
``_exit_autocast`` calls; the regions stage turns them into higher-order ops.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc

import torch

from .. import _torch
from ..errors import ExportError, exception_location
from . import unholdable
from .functional_trace import functional_trace
from ..policies.op_policy import OpPolicy
from ..ir.assumptions import is_run_time_message
from ..ir.program_meta import program_meta
from ..ir.records import WRITES, TraceRecord
from .recorder.session import recording

_ROOT = "_export_root."


@dataclasses.dataclass
class Captured:
    artifact: object  # torch.export's ExportArtifact (gm, signature, constants, specs)
    record: TraceRecord
    args: tuple
    kwargs: dict
    dynamic_shapes: object
    original_state_dict: dict
    verify_additional_inputs: object

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.artifact.aten.gm

    @property
    def signature(self):
        return self.artifact.aten.sig


def _strip_root(name: str) -> str:
    return name[len(_ROOT):] if name.startswith(_ROOT) else name


def history_nodes(record: TraceRecord) -> set:
    """What the history stage may need although nothing else uses it: a
    replaced value, the node a grad-mode segment ended at (where its
    keep_history goes), and where a replayed view was made."""
    return {*record.needed, *(n for e in record.events if e.kind in WRITES for n in (e.of, e.node, e.at))}


def _strip_key(key: str) -> str:
    """``"param:_export_root.w"`` -> ``"param:w"`` (other keys as they are)."""
    kind, sep, name = key.partition(":")
    return f"{kind}{sep}{_strip_root(name)}" if sep else key


def _aten_stage(policy: OpPolicy, record: TraceRecord, specialize: bool):
    """torch.export's ``_to_aten_func`` hook, doing our functional pre-dispatch
    trace (specializing: with the nodes binding unbacked symbols noted, which
    torch's passes after it forget once a guard made a symbol a number)."""

    def to_aten(mod, fake_args, fake_kwargs, fake_params_buffers, constant_attrs,
                produce_guards_callback=None, *, transform=lambda f: f, **_unused):
        def trace(stack, wrapped, args, *, kwargs=None, **_flags):
            # a stamped layer's outputs carry no real value: specializing, every layer is traced
            with recording(wrapped, record, _strip_root, reuse_layers=not specialize):
                gm, signature, record.input_views = functional_trace(
                    wrapped, args, kwargs, keep=lambda: history_nodes(record),
                    on_layout_change=lambda key, change: record.layouts.__setitem__(
                        _strip_key(key), {**change.to_json(), "source": change.source and _strip_key(change.source)}),
                    on_retrace=record.clear, rebound=lambda: record.rebound_buffers, record=record,
                    on_output_view=lambda index, view: record.output_views.__setitem__(
                        index, {**view.to_json(), "of": _strip_key(view.of)}))
                hold_module_stacks(gm)
                return gm, signature

        if specialize:
            _torch.real_values_restored(fake_params_buffers, _named_state(mod))
        with contextlib.ExitStack() as stack:
            stack.enter_context(_torch.restoring_module_attributes(getattr(mod, "_export_root", mod)))
            stack.enter_context(_torch.reparametrize_module(
                mod, fake_params_buffers, tie_weights=True, strict=True, stack_weights=True))
            stack.enter_context(_torch.backend_decompositions_ignored())
            stack.enter_context(_torch.compiling_state_context())
            stack.enter_context(torch.enable_grad())
            stack.enter_context(_torch.decompose_by(policy.should_decompose))
            stack.enter_context(_torch.pre_dispatch_pushes_without_uncaching())
            stack.enter_context(_torch.fast_fake_kernels())
            stack.enter_context(_torch.symbolic_work_recorded_when_read())
            with _torch.module_stacks_renamed_once() as hold_module_stacks:
                gm, graph_signature = transform(trace)(stack, mod, fake_args, kwargs=fake_kwargs)
        # a program exported again: its checks of the example's branches are its own ops, not
        # torch's to write again beside them (G7: passes/assumptions.py drops torch's copies)
        runs_its_own_checks = _torch.kept_as_they_are(gm, is_run_time_message)
        if specialize or runs_its_own_checks:
            record.unbacked_bindings = {n: s for n in gm.graph.nodes if (s := _torch.unbacked_symbols_bound(n))}
        if specialize:
            record.specialized_guards = _torch.specialized_guards(gm)

        if produce_guards_callback is not None:
            try:
                produce_guards_callback(gm)
            except (_torch.ConstraintViolationError, _torch.ValueRangeError) as e:
                raise _torch.UserError(_torch.UserErrorType.CONSTRAINT_VIOLATION, str(e)) from e

        return _torch.produce_aten_artifact(
            gm=gm, mod=mod, constant_attrs=constant_attrs, graph_signature=graph_signature,
            pre_dispatch=False,  # torch's region passes are replaced by ours
            fake_args=fake_args, fake_kwargs=fake_kwargs, fake_params_buffers=fake_params_buffers)

    return to_aten


def _named_state(mod: torch.nn.Module) -> dict:
    return {**dict(mod.named_parameters(remove_duplicate=False)), **dict(mod.named_buffers(remove_duplicate=False))}


def _hooked(path: str | None) -> str:
    return "every module (global)" if path is None else f"submodule {path!r}" if path else "the module"


def _refuse_uninitialized_state(module: torch.nn.Module) -> None:
    """A lazy module (``nn.LazyConv2d``) learns its parameters' shapes from its
    first call, which eager makes before any other; a trace cannot: it
    works on the state as the export finds it."""
    for name, t in _named_state(module).items():
        if isinstance(t, torch.nn.parameter.UninitializedTensorMixin):
            owner = module.get_submodule(name.rpartition(".")[0])
            raise ExportError(
                f"{name} of {type(owner).__name__} is not initialized yet: a lazy module takes its "
                "shapes from its first call; call the module once on an example input before exporting it")


def _refuse_backward_hooks(module: torch.nn.Module) -> None:
    """A module backward hook changes eager's gradients; a graph cannot call it."""
    for path, hook in _torch.backward_hooks(module):
        code = getattr(hook, "__code__", None)
        where = f"{code.co_filename}:{code.co_firstlineno}" if code else repr(hook)
        raise ExportError(
            f"a backward hook on {_hooked(path)} "
            f"({getattr(hook, '__qualname__', hook)}, defined at {where}) cannot be exported "
            "soundly: the program's backward would not call it; remove it before exporting, or "
            "register it on ep.module()")


def capture_module(module, args, kwargs, dynamic_shapes, policy: OpPolicy, record: TraceRecord,
                   data_dependent: str = "refuse") -> Captured:
    """The capture stage of a module's export: torch.export's front end, our
    trace as its aten stage. ``data_dependent="specialize"``: the trace
    carries the example's real values and takes the branches they take, each
    a guard recorded in ``record`` and checked at run time."""
    _refuse_backward_hooks(module)
    _refuse_uninitialized_state(module)
    args, kwargs, orig_in_spec, dynamic_shapes, verify_additional_inputs = (
        _torch.process_export_inputs(module, args, kwargs, dynamic_shapes))
    original_state_dict = _torch.original_state_dict(module)
    _torch.clear_fake_dispatch_cache()  # one export's entries are not another's (see there)
    specialize = data_dependent == "specialize"
    with (_data_dependence_as_export_error(specialize), _torch.fake_tensor_log_quiet(),
          _functionalization_errors_as_export_errors(), _garbage_collection_paused(),
          _torch.real_values_propagated() if specialize else contextlib.nullcontext()):
        artifact = _torch.non_strict_export(module, args, kwargs, dynamic_shapes, orig_in_spec,
                                            _aten_stage(policy, record, specialize))
    if specialize:
        _torch.real_values_dropped(artifact.fake_mode, artifact.aten.gm)
    unholdable.refuse_what_no_program_holds(module, artifact.aten)
    # autocast the caller has on applies to the traced ops without a block in the graph: where the
    # forward read a dtype under it (a branch on it, a cast to it), the program holds only under
    # it (program/ambient.py)
    if record.reads_dtype_under_autocast or _checks_ambient_autocast(module):  # (a program exported again)
        record.ambient_autocast = {d: str(torch.get_autocast_dtype(d)).removeprefix("torch.")
                                   for d in _torch.autocast_devices() if torch.is_autocast_enabled(d)}
    if isinstance(module, torch.fx.GraphModule):  # a program exported again: its calls' checks are its own
        record.requires_grad_reads += [r for r in program_meta(module).get("requires_grad_reads", [])
                                       if r not in record.requires_grad_reads]
    return Captured(artifact, record, args, kwargs, dynamic_shapes,
                    original_state_dict, verify_additional_inputs)


def _checks_ambient_autocast(module: torch.nn.Module) -> bool:
    """``ep.module()`` of a program that checks the caller's autocast: its
    forward's dtype reads happened in the first export."""
    return isinstance(module, torch.fx.GraphModule) and bool(program_meta(module).get("ambient_autocast"))


@contextlib.contextmanager
def _garbage_collection_paused():
    """Python's cycle collector waits until the trace ends: the finalizers it
    runs are not the module's code, yet their torch calls would be traced (an
    abandoned generator decorated with ``torch.no_grad()`` enters and leaves
    the block as it is collected: a grad-mode block in the graph)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _data_dependence_as_export_error(specializing: bool):
    """Python control flow on a tensor's value cannot be captured in a graph
    (specializing: where the example's value is not known, as in an
    autograd.Function's backward, which is traced on inputs of no value)."""
    try:
        yield
    except _torch.data_dependence_errors() as e:
        remedy = ("the example's value is not known there" if specializing else
                  "write the branch at that line as torch.cond(pred, true_fn, false_fn, operands), "
                  "which keeps both branches in the program, or export with "
                  "data_dependent='specialize' to take the example's branch, checked when the program runs")
        raise ExportError(
            "data-dependent Python control flow (a Python bool/int/float/item() of a "
            f"tensor's value) cannot be exported soundly, at {exception_location(e)} ({_first_line(e)}); "
            f"{remedy}") from e


# functionalization's (and torch.export's collective remapping's) refusals, said in user terms:
# the kind of refusal (as the seam tells it from torch's text) -> what it means
_FUNCTIONALIZATION_ERRORS = {
    "non-functional mutation":
        "an in-place update at {where} of a tensor that is neither a parameter, a buffer nor an "
        "input (a plain tensor attribute, a global, a closure's tensor) cannot be exported soundly; "
        "register it with register_buffer or pass it as an input",
    "async collective":
        "an asynchronous collective (async_op=True) at {where} cannot be exported soundly: the "
        "work handle it returns is waited on outside the graph; use a functional collective "
        "(torch.distributed._functional_collectives, waited on where its result is read) or "
        "async_op=False",
    "frozen storage":
        "an in-place update at {where} of a view of a tensor whose storage a set_() swapped before "
        "(the view still shares the old storage) cannot be exported soundly: functionalization "
        "cannot follow the old storage past the swap (AOTAutograd refuses it too); take the view "
        "after the set_(), or copy instead of swapping",
    "no_grad view":
        "a view made under no_grad whose base is updated in grad mode (or read through it after "
        "such an update), at {where}: the trace's own autograd refuses to replay the view, so it "
        "cannot be exported; take the view (or the set_ source) from a clone instead",
}


@contextlib.contextmanager
def _functionalization_errors_as_export_errors():
    try:
        yield
    except (RuntimeError, AssertionError) as e:  # torch's collective remapping asserts
        kind = _torch.functionalization_error_kind(e)
        if kind is not None:
            raise ExportError(_FUNCTIONALIZATION_ERRORS[kind].format(where=exception_location(e))) from e
        raise


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
