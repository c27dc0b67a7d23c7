"""What the tracer cannot see in the functional graph, recorded while tracing.

A torch-function mode pushed inside the traced forward (:mod:`.mode`) hands
each torch call down one table of rules (:mod:`.table`, the recorder's table
of contents), each rule a kind of event with its handler, acting on one
explicit state per forward (:mod:`.state`) and on marks the tensors carry
(:mod:`.marks`). What it notes, the graph cannot show:

* which ``_set_grad_enabled`` node enters and which exits a grad-mode block
  (:mod:`.grad_blocks`; the flat graph only shows the values, so nesting
  would be lost);
* tensors whose value was replaced without autograd seeing it (an in-place
  op under no_grad, :mod:`.spans`, or on a detached alias, :mod:`.detached`,
  directly or through views): eager keeps their old history,
  functionalization does not, so the keep-history pass restores it; views
  are brought up to date in the grad mode they were made in (:mod:`.views`);
* tensors written in grad mode between two grad-mode markers: outside every
  grad block that code runs in the caller's mode, which may be no_grad; and
  replays of views made in grad mode, with where they were made;
* tensors read through an op: made to require grad in the forward, or with a
  history of their own (:mod:`.leaves`);
* ``t.set_(source)``, traced onto an alias of ``source`` (:mod:`.swaps`),
  ``t.data`` (:mod:`.data`), ``F.embedding(max_norm=...)``'s renorm
  (:mod:`.renorm`), custom ops that alias their input (:mod:`.custom_ops`);
* the casts eager's autocast cache would hold (:mod:`predispatch.trace.autocast_cache`,
  around each call: :mod:`.traced_call`); how in-place ops functionalization
  gets wrong are traced is :mod:`predispatch.trace.inplace_rules`, applied
  where functionalization sees each op (:mod:`.observing`);
* how each graph input was mutated ("hidden" from autograd, under
  "no_grad", or under "grad"), so the program writes it back the same way.

:func:`.session.recording` runs a forward under all of it; what it leaves
is the record's list of typed events (:mod:`predispatch.ir.records`: a
write out of autograd's sight, a view's replay, a read of an own history,
...) and the node-meta keys of :mod:`predispatch.ir.meta_keys` (grad-mode
blocks, for the regions stage). This module re-exports only names of
modules that import none of the package's others (the package's modules
import one another as ``from . import marks``: an import of this one).
"""
from .marks import mark_view, user_swap_location  # noqa: F401  (inputs traced as views of another)
from .observing import unobserved  # noqa: F401  (write-backs that are not the forward's own)
