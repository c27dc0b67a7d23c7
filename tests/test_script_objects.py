"""Script objects (torchbind: ``torch.classes``) in the forward, from PyTorch's
test/export/test_torchbind.py: an object held as an attribute or passed as
an input, its methods called, ops taking it. Functionalization orders such
calls by an effect token; the program calls them directly, in its graph's
order (passes/effects.py), and matches eager: outputs, gradients, and the
object's state (a queue pushed to and popped from). A Python value such an
object returns (a queue's size) is refused: the trace reads it off the
example's object.

torch's library of test classes ships in its CPU wheels only: skipped where
it is missing.
"""
from __future__ import annotations

import pytest
import torch

import predispatch
from predispatch.testing.eager import assert_matches_eager


@pytest.fixture(scope="module", autouse=True)
def _test_classes():
    from torch.testing._internal.torchbind_impls import init_torchbind_implementations

    try:
        init_torchbind_implementations()
    except FileNotFoundError:
        pytest.skip("this torch build has no libtorchbind_test.so", allow_module_level=True)


def _ops():
    return torch.ops._TorchScriptTesting


class FooAttribute(torch.nn.Module):
    """test_attribute / test_custom_obj_tuple_out: a method and an op taking the object."""

    def __init__(self):
        super().__init__()
        self.foo = torch.classes._TorchScriptTesting._Foo(10, 20)

    def forward(self, x):
        a, b = _ops().takes_foo_tuple_return(self.foo, x)
        return x + _ops().takes_foo(self.foo, a + b)


class QueueInput(torch.nn.Module):
    """test_aot_export_tensor_queue_operators: a queue given, pushed to and popped from."""

    def forward(self, queue, x):
        _ops().queue_push(queue, x.cos())
        _ops().queue_push(queue, x.sin())
        first = _ops().queue_pop(queue) * 2
        return first, _ops().queue_pop(queue) + first


class QueueAttribute(torch.nn.Module):
    """test_compile_obj_attributes: the module's own queue, its methods."""

    def __init__(self):
        super().__init__()
        self.queue = torch.classes._TorchScriptTesting._TensorQueue(torch.zeros(0))

    def forward(self, x):
        self.queue.push(x * 2)
        self.queue.push(x + 1)
        return self.queue.pop() * self.queue.pop()


def _queue():
    return torch.classes._TorchScriptTesting._TensorQueue(torch.zeros(0))


@pytest.mark.parametrize("module, args", [(FooAttribute, lambda: (torch.randn(2, 3),)),
                                          (QueueInput, lambda: (_queue(), torch.randn(2, 3))),
                                          (QueueAttribute, lambda: (torch.randn(2, 3),))],
                         ids=["foo_attribute", "queue_input", "queue_attribute"])
def test_calls_on_a_script_object_match_eager(module, args):
    # refused before: "an in-place update (aten.detach_)", the effect token's
    ep = assert_matches_eager(module(), args())
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.higher_order.with_effects not in targets


def test_the_calls_keep_their_order_and_the_queue_its_state():
    ep = predispatch.export_predispatch(QueueInput(), (_queue(), torch.randn(2, 3)))
    pushes = [n for n in ep.graph.nodes if n.target is _ops().queue_push.default]
    pops = [n for n in ep.graph.nodes if n.target is _ops().queue_pop.default]
    order = list(ep.graph.nodes)
    assert len(pushes) == 2 and len(pops) == 2
    assert max(map(order.index, pushes)) < min(map(order.index, pops))  # both pushes before the pops
    queue, eager_queue, x = _queue(), _queue(), torch.randn(2, 3)
    for q in (queue, eager_queue):  # a queue not empty: the program pops what eager pops
        q.push(torch.ones(2, 3))
    torch.testing.assert_close(ep.module()(queue, x), QueueInput()(eager_queue, x))
    assert queue.size() == eager_queue.size() == 1


class ReadsTheQueueSize(torch.nn.Module):
    def forward(self, queue, x):
        _ops().queue_push(queue, x)
        return _ops().queue_pop(queue) * queue.size()  # a Python int: the example's, in a program


def test_a_python_value_a_script_object_returns_is_refused_naming_the_line():
    with pytest.raises(predispatch.ExportError, match=r"method size\(\) at .* returns a Python value of a script "
                                                      r"object") as info:
        predispatch.export_predispatch(ReadsTheQueueSize(), (_queue(), torch.randn(2, 3)))
    assert "test_script_objects.py" in str(info.value) and "queue.size()" in str(info.value)
