"""What one fake op of a new shape costs, torch's fake path against predispatch's fake kernels.

    python tools/fake_cost.py [--calls 50]

For each op predispatch's ``_torch/fake_kernels.py`` makes (batch norm and
activations by rule; ``addmm``, the losses and softmaxes by their meta
kernels), the milliseconds of one call on fake tensors with FakeTensorMode's
cache cleared before it (a shape the export has not met), on torch's path
(its Python decomposition) and on ours, with a convolution beside them for
scale; the rules also with the batch dimension symbolic (a dynamic batch),
where torch's path decomposes every op without a meta kernel that takes
symbolic sizes. Shapes are those of a ResNet stage and a BERT layer's head.
Wall time, one thread. design/performance.md quotes it.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from predispatch._torch import fake_kernels

aten = torch.ops.aten


def _cases():
    """name -> (fake mode, op, arguments)."""
    mode = FakeTensorMode()

    def fake(*shape, dtype=torch.float32, transposed=False):
        meta = torch.empty(shape[::-1] if transposed else shape, dtype=dtype, device="meta")
        meta = meta.t() if transposed else meta
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cpu"))

    dynamic = FakeTensorMode(shape_env=ShapeEnv())  # the batch dimension symbolic, the rest static

    def batch_symbolic(*shape):
        sizes = [DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (len(shape) - 1)
        return dynamic.from_tensor(torch.empty(shape), symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    x, c = fake(8, 64, 16, 16), lambda: fake(64)
    xs, cs = batch_symbolic(8, 64, 16, 16), lambda: dynamic.from_tensor(torch.empty(64), static_shapes=True)
    logits = fake(256, 1000)
    return {
        "convolution (for scale)": (mode, aten.convolution.default,
                                    (x, fake(64, 64, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        "batch norm, train": (mode, aten._native_batch_norm_legit_functional.default,
                              (x, c(), c(), c(), c(), True, 0.1, 1e-5)),
        "batch norm, eval": (mode, aten._native_batch_norm_legit_no_training.default,
                             (x, c(), c(), c(), c(), 0.1, 1e-5)),
        "batch norm, train, dynamic batch": (dynamic, aten._native_batch_norm_legit_functional.default,
                                             (xs, cs(), cs(), cs(), cs(), True, 0.1, 1e-5)),
        "relu": (mode, aten.relu.default, (x,)),
        "relu, dynamic batch": (dynamic, aten.relu.default, (xs,)),
        "gelu, dynamic batch": (dynamic, aten.gelu.default, (xs,)),
        "hardswish": (mode, aten.hardswish.default, (x,)),
        "addmm": (mode, aten.addmm.default, (fake(768), fake(256, 768), fake(768, 768, transposed=True))),
        "_log_softmax": (mode, aten._log_softmax.default, (logits, 1, False)),
        "_safe_softmax": (mode, aten._safe_softmax.default, (fake(2, 12, 128, 128), -1)),
        "nll_loss_forward": (mode, aten.nll_loss_forward.default,
                             (logits, fake(256, dtype=torch.long), None, 1, -100)),
    }


def cold_ms(mode, op, args, fast: bool, calls: int) -> float:
    with (fake_kernels.fast_fake_kernels() if fast else contextlib.nullcontext()), mode:
        op(*args)  # imports and first-call work
        start = time.perf_counter()
        for _ in range(calls):
            FakeTensorMode.cache_clear()
            # at symbolic sizes torch >= 2.14 caches in the shape env (an export's own: new to each export)
            getattr(mode.shape_env, "fake_tensor_cache", {}).clear()
            op(*args)
        return (time.perf_counter() - start) / calls * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=50, help="calls per op and path (default 50)")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}: ms per fake call of a new shape")
    print("| op | torch's path | predispatch |\n|---|---|---|")
    for name, (mode, op, args) in _cases().items():
        print(f"| {name} | {cold_ms(mode, op, args, False, opts.calls):.2f} | "
              f"{cold_ms(mode, op, args, True, opts.calls):.2f} |")
    FakeTensorMode.cache_clear()


if __name__ == "__main__":
    main()
