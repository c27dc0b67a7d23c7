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

import torch


def compile_training_step(module: torch.nn.Module, example_inputs: list, inner_compile, options: dict):
    """``compile_fx(module, example_inputs, inner_compile=...)`` under inductor's
    config ``options``: the compiled function, taking the flat inputs.

    AOTAutograd's own cache is off meanwhile: a hit returns the compiled
    function of an earlier process without calling ``inner_compile`` (whose
    wrappers the step needs); inductor's FX graph cache, inside
    ``compile_fx_inner``, still spares a second process the kernels' compile."""
    from torch._inductor.compile_fx import compile_fx

    with torch._functorch.config.patch(enable_autograd_cache=False), inductor_config(options):
        return compile_fx(module, example_inputs, inner_compile=inner_compile)


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
