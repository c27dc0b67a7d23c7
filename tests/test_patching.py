"""The trace's global wrappers serve the tracing thread only, and go on exit."""
import threading
import types

import torch

from predispatch._torch.patching import patched


class Base:
    @classmethod
    def make(cls):
        return ("made", cls.__name__)

    def greet(self):
        return "hello"


class Child(Base):
    pass


def _in_other_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_replacement_in_this_thread_original_elsewhere_and_restored():
    module = types.ModuleType("m")
    module.draw = lambda: 4
    with patched(module, "draw", lambda original: lambda: original() + 1), \
            patched(Base, "greet", lambda original: lambda self: original(self).upper()), \
            patched(Base, "make", lambda original: lambda cls: ("wrapped", *original(cls))):
        assert module.draw() == 5 and _in_other_thread(module.draw) == 4
        assert Child().greet() == "HELLO" and _in_other_thread(Child().greet) == "hello"
        assert Child.make() == ("wrapped", "made", "Child")  # a classmethod keeps its class
        assert _in_other_thread(Child.make) == ("made", "Child")
    assert module.draw() == 4 and Child().greet() == "hello" and Child.make() == ("made", "Child")
    assert "greet" in vars(Base) and "make" in vars(Base)


def test_an_inherited_method_is_removed_again():
    with patched(torch.Tensor, "set_", lambda original: original):
        assert "set_" in vars(torch.Tensor)
    assert "set_" not in vars(torch.Tensor)


class FromKeys(dict):
    fromkeys = vars(dict)["fromkeys"]  # a C classmethod, as torch.autograd.Function.apply is since torch 2.14


def test_a_c_classmethod_keeps_its_class():
    assert isinstance(vars(FromKeys)["fromkeys"], types.ClassMethodDescriptorType)
    with patched(FromKeys, "fromkeys", lambda original: lambda cls, keys: ("wrapped", original(cls, keys))):
        assert FromKeys.fromkeys("a") == ("wrapped", {"a": None})
        assert type(FromKeys.fromkeys("a")[1]) is FromKeys
        assert _in_other_thread(lambda: type(FromKeys.fromkeys("a"))) is FromKeys
    assert isinstance(vars(FromKeys)["fromkeys"], types.ClassMethodDescriptorType)
    assert type(FromKeys.fromkeys("a")) is FromKeys


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_function_apply_keeps_its_class_whatever_kind_of_classmethod_it_is():
    """``Function.apply`` is a Python classmethod on torch 2.13, a C one since 2.14:
    patched, a Function's own apply still runs its forward, here and in other threads."""
    seen = []

    def capturing(original):
        def call(cls, *args):
            seen.append(cls)
            return original(cls, *args)
        return call

    x = torch.ones(2, requires_grad=True)
    with patched(torch.autograd.Function, "apply", capturing):
        assert Double.apply(x).tolist() == [2.0, 2.0] and seen == [Double]
        assert _in_other_thread(lambda: Double.apply(x).tolist()) == [2.0, 2.0] and seen == [Double]
    Double.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0]
