"""Layer reuse and the Python state a layer reaches (predispatch/trace/python_state.py).

A replay runs a layer's Python code on meta tensors before deciding whether
to stamp it. Whatever Python state the layer can reach — objects given as
arguments (a counter, a cache that holds tensors, a list, a dict, a
dataclass), its module's attributes, its class's attributes, globals,
closures, ``functools.lru_cache`` helpers, iterators — must be exactly as
eager leaves it. Each case: the program with reuse on is the program with
reuse off, node for node (``export_both``), and it matches eager; the report
says the layers that write such state are traced. Each module resets its
state at the start of its forward, so eager and every export start alike.
"""
import dataclasses
import functools
import itertools

import pytest
import torch
import torch.nn as nn

from predispatch.trace import layer_reuse
from predispatch.testing.eager import assert_matches_eager
from test_layer_reuse import export_both


def _x():
    return (torch.randn(2, 4),)


class Layers(nn.Module):
    """Three layers of ``layer_class``, given ``make_state()`` (if any) as their second argument."""

    def __init__(self, layer_class, make_state=None, finish=None):
        super().__init__()
        self.finish = finish
        self.layers = nn.ModuleList(layer_class(i) for i in range(3))
        self.make_state = make_state
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        x = x * self.scale  # every layer's input requires grad: one key for all
        state = self.make_state() if self.make_state is not None else None
        for layer in self.layers:
            x = layer(x) if state is None else layer(x, state)
        return x if self.finish is None else self.finish(x, state)


