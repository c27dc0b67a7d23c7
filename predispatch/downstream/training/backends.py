"""The compilers ``compile_training`` hands the program's graphs to: "eager", "inductor", or a callable.

- ``"eager"`` (the default): AOTAutograd's joint trace
  (``aot_module_simplified``), split by its default partitioner, each graph
  run op by op, in eager's memory (``in_place.py``, ``_torch.freeing_inputs``),
  buffers updated where they lie (``updates_in_place.py``).
- ``"inductor"``: what ``torch.compile(backend="inductor")`` does with a
  graph, through its own entry point, inductor's ``compile_fx``
  (``_torch.inductor``): AOTAutograd with inductor's decompositions,
  inductor's joint-graph passes and min-cut partitioner
  (rematerialization), and inductor's compile of each graph
  (``compile_fx_inner``, reached through ``compile_fx``'s ``inner_compile``
  hook, where the wrappers below go on). On the CPU, without inductor's
  layout optimization (``CPU_LAYOUT``; ``options={"layout_optimization":
  True}`` asks for it).
- a callable ``backend(gm, example_inputs) -> callable``, as torch.compile
  takes: it compiles the forward graph, then the backward graph, as
  ``aot_autograd(fw_compiler=backend, bw_compiler=backend)`` would call it
  (AOTAutograd's default partitioner; a copy of each graph, which it may
  change). What it returns is called with the graph's inputs (``*args``, or
  one list where it takes AOTAutograd's boxed convention).

Every backend's graphs run with autocast's dispatch keys skipped, the
backward with eager's ``None`` gradients (``runners.py``), and the
backward draws no random numbers of its own. Random draws are eager's: for
inductor, ``fallback_random`` (aten's random ops, not inductor's own
generator) and a scheduler pass that orders the kernels of draws and
generator ops as the graph does (inductor's scheduler orders kernels by
their data alone: a fused kernel can pull a draw ahead of another, or ahead
of the seeding it was made under); ``options={"fallback_random": False}``
asks for inductor's own.
"""
from __future__ import annotations

import copy
import dataclasses
import traceback
from collections.abc import Callable

import torch
import torch.fx

from ... import _torch
from ...errors import BackwardAutocastMismatchError, ExportError
from ...ir import generator_ops
from ...program.ambient import AutocastCallError
from ...program.run_time_calls import use_run_time_calls
from .calls import CallNotSupportedError
from .detaches import without_read_detaches
from .equal_calls import merge_equal_calls
from .in_place import write_into_dead_operands
from .updates_in_place import buffers_updated_in_place
from .runners import run_backward, run_forward, without_dead_random_ops
from .unread_arguments import unread_arguments_as_none

BACKENDS = ("eager", "inductor")
# inductor's config for eager's random draws; options given to compile_training override them
EAGER_DRAWS = {"fallback_random": True}
# inductor's config where the program's tensors are all on the CPU: its layout optimization
# (channels-last around every convolution, on the CPU whenever mkldnn is there) copies the
# convolutions' weights into it and their gradients back out each step, which costs a
# training step more than it saves (a ResNet's step: 1.20x eager's with it, 0.90x without)
CPU_LAYOUT = {"layout_optimization": False}


class CompileError(ExportError):
    """A backend could not compile the program's forward or backward graph.

        >>> def broken(gm, example_inputs):
        ...     raise RuntimeError("no kernel for aten.addmm")
        >>> ep = predispatch.export_predispatch(torch.nn.Linear(3, 1), (torch.randn(4, 3),))
        >>> predispatch.compile_training(ep, backend=broken)
        Traceback (most recent call last):
        ...
        predispatch.downstream.training.backends.CompileError: compile_training(backend=broken) could not compile the program: RuntimeError: no kernel for aten.addmm

    A subclass of :class:`predispatch.ExportError`; the backend's own
    exception is its ``__context__``."""


@dataclasses.dataclass(frozen=True)
class Backend:
    """A compiler for the graphs: ``name`` ("eager", "inductor", or the
    callable's name), the callable, and inductor's config options."""

    name: str
    compiler: Callable | None = None
    options: tuple = ()  # inductor config, as sorted (name, value) pairs

    @classmethod
    def of(cls, backend, options: dict | None) -> Backend:
        """ValueError for a backend or options compile_training does not take."""
        if callable(backend) and not isinstance(backend, str):
            name = getattr(backend, "__name__", type(backend).__name__)
            _check_no_options(name, options)
            return cls(name, backend)
        if backend not in BACKENDS:
            raise ValueError(f"compile_training: unknown backend {backend!r}; use one of "
                             f"{', '.join(map(repr, BACKENDS))}, or a callable (gm, example_inputs) -> callable "
                             "as torch.compile takes")
        if backend == "eager":
            _check_no_options(backend, options)
            return cls(backend)
        return cls(backend, None, tuple(sorted({**EAGER_DRAWS, **_inductor_options(options)}.items())))

    def _inductor_config(self, tensors) -> dict:
        on_cpu = all(x.device.type == "cpu" for x in tensors if isinstance(x, torch.Tensor))
        return _draws_kept_in_order({**(CPU_LAYOUT if on_cpu else {}), **dict(self.options)})

    def compile(self, flat: torch.nn.Module, examples: list, num_outputs: int, graphs: dict,
                reads_generators: bool = False):
        """The compiled function of the program ``flat`` (a module of flat
        tensor inputs, returning a tuple of ``num_outputs``) traced on
        ``examples``; ``graphs`` gets its "forward" and "backward" graphs (aten
        ops, before a backend's lowering). ``reads_generators``: the program
        reads a generator's state (``generator_ops``), and two equal reads
        are not to be merged."""
        try:
            if self.name == "inductor":
                config = self._inductor_config([*examples, *flat.parameters(), *flat.buffers()])
                return _torch.inductor.compile_training_step(flat, examples, num_outputs, _inductor_hook(graphs),
                                                             config, not reads_generators)
            return _aot_compile(flat, examples, graphs, self.compiler)
        except (ExportError, CallNotSupportedError, BackwardAutocastMismatchError):
            raise
        except AutocastCallError as e:  # a call ep.module() refuses (its autocast, its dtypes)
            raise CallNotSupportedError(f"the compiled program cannot take this call: {e}") from None
        except Exception as e:  # a backend's error, from deep inside torch: said once, plainly
            raise CompileError(f"compile_training(backend={self.name}) could not compile the program: "
                               f"{_first_line(e)}") from None


