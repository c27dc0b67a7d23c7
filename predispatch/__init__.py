"""predispatch: export a torch.nn.Module to a functionalized pre-dispatch graph
with grad/autocast regions, as a real torch.export.ExportedProgram."""
from . import _torch
from .policies.autocast_policy import AutocastPolicy
from .errors import BackwardAutocastMismatchError, BackwardAutocastMismatchWarning, ExportError
from .pipeline import export_predispatch
from .trace.layer_reuse import reuse_layers
from .policies.op_policy import OpPolicy
from .program.program import PredispatchProgram, fix_unflattened_write_backs, load
from .program.printing import format_program
from .downstream.quantization import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
from .ir.region_graphs import Region, inline_regions, regions
from .distributed.sharding import Layout, sharded_layouts
from .downstream.training import CallNotSupportedError, CompiledTraining, autocast_policy, compile_training

_torch.install_region_runtime()
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
