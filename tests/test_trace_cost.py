"""What the trace costs per op: work torch does that the trace skips, and why that is sound."""
import unittest
from unittest import mock

import torch

import predispatch
from predispatch import _torch


class _BatchNormDropout(torch.nn.Module):
    """Composites FunctionalTensorMode decomposes (batch_norm, dropout), each
    re-entering the mode (``with self:``), which pushes it as a pre-dispatch mode."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)

    def forward(self, x):
        return torch.nn.functional.dropout(self.bn(self.linear(x)), 0.5, training=True).relu_()


class TestPreDispatchPushes(unittest.TestCase):
    def test_no_op_caches_a_pre_dispatch_handler(self):
        """The uncaching loop a pre-dispatch push skips (pre_dispatch_pushes_without_uncaching)
        would have dropped nothing: torch caches no op's PreDispatch entry, while tracing or after."""
        seen = []
        original = torch._ops.OpOverload.decompose

        def decompose(op, *args, **kwargs):
            seen.append(_torch.pre_dispatch_cached_ops())
            return original(op, *args, **kwargs)

        with mock.patch.object(torch._ops.OpOverload, "decompose", decompose):
            predispatch.export_predispatch(_BatchNormDropout().train(), (torch.randn(3, 4),))
        self.assertTrue(seen)  # composites were decomposed under the mode
        self.assertEqual([ops for ops in seen if ops], [])
        self.assertEqual(_torch.pre_dispatch_cached_ops(), [])

    def test_a_traced_export_uncaches_nothing(self):
        calls = []
        original = torch._ops.OpOverload._uncache_dispatch

        def uncache(op, key):
            calls.append((op, key))
            return original(op, key)

        with mock.patch.object(torch._ops.OpOverload, "_uncache_dispatch", uncache):
            ep = predispatch.export_predispatch(_BatchNormDropout().train(), (torch.randn(3, 4),))
        self.assertEqual(calls, [])
        self.assertIn("_native_batch_norm_legit_functional", str(ep.graph))

    def test_other_threads_push_as_torch_does(self):
        """The replacement serves the tracing thread only (patching.patched)."""
        from torch.utils import _python_dispatch
        original = _python_dispatch._push_mode
        with _torch.pre_dispatch_pushes_without_uncaching():
            self.assertIsNot(_python_dispatch._push_mode, original)
        self.assertIs(_python_dispatch._push_mode, original)


if __name__ == "__main__":
    unittest.main()
