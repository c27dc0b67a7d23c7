"""Graph expect-tests: the same kit predispatch's own tests use.

    from predispatch.testing import GraphTestCase

    class TestMyPass(GraphTestCase):
        def test_seed(self):
            ep = predispatch.export_predispatch(Seed(), (torch.ones(2),))
            self.assertGraphExpectedInline(ep, '''...''')

The program is printed by :func:`predispatch.program.printing.format_program`: every
graph and subgraph, the signature and the autocast policy, with node names
re-derived from their ops, so the text does not change with file paths, line
numbers or torch's node-name counters. ``EXPECTTEST_ACCEPT=1`` rewrites the
expected strings in place; works under pytest and unittest alike.
"""
from __future__ import annotations

import expecttest

from ..program.printing import format_program
from .eager import assert_matches_eager
from .invariants import assert_invariants
from .structure import assert_same_program, program_structure

__all__ = ["GraphTestCase", "assert_invariants", "assert_matches_eager", "assert_same_program", "format_program",
           "program_structure"]


class GraphTestCase(expecttest.TestCase):
    """An ``expecttest.TestCase`` with :meth:`assertGraphExpectedInline`.

        >>> class TestDouble(predispatch.testing.GraphTestCase):
        ...     def test_double(self):
        ...         ep = predispatch.export_predispatch(torch.nn.Linear(2, 2), (torch.ones(1, 2),))
        ...         self.assertGraphExpectedInline(ep, '''\\
        ... def forward(p_weight: f32[2, 2], p_bias: f32[2], input: f32[1, 2]):
        ...     linear = aten.linear.default(input, p_weight, p_bias)
        ...     return (linear,)
        ... inputs:
        ...     p_weight: PARAMETER -> weight
        ...     p_bias: PARAMETER -> bias
        ...     input: USER_INPUT
        ... outputs:
        ...     linear: USER_OUTPUT
        ... autocast policy: backward_pass_autocast='same_as_forward', on_backward_autocast_mismatch='error'
        ... ''')
        >>> import io, unittest
        >>> unittest.TextTestRunner(stream=io.StringIO()).run(TestDouble("test_double")).wasSuccessful()
        True

    The program is printed by :func:`predispatch.format_program`, so the
    text does not change with file paths, line numbers or torch's node-name
    counters; ``EXPECTTEST_ACCEPT=1`` rewrites the expected strings.
    """

    def assertGraphExpectedInline(self, ep_or_graph_module, expect: str, skip: int = 0) -> None:
        self.assertExpectedInline(format_program(ep_or_graph_module), expect, skip=skip + 1)
