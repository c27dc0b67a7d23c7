"""Inductor, torch.compile's compiler: its training entry point, its graph compiler and its config.

torch.compile's inductor backend hands the graph dynamo captured to
``torch._inductor.compile_fx.compile_fx``: AOTAutograd traces the joint
forward/backward with inductor's decompositions, inductor's joint-graph
passes and its min-cut partitioner split it, and ``compile_fx``'s
``inner_compile`` hook (``compile_fx_inner`` by default) compiles the
forward graph, then the backward graph. :func:`compile_training_step` is
that entry point on a module of flat tensor inputs, with the hook ours.
Inductor is imported on first use: a process that never compiles with it
does not pay its import.
"""
from __future__ import annotations

import contextlib
import functools
import operator
import re

import torch
import torch.fx


def compile_training_step(module: torch.nn.Module, example_inputs: list, num_outputs: int, inner_compile,
                          options: dict, merge_equal_calls: bool = True):
    """``compile_fx(module, example_inputs, inner_compile=...)`` under inductor's
    config ``options``: the compiled function, taking the flat inputs.
    ``module`` returns a tuple of ``num_outputs`` values; ``compile_fx``
    takes it as a graph module calling it (it counts the outputs of the
    graph it gets, where a forward's outputs begin among the partitioned
    forward's, to give them eager's strides). ``merge_equal_calls=False``:
    AOTAutograd's common-subexpression elimination off, which merges two
    equal calls of an op torch does not know changes with time (two reads
    of a generator's state, with a draw between them).

    AOTAutograd's own cache is off meanwhile: a hit returns the compiled
    function of an earlier process without calling ``inner_compile`` (whose
    wrappers the step needs); inductor's FX graph cache, inside
    ``compile_fx_inner``, still spares a second process the kernels' compile."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(enable_autograd_cache=False, cse=merge_equal_calls), inductor_config(options), \
            _no_graph_cache_for_symbolic_sizes(example_inputs):
        return compile_fx(_graph_calling(module, len(example_inputs), num_outputs), example_inputs,
                          inner_compile=inner_compile)


def _no_graph_cache_for_symbolic_sizes(example_inputs: list):
    """Inductor's FX graph cache off for a trace at symbolic sizes. Its entry's
    guards name each size by a graph input holding it (torch.compile passes
    every symbolic size as one); ours are the program's own symbols, which no
    input holds where the graph takes only, say, ``16 * s77``: the guard then
    names the symbol's own source, and a later process's lookup of the entry
    raised ``NameError: name 'predispatch_dim_s77' is not defined``."""
    symbolic = any(isinstance(x, torch.Tensor) and any(isinstance(n, torch.SymInt) for n in x.shape)
                   for x in example_inputs)
    if not symbolic:
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(fx_graph_cache=False)


def _graph_calling(module: torch.nn.Module, num_inputs: int, num_outputs: int) -> torch.fx.GraphModule:
    """A graph module calling ``module`` (its submodule ``program``) on its inputs."""
    root = torch.nn.Module()
    root.add_module("program", module)
    graph = torch.fx.Graph()
    inputs = [graph.placeholder(f"input_{i}") for i in range(num_inputs)]
    call = graph.call_module("program", tuple(inputs))
    graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for i in range(num_outputs)))
    return torch.fx.GraphModule(root, graph)


def compile_graph(gm: torch.fx.GraphModule, example_inputs, **kwargs):
    """Inductor's compile of one forward or backward graph (``compile_fx``'s
    default ``inner_compile``): a function taking its inputs as a list."""
    from torch._inductor.compile_fx import compile_fx_inner

    return compile_fx_inner(gm, example_inputs, **kwargs)


def is_backward_compile(inner_compile_kwargs: dict) -> bool:
    """Is this ``inner_compile`` call the backward graph's?"""
    return bool(inner_compile_kwargs.get("is_backward"))


def inductor_config(options: dict):
    """Inductor's config with ``options`` set (``torch.compile(options=...)``'s names)."""
    if not options:
        return contextlib.nullcontext()
    from torch._inductor import config

    return config.patch(options)


def inductor_option_names() -> list[str]:
    """The names ``torch.compile(backend="inductor", options=...)`` accepts."""
    from torch._inductor import config

    return sorted(config.get_config_copy())


