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
    """An ``expecttest.TestCase`` with :meth:`assertGraphExpectedInline`."""

    def assertGraphExpectedInline(self, ep_or_graph_module, expect: str, skip: int = 0) -> None:
        self.assertExpectedInline(format_program(ep_or_graph_module), expect, skip=skip + 1)
