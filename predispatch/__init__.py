"""predispatch: a torch.nn.Module exported as a functionalized pre-dispatch program.

The program is a real torch.export.ExportedProgram with grad-mode and
autocast regions, which still trains. The public names are in ``__all__``;
the pipeline is :mod:`predispatch.pipeline`, the layers are folders
(design/architecture.md)."""
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
