"""The program stage's result: a real ``torch.export.ExportedProgram`` that runs like eager.

``PredispatchProgram`` is an ``ExportedProgram`` whose ``module()`` writes
mutated parameters, buffers and inputs back the way eager mutated them
(:mod:`predispatch.program.write_backs`), checks that a call's inputs share
memory as the example inputs did where it matters, and that a program exported
under autocast is called under it (:mod:`predispatch.program.ambient`), keeps the module's
submodule order, and calls ops by their cheapest spelling
(:mod:`predispatch.program.run_time_calls`). ``predispatch.load`` restores the
class after ``torch.export.load``.
"""
from __future__ import annotations

import contextlib
import os
import zipfile

import torch
from torch.export import ExportedProgram

from .. import _torch
from ..ir.meta_keys import SWITCH_REGION
from ..ir.program_meta import program_meta
from ..ir.regions import regions
from .ambient import check_ambient_autocast_at_calls
from .requires_grad_calls import check_requires_grad_at_calls
from .output_views import make_output_views
from .run_time_calls import use_run_time_calls
from .write_backs import check_input_aliasing, copy_target_name, fix_write_backs, mutated_user_inputs


def restore_module_order(unlifted: torch.nn.Module, order: list[str]) -> None:
    """torch's unlift makes the submodules in the order it assigns state:
    parameters first, so a submodule holding only buffers moves after those
    with parameters, and ``named_buffers()`` (the order a re-export lifts
    them in) changes. Put every level back in the exported module's order."""
    rank = {path: i for i, path in enumerate(order)}
    for path, m in unlifted.named_modules():
        prefix = f"{path}." if path else ""
        _torch.reorder_child_modules(m, lambda name, prefix=prefix: rank.get(prefix + name, len(rank)))


def leave_caller_in_grad_mode(mode: bool) -> None:
    """The last call of a module whose forward ends under a bare switch. A
    switch as the user writes it: exporting the module again, the trace sees
    one (torch's own redundant ``_set_grad_enabled`` calls it ignores)."""
    torch.set_grad_enabled(mode)


_torch.mark_side_effectful(leave_caller_in_grad_mode)


def leave_grad_mode(unlifted: torch.fx.GraphModule, mode: bool | None) -> None:
    """A forward whose bare grad-mode switch is still in force at its end
    leaves its caller in that mode, as eager does: the module sets it last,
    after the write-backs (which ran in the caller's mode, as the graph's did)."""
    if mode is None:
        return
    graph = unlifted.graph
    with graph.inserting_before(graph.output_node()):
        graph.call_function(leave_caller_in_grad_mode, (mode,))
    unlifted.recompile()


def mark_switch_regions(unlifted: torch.fx.GraphModule) -> None:
    """The submodules of the regions bare switches opened, marked for the
    region run time (in ``meta``, which a copy of the module keeps): an
    exception leaving one restores no grad mode, as in eager."""
    for region in regions(unlifted):
        if region.node.meta.get("custom", {}).get(SWITCH_REGION):
            region.submodule.meta[SWITCH_REGION] = True


class PredispatchProgram(ExportedProgram):
    """The ``ExportedProgram`` :func:`export_predispatch` returns.

        >>> class EMA(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.register_buffer("mean", torch.zeros(2))
        ...     def forward(self, x):
        ...         self.mean.mul_(0.5).add_(x)
        ...         return x * 2
        >>> ep = predispatch.export_predispatch(EMA(), (torch.ones(2),))
        >>> isinstance(ep, torch.export.ExportedProgram), type(ep).__name__
        (True, 'PredispatchProgram')
        >>> m = ep.module()
        >>> m(torch.ones(2)), m.mean       # the buffer is updated as eager updates it
        (tensor([2., 2.]), tensor([1., 1.]))

    Its ``module()`` writes mutated parameters, buffers and inputs back the
    way eager mutated them (a parameter updated under no_grad is updated
    without autograd errors), checks that a call's inputs share memory as
    the example inputs did where it matters, and keeps the module's
    submodule order. :func:`load` gives one back after ``torch.export.save``.
    """

    def module(self, check_guards: bool = True) -> torch.fx.GraphModule:
        unlifted = super().module(check_guards=check_guards)
        record = program_meta(self)
        fix_write_backs(unlifted, record.get("write_back", {}), layouts=record.get("layouts", {}),
                        input_views=record.get("input_views", {}))
        make_output_views(unlifted, record.get("output_views", {}), copy_target_name)
        check_input_aliasing(unlifted, record.get("input_views", {}), mutated_user_inputs(self.graph_signature),
                             record.get("repeated_inputs", {}))
        check_ambient_autocast_at_calls(unlifted, record.get("ambient_autocast"))
        check_requires_grad_at_calls(unlifted, record.get("requires_grad_reads"))
        restore_module_order(unlifted, program_meta(self).get("module_order", []))
        leave_grad_mode(unlifted, record.get("grad_mode_after"))
        use_run_time_calls(unlifted, record.get("ambient_autocast"))
        mark_switch_regions(unlifted)
        return unlifted

    def run_decompositions(self, *args, **kwargs) -> PredispatchProgram:
        """torch's ``run_decompositions``, as for any program: the graph is
        traced below autograd, so regions are inlined and their grad and
        autocast semantics are lost (gradients through a no_grad block are
        no longer cut). The result still writes mutations back as eager did
        (the write-back record survives decomposition)."""
        with _aliased_inputs_apart(self):
            return as_predispatch_program(super().run_decompositions(*args, **kwargs))


