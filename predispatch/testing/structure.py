"""Two exports compared node for node, up to node names.

    >>> assert_same_program(ep_a, ep_b)

:func:`program_structure` lists every node of the program and its
subgraphs: its op, its arguments (by position, not name), its value's
metadata, module stack, stack trace and torch function, the predispatch
keys in its metadata; and the signature's kinds and targets. Two exports of
one module that should be the same program (layer reuse on and off, a
re-export) have equal structures.
"""
from __future__ import annotations

import torch


def program_structure(ep) -> tuple[list, list, list]:
    """(node records, input specs, output specs) of ``ep``, up to node names."""
    lines = []

    def walk(gm, prefix):
        names = {n: n.name if n.op == "placeholder" else f"{prefix}{i}" for i, n in enumerate(gm.graph.nodes)}
        for n in gm.graph.nodes:
            val = n.meta.get("val")
            lines.append((
                names[n], n.op, str(n.target), repr(torch.fx.node.map_arg((n.args, n.kwargs), names.get)),
                (tuple(val.shape), val.stride(), val.dtype, val.requires_grad) if isinstance(val, torch.Tensor)
                else repr(val),
                repr(n.meta.get("nn_module_stack")), n.meta.get("stack_trace"), repr(n.meta.get("torch_fn")),
                sorted(k for k in n.meta if k.startswith("predispatch"))))
        for name, sub in gm.named_children():
            if isinstance(sub, torch.fx.GraphModule):
                walk(sub, name + ".")

    walk(ep.graph_module, "")
    sig = ep.graph_signature
    return lines, [(s.kind, s.target) for s in sig.input_specs], [(s.kind, s.target) for s in sig.output_specs]


def assert_same_program(a, b, what: str = "") -> None:
    """Raise AssertionError naming the first node where ``a`` and ``b`` differ."""
    (nodes_a, ins_a, outs_a), (nodes_b, ins_b, outs_b) = program_structure(a), program_structure(b)
    prefix = f"{what}: " if what else ""
    assert (ins_a, outs_a) == (ins_b, outs_b), f"{prefix}signatures differ: {ins_a, outs_a} != {ins_b, outs_b}"
    for x, y in zip(nodes_a, nodes_b):
        assert x == y, f"{prefix}programs differ at node {x[0]}:\n  {x}\n  {y}"
    assert len(nodes_a) == len(nodes_b), f"{prefix}{len(nodes_a)} nodes != {len(nodes_b)} nodes"
