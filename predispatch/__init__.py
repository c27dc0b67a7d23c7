"""predispatch: a torch.nn.Module exported as a functionalized pre-dispatch program.

    >>> class M(torch.nn.Module):
    ...     def forward(self, x):
    ...         x = x * 1.0
    ...         with torch.no_grad():
    ...             x.mul_(2)
    ...         return x * x
    >>> ep = predispatch.export_predispatch(M(), (torch.ones(2),))
    >>> print(predispatch.format_program(ep))
    def forward(x: f32[2]):
        mul = aten.mul.Tensor(x, 1.0)
        no_grad_0 = wrap_with_set_grad_enabled(False, self.no_grad_0, mul)
    ...
    >>> ep.module()(torch.ones(2))
    tensor([4., 4.])

The program is a real ``torch.export.ExportedProgram``: functional (every
mutation is data flow), traced above autograd and autocast (kept
composites such as ``aten.linear``), each grad-mode or autocast block a
higher-order-op region, and it still trains as the eager module does.

Exporting:
    export_predispatch(module, args, ...) -> PredispatchProgram
    OpPolicy                which composite ops are kept whole
    reuse_layers(enabled)   trace repeated layers once (the default) or each
    ExportError             what no functional program can reproduce
Reading a program:
    format_program(ep)      the program as stable text
    regions(ep), Region     every grad-mode and autocast region
    inline_regions(ep)      the regions as plain ops (their modes lost)
    autocast_policy(ep), AutocastPolicy   the backward's autocast policy
    sharded_layouts(ep), Layout           a sharded module's placements
    load(path)              ``torch.export.load`` giving a PredispatchProgram
Running and training:
    compile_training(ep, backend="eager") -> CompiledTraining   forward and backward ahead of time;
                            backend "inductor" (as torch.compile) or a torch.compile-style callable
    BackwardAutocastMismatchError, BackwardAutocastMismatchWarning,
    CallNotSupportedError
    prepare_pt2e, prepare_qat_pt2e, convert_pt2e   torchao's PT2E through regions
Testing: predispatch.testing (GraphTestCase, assert_matches_eager).

The README is the tour; design/ has the depth (design/architecture.md
explains the pipeline, :mod:`predispatch.pipeline`, and the folders).
"""
from . import _torch
from .policies.autocast_policy import AutocastPolicy, autocast_policy
from .errors import BackwardAutocastMismatchError, BackwardAutocastMismatchWarning, ExportError
from .api import export_predispatch
from .trace.layer_reuse import reuse_layers
from .policies.op_policy import OpPolicy
from .program import region_runtime
from .program.program import PredispatchProgram, load
from .program.write_backs import fix_unflattened_write_backs
from .program.printing import format_program
from .downstream.quantization import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
from .downstream.inline import inline_regions
from .ir.regions import Region, regions
from .distributed.sharding import Layout, sharded_layouts
from .downstream.training import CallNotSupportedError, CompiledTraining, compile_training

region_runtime.install_region_runtime()
_torch.install_unflatten_write_backs(fix_unflattened_write_backs)

__all__ = [
    "AutocastPolicy",
    "BackwardAutocastMismatchError",
    "BackwardAutocastMismatchWarning",
    "ExportError",
    "Layout",
    "OpPolicy",
    "PredispatchProgram",
    "CompiledTraining",
    "CallNotSupportedError",
    "Region",
    "autocast_policy",
    "compile_training",
    "convert_pt2e",
    "format_program",
    "export_predispatch",
    "inline_regions",
    "load",
    "prepare_pt2e",
    "prepare_qat_pt2e",
    "regions",
    "sharded_layouts",
    "reuse_layers",
]
