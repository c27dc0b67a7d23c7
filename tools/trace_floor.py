"""Where export time goes, against the fake-forward floor of tools/bench.py.

    python tools/trace_floor.py                 # llama, llama-L8, bert, gpt2
    python tools/trace_floor.py --only llama-L8 --repeat 7

For each case, interleaved and repeated (min and median, seconds):

* floor        one forward on fake tensors (bench.fake_forward);
* bare trace   torch's tracer alone, as the capture stage runs it:
               make_fx(pre_dispatch=True) over the forward under a
               FunctionalTensorMode, on fake tensors (functional_trace,
               without torch.export's front end, the recorder, and with no
               node stack traces at all);
* predispatch  export_predispatch;
* torch.export torch.export.export (non-strict);
* torch functional  torch's own way to a functional program:
               torch.export.export, then ``run_decompositions({})``
               (functionalized; its grad and autocast blocks and its
               composites are gone).

The "bare trace / floor" ratio bounds what any pipeline built on make_fx and
FunctionalTensorMode can reach against the floor; "torch functional" is what
torch itself spends to give a functional program. A command, not a test.

    python tools/trace_floor.py --only resnet-L4-train,vit-L4-train,resnet-L4-train-dyn
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
import unittest.mock
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (puts the repository on sys.path)
import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from predispatch import _torch  # noqa: E402
from predispatch.trace.functional_trace import functional_trace  # noqa: E402


class _FlatOutputs(torch.nn.Module):
    """The traced module returns a tuple (torch.export's front end flattens too)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return tuple(pytree.tree_leaves(self.model(*args, **kwargs)))


def bare_trace(model, args):
    """functional_trace on fake parameters, buffers and inputs, in the state
    the capture stage traces in (grad on, compiling flag set); static shapes."""
    args, kwargs, _ = bench.export_arguments(args)
    model = _FlatOutputs(model)
    mode = FakeTensorMode(allow_non_fake_inputs=False)
    state = {**dict(model.named_parameters(remove_duplicate=False)),  # tied weights: each name
             **dict(model.named_buffers(remove_duplicate=False))}
    fake_state = {name: mode.from_tensor(t) for name, t in state.items()}
    fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    with contextlib.ExitStack() as stack:
        stack.enter_context(mode)
        stack.enter_context(_torch.reparametrize_module(model, fake_state))
        stack.enter_context(_torch.compiling_state_context())
        stack.enter_context(torch.enable_grad())
        stack.enter_context(unittest.mock.patch.object(torch.fx.config, "do_not_emit_stack_traces", True))
        return functional_trace(model, fake_args, fake_kwargs)[:2]


def torch_functional(model, args):
    """torch.export's program made functional by torch: ``run_decompositions({})``."""
    return bench.export_torch(model, args).run_decompositions({})


MEASURED = {"floor": bench.fake_forward, "bare trace": bare_trace,
            "predispatch": bench.export_pd, "torch.export": bench.export_torch,
            "torch functional": torch_functional}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default="llama,llama-L8,bert,gpt2")
    p.add_argument("--repeat", type=int, default=5)
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    bench.warm_up()
    for name in opts.only.split(","):
        model, args = bench.CASE_BY_NAME[name].build()
        bare_trace(model, args)  # first-call costs of this model's ops
        times = {k: [] for k in MEASURED}
        for r in range(opts.repeat):
            for k in bench.rotated(list(MEASURED), r):
                # CPU time: steadier than wall time on a shared machine
                times[k].append(bench.timed(MEASURED[k], model, args, clock=time.process_time))
        floor = statistics.median(times["floor"])
        print(f"{name}:")
        for k, ts in times.items():
            med = statistics.median(ts)
            print(f"    {k:16s} min {min(ts):.3f} s  median {med:.3f} s  x floor {med / floor:.2f}"
                  f"  x torch.export {med / statistics.median(times['torch.export']):.2f}")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
