"""PT2E quantization through regions (contract §6), inside every region too.

torchao's ``prepare_pt2e`` / ``prepare_qat_pt2e`` / ``convert_pt2e``, with the same
calling convention, run on the whole program (every region, nested ones
too) rather than on its top-level graph only; the regions stay.

    >>> from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
    ...     X86InductorQuantizer, get_default_x86_inductor_quantization_config)
    >>> quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    >>> prepared = predispatch.prepare_pt2e(ep.module(), quantizer)
    >>> prepared(*calibration_batch)
    >>> quantized = predispatch.convert_pt2e(prepared)

Each function inlines the regions with a record of where each node ran,
lets torchao's function annotate, observe or convert the one flat graph,
and outlines the regions again (``through_regions``): a quantizer's
patterns and observers see the true edges, so a value crossing a region
boundary gets one observer (one set of quantization parameters) on whichever
side it is computed, and the ops inside a no_grad or autocast region still
run in that mode. Inside an autocast region the observers see the values the
region computes (a linear's input before autocast casts it; its output in
the autocast dtype), and the dequantized values are cast by autocast as the
float ones were.

torchao is an optional dependency: ``pip install 'predispatch[quant]'``.
torchao's own functions on such a module (``ep.module()``) annotate and
observe the top-level graph only: the ops inside regions stay in floating
point, without a warning.
"""
from __future__ import annotations

import importlib

import torch.fx

from .through_regions import through_regions

EXTRA = "quant"


def _pt2e():
    """torchao's PT2E functions, imported on first use."""
    try:
        return importlib.import_module("torchao.quantization.pt2e.quantize_pt2e")
    except ImportError as e:
        raise ImportError(
            f"predispatch's PT2E quantization needs torchao, an optional dependency: "
            f"pip install 'predispatch[{EXTRA}]' ({e})") from e


def prepare_pt2e(model: torch.fx.GraphModule, quantizer) -> torch.fx.GraphModule:
    """torchao's ``prepare_pt2e`` on ``model`` (``ep.module()``), its regions
    included: observers inside regions too, the regions kept.

        >>> from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        ...     X86InductorQuantizer, get_default_x86_inductor_quantization_config)
        >>> class Teacher(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.frozen, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             x = self.frozen(x)
        ...         return self.head(x)
        >>> x = torch.randn(2, 4)
        >>> ep = predispatch.export_predispatch(Teacher(), (x,))
        >>> quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
        >>> prepared = predispatch.prepare_pt2e(ep.module(), quantizer)
        >>> print(prepared.no_grad_0.code.strip())       # the frozen linear, observed in its region
        def forward(self, activation_post_process_0, activation_post_process_1, frozen_bias):
            linear = torch.ops.aten.linear.default(activation_post_process_0, ...
            activation_post_process_2 = self.activation_post_process_2(linear);  linear = None
            return (activation_post_process_2,)
        >>> _ = prepared(x)                               # calibrate, then convert_pt2e

    torchao's calling convention and quantizers (the optional extra
    ``predispatch[quant]``; without torchao this raises an ``ImportError``
    naming it). Like torchao's, it changes the module it is given.
    design/quantization.md says how it works and what it measured.
    """
    pt2e = _pt2e()
    return through_regions(model, lambda gm: pt2e.prepare_pt2e(gm, quantizer))


def prepare_qat_pt2e(model: torch.fx.GraphModule, quantizer) -> torch.fx.GraphModule:
    """torchao's ``prepare_qat_pt2e`` on ``model``, its regions included:
    fake quantization inside regions too, the regions kept.

        >>> from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        ...     X86InductorQuantizer, get_default_x86_inductor_quantization_config)
        >>> class Teacher(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.frozen, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             x = self.frozen(x)
        ...         return self.head(x)
        >>> x = torch.randn(2, 4)
        >>> ep = predispatch.export_predispatch(Teacher(), (x,))
        >>> quantizer = X86InductorQuantizer().set_global(
        ...     get_default_x86_inductor_quantization_config(is_qat=True))
        >>> prepared = predispatch.prepare_qat_pt2e(ep.module(), quantizer)
        >>> prepared(x).sum().backward()
        >>> [name for name, p in prepared.named_parameters() if p.grad is not None]   # no_grad still cuts
        ['head.weight', 'head.bias']

    A no_grad region still cuts gradients, an autocast region still
    autocasts. A value in a
    16-bit float dtype (what autocast computes) is fake-quantized in float32
    and cast back: torchao's fused fake quantizer takes float32 only."""
    pt2e = _pt2e()
    fake_quantize = importlib.import_module("torchao.quantization.pt2e").FakeQuantizeBase

    def prepare(gm):
        return fake_quantize_in_float32(pt2e.prepare_qat_pt2e(gm, quantizer), fake_quantize)

    return through_regions(model, prepare)


_HALF = (torch.bfloat16, torch.float16)


def fake_quantize_in_float32(gm: torch.fx.GraphModule, fake_quantize: type) -> torch.fx.GraphModule:
    """Each fake quantizer reading a bfloat16 or float16 value reads it cast
    to float32, and its users read its output cast back."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(gm.get_submodule(node.target), fake_quantize):
            continue
        value = node.args[0].meta.get("val")
        if not isinstance(value, torch.Tensor) or value.dtype not in _HALF:
            continue
        with graph.inserting_before(node):
            wide = _cast(graph, node.args[0], torch.float32)
        node.replace_input_with(node.args[0], wide)
        node.meta["val"] = wide.meta["val"]
        with graph.inserting_after(node):
            narrow = _cast(graph, node, value.dtype)
        node.replace_all_uses_with(narrow, delete_user_cb=lambda user: user is not narrow)
    gm.recompile()
    return gm


def _cast(graph: torch.fx.Graph, node: torch.fx.Node, dtype: torch.dtype) -> torch.fx.Node:
    cast = graph.call_function(torch.ops.aten._to_copy.default, (node,), {"dtype": dtype})
    cast.meta["val"] = node.meta["val"].to(dtype)
    return cast


def convert_pt2e(model: torch.fx.GraphModule, use_reference_representation: bool = False,
                 fold_quantize: bool = True) -> torch.fx.GraphModule:
    """torchao's ``convert_pt2e`` on a module prepared by :func:`prepare_pt2e`
    or :func:`prepare_qat_pt2e`: quantize/dequantize pairs inside regions
    too, the regions kept.

        >>> from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        ...     X86InductorQuantizer, get_default_x86_inductor_quantization_config)
        >>> class Teacher(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.frozen, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             x = self.frozen(x)
        ...         return self.head(x)
        >>> x = torch.randn(2, 4)
        >>> ep = predispatch.export_predispatch(Teacher(), (x,))
        >>> quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
        >>> prepared = predispatch.prepare_pt2e(ep.module(), quantizer)
        >>> _ = prepared(x)                               # calibrate
        >>> quantized = predispatch.convert_pt2e(prepared)
        >>> [r.name for r in predispatch.regions(quantized)]
        ['no_grad_0']
        >>> quantize = torch.ops.quantized_decomposed.quantize_per_tensor.default
        >>> [n.name for n in quantized.no_grad_0.graph.nodes if n.target is quantize]
        ['quantize_per_tensor_default_1']
    """
    pt2e = _pt2e()
    return through_regions(model, lambda gm: pt2e.convert_pt2e(
        gm, use_reference_representation=use_reference_representation, fold_quantize=fold_quantize))
