"""The normalized printer (CLI, GraphTestCase, assert_matches_eager's G7
check) on what torch can put in a program besides our regions."""
import torch

import predispatch
from predispatch.testing.eager import assert_matches_eager


@torch.library.custom_op("predispatch_print::bump_", mutates_args=("x",))
def bump_(x: torch.Tensor) -> None:
    x.add_(1)


@bump_.register_fake
def _(x):
    return None


class _BumpsABuffer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(4))

    def forward(self, x):
        torch.ops.predispatch_print.bump_(self.b)
        return x + self.b


def test_other_higher_order_ops_print_under_their_own_name():
    """A mutating custom op is auto_functionalized_v2, a higher-order op
    without a submodule (the printer took it for a region and failed)."""
    ep = assert_matches_eager(_BumpsABuffer(), (torch.randn(4),), inputs_require_grad=False)
    text = predispatch.format_program(ep)
    assert "auto_functionalized_v2 = auto_functionalized_v2(" in text


class _DataDependentSize(torch.nn.Module):
    def forward(self, x):
        return torch.nonzero(x > 0).shape[0] * x


def test_runtime_assertion_messages_name_nodes_as_printed():
    """``_assert_scalar``'s message names a node by torch's counter ('ge',
    'ge_1'): printed with the normalized name, a re-export prints the same."""
    ep = assert_matches_eager(_DataDependentSize(), (torch.randn(4, 4),))  # checks G7 by the print
    again = predispatch.export_predispatch(ep.module(), (torch.randn(4, 4),))
    assert predispatch.format_program(again) == predispatch.format_program(ep)
    assert "on node '" in predispatch.format_program(ep)
