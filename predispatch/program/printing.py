"""A normalized, readable print of a program: the face of predispatch's IR.

    >>> print(format_program(ep))
    def forward(x: f32[2]):
        mul = aten.mul.Tensor(x, 1.0)
        no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, mul)
        getitem = no_grad_0[0]
        ...
    def no_grad_0(mul: f32[2]):
        mul_1 = aten.mul.Tensor(mul, 2)
        return (mul_1,)
    inputs: x USER_INPUT
    outputs: mul_2 USER_OUTPUT
    autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'

A program exported with ``data_dependent="specialize"`` also lists the
branches it assumes (``data-dependent assumptions:``, one a line).
Node names are re-derived from each node's op with a per-graph counter, so
the text does not depend on torch's name counters; no file paths or line
numbers are printed. Placeholders keep their (signature) names.
"""
from __future__ import annotations

import operator
import re

import torch
import torch.fx
from torch.export import ExportedProgram

from .. import _torch
from ..ir.assumptions import assumptions
from ..ir.autograd_function_op import AUTOGRAD_FUNCTION
from ..ir.control_flow_op import control_flow_kind, subgraph_inputs
from ..ir.program_meta import program_meta
from ..policies.autocast_policy import autocast_policy


def _op_name(target) -> str:
    if isinstance(target, _torch.OpOverload):
        return ".".join(_torch.op_name_parts(target))
    if isinstance(target, _torch.HigherOrderOperator):
        return target.name()
    if target is operator.getitem:
        return "getitem"
    return getattr(target, "__name__", str(target))


def _base_name(node: torch.fx.Node) -> str:
    if node.op == "call_function":
        if isinstance(node.target, _torch.OpOverload):
            return _torch.op_name_parts(node.target)[1]
        if control_flow_kind(node.target) is not None:
            return node.target.name()
        if isinstance(node.target, _torch.HigherOrderOperator):
            subs = _subgraphs(node)  # named for its (first) submodule
            return subs[0][0].target.removesuffix("_fwd") if subs else node.target.name()
        return _op_name(node.target)
    return node.op


def _type(node: torch.fx.Node) -> str:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        short = {torch.float32: "f32", torch.float64: "f64", torch.float16: "f16",
                 torch.bfloat16: "bf16", torch.int64: "i64", torch.int32: "i32", torch.bool: "b8"}
        dims = ", ".join(str(d) for d in val.shape)
        return f"{short.get(val.dtype, str(val.dtype).replace('torch.', ''))}[{dims}]"
    return ""


_QUOTED_NAME = re.compile(r"'(\w+)'")
_SOURCE_LOCATION = re.compile(r"(?:[^\s'\"]*[/\\])?([\w.-]+\.py):\d+")  # a path and line in a message


class _Namer:
    def __init__(self, graph: torch.fx.Graph, placeholder_names=None):
        self.names: dict[torch.fx.Node, str] = {}
        placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        # a value passed in that is no node (an int a loop carries): the placeholder's own name
        names = [given if given is not None else n.name
                 for given, n in zip(placeholder_names or [None] * len(placeholders), placeholders)]
        self.names.update(zip(placeholders, names))
        for node in graph.nodes:
            if node.op == "get_attr":
                self.names[node] = str(node.target)
        taken = set(names)
        for node in graph.nodes:
            if node in self.names:
                continue
            base, k = _base_name(node), 0
            name = base
            while name in taken:
                k += 1
                name = f"{base}_{k}"
            taken.add(name)
            self.names[node] = name
        self._by_raw_name = {n.name: self.names[n] for n in self.names}

    def arg(self, a) -> str:
        if isinstance(a, torch.fx.Node):
            return f"self.{a.target}" if a.op == "get_attr" else self.names[a]
        if isinstance(a, (list, tuple)):
            inner = ", ".join(self.arg(x) for x in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
        if isinstance(a, torch.dtype):
            return str(a)
        if isinstance(a, str):  # e.g. a runtime assertion's message naming its node, or a source line
            return repr(_unlocated(_QUOTED_NAME.sub(lambda m: f"'{self._by_raw_name.get(m[1], m[1])}'", a)))
        return repr(a)


def format_graph(name: str, gm: torch.fx.GraphModule, placeholder_names=None) -> str:
    """One graph; a region's placeholders are named after the values passed
    in, so no raw node name of torch's shows through."""
    return "\n".join(_format_graphs(name, gm, placeholder_names))


def _format_graphs(name: str, gm: torch.fx.GraphModule, placeholder_names=None) -> list[str]:
    namer = _Namer(gm.graph, placeholder_names)
    params = [f"{namer.names[n]}: {_type(n)}".rstrip(": ") for n in gm.graph.nodes if n.op == "placeholder"]
    lines, inner = [f"def {name}({', '.join(params)}):"], []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            continue
        if node.op == "output":
            lines.append(f"    return {namer.arg(node.args[0])}")
            continue
        if node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node):
            lines.append(f"    {namer.names[node]} = {namer.arg(node.args[0])}[{node.args[1]!r}]")
            continue
        args = [namer.arg(a) for a in node.args]
        args += [f"{k}={namer.arg(v)}" for k, v in node.kwargs.items()]
        lines.append(f"    {namer.names[node]} = {_op_name(node.target)}({', '.join(args)})")
        for sub, passed in _subgraphs(node):
            names = None if passed is None else [namer.arg(a) if isinstance(a, torch.fx.Node) else None
                                                 for a in passed]
            inner += _format_graphs(f"{name}.{sub.target}" if name != "forward" else sub.target,
                                    getattr(gm, sub.target), names)
    return ["\n".join(lines), *inner]


