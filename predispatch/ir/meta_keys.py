"""The ``node.meta`` keys the trace writes and the later stages read.

The ``node.meta`` keys the trace writes on the graph's nodes and the later
stages read (the recorder of :mod:`predispatch.trace.recorder` sets them; the
history, regions and writes passes act on them), with the values some take."""

GRAD_BLOCK = "predispatch_grad_block"  # a grad-mode marker: (phase, block id, what the mode passed is)
# a view op replaying a view made under no_grad, which in eager never requires
# grad; the keep-history pass leaves its inputs without history
NO_GRAD_VIEW_REPLAY = "predispatch_no_grad_view_replay"
# a view op replaying a view made in grad mode (where it is next read, or
# after the forward); the value is the node after which it was made
GRAD_VIEW_REPLAY = "predispatch_grad_view_replay"
# a view op making or replaying a user input traced as a view of another: the
# caller made it, and eager's has its history in any grad mode
INPUT_VIEW = "predispatch_input_view"
# a view's history as eager regenerates it once its base's version moved
# (as_strided of the base's update): eager does that in any grad mode
REGENERATED_VIEW = "predispatch_regenerated_view"
# a replay of a grad-mode view; the value is the view's node as made, whose
# history eager's view keeps while its base is updated out of autograd's sight
REPLAY_OF = "predispatch_replay_of"
# a keep_history read of a detached alias's own history (the value it keeps is
# the update's, which a later keep of the base's history must not replace)
OWN_HISTORY_READ = "predispatch_own_history_read"
# a copy writing values only: the written tensor's history is not the memory's (passes/writes.py)
VALUES_ONLY = "predispatch_values_only"
# a keep_history read of a set_() target's own history (the value it had); the
# value says whether the target is an eager view (made by a view op), not one relaid in place
SWAPPED_HISTORY = "predispatch_swapped_history"
SWAPPED_VIEW, SWAPPED_NO_VIEW = "of a view", "of no view"  # SWAPPED_HISTORY's values
# a grad-mode read (torch.is_grad_enabled()) in the forward: (its code, the offset of the call)
GRAD_MODE_READ = "predispatch_grad_mode_read"
# where the mode a set_grad_enabled(x) passes comes from, besides a read's node:
DERIVED = "derived"  # computed from a grad-mode read: its value depends on the caller's
UNKNOWN = "unknown"  # an origin the code does not show (an argument, an attribute)
# in a region call's ``meta["custom"]`` (kept through save and load): the region a bare
# grad-mode switch opened, which, as eager, restores no mode when an exception leaves it
SWITCH_REGION = "predispatch_switch_region"
