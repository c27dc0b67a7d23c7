"""predispatch: export a torch.nn.Module to a functionalized pre-dispatch graph
with grad/autocast regions, as a real torch.export.ExportedProgram."""
from . import _torch, program
from .autocast_policy import AutocastPolicy
from .errors import BackwardAutocastMismatchError, BackwardAutocastMismatchWarning, ExportError
from .export import export_predispatch
from .layer_reuse import reuse_layers
from .op_policy import OpPolicy
from .program import PredispatchProgram, load
from .printing import format_program
from .quantization import convert_pt2e, prepare_pt2e, prepare_qat_pt2e
from .region_utils import Region, inline_regions, regions
from .sharding import Layout, sharded_layouts
from .training import CallNotSupportedError, CompiledTraining, autocast_policy, compile_training

_torch.install_region_runtime()
_torch.install_unflatten_write_backs(program.fix_unflattened_write_backs)

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
