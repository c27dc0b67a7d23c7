"""The ``node.meta`` keys the trace writes and the later stages read.

The ``node.meta`` keys the trace writes on the graph's nodes and the later
stages read (the recorder of :mod:`predispatch.trace.recorder` sets them; the
regions and writes passes act on them), with the values some take. What the
recorder saw of values for the history stage is not here: it is the record's
list of events (:mod:`predispatch.ir.records`)."""

GRAD_BLOCK = "predispatch_grad_block"  # a grad-mode marker: (phase, block id, what the mode passed is)
# a copy writing values only: the written tensor's history is not the memory's (passes/writes.py)
VALUES_ONLY = "predispatch_values_only"
# a grad-mode read (torch.is_grad_enabled()) in the forward: (its code, the offset of the call)
GRAD_MODE_READ = "predispatch_grad_mode_read"
# where the mode a set_grad_enabled(x) passes comes from, besides a read's node:
DERIVED = "derived"  # computed from a grad-mode read: its value depends on the caller's
UNKNOWN = "unknown"  # an origin the code does not show (an argument, an attribute)
# in a region call's ``meta["custom"]`` (kept through save and load): the region a bare
# grad-mode switch opened, which, as eager, restores no mode when an exception leaves it
SWITCH_REGION = "predispatch_switch_region"
