"""Random programs with repeated layers that share Python state: layer reuse under fuzzing.

    >>> from hypothesis import given
    >>> @given(layered_programs())
    ... def test(program):
    ...     module, args = program.build()

A program is three calls of one ``Layer`` class (in train mode: dropout,
BatchNorm, in-place writes of its own values, a buffer it updates; floats
of its own: a drop rate, a bound), given an object they share
(``state``: a counter, a list, a dict), with statements drawn from a small
table: tensor ops, and reads and writes of Python state a layer can reach —
that object, the layer's own attribute, a class attribute, a global counter,
a module-level cache, a closure's counter — sometimes under a branch on
that state or on the layer's index, sometimes none at all (so that layers
are stamped too). The top module resets every piece of state at the start
of its forward, so eager and each export start alike, and returns the
output with a digest of the state. Rendered as a pasteable test, like
:class:`tools.fuzz.generator.Program`; the oracle checks it against eager
and checks that the program with layer reuse on is, node for node, the
program with it off.
"""
from __future__ import annotations

import dataclasses

from hypothesis import strategies as st

from .generator import built, programs

OPS = ["x = self.lin(x)", "x = x.relu()", "x = torch.tanh(x) * 0.5",
       # as training runs a layer: random draws, writes of its own values, its state updated
       "x = self.drop(x)", "x = self.bn(x)", "y = self.lin(x)\ny.masked_fill_(y > 0.5, 0.0)\nx = x + y",
       "x = self.lin(x)\nx.mul_(0.5)", "self.steps.add_(1)\nx = x * 1.0", "x = x + self.steps",
       # a float of the layer's own: a drop-path rate, a dropout probability, a bound, an exponent
       "keep = 1.0 - 0.1 * self.i\nx = x * x.new_empty(3, 1).bernoulli_(keep).div_(keep)",
       "x = torch.nn.functional.dropout(x, 0.2 * self.i)", "x = x.clamp(min=-0.5 * self.i)",
       "x = x.abs().pow(self.i + 1.0)"]
READS = [
    "x = x * state.calls",
    "x = x * (len(state.log) + 1)",
    "x = x + state.table.get(self.i - 1, 0.0)",  # the previous layer's tensor
    "x = x * len(self.seen)",
    "x = x * CALLS",
    "x = x * _CACHE.setdefault('scale', 2.0)",
    "x = x * Layer.hits",
    "x = x * (self.i + 1.0)",
]
WRITES = [
    "state.calls += 1",
    "state.log.append(x.mean())",
    "state.table[self.i] = x.sum()",
    "state.table['acc'] = state.table.get('acc', 0.0) + x.sum()",
    "self.seen.append(self.i)",
    "CALLS += 1",
    "_CACHE[self.i] = 1",
    "x = x * BUMP()",
    "Layer.hits += 1",
]
BRANCHES = ["if state.calls > 1:", "if self.i % 2:", "if len(_CACHE) > 1:"]
LAYERS = 3

PRELUDE = '''\
CALLS = 0
_CACHE = {}


def _make_counter():
    n = 0

    def bump():
        nonlocal n
        n += 1
        return n
    return bump


BUMP = _make_counter()


class Shared:
    def __init__(self):
        self.calls = 0
        self.log = []
        self.table = {}


class Layer(nn.Module):
    hits = 0

    def __init__(self, i):
        super().__init__()
        self.i = i
        self.seen = []
        self.lin = nn.Linear(4, 4)
        self.drop = nn.Dropout(0.3)
        self.bn = nn.BatchNorm1d(4)
        self.register_buffer("steps", torch.zeros(()))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)
            self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)

    def forward(self, x, state):
        global CALLS
'''

TOP = f'''

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.layers = nn.ModuleList(Layer(i) for i in range({LAYERS}))

    def forward(self, x):
        global CALLS, BUMP
        CALLS = 0
        _CACHE.clear()
        BUMP = _make_counter()
        Layer.hits = 0
        for layer in self.layers:
            layer.seen.clear()
        state = Shared()
        x = x * self.scale
        for layer in self.layers:
            x = layer(x, state)
        digest = sum(state.log, torch.zeros(())) + sum(state.table.values(), torch.zeros(()))
        return x, digest + state.calls + len(_CACHE) + CALLS
'''


@dataclasses.dataclass
class LayeredProgram:
    body: list[str]  # the layer's forward, one line each, indented from the forward's body
    inputs_require_grad: bool = True
    repeated_layers = True  # the oracle also compares reuse on and off
    tolerance = {}

    @property
    def module_source(self) -> str:
        body = [f"        {part}" for line in self.body for part in line.split("\n")] + ["        return x"]
        return PRELUDE + "\n".join(body) + "\n" + TOP

    @property
    def args_source(self) -> str:
        return "g = torch.Generator().manual_seed(1)\nargs = (torch.randn(3, 4, generator=g),)\n"

    def check_call(self) -> str:
        return (f"assert_matches_eager(M(), args, inputs_require_grad={self.inputs_require_grad})\n"
                "assert_same_without_reuse(M(), args)")

    @property
    def source(self) -> str:
        body = self.args_source + self.check_call()
        return ("import torch\nimport torch.nn as nn\n"
                "from predispatch.testing.eager import assert_matches_eager\n"
                "from tools.fuzz.oracle import assert_same_without_reuse\n\n\n"
                + self.module_source + "\n\ndef test_repro():\n"
                + "".join("    " + line + "\n" for line in body.splitlines()))

    def __repr__(self) -> str:
        return "\n" + self.source

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(self.__repr__())

    def build(self):
        """(module, args), the source exec'd as a module whose globals the layers share."""
        return built(self.module_source + "\n" + self.args_source, "fuzz-layered")

    @classmethod
    def from_source(cls, source: str) -> "LayeredProgram":
        lines = source.splitlines()
        start = lines.index("        global CALLS") + 1
        end = start + lines[start:].index("        return x")
        require = "inputs_require_grad=False" not in source
        return cls([line[8:] for line in lines[start:end]], require)


@st.composite
def layered_programs(draw, max_statements: int = 6) -> LayeredProgram:
    """A random :class:`LayeredProgram` (see the module docstring)."""
    body = []
    for _ in range(draw(st.integers(1, max_statements))):
        kind = draw(st.sampled_from(["op", "op", "read", "write", "write", "branch"]))
        if kind == "op":
            body.append(draw(st.sampled_from(OPS)))
        elif kind == "read":
            body.append(draw(st.sampled_from(READS)))
        elif kind == "write":
            body.append(draw(st.sampled_from(WRITES)))
        else:
            inner = draw(st.sampled_from(OPS + WRITES))
            body += [draw(st.sampled_from(BRANCHES)), "\n".join(f"    {part}" for part in inner.split("\n"))]
    if draw(st.integers(0, 3)) == 0:  # the tensor ops only: a layer stamped from the first
        body = [line for line in body if line in OPS] or body
    return LayeredProgram(body, draw(st.sampled_from([True, True, False])))


@st.composite
def any_programs(draw, max_statements: int = 12):
    """A :func:`tools.fuzz.generator.programs` program, or one draw in five a layered one."""
    if draw(st.integers(0, 4)) == 0:
        return draw(layered_programs())
    return draw(programs(max_statements=max_statements))