def _first_line(e: Exception) -> str:
    """The error's type and first line, or where it was raised if it says nothing."""
    lines = str(e).strip().splitlines()
    if lines:
        return f"{type(e).__name__}: {lines[0]}"
    frame = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__} at {frame.filename}:{frame.lineno} ({frame.line})"


def _draws_kept_in_order(options: dict) -> dict:
    """Eager's draws (``fallback_random``): inductor's kernels of draws and
    generator ops run in the graph's order (after a scheduler pass of the
    user's own, if any)."""
    if not options.get("fallback_random"):
        return options
    ordered = _torch.inductor.draws_in_order(frozenset(generator_ops.READS))
    users = options.get("_pre_fusion_custom_pass")
    return {**options, "_pre_fusion_custom_pass": ordered if users is None else _chained(users, ordered)}


def _chained(first, then):
    return lambda nodes: then(first(nodes))


def _check_no_options(name: str, options) -> None:
    if options:
        raise ValueError(f"compile_training: options are inductor's config, for backend='inductor' only "
                         f"(got backend {name!r} with options {sorted(options)})")


def _inductor_options(options) -> dict:
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"compile_training: options must be a dict of inductor config values, not {options!r}")
    known = _torch.inductor.inductor_option_names()
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(f"compile_training: unknown inductor option(s) {unknown}; the names are inductor's "
                         "config's, as torch.compile(options=...) takes them, e.g. 'fallback_random', "
                         "'max_autotune'")
    return dict(options)


def _graph_copy(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A graph module of its own for a compiler that may change it (the
    nodes' metadata shared: copied shallowly)."""
    return torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))


def _op_by_op(gm: torch.fx.GraphModule, _example_inputs):
    return gm


def _aot_compile(flat, examples, graphs, compiler):
    """AOTAutograd's joint trace with its default partitioner; each graph run
    op by op, or compiled by ``compiler``."""
    def compiled(gm, example_inputs, backward=False):
        if compiler is None:  # op by op: buffers updated where they lie, dead operands written into,
            run = without_read_detaches(_graph_copy(gm)) if backward else buffers_updated_in_place(_graph_copy(gm))
            run = _torch.freeing_inputs(write_into_dead_operands(run, backward))  # inputs freed at last use
            use_run_time_calls(run)  # each op called by its C++ entry point, as ep.module() calls it
            return run
        return _torch.as_boxed(compiler(_graph_copy(gm), example_inputs))

    def forward(gm, example_inputs):
        graphs["forward"] = gm
        return run_forward(compiled(gm, example_inputs))

    def backward(gm, example_inputs):
        graphs["backward"] = gm = without_dead_random_ops(gm)
        return run_backward(gm, compiled(gm, example_inputs, backward=True))

    # op by op: updates of buffers nothing differentiates kept in the forward graph (copy_), as
    # aot_eager keeps them; a callable gets the graphs aot_autograd(fw_compiler=...) would give it
    return _torch.aot_module_simplified(flat, examples, fw_compiler=forward, bw_compiler=backward,
                                        partition_fn=_torch.partitioned_after(_joint_rewrites),
                                        keep_inference_input_mutations=compiler is None)


def _joint_rewrites(graph: torch.fx.Graph) -> None:
    """The op-by-op backends' joint graph, before it is split: equal calls
    merged, arguments the backward does not read not saved."""
    merge_equal_calls(graph)
    unread_arguments_as_none(graph)


def _inductor_hook(graphs: dict):
    """``compile_fx``'s ``inner_compile``: each graph as inductor compiles it,
    with the run-time wrappers of the other backends; the graphs recorded
    before inductor lowers them (its passes change the graph it gets)."""
    def inner_compile(gm, example_inputs, **kwargs):
        if _torch.inductor.is_backward_compile(kwargs):
            gm = without_dead_random_ops(gm)
            graphs["backward"] = recorded = _graph_copy(gm)
            return run_backward(recorded, _torch.inductor.compile_graph(gm, example_inputs, **kwargs))
        _torch.inductor.saved_inputs_copied(gm)
        graphs["forward"] = _graph_copy(gm)
        return run_forward(_torch.inductor.compile_graph(gm, example_inputs, **kwargs))

    return inner_compile
