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