class Layer(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.index = index


def check(module, traced_at_least=1):
    """Reuse on equals reuse off and eager; returns the report."""
    torch.manual_seed(0)
    _, report = export_both(module, _x())
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(module, _x())
    assert report.traced >= traced_at_least
    return report


# --- objects given as arguments -----------------------------------------------

class Counter:  # the issue's: Python-only state the layers share
    def __init__(self):
        self.n = {}

    def bump(self, i):
        self.n[i] = self.n.get(i, 0) + 1
        return self.n[i]


class Counted(Layer):
    def forward(self, x, counter):
        return self.lin(x) * counter.bump(self.index)


def test_shared_counter_object():
    report = check(Layers(Counted, Counter))
    assert report.stamped == 0  # every layer writes the counter


class TensorCache:  # as transformers' DynamicCache: a per-layer entry made on first use
    def __init__(self):
        self.keys = []

    def update(self, i, k):
        if len(self.keys) <= i:
            self.keys.append(k)
        else:
            self.keys[i] = torch.cat([self.keys[i], k])
        return self.keys[i]


class Cached(Layer):
    def forward(self, x, cache):
        return self.lin(x) + cache.update(self.index, x).sum()


def test_cache_holding_tensors():
    check(Layers(Cached, TensorCache))


class AppendsToList(Layer):
    def forward(self, x, seen):
        seen.append(x.sum())
        return self.lin(x)


def test_list_argument_appended_to():
    """The calls log the same torch ops: only the list tells them apart (its
    length is in the call's key too: a pytree container's structure)."""
    check(Layers(AppendsToList, list, lambda x, seen: x * len(seen) + sum(seen)))


class UpdatesListEntry(Layer):
    def forward(self, x, totals):
        totals[0] = totals[0] + x.sum()
        return self.lin(x)


def test_list_argument_entry_replaced():
    """Same structure before each call: only the replay's write tells the calls apart."""
    check(Layers(UpdatesListEntry, lambda: [torch.zeros(())], lambda x, totals: x + totals[0]))


class WritesDict(Layer):
    def forward(self, x, table):
        table[self.index] = x.mean()
        return self.lin(x)


def test_dict_argument_written():
    check(Layers(WritesDict, dict, lambda x, table: x * len(table) + sum(table.values())))


class UpdatesDictEntry(Layer):
    def forward(self, x, table):
        table["total"] = table["total"] + x.sum()
        return self.lin(x)


def test_dict_argument_entry_replaced():
    check(Layers(UpdatesDictEntry, lambda: {"total": torch.zeros(())}, lambda x, table: x + table["total"]))


@dataclasses.dataclass
class Stats:
    calls: int = 0
    log: list = dataclasses.field(default_factory=list)


class UpdatesDataclass(Layer):
    def forward(self, x, stats):
        stats.calls += 1
        stats.log.append(self.index)
        return self.lin(x) * stats.calls


def test_dataclass_argument_updated():
    check(Layers(UpdatesDataclass, Stats))


class ReadsOnly(Layer):
    def forward(self, x, stats):
        return self.lin(x) * (stats.calls + 1.0)


def test_state_only_read_is_still_stamped():
    report = check(Layers(ReadsOnly, Stats), traced_at_least=0)
    assert (report.templates, report.stamped) == (1, 2)


# --- the module's own state ------------------------------------------------------

class AppendsToAttribute(Layer):
    def __init__(self, index):
        super().__init__(index)
        self.seen = []

    def forward(self, x):
        self.seen.append(1)
        return self.lin(x) * len(self.seen)


class ResetsAttributes(Layers):
    def forward(self, x):
        for layer in self.layers:
            layer.seen.clear()
        return super().forward(x)


def test_module_attribute_mutated_in_place():
    check(ResetsAttributes(AppendsToAttribute))


class CountsOnClass(Layer):
    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return self.lin(x) * type(self).calls


class ResetsClass(Layers):
    def forward(self, x):
        CountsOnClass.calls = 0
        return super().forward(x)


def test_class_attribute_updated():
    check(ResetsClass(CountsOnClass))


# --- globals, closures, caches, iterators ----------------------------------------

CALLS = 0
_CACHE = {}


class CountsGlobally(Layer):
    def forward(self, x):
        global CALLS
        CALLS += 1
        return self.lin(x) * CALLS


class CachesGlobally(Layer):
    def forward(self, x):
        scale = _CACHE.setdefault(x.shape[-1], torch.full((), 2.0))
        _CACHE[len(_CACHE)] = self.index
        return self.lin(x) * scale * len(_CACHE)


def _make_counter():
    n = 0

    def bump():
        nonlocal n
        n += 1
        return n
    return bump


BUMP = _make_counter()


class BumpsClosure(Layer):
    def forward(self, x):
        return self.lin(x) * BUMP()


@functools.lru_cache(maxsize=None)
def positions(n):
    return torch.arange(n, dtype=torch.float32)


class UsesCachedHelper(Layer):
    def forward(self, x):
        return self.lin(x) + positions(x.shape[-1])


IDS = itertools.count()


class DrawsFromIterator(Layer):
    def forward(self, x):
        return self.lin(x) * next(IDS)


class ResetsGlobals(Layers):
    def forward(self, x):
        global CALLS, BUMP, IDS
        CALLS = 0
        _CACHE.clear()
        BUMP = _make_counter()
        positions.cache_clear()
        IDS = itertools.count(1)
        return super().forward(x)


@pytest.mark.parametrize("layer_class", [CountsGlobally, CachesGlobally, BumpsClosure, UsesCachedHelper,
                                         DrawsFromIterator])
def test_global_state(layer_class):
    check(ResetsGlobals(layer_class))


# --- real models -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["XLM", "Flaubert"])
def test_transformers_model_with_a_cache_in_train_mode(name):
    """XLM and Flaubert give their layers a DynamicCache in train mode (the
    replay used to leave meta tensors in it); their FFN layers, which do not
    touch it, are still stamped."""
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, f"{name}Config")(vocab_size=64, emb_dim=32, n_layers=3, n_heads=4,
                                                      dropout=0.0, attention_dropout=0.0)
    model = getattr(transformers, f"{name}WithLMHeadModel")(config).train()
    ids = torch.randint(0, 64, (2, 8))
    _, report = export_both(model, (ids,))
    assert report.stamped == 2  # the second and third FFN layers
    with layer_reuse.reuse_layers(True):
        assert_matches_eager(model, (ids,))
