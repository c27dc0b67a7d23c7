"""``compile_training``: a program's forward and backward traced ahead of time (contract §3).

It checks at run time that the backward runs under the autocast state it
was traced for.

    >>> train = compile_training(ep)                       # or backend="inductor", or a callable
    >>> out = train(x); out.sum().backward()
    >>> train.forward_graph, train.backward_graph     # torch.fx.GraphModules

The graphs are traced for the program's example inputs, in grad mode, under
the autocast state ``compile_training`` runs under, and compiled by the
backend (``backends.py``): "eager" runs them op by op, "inductor" as
torch.compile compiles a training step, a callable as torch.compile calls
one. The program's dynamic sizes stay symbolic: one trace serves every size
its ranges allow (``calls.py``), the guards the trace added checked per new
size. A call that differs in another thing a trace depends on (a static
size, dtypes, strides, a dynamic non-tensor input's value, grad mode, the
ambient autocast state, which inputs and parameters require grad, which
mutated inputs are leaves, and the memory its inputs share) gets graphs
traced for it, kept in a small cache;
a call ``ep.module()`` would refuse (a size outside the program's shapes, a
non-tensor input other than the exported one, inputs sharing memory otherwise
than the example inputs did where the program relies on it) raises
:class:`CallNotSupportedError`. The graphs compute in the train/eval mode the
module was exported in; ``train()``/``eval()`` to the other raises.

The gradients are eager's, ``None`` included: a parameter or input that
eager's autograd never reaches (behind an output left out of the loss, or
only read and updated under no_grad) keeps ``.grad`` at ``None``, not zeros
(``runners.run_backward``). The random draws are eager's, with every backend.

The backward is traced under the program's ``backward_pass_autocast``
(AOTAutograd's ``backward_pass_autocast`` config): "same_as_forward" = the
autocast state the forward ran under, "off", or a list of
``torch.amp.autocast`` kwargs. Both graphs are run with autocast disabled:
the casts they need are in the graphs already. Each time a backward runs
under an ambient autocast state that differs from that assumption, the
backward is traced again (op by op) under the state found; if that gives
another graph, the program's ``on_backward_autocast_mismatch`` says what to do.
"""
from __future__ import annotations

from ..._torch import pytree
from ...ir.assumptions import assumptions
from ...ir.program_meta import program_meta
from ...policies.autocast_policy import autocast_policy
from .backends import Backend, CompileError
from .calls import CallKey, CallNotSupportedError, ProgramShapes, aliasing_check, mutated_inputs
from .compiled import CompiledTraining, Program
from .joint import for_autograd_tracing, reads_generators

__all__ = ["CallNotSupportedError", "CompileError", "CompiledTraining", "compile_training"]
for _public in (CallNotSupportedError, CompileError, CompiledTraining):  # named where users import them
    _public.__module__ = __name__


def compile_training(ep, backend="eager", *, options: dict | None = None) -> CompiledTraining:
    """Trace ``ep``'s joint forward/backward ahead of time, and compile it with ``backend``.

        >>> ep = predispatch.export_predispatch(torch.nn.Linear(3, 1), (torch.randn(4, 3),))
        >>> train = predispatch.compile_training(ep)
        >>> train(torch.randn(4, 3)).sum().backward()
        >>> train.weight.grad.shape
        torch.Size([1, 3])
        >>> [str(n.target) for n in train.forward_graph.graph.nodes if n.op == "call_function"]
        ['aten.t.default', 'aten.addmm.default']

    Returns a :class:`CompiledTraining`, a drop-in for the exported module;
    its ``forward_graph`` and ``backward_graph`` are ``torch.fx.GraphModule``
    s (aten ops, before a compiler lowers them). The backward is traced
    under the program's ``backward_pass_autocast`` and checked at run time
    (:class:`BackwardAutocastMismatchError`); a call of a new kind (dtypes,
    grad mode, ambient autocast, a static size) is traced again, a size
    inside the program's dynamic shapes is not.

    ``backend``: ``"eager"`` (the graphs run op by op), ``"inductor"`` (as
    ``torch.compile`` compiles a training step: inductor's decompositions,
    min-cut partitioner and kernels), or a callable ``(gm, example_inputs)
    -> callable``, as torch.compile takes, given the forward graph, then
    the backward graph. ``options``: inductor's config, as
    ``torch.compile(options=...)``; the random draws are eager's unless
    ``options={"fallback_random": False}`` asks for inductor's own
    generator (other draws, which it may reorder). A backend that fails
    raises :class:`CompileError`. See design/training.md.
    """
    backend = Backend.of(backend, options)
    policy = autocast_policy(ep)
    if assumptions(ep):
        raise ValueError(
            "compile_training cannot take a program exported with data_dependent='specialize' "
            f"({len(assumptions(ep))} data-dependent branch(es) assumed, e.g. at {assumptions(ep)[0].where}): "
            "its ahead-of-time trace has no value to read them from; use ep.module()")
    if ep.example_inputs is None:
        raise ValueError("compile_training needs the program's example inputs (ep.example_inputs)")
    leaves, in_spec = pytree.tree_flatten(ep.example_inputs)
    shapes = ProgramShapes.of(ep)
    if len(shapes.dims) != len(leaves):  # not one placeholder per input leaf: traced per size
        shapes = ProgramShapes(tuple({} for _ in leaves), {})
    module = for_autograd_tracing(ep.module(), program_meta(ep).get("ambient_autocast"))
    program = Program(module, in_spec, len(ep.graph_signature.user_outputs), policy, mutated_inputs(ep), shapes,
                      backend, reads_generators(module), program_meta(ep).get("training"), aliasing_check(ep),
                      tuple(program_meta(ep).get("requires_grad_reads", ())))
    train = CompiledTraining(program, program_meta(ep).get("grad_mode_after"))
    args, kwargs = ep.example_inputs
    key = CallKey.of(leaves, program.mutated, True, train._state)
    train._calls[key] = train.variant(key, leaves, args, kwargs)
    return train