@contextlib.contextmanager
def _aliased_inputs_apart(ep: ExportedProgram):
    """While torch traces the program again: the user inputs it sees as views
    of one base (their example values share memory) get example values of
    their own. The graph holds their aliasing itself (a view of the covering
    input, a synthetic base made of their values), and AOTAutograd's export
    refuses to trace inputs that share memory with one mutated."""
    views = program_meta(ep).get("input_views", {})
    positions = {int(i) for i in views} | {v["of"] for v in views.values()}
    users = [n for n in ep.graph.nodes if n.op == "placeholder" and n.name in ep.graph_signature.user_inputs]
    saved = {}
    for i in sorted(positions):
        val = users[i].meta.get("val") if i < len(users) else None
        if isinstance(val, torch.Tensor):
            saved[users[i]] = val
            with _torch.fake_mode_of(val):
                users[i].meta["val"] = torch.empty_strided(val.size(), val.stride(), dtype=val.dtype,
                                                           device=val.device)
    try:
        yield
    finally:
        for node, val in saved.items():
            node.meta["val"] = val


def as_predispatch_program(ep: ExportedProgram) -> PredispatchProgram:
    """The same program, as a PredispatchProgram (e.g. after torch.export.load)."""
    if isinstance(ep, PredispatchProgram):
        return ep
    ep.__class__ = PredispatchProgram
    return ep


def load(path, **kwargs) -> PredispatchProgram:
    """``torch.export.load`` that restores what a plain load cannot.

        >>> import os, tempfile
        >>> ep = predispatch.export_predispatch(torch.nn.Linear(2, 2), (torch.ones(1, 2),),
        ...                                     backward_pass_autocast="off")
        >>> path = os.path.join(tempfile.mkdtemp(), "linear.pt2")
        >>> torch.export.save(ep, path)
        >>> loaded = predispatch.load(path)
        >>> type(loaded).__name__, predispatch.autocast_policy(loaded).backward_pass_autocast
        ('PredispatchProgram', 'off')

    A plain ``torch.export.load`` keeps the graph, the regions, the signature
    and the autocast policy (``predispatch.policies.autocast_policy`` reads it), but
    gives a plain ``ExportedProgram`` whose ``module()`` writes mutations back
    torch's way (a ``copy_`` outside no_grad, refused for a parameter updated
    under no_grad), and does not leave its caller in the grad mode a bare
    switch left in force at the forward's end (``torch.set_grad_enabled(False)``
    called as a function, and never switched back). This returns a
    :class:`PredispatchProgram`, whose ``module()`` writes them back as eager
    did and leaves the caller in that mode. Importing predispatch also
    registers ``predispatch::keep_history``, which loading needs.

    A file that is not such a program (not a zip archive, or one without
    ``torch.export.save``'s archive format: ``torch.save``'s) raises
    ``ValueError`` saying so.
    """
    _refuse_what_is_not_a_saved_program(path)
    return as_predispatch_program(torch.export.load(path, **kwargs))


def _refuse_what_is_not_a_saved_program(path) -> None:
    """torch.export.load would raise zipfile's BadZipFile, or log a traceback
    and raise a RuntimeError that points at it."""
    if not isinstance(path, (str, os.PathLike)) or not os.path.isfile(path):
        return  # a buffer, or a missing file (FileNotFoundError says it)
    what = f"predispatch.load({str(path)!r}): the file is not a program saved with torch.export.save"
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{what} (that is a zip archive; this file is not one)")
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
    if not any(name.rsplit("/", 1)[-1] == "archive_format" for name in names):
        kind = "a torch.save file" if any(name.endswith("data.pkl") for name in names) else "another zip archive"
        raise ValueError(f"{what} (its archive holds no program: it is {kind})")