def _subgraphs(node: torch.fx.Node) -> list[tuple[torch.fx.Node, tuple | None]]:
    """The submodules a higher-order op node runs, each with the arguments
    its placeholders take (None: they keep their own names). A region's take
    the arguments after it; an autograd Function's forward takes its inputs,
    its backward gradients and saved tensors."""
    if node.op != "call_function" or not isinstance(node.target, _torch.HigherOrderOperator):
        return []
    if control_flow_kind(node.target) is not None:  # branches take its operands
        return subgraph_inputs(node)
    subs = [a for a in node.args if isinstance(a, torch.fx.Node) and a.op == "get_attr"]
    if node.target is AUTOGRAD_FUNCTION:
        fwd, bwd = subs
        return [(fwd, node.args[2:]), (bwd, None)]
    return [(sub, node.args[node.args.index(sub) + 1:]) for sub in subs[:1]]


def format_program(ep_or_gm) -> str:
    """The program as text: graph, every subgraph, signature and autocast policy,
    and the grad mode a call leaves its caller in, where a bare switch sets it.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(3, 2), (torch.ones(1, 3),))
        >>> print(predispatch.format_program(ep))
        def forward(p_weight: f32[2, 3], p_bias: f32[2], input: f32[1, 3]):
            linear = aten.linear.default(input, p_weight, p_bias)
            return (linear,)
        inputs:
            p_weight: PARAMETER -> weight
            p_bias: PARAMETER -> bias
            input: USER_INPUT
        outputs:
            linear: USER_OUTPUT
        autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
        <BLANKLINE>

    Normalized: node names are re-derived from their ops and nothing
    depends on file paths, line numbers or torch's name counters, so the
    text is stable (what ``predispatch.testing.GraphTestCase`` compares).
    Takes an ``ExportedProgram`` or a graph module (then without signature).
    """
    gm = ep_or_gm.graph_module if isinstance(ep_or_gm, ExportedProgram) else ep_or_gm
    parts = _format_graphs("forward", gm)
    if isinstance(ep_or_gm, ExportedProgram):
        parts.append(format_signature(ep_or_gm))
        policy = autocast_policy(ep_or_gm)
        parts.append(f"autocast policy: {policy.describe()}")
        after = program_meta(ep_or_gm).get("grad_mode_after")
        if after is not None:  # a bare switch in force at the forward's end
            parts.append(f"leaves the caller in grad mode: {'on' if after else 'off'}")
        ambient = program_meta(ep_or_gm).get("ambient_autocast")
        if ambient:  # the caller's autocast at export, which each call checks
            parts.append("exported under autocast: " + ", ".join(f"{d} {t}" for d, t in sorted(ambient.items())))
        parts += _format_assumptions(ep_or_gm)
    return "\n".join(parts) + "\n"


def _format_assumptions(ep: ExportedProgram) -> list[str]:
    """The data-dependent branches the program assumes (``data_dependent="specialize"``), if any."""
    found = assumptions(ep)
    if not found:
        return []
    return ["data-dependent assumptions:", *(f"    {_unlocated(a.describe())}" for a in found)]


def _unlocated(text: str) -> str:
    """``/some/dir/file.py:12`` -> ``file.py``: no path nor line number printed."""
    return _SOURCE_LOCATION.sub(r"\1", text)


def format_signature(ep: ExportedProgram) -> str:
    namer = _Namer(ep.graph_module.graph)
    by_name = {n.name: n for n in ep.graph_module.graph.nodes}
    outputs = ep.graph_module.graph.output_node().args[0]

    def spec_line(spec, node=None):
        name = namer.names[node] if node is not None else getattr(spec.arg, "name", repr(spec.arg))
        target = f" -> {spec.target}" if spec.target else ""
        return f"    {name}: {spec.kind.name}{target}"

    lines = ["inputs:"]
    lines += [spec_line(s, by_name.get(getattr(s.arg, "name", None))) for s in ep.graph_signature.input_specs]
    lines.append("outputs:")
    lines += [spec_line(s, o if isinstance(o, torch.fx.Node) else None)
              for s, o in zip(ep.graph_signature.output_specs, outputs)]
    return "\n".join(lines)
