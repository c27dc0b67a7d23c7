"""What one fake op of a new shape costs, torch's fake path against predispatch's fake kernels.

    python tools/fake_cost.py [--calls 50]

For each op predispatch's ``_torch/fake_kernels.py`` makes (batch norm by
rule; ``addmm``, the losses and softmaxes by their meta kernels), the
milliseconds of one call on fake tensors with FakeTensorMode's cache cleared
before it (a shape the export has not met), on torch's path (its Python
decomposition) and on ours, with a convolution beside them for scale.
Shapes are those of a ResNet stage and a BERT layer's head. Wall time, one
thread. design/performance.md quotes it.
"""
from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from predispatch._torch import fake_kernels

aten = torch.ops.aten


def _cases(mode):
    def fake(*shape, dtype=torch.float32, transposed=False):
        meta = torch.empty(shape[::-1] if transposed else shape, dtype=dtype, device="meta")
        meta = meta.t() if transposed else meta
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, torch.device("cpu"))

    x, c = fake(8, 64, 16, 16), lambda: fake(64)
    logits = fake(256, 1000)
    return {
        "convolution (for scale)": (aten.convolution.default,
                                    (x, fake(64, 64, 3, 3), None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)),
        "batch norm, train": (aten._native_batch_norm_legit_functional.default,
                              (x, c(), c(), c(), c(), True, 0.1, 1e-5)),
        "batch norm, eval": (aten._native_batch_norm_legit_no_training.default, (x, c(), c(), c(), c(), 0.1, 1e-5)),
        "addmm": (aten.addmm.default, (fake(768), fake(256, 768), fake(768, 768, transposed=True))),
        "_log_softmax": (aten._log_softmax.default, (logits, 1, False)),
        "_safe_softmax": (aten._safe_softmax.default, (fake(2, 12, 128, 128), -1)),
        "nll_loss_forward": (aten.nll_loss_forward.default,
                             (logits, fake(256, dtype=torch.long), None, 1, -100)),
    }


def cold_ms(mode, op, args, fast: bool, calls: int) -> float:
    with (fake_kernels.fast_fake_kernels() if fast else contextlib.nullcontext()), mode:
        op(*args)  # imports and first-call work
        start = time.perf_counter()
        for _ in range(calls):
            FakeTensorMode.cache_clear()
            op(*args)
        return (time.perf_counter() - start) / calls * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=50, help="calls per op and path (default 50)")
    opts = p.parse_args(argv)
    torch.set_num_threads(1)
    mode = FakeTensorMode()
    print(f"torch {torch.__version__}: ms per fake call of a new shape")
    print("| op | torch's path | predispatch |\n|---|---|---|")
    for name, (op, args) in _cases(mode).items():
        print(f"| {name} | {cold_ms(mode, op, args, False, opts.calls):.2f} | "
              f"{cold_ms(mode, op, args, True, opts.calls):.2f} |")
    FakeTensorMode.cache_clear()


if __name__ == "__main__":
    main()
