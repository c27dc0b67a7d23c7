"""Outputs that eager returns as views of an input the forward wrote: made again from the caller's tensor.

    >>> class AddThenView(torch.nn.Module):
    ...     def forward(self, x):
    ...         x.add_(1)
    ...         return x.view(-1)
    >>> ep = predispatch.export_predispatch(AddThenView(), (torch.zeros(2, 2),))
    >>> x = torch.zeros(2, 2, requires_grad=True) * 1
    >>> with torch.no_grad():
    ...     out = ep.module()(x)
    >>> out._base is x, out.requires_grad     # a view of the caller's x, as eager's
    (True, True)

The program's graph computes such an output as a view of its own updated
copy of the input: its value, not eager's tensor, which shares the caller's
memory and, called under no_grad, still requires grad (a view made under
no_grad of a tensor that requires grad). As AOTAutograd's runtime wrapper
regenerates an output aliasing an input (``gen_alias_from_base``),
``ep.module()`` makes each one again after the write-backs: that view
(size, strides, storage offset counted from where the caller's tensor
starts) of the caller's tensor, in the grad mode eager made it in, which
the program's record keeps (``output_views``: see
:class:`predispatch.trace.functional_trace.OutputView`). The graph
(``ep.graph_module``) is unchanged.
"""
from __future__ import annotations

import contextlib

import torch

from .. import _torch
from ..trace.functional_trace import note_output_view

# the grad mode eager made the view in -> the mode it is made again in
_MADE_IN = {"no_grad": torch.no_grad, "grad": torch.enable_grad, "caller": contextlib.nullcontext,
            "detached": contextlib.nullcontext}


def output_view(target: torch.Tensor, value: torch.Tensor, view: dict) -> torch.Tensor:
    """The output the program computed as ``value``, as eager returns it:
    ``view`` of ``target``, the caller's tensor after the write-backs."""
    if _torch.is_traced(target):  # the program is being exported again: it finds the same view
        note_output_view(value, target, view)
        return value
    base = target.detach() if view["mode"] == "detached" else target
    with _MADE_IN[view["mode"]]():
        return base.as_strided(view["size"], view["stride"], target.storage_offset() + view["offset"])


def make_output_views(unlifted: torch.fx.GraphModule, views: dict, target_name) -> None:
    """The user outputs ``views`` names (flat positions, as strings) made
    again as views of the caller's tensors, after the write-backs;
    ``target_name``: the name a placeholder or attribute node reads (as the
    record names the tensors viewed)."""
    if not views:
        return
    graph = unlifted.graph
    output = graph.output_node()
    outputs = list(output.args[0])
    nodes = {target_name(n): n for n in graph.nodes if n.op in ("placeholder", "get_attr")}
    for index, view in views.items():
        value = outputs[int(index)]
        target = nodes.get(view["of"])
        if target is None:
            with graph.inserting_before(output):
                target = nodes[view["of"]] = graph.get_attr(view["of"])
        with graph.inserting_before(output):
            outputs[int(index)] = graph.call_function(output_view, (target, value, view))
        outputs[int(index)].meta.update({k: v for k, v in value.meta.items() if k in ("val", "stack_trace")})
    output.args = (type(output.args[0])(outputs), *output.args[1:])
    unlifted.recompile()