def saved_inputs_copied(forward: torch.fx.GraphModule) -> None:
    """The partitioned ``forward`` saves a copy of each input it mutates and
    the backward reads, not the input itself.

    Inductor's joint-graph pass ``remove_noop_ops`` drops the functional
    trace's ``clone`` of such an input: the forward then saves the input
    itself, which the compiled function's epilogue writes in place (or the
    graph does), so the backward reads the new value, or autograd refuses
    the changed version (torch.compile has this on a module doing
    ``x.mul_(w)``). AOTAutograd's record of the trace says which inputs are
    mutated and where the saved values begin among the forward's outputs."""
    context = torch._guards.TracingContext.try_get()
    meta = context.fw_metadata if context is not None else None
    if meta is None:
        return
    placeholders = [n for n in forward.graph.nodes if n.op == "placeholder"]
    mutated = {placeholders[i] for i, info in enumerate(meta.input_info)
               if i < len(placeholders) and (info.mutates_data or info.mutates_metadata)}
    output = forward.graph.output_node()
    outputs = list(output.args[0])
    for i in range(meta.num_forward_returns, len(outputs)):
        if outputs[i] in mutated:
            with forward.graph.inserting_before(output):
                copy = forward.graph.call_function(torch.ops.aten.clone.default, (outputs[i],))
            val = outputs[i].meta["val"]
            with val.fake_mode:
                copy.meta["val"] = val.clone()  # storage of its own: not a no-op to remove again
            outputs[i] = copy
    output.args = (tuple(outputs),)
    forward.recompile()


def draws_in_order(reads: frozenset = frozenset()):
    """Inductor's ``_pre_fusion_custom_pass`` that keeps the draws in the
    graph's order: each kernel of an op that draws or sets a generator
    (tagged ``nondeterministic_seeded``) or reads one (``reads``) gets an
    ordering-only dependency (a fake ``WeakDep``, as inductor orders
    collectives and conditionals) on the one before it in the graph, which
    fusion and the reorderings after it (``reorder_for_peak_memory`` too)
    keep. Inductor orders kernels by their data alone: a fused kernel placed
    where its first node was pulled the draws it reads ahead of others (a
    mask computed early and used late, a draw under a seeded state moved
    before the seeding). A ``CustomSchedulerPass``, whose ``uuid`` the FX
    graph cache keys on (the ops are held by name)."""
    return _scheduler_pass_class()(frozenset(map(str, reads)))


@functools.cache
def _scheduler_pass_class():
    from torch._inductor.custom_graph_pass import CustomSchedulerPass, get_hash_for_files

    class DrawsInOrder(CustomSchedulerPass):
        def __init__(self, reads: frozenset):
            self.reads = reads

        def __call__(self, nodes: list) -> list:
            return _draws_in_order(nodes, self.reads)

        def uuid(self):
            return get_hash_for_files((__file__,)), tuple(sorted(self.reads))

        def __reduce__(self):  # a cache key may pickle inductor's config
            return draws_in_order, (self.reads,)

    return DrawsInOrder


def _draws_in_order(nodes: list, reads: frozenset) -> list:
    from torch._inductor.dependencies import WeakDep

    draws = sorted((n for n in nodes if _draws(n, reads)), key=_lowered_position)
    if len(draws) < 2:
        return nodes
    for before, draw in zip(draws, draws[1:]):
        draw.add_fake_dep(WeakDep(next(iter(before.get_buffer_names())),
                                  mutating_buf=next(iter(draw.get_buffer_names())), is_fake=True))
    scheduler = nodes[0].scheduler
    scheduler.nodes = scheduler.topological_sort_schedule(nodes)
    scheduler.compute_ancestors()  # fusion asks them whether fusing two nodes makes a cycle
    return scheduler.nodes


def _draws(node, reads: frozenset) -> bool:
    op = getattr(getattr(node, "node", None), "op_overload", None)
    return isinstance(op, torch._ops.OpOverload) and (torch.Tag.nondeterministic_seeded in op.tags
                                                      or str(op) in reads)


def _lowered_position(node) -> int:
    """Where a kernel's operation was lowered, in the graph's order (its name, ``op<N>``)."""
    match = re.fullmatch(r"op(\d+)", node.get_name())
    return int(match.group(1)) if match else -1
