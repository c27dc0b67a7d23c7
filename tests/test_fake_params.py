"""Parameters and buffers made fake directly (_torch/fake_params.py): the
program is the one torch's converter gives, and only plain tensors skip it."""
from unittest import mock

import pytest
import torch

import predispatch
from predispatch._torch import fake_params
from predispatch.program.printing import format_program
from predispatch.testing import assert_matches_eager


class Shared(torch.nn.Module):
    """Tied weights, batch norm statistics (an int64 scalar among them), a
    channels-last convolution weight, a buffer that is a row of a larger
    tensor, a frozen parameter, and a buffer the caller passes as an input too."""

    def __init__(self, given: torch.Tensor):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.bn = torch.nn.BatchNorm1d(4)
        self.conv = torch.nn.Conv2d(2, 2, 3).to(memory_format=torch.channels_last)
        self.frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
        self.register_buffer("row", torch.zeros(3, 4)[1])
        self.register_buffer("given", given)

    def forward(self, ids, image, given):
        with torch.no_grad():
            self.row.add_(1)
        h = self.bn(self.emb(ids)) * self.frozen + self.row
        return self.head(h), self.conv(image).sum() + given.sum() + self.given.sum()


def _inputs():
    given = torch.randn(4)
    return Shared(given).train(), (torch.tensor([1, 2, 3]), torch.randn(1, 2, 3, 3), given)


def _placeholders(ep) -> list:
    return [(n.name, tuple(v.shape), v.stride(), v.dtype, v.device, v.requires_grad, isinstance(v, torch.nn.Parameter))
            for n in ep.graph.nodes if n.op == "placeholder" for v in [n.meta["val"]]]


def test_the_program_is_the_one_torchs_converter_gives():
    made = []
    direct = fake_params._fake_of_plain

    def counted(mode, t):
        made.append(t)
        return direct(mode, t)

    model, args = _inputs()
    with mock.patch.object(fake_params, "_fake_of_plain", counted):
        ours = predispatch.export_predispatch(model, args)
    with mock.patch.object(fake_params, "_plain", lambda t, shared: False):
        torchs = predispatch.export_predispatch(model, args)
    assert format_program(ours) == format_program(torchs)
    assert _placeholders(ours) == _placeholders(torchs)
    # directly: the embedding (once, tied), the batch norm's five, the convolution's bias, the frozen one;
    # not: the row (a view), the buffer passed as an input, the channels-last weight (not contiguous)
    plain = {id(t) for t in made}
    assert plain == {id(t) for t in (model.emb.weight, model.bn.weight, model.bn.bias, model.bn.running_mean,
                                     model.bn.running_var, model.bn.num_batches_tracked, model.conv.bias,
                                     model.frozen)}
    assert len(made) == len(plain)


def test_a_program_with_them_matches_eager():
    model, args = _inputs()
    assert_matches_eager(model, args, inputs_require_grad=[False, True, True])


@pytest.mark.skipif(not hasattr(torch.nn, "Buffer"), reason="nn.Buffer")
def test_a_buffer_marked_as_one_is_left_to_torch():
    class Marked(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.b = torch.nn.Buffer(torch.ones(2))

        def forward(self, x):
            return x + self.b

    assert_matches_eager(Marked(), (torch.randn(2),))
