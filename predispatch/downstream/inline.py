"""A program with its regions inlined, for consumers that cannot take higher-order ops.

The grad-mode and autocast semantics of the regions are lost (see
:func:`inline_regions`).
"""
from __future__ import annotations

import copy

import torch
import torch.fx
from torch.export import ExportedProgram

from .. import _torch
from ..ir.regions import delete_unused_submodules, function_calls, graph_modules
from ..ir.regions import inline_region, regions
from ..ir.program_meta import program_meta, set_program_meta
from ..program.program import PredispatchProgram
from ..program.run_time_calls import DTYPE_GUARD


def inline_regions(ep: ExportedProgram) -> ExportedProgram:
    """A copy of ``ep`` with every region inlined as plain ops.

        >>> class NoGrad(torch.nn.Module):
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             y = x * 2
        ...         return x + y
        >>> ep = predispatch.export_predispatch(NoGrad(), (torch.ones(2),))
        >>> flat = predispatch.inline_regions(ep)
        >>> list(predispatch.regions(flat))
        []
        >>> x = torch.ones(2, requires_grad=True)
        >>> flat.module()(x).sum().backward(); x.grad   # the no_grad block no longer cuts
        tensor([3., 3.])

    For consumers that cannot handle higher-order ops. The grad-mode and
    autocast semantics of the regions are LOST: the inlined ops run under
    whatever mode the caller has (a no_grad block's ops now record autograd
    history, an autocast block's ops are no longer autocast: their values
    show the dtypes they compute in without autocast, and the ``.to()``
    guards on dtypes autocast made are dropped). An autograd Function's op is
    replaced by its forward: its custom backward is LOST too (the program
    differentiates the forward's ops). A control-flow operator (``torch.cond``,
    ``while_loop``, ``map``) stays, as torch's own op; the regions in its
    branches are inlined there.
    """
    gm = copy.deepcopy(ep.graph_module)
    record = program_meta(gm)  # it may live on a region's node, which inlining removes
    autocast_inlined = {}  # the graphs an autocast region was inlined in (a branch's too), by id
    while True:  # outermost first; those in a control-flow operator's branches too, inlined there
        top = [r for r in regions(gm) if r.depth == 0] + function_calls(gm)
        if not top:
            break
        for region in top:
            if region.kind == "autocast":
                autocast_inlined[id(region.owner)] = region.owner
            inline_region(region.owner, region)
    for owner in graph_modules(gm):
        owner.recompile()
    delete_unused_submodules(gm)
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n.op in ("placeholder", "output") or n.is_impure())
    for owner in autocast_inlined.values():  # the nodes' values say what autocast made
        _drop_guards_of_autocast_dtypes(owner)
    set_program_meta(gm, record)
    gm.recompile()
    signature = copy.deepcopy(ep.graph_signature)
    outputs = gm.graph.output_node().args[0]
    for spec, node in zip(signature.output_specs, outputs):
        if hasattr(spec.arg, "name") and isinstance(node, torch.fx.Node):
            spec.arg.name = node.name
    new = _torch.program_with(ep, gm, signature)
    if isinstance(ep, PredispatchProgram):
        new.__class__ = PredispatchProgram
    return new




def _drop_guards_of_autocast_dtypes(gm: torch.fx.GraphModule) -> None:
    """Refresh the nodes' values after autocast regions are inlined. A
    ``.to()`` guard checks the dtype its input had when traced; where an
    inlined autocast made that dtype, the input's dtype now depends on the
    caller's mode, so the guard goes."""
    stale = []

    def check(node):
        if node.target is DTYPE_GUARD:
            dtype = node.args[0].meta["val"].dtype
            traced = node.kwargs["dtype"] if "dtype" in node.kwargs else node.args[3]
            if dtype != traced:
                stale.append(node)
                node.target = _SKIPPED  # while values are refreshed

    _torch.refresh_fake_values(gm, before_node=check)
    for node in stale:
        gm.graph.erase_node(node)


def _SKIPPED(*args, **kwargs):
    return None


