"""Python function calls of one call, split by who made them (``bench.py --calls``).

CPU time on a shared 2-core machine moves by a third between runs; the
number of Python function calls an export makes (``sys.setprofile``'s
``call`` events, C functions not counted) does not, and it tracks the
export's Python-side cost.

Each call is attributed to the nearest frame on the stack whose code is in
the predispatch package (the called function itself when it is one):

* ``predispatch``: calls of predispatch's own functions;
* ``front_end``: calls out of predispatch (into torch, or any other code)
  whose nearest predispatch frame is one of ``FRONT_END``, the seam and
  trace functions that hand work to torch.export's own machinery
  (``_non_strict_export``, make_fx's placeholders, the passes after the
  trace, the ExportedProgram). The module's forward inside make_fx is not
  front end: make_fx calls back into our frames (``functionalized``,
  ``recorded_forward``), and the calls below them are ours;
* the rest (``total - predispatch - front_end``): calls out of predispatch
  from any other predispatch function (the module's forward, torch ops
  recorded or stamped), and calls with no predispatch frame above them
  (torch.export's own export: all of it).
"""
from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import predispatch

PACKAGE = str(Path(predispatch.__file__).resolve().parent) + "/"

# predispatch functions whose calls out of the package are torch.export's front end
FRONT_END = {
    "_torch/export.py": {"non_strict_export", "produce_aten_artifact", "build_exported_program",
                         "original_state_dict", "process_export_inputs"},
    "trace/functional_trace.py": {"_trace_once"},  # make_fx's own work around our functionalized call
    "trace/capture.py": {"to_aten"},  # its context managers: reparametrize_module, ...
}

OUTSIDE, OURS, SEAM = 0, 1, 2  # what a frame's nearest predispatch frame is: none, ours, a FRONT_END one


@dataclasses.dataclass(frozen=True)
class CallCounts:
    total: int
    predispatch: int  # calls of predispatch's own functions
    front_end: int  # calls out of FRONT_END functions

    @property
    def rest(self) -> int:
        return self.total - self.predispatch - self.front_end


class _Profiler:
    """A ``sys.setprofile`` function: for each live Python frame, what its
    nearest predispatch frame is (a stack, pushed on ``call``, popped on ``return``)."""

    def __init__(self):
        self.total = self.predispatch = self.front_end = 0
        self.owners: list[int] = []
        self.kind_of: dict = {}  # code object -> OUTSIDE (not ours) | OURS | SEAM

    def kind(self, code) -> int:
        kind = self.kind_of.get(code)
        if kind is None:
            kind = self.kind_of[code] = code_kind(code.co_filename, code.co_name)
        return kind

    def __call__(self, frame, event, arg):
        if event == "call":
            self.total += 1
            kind = self.kind(frame.f_code)
            if kind == OUTSIDE:
                owner = self.owners[-1] if self.owners else OUTSIDE
                self.front_end += owner == SEAM
                self.owners.append(owner)
            else:
                self.predispatch += 1
                self.owners.append(kind)
        elif event == "return" and self.owners:
            self.owners.pop()


def code_kind(filename: str, name: str) -> int:
    if not filename.startswith(PACKAGE):
        return OUTSIDE
    return SEAM if name in FRONT_END.get(filename[len(PACKAGE):], ()) else OURS


def count_calls(fn, *args) -> CallCounts:
    """The Python calls of ``fn(*args)``, attributed (its result dropped after counting)."""
    profiler = _Profiler()
    sys.setprofile(profiler)
    try:
        result = fn(*args)
    finally:
        sys.setprofile(None)
    del result
    return CallCounts(profiler.total, profiler.predispatch, profiler.front_end)
