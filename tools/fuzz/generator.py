"""Random small programs with grad/autocast regions, views and mutations.

    >>> from hypothesis import given
    >>> @given(programs())
    ... def test(program):
    ...     module, args = program.build()

A program is a list of statements (``Stmt``: a line, or a ``with`` header and
a body) rendered as the Python source of an ``nn.Module`` and exec'd to build
it, so a failing example prints as a test a developer can paste::

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            g = torch.Generator().manual_seed(0)
            self.register_buffer("b", torch.randn(3, 4, generator=g))

        def forward(self, x):
            with torch.no_grad():
                v0 = x[0]
                v0.mul_(2.0)
            return x.sin(), v0

Inputs may share memory (``y`` passed as ``x``, ``z`` as a row of ``x``).
Blocks are ``no_grad`` / ``enable_grad`` / ``set_grad_enabled(b)`` /
``autocast("cpu", dtype=torch.bfloat16)`` / ``autocast("cpu", enabled=False)`` /
``inference_mode(False)``,
nested up to three deep, sometimes in decorator form (a decorated local
function). Statements: ordinary ops (sin, relu, tanh, sigmoid, clone, +, *,
-, sum, mean, ``@ self.w``, ``self.lin``, ``.float()``), views (slices,
select, ``.t()``, ``.view``, ``.unsqueeze``, ``.detach()``) of inputs,
parameters, buffers and intermediates, and in-place ops on any of them
(add_, sub_, mul_, copy_, zero_, ``mul_(0)``, index assignment, EMA
``mul_(0.9).add_(v, alpha=0.1)``, ``nn.init.constant_``, whose no_grad block
no torch-function mode sees), values made leaves (``.detach().requires_grad_()``),
metadata mutations (``t_``, ``transpose_``, ``unsqueeze_``, ``squeeze_``) and
storage swaps (``set_``, under no_grad) of inputs and intermediates.
Outputs may alias inputs, parameters or buffers.

Some programs (:data:`FEATURE_SHARES`: a quarter, a fifth, a fifth drawn;
about 15%, 10% and 10% show them, a third any) also draw, one statement in
four, from :data:`FEATURES`:

* **random state** — draws (``torch.randn``/``rand``, ``rand_like``,
  ``bernoulli``, a dropout in training, ``normal_``/``uniform_``/``bernoulli_``
  fills), from torch's generator or from a ``torch.Generator().manual_seed(k)``
  made in the forward; ``torch.manual_seed(k)``; ``with
  torch.random.fork_rng(...)`` blocks (often seeded first); ``s =
  torch.get_rng_state()`` ... ``torch.set_rng_state(s)``; a generator's
  ``get_state()`` / ``set_state(s)`` / ``manual_seed(k)``;
* **bare switches** — ``torch.set_grad_enabled(b)`` called as a function,
  ``torch._C._set_grad_enabled(b)``, ``prev = torch.is_grad_enabled()`` and
  the switch back to ``prev``, at top level and inside blocks (a grad
  block's exit restores the mode its entry found, an autocast block's or a
  fork's does not; the mode left at the end is the caller's after the call);
* **branches** — ``if`` on a tensor's value (``v.sum() > 0``,
  ``v[0, 0].item() > 0.5``, ``v.mean().item() < 0``, ``(v > 0).any()``) with a
  body, or ``a if <condition> else b``: such a program is exported with
  ``data_dependent="specialize"`` and the oracle also runs it on other inputs.
  A condition never reads drawn values (the export's real values are other
  draws), and what a branch's body makes stays in it (it may not run).

The generator keeps a small abstract state (shape, dtype, storage root,
grad mode at creation, "saved for backward", "requires grad") to steer away
from programs eager itself would refuse (an in-place op on a leaf that
requires grad, on a view created under no_grad then modified with grad, on
a tensor saved for backward); one in-place op in ten ignores it, so those
corners are tried too. It is a heuristic: the oracle
(:mod:`tools.fuzz.oracle`) runs eager first and discards what it refuses.
It never writes with an operand that partially overlaps the written memory
(``v.add_(v[0])`` of ``v = b.t()``): eager computes that in iteration order,
which is undefined behaviour, not something a functional program can match.
"""
from __future__ import annotations

import dataclasses
import itertools
import linecache
import re

from hypothesis import strategies as st

# --------------------------------------------------------------------------
# The program: statements, rendering, building.


@dataclasses.dataclass
class Stmt:
    """One statement: ``text`` is the line (a ``with ...:`` header for a block).

    A block with a ``function`` name is rendered in decorator form: a local
    function decorated with the context manager, returning the names its body
    defines, and a call that binds them::

        @torch.no_grad()
        def f0():
            v3 = v1 * 2.0
            v1.add_(1.0)
            return (v3,)
        v3, = f0()
    """

    text: str
    body: list["Stmt"] | None = None  # None: a simple statement
    function: str | None = None

    def defined(self) -> list[str]:
        """Names the statement (and its body) assign."""
        if self.body is None:
            m = re.match(r"(v\d+) = ", self.text)
            return [m.group(1)] if m else []
        if self.text.startswith("if "):
            return []  # a branch may not run: what its body makes stays in it
        return [name for s in self.body for name in s.defined()]

    def lines(self, indent: int) -> list[str]:
        pad = "    " * indent
        if self.body is None:
            return [pad + self.text]
        inner = [line for s in self.body for line in s.lines(indent + 1)]
        if self.function is None:
            return [pad + self.text] + (inner or [pad + "    pass"])
        decorator = self.text[len("with "):].rstrip(":")
        names = self.defined()
        if names:
            inner.append(f"{pad}    return ({', '.join(names)},)")
            call = f"{pad}{', '.join(names)}, = {self.function}()"
        else:
            call = f"{pad}{self.function}()"
        return [f"{pad}@{decorator}", f"{pad}def {self.function}():"] + (inner or [pad + "    pass"]) + [call]


# Members the forward may use: name -> (kind, shape, __init__ lines).
MEMBERS = {
    "w": ("param", (4, 4), ["self.w = nn.Parameter(torch.randn(4, 4, generator=g) * 0.5)"]),
    "p": ("param", (3, 4), ["self.p = nn.Parameter(torch.randn(3, 4, generator=g))"]),
    "lin": ("module", None, [
        "self.lin = nn.Linear(4, 4)",
        "with torch.no_grad():",
        "    self.lin.weight.copy_(torch.randn(4, 4, generator=g) * 0.5)",
        "    self.lin.bias.copy_(torch.randn(4, generator=g) * 0.1)",
    ]),
    "b": ("buffer", (3, 4), ['self.register_buffer("b", torch.randn(3, 4, generator=g))']),
    "s": ("buffer", (4,), ['self.register_buffer("s", torch.zeros(4))']),
    "n": ("buffer", (), ['self.register_buffer("n", torch.zeros(()))']),
}
# Tensors a statement may name directly: expression -> (kind, shape).
STATE_TENSORS = {
    "self.w": ("param", (4, 4)),
    "self.p": ("param", (3, 4)),
    "self.lin.weight": ("param", (4, 4)),
    "self.lin.bias": ("param", (4,)),
    "self.b": ("buffer", (3, 4)),
    "self.s": ("buffer", (4,)),
    "self.n": ("buffer", ()),
}
INPUTS = (("x", (3, 4)), ("y", (3, 4)), ("z", (4,)))

BF16_TOLERANCE = 2e-2  # rtol and atol when the program uses bf16 autocast

_counter = itertools.count()


def built(code: str, tag: str):
    """(``M()``, ``args``) of a program's ``code``, exec'd as a module of its
    own, registered in linecache (tracebacks and ExportError messages show
    the program's lines)."""
    import torch
    import torch.nn as nn

    filename = f"<{tag}-{next(_counter)}>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    namespace = {"torch": torch, "nn": nn, "__name__": tag.replace("-", "_")}
    exec(compile(code, filename, "exec"), namespace)
    return namespace["M"](), namespace["args"]


@dataclasses.dataclass
class Program:
    stmts: list[Stmt]
    returns: list[str]
    inputs: list[tuple[str, tuple]]
    inputs_require_grad: bool = True
    # inputs passed as another input or a view of one: name -> expression ("x", "x[0]")
    aliasing: dict = dataclasses.field(default_factory=dict)

    # -- derived ----------------------------------------------------------
    @property
    def forward_lines(self) -> list[str]:
        lines = [line for s in self.stmts for line in s.lines(2)]
        ret = self.returns[0] if len(self.returns) == 1 else "(" + ", ".join(self.returns) + ")"
        return lines + [f"        return {ret}"]

    def members_used(self) -> list[str]:
        text = "\n".join(self.forward_lines)
        used = set(re.findall(r"\bself\.(\w+)", text))
        return [m for m in MEMBERS if m in used]

    def inputs_used(self) -> list[tuple[str, tuple]]:
        text = "\n".join(self.forward_lines)
        return [(n, s) for n, s in self.inputs if re.search(rf"\b{n}\b", text)] or self.inputs[:1]

    @property
    def uses_autocast(self) -> bool:
        return any("torch.bfloat16" in line for line in self.forward_lines)

    @property
    def features(self) -> set[str]:
        """The :data:`FEATURES` the forward shows."""
        return {f for f, pattern in FEATURE_PATTERNS.items()
                if any(re.match(pattern, line) for line in self.forward_lines)}

    @property
    def branches(self) -> bool:
        """Does the forward branch on a tensor's value (exported with
        ``data_dependent="specialize"``, checked on other inputs too)?"""
        return "branches" in self.features

    @property
    def export_options(self) -> dict:
        return {"data_dependent": "specialize"} if self.branches else {}

    @property
    def tolerance(self) -> dict:
        if self.uses_autocast:
            return {"rtol": BF16_TOLERANCE, "atol": BF16_TOLERANCE}
        return {}

    @property
    def module_source(self) -> str:
        init = ["    def __init__(self):", "        super().__init__()"]
        members = self.members_used()
        if members:
            init.append("        g = torch.Generator().manual_seed(0)")
            for m in members:
                init += ["        " + line for line in MEMBERS[m][2]]
        names = ", ".join(n for n, _ in self.inputs_used())
        return "\n".join(["class M(nn.Module):", *init, "",
                          f"    def forward(self, {names}):", *self.forward_lines]) + "\n"

    @property
    def args_source(self) -> str:
        used = self.inputs_used()
        if not any(n in self.aliasing for n, _ in used):
            items = ", ".join(f"torch.randn({', '.join(map(str, s))}, generator=g)" for _, s in used)
            return f"g = torch.Generator().manual_seed(1)\nargs = ({items},)\n"
        # inputs sharing memory: the tensors first, then the arguments naming them
        shapes = dict(INPUTS)
        bases = sorted({re.match(r"\w+", self.aliasing.get(n, n)).group(0) for n, _ in used},
                       key=[n for n, _ in INPUTS].index)
        lines = ["g = torch.Generator().manual_seed(1)"]
        lines += [f"{b} = torch.randn({', '.join(map(str, shapes[b]))}, generator=g)" for b in bases]
        lines.append(f"args = ({', '.join(self.aliasing.get(n, n) for n, _ in used)},)")
        return "\n".join(lines) + "\n"

    def check_call(self) -> str:
        kw = [f"inputs_require_grad={self.inputs_require_grad}"]
        kw += [f"{k}={v}" for k, v in self.tolerance.items()]
        check = "assert_branches_checked" if self.branches else "assert_matches_eager"
        return f"{check}(M(), args, {', '.join(kw)})"

    @property
    def source(self) -> str:
        """A pasteable test: imports, the module, its inputs, the check."""
        body = self.args_source + self.check_call()
        imports = ("from tools.fuzz.oracle import assert_branches_checked\n" if self.branches
                   else "from predispatch.testing.eager import assert_matches_eager\n")
        return ("import torch\nimport torch.nn as nn\n" + imports + "\n\n"
                + self.module_source + "\n\ndef test_repro():\n"
                + "".join("    " + line + "\n" for line in body.splitlines()))

    def __repr__(self) -> str:
        return "\n" + self.source

    def _repr_pretty_(self, printer, cycle) -> None:  # hypothesis prints failing examples so
        printer.text(self.__repr__())

    # -- building ---------------------------------------------------------
    def build(self):
        """(module, args): exec the source (see :func:`built`)."""
        return built(self.module_source + "\n" + self.args_source, "fuzz-program")

    @classmethod
    def from_source(cls, source: str) -> "Program":
        """The program back from its ``source`` (as printed for a failure)."""
        lines = source.splitlines()
        start = next(i for i, line in enumerate(lines) if line.strip().startswith("def forward("))
        names = lines[start].split("(", 1)[1].rsplit(")", 1)[0].split(",")[1:]
        shapes = dict(INPUTS)
        inputs = [(n.strip(), shapes[n.strip()]) for n in names]
        root: list[Stmt] = []
        stack = [(8, root)]  # (indent of the statements, list they go to)
        returns = None
        decorator = None
        for line in lines[start + 1:]:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip())
            if indent < 8:
                break
            text = line.strip()
            while indent < stack[-1][0]:
                stack.pop()
            if text.startswith("@"):
                decorator = text[1:]
                continue
            if decorator is not None:  # def fN():
                stmt = Stmt(f"with {decorator}:", [], text[len("def "):].split("(")[0])
                decorator = None
                stack[-1][1].append(stmt)
                stack.append((indent + 4, stmt.body))
                continue
            if re.fullmatch(r"(v\d+, )*(v\d+,? = )?f\d+\(\)", text):
                continue  # the call of a decorated function
            if text.startswith("return ") and indent > 8:
                continue  # a decorated function's return
            if text.startswith("return "):
                value = text[len("return "):]
                if value.startswith("(") and value.endswith(")"):
                    value = value[1:-1]
                returns = [r.strip() for r in value.split(",") if r.strip()]
                break
            if text == "pass":
                continue
            stmt = Stmt(text, [] if text.startswith(("with ", "if ")) else None)
            stack[-1][1].append(stmt)
            if stmt.body is not None:
                stack.append((indent + 4, stmt.body))
        require = re.search(r"inputs_require_grad=(True|False)", source)
        aliasing = {}
        named_args = re.search(r"^\s*args = \(((?:[a-z]\w*(?:\[\d+\])?, )*[a-z]\w*(?:\[\d+\])?),?\)$",
                               source, re.M)
        if named_args:  # the arguments name tensors: some are others (or views of them)
            for (name, _), expr in zip(inputs, named_args.group(1).split(", ")):
                if expr != name:
                    aliasing[name] = expr
        return cls(root, returns or [inputs[0][0]], inputs,
                   inputs_require_grad=require is None or require.group(1) == "True", aliasing=aliasing)


# --------------------------------------------------------------------------
# The abstract state the generator steers by.

ON, OFF, AMBIENT = "on", "off", "ambient"  # grad mode a statement runs in


@dataclasses.dataclass
class Root:
    """A storage: an input, a parameter, a buffer or a fresh intermediate."""

    kind: str
    leaf_requires_grad: bool  # an in-place op with grad on is an eager error
    requires_grad: bool  # (estimated for an ambient grad mode on)
    saved: bool = False  # saved for backward: a later in-place breaks backward
    random: bool = False  # its values come from a random draw (no branch reads them)


@dataclasses.dataclass(frozen=True)
class Var:
    expr: str  # how the program names it
    shape: tuple
    dtype: str  # "f32" | "bf16"
    root: str
    is_view: bool = False
    differentiable: bool = True  # False below a .detach()
    view_modes: frozenset = frozenset()  # grad modes the views of its chain were made in
    storage: str = ""  # the storage it lives in, when not its root's (a leaf made of an alias)

    @property
    def memory(self) -> str:
        return self.storage or self.root


def _broadcast(a: tuple, b: tuple) -> tuple | None:
    out = []
    for i in range(1, max(len(a), len(b)) + 1):
        da = a[-i] if i <= len(a) else 1
        db = b[-i] if i <= len(b) else 1
        if da != db and 1 not in (da, db):
            return None
        out.append(max(da, db))
    return tuple(reversed(out))


def _fits(src: tuple, dst: tuple) -> bool:
    """``src`` broadcasts to ``dst`` without changing it (an in-place operand)."""
    return _broadcast(src, dst) == dst


def _numel(shape: tuple) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


SCALARS = ("2.0", "0.5", "-1.0", "1.0")
SEEDS = (0, 1, 7, 42)

# What a program may also draw, each in a share of the programs (percent;
# hypothesis's draws are not uniform: run ``python -m tools.fuzz.run --shares``
# for the share of programs that show each), and the statement kinds it adds.
FEATURES = {
    "random state": ["draw", "rng"],  # draws; seeds, forks, saved states, generators
    "bare switches": ["switch"],  # torch.set_grad_enabled(b), torch._C._set_grad_enabled(b)
    "branches": ["branch"],  # if on a tensor's value: data_dependent="specialize"
}
FEATURE_SHARES = {"random state": 25, "bare switches": 20, "branches": 20}
FEATURE_STATEMENTS = 25  # percent of a program's statements drawn from its features
FEATURE_PATTERNS = {  # a line of the forward that shows it
    "random state": r".*(torch\.(rand|randn|rand_like|randn_like|bernoulli|manual_seed|get_rng_state|set_rng_state"
                    r"|Generator)\b|fork_rng|dropout\(|\.(normal_|uniform_|bernoulli_)\(|\.(get|set)_state\()",
    "bare switches": r"\s*(prev\d+ = torch\.is_grad_enabled\(\)|torch\.(_C\._)?set_grad_enabled\()",
    "branches": r"\s*(if |v\d+ = .* if .* else )",
}


def _scope() -> dict[str, list]:
    return {"states": [], "generators": [], "modes": []}


def _shape_args(shape: tuple) -> str:
    return ", ".join(map(str, shape)) if shape else "()"


class _Builder:
    """Draws statements one by one against the abstract state."""

    def __init__(self, draw, inputs, inputs_require_grad, max_statements, aliasing=None,
                 features=frozenset()):
        self.draw = draw
        self.aliasing = aliasing or {}
        self.inputs_require_grad = inputs_require_grad
        self.budget = max_statements
        self.features = features  # of FEATURES: the statement kinds this program also draws
        self.grad = AMBIENT  # the grad mode in force: blocks and bare switches set it
        self.autocasts: list[bool] = []  # the autocast blocks open (enabled or not)
        # names a block's body made that are not tensors: random states, generators, grad modes
        self.scopes: list[dict[str, list]] = [_scope()]
        self.in_branch = 0  # inside an ``if`` body: no switch, relayout or swap (it may not run)
        self.roots: dict[str, Root] = {}
        self.vars: list[Var] = []
        self.fresh = itertools.count()
        self.functions = itertools.count()
        self.others = itertools.count()  # random states, generators, saved grad modes
        self.contiguous: dict[str, bool] = {}
        for name, shape in inputs:
            if name in self.aliasing:  # the same tensor as another input, or a view of it
                of = re.match(r"\w+", self.aliasing[name]).group(0)
                same = self.aliasing[name] == of
                self._add(Var(name, shape, "f32", of, is_view=not same), contiguous=True)
            else:
                self._add_root(name, "input", shape, leaf=inputs_require_grad)
        for expr, (kind, shape) in STATE_TENSORS.items():
            self._add_root(expr, kind, shape, leaf=(kind == "param"))

    # -- state ------------------------------------------------------------
    def _add_root(self, expr, kind, shape, *, leaf):
        self.roots[expr] = Root(kind, leaf, requires_grad=leaf)
        self._add(Var(expr, shape, "f32", expr), contiguous=True)

    def _add(self, var: Var, *, contiguous: bool) -> Var:
        self.vars.append(var)
        self.contiguous[var.expr] = contiguous
        return var

    def grad_mode(self) -> str:
        return self.grad

    def autocast(self) -> bool:
        return self.autocasts[-1] if self.autocasts else False

    def random(self, v: Var) -> bool:
        """Are ``v``'s values (as far as the state knows) drawn at random?"""
        return self.roots[v.root].random or (v.storage in self.roots and self.roots[v.storage].random)

    def in_scope(self, kind: str) -> list:
        return [name for scope in self.scopes for name in scope[kind]]

    def body(self, depth: int, mode=None) -> list[Stmt]:
        """A block's body, drawn in the block's ``mode`` (("grad", ON|OFF),
        ("autocast", bool) or None): a grad block's exit restores the grad
        mode its entry found, a bare switch inside another block runs on
        after it; what the body names (random states, ...) stays in it."""
        grad, autocasts = self.grad, len(self.autocasts)
        if mode is not None and mode[0] == "grad":
            self.grad = mode[1]
        elif mode is not None:
            self.autocasts.append(mode[1])
        self.scopes.append(_scope())
        try:
            return self.statements(depth + 1, 4)
        finally:
            self.scopes.pop()
            del self.autocasts[autocasts:]
            if mode is not None and mode[0] == "grad":
                self.grad = grad

    def may_record(self) -> bool:
        return self.grad_mode() != OFF

    def requires(self, v: Var) -> bool:
        return v.differentiable and self.roots[v.root].requires_grad

    def new_name(self) -> str:
        return f"v{next(self.fresh)}"

    def pick(self, candidates):
        return self.draw(st.sampled_from(candidates))

    def pick_var(self, candidates=None) -> Var:
        """Mostly a value the program made (an intermediate or a view), else
        any: inputs, parameters and buffers are always there."""
        candidates = self.vars if candidates is None else candidates
        made = [v for v in candidates if v.expr not in self.roots or self.roots[v.expr].kind == "tmp"]
        if made and self.draw(st.integers(0, 9)) < 6:
            return self.pick(made)
        return self.pick(candidates)

    # -- statements -------------------------------------------------------
    def statements(self, depth: int, most: int) -> list[Stmt]:
        n = self.draw(st.integers(1, most))
        out = []
        for _ in range(n):
            if self.budget <= 0:
                break
            self.budget -= 1
            out.append(self.statement(depth))
        saved = self.scopes[-1]["states"]
        if saved and self.draw(st.booleans()):  # a state saved here put back at the end, now and then
            generators = self.in_scope("generators")
            target = self.pick(["torch"] + generators)
            call = "torch.set_rng_state" if target == "torch" else f"{target}.set_state"
            out.append(Stmt(f"{call}({self.pick(saved)})"))
        return out

    def statement(self, depth: int) -> Stmt:
        kinds = ["op", "view", "inplace", "op", "setitem", "view", "inplace", "op", "ema", "leaf",
                 "relayout", "swap"]
        if depth < 3:
            kinds += ["block", "block", "block"]
        for feature in sorted(self.features):  # one statement in five or so, in a program that has it
            if self.draw(st.integers(0, 99)) >= 100 - FEATURE_STATEMENTS:
                kinds = [k for k in FEATURES[feature] if depth < 3 or k != "branch"] or kinds
                break
        kind = self.pick(kinds)
        made = getattr(self, "_" + kind)(depth)
        return made if made is not None else self._op(depth)

    def _block(self, depth) -> Stmt:
        header, mode = self.pick([
            ("with torch.no_grad():", ("grad", OFF)),
            ("with torch.enable_grad():", ("grad", ON)),
            ("with torch.set_grad_enabled(False):", ("grad", OFF)),
            ("with torch.set_grad_enabled(True):", ("grad", ON)),
            ('with torch.autocast("cpu", dtype=torch.bfloat16):', ("autocast", True)),
            ('with torch.autocast("cpu", enabled=False):', ("autocast", False)),
            ("with torch.inference_mode(False):", ("grad", ON)),  # grad on, even under no_grad
        ])
        as_function = self.draw(st.integers(0, 3)) == 3  # the decorator form, now and then
        body = self.body(depth, mode)
        return Stmt(header, body, f"f{next(self.functions)}" if as_function else None)

    # ordinary ops: a fresh intermediate
    def _op(self, depth) -> Stmt:
        a = self.pick_var()
        choices = ["unary", "scalar", "binary", "reduce"]
        if a.shape and a.shape[-1] == 4 and len(a.shape) <= 2:
            choices += ["matmul", "linear"]
        if a.dtype == "bf16" or a.shape:
            choices += ["cast"]
        what = self.pick(choices)
        name = self.new_name()
        record = self.may_record()
        if what == "unary":
            fn = self.pick(["{}.sin()", "{}.relu()", "torch.tanh({})", "torch.sigmoid({})", "{}.clone()"])
            out = self._fresh(name, a.shape, a.dtype, [a])
            if record and self.requires(out):
                if fn == "{}.sin()":
                    self.roots[a.root].saved = True
                elif fn != "{}.clone()":
                    self.roots[name].saved = True  # saves its result
            return Stmt(f"{name} = {fn.format(a.expr)}")
        if what == "scalar":
            fn = self.pick(["{} * 2.0", "{} + 1.0", "{} * 0.5", "-{}"])
            self._fresh(name, a.shape, a.dtype, [a])
            return Stmt(f"{name} = {fn.format(a.expr)}")
        if what == "binary":
            others = [v for v in self.vars if _broadcast(a.shape, v.shape) is not None]
            b = self.pick_var(others)
            op = self.pick(["+", "*", "-"])
            dims = [v.dtype for v in (a, b) if v.shape] or [a.dtype, b.dtype]
            dtype = "f32" if "f32" in dims else "bf16"
            self._fresh(name, _broadcast(a.shape, b.shape), dtype, [a, b])
            if op == "*" and record:
                if self.requires(b):
                    self.roots[a.root].saved = True
                if self.requires(a):
                    self.roots[b.root].saved = True
            return Stmt(f"{name} = {a.expr} {op} {b.expr}")
        if what == "reduce":
            forms = [("{}.sum()", ())]
            if a.shape:
                forms += [("{}.sum(0)", a.shape[1:]), ("{}.mean(-1, keepdim=True)", a.shape[:-1] + (1,))]
            fn, shape = self.pick(forms)
            self._fresh(name, shape, a.dtype, [a])
            return Stmt(f"{name} = {fn.format(a.expr)}")
        if what in ("matmul", "linear"):
            arg = a.expr if a.dtype == "f32" or self.autocast() else f"{a.expr}.float()"
            weight = "self.w" if what == "matmul" else "self.lin.weight"
            text = f"{arg} @ self.w" if what == "matmul" else f"self.lin({arg})"
            w = next(v for v in self.vars if v.expr == weight)
            inputs = [a, w] + ([next(v for v in self.vars if v.expr == "self.lin.bias")] if what == "linear" else [])
            self._fresh(name, a.shape, "bf16" if self.autocast() else "f32", inputs)
            if record:
                self.roots[a.root].saved = self.roots[a.root].saved or self.requires(w)
                self.roots[w.root].saved = self.roots[w.root].saved or self.requires(a)
            return Stmt(f"{name} = {text}")
        # cast: .float() of an f32 tensor is the tensor itself (an alias)
        if a.dtype == "f32":
            self._add(dataclasses.replace(a, expr=name), contiguous=self.contiguous[a.expr])
            return Stmt(f"{name} = {a.expr}.float()")
        self._fresh(name, a.shape, "f32", [a])
        return Stmt(f"{name} = {a.expr}.float()")

    def _fresh(self, name, shape, dtype, inputs) -> Var:
        requires = self.may_record() and any(self.requires(i) for i in inputs)
        self.roots[name] = Root("tmp", False, requires, random=any(self.random(i) for i in inputs))
        # elementwise results keep a strided input's layout (clone, x * 2 of x.t())
        contiguous = all(self.contiguous[i.expr] for i in inputs if i.shape == shape)
        return self._add(Var(name, shape, dtype, name), contiguous=contiguous)

    # views: a new name for (part of) an existing storage
    def _view(self, depth) -> Stmt | None:
        a = self.pick_var()
        contiguous = self.contiguous[a.expr]
        forms = [(".detach()", a.shape, contiguous), (".unsqueeze(0)", (1,) + a.shape, contiguous)]
        if a.shape:
            forms.append(("[0]", a.shape[1:], contiguous))
            if a.shape[0] >= 2:
                forms.append(("[1:]", (a.shape[0] - 1,) + a.shape[1:], contiguous))
            if contiguous:
                forms.append((".view(-1)", (_numel(a.shape),), True))
        if len(a.shape) == 2:
            forms += [(".t()", a.shape[::-1], False), ("[:, 0]", a.shape[:1], False)]
            if a.shape[1] >= 3:
                forms.append(("[:, 1:3]", (a.shape[0], 2), False))
            if contiguous and _numel(a.shape) == 12:
                forms.append((".view(4, 3)", (4, 3), True))
        suffix, shape, contig = self.pick(forms)
        name = self.new_name()
        var = Var(name, shape, a.dtype, a.root, is_view=True, storage=a.storage,
                  differentiable=a.differentiable and suffix != ".detach()",
                  view_modes=a.view_modes | {self.grad_mode()})
        self._add(var, contiguous=contig)
        return Stmt(f"{name} = {a.expr}{suffix}")

    # in-place ops
    def _may_mutate(self, t: Var) -> bool:
        """False where eager would refuse (as far as the abstract state knows)."""
        mode = self.grad_mode()
        root = self.roots[t.root]
        if mode != OFF and t.differentiable and root.leaf_requires_grad:
            return False  # in-place on a leaf (or a view of one) that requires grad
        if root.saved:
            return False  # saved for backward
        if t.is_view and t.differentiable:
            for made in t.view_modes:
                if (made == OFF and mode != OFF) or (made == AMBIENT and mode == ON):
                    return False  # a view made under no_grad, modified with grad
        return True

    def operand(self, shape, target: Var):
        """A value for an in-place op on (part of) ``target``, of ``shape``:
        a tensor that broadcasts to it, or a scalar."""
        fitting = self._operand_tensors(shape, target)
        if not fitting or self.draw(st.integers(0, 3)) == 0:
            return self.pick(SCALARS)
        return self.pick_var(fitting)

    def _operand_tensors(self, shape, target: Var) -> list[Var]:
        """Tensors that broadcast to ``shape`` and do not partially overlap
        ``target``: eager runs an in-place op whose operand is another view
        of the written memory (``v.add_(v[0])`` of ``v = b.t()``) in
        iteration order, which no functional program reproduces; the same
        tensor (full overlap) is well defined."""
        def overlaps(v):
            return v.memory == target.memory and v.expr != target.expr and (v.is_view or target.is_view)
        return [v for v in self.vars if _fits(v.shape, shape) and not overlaps(v)]

    def _after_mutation(self, t: Var, operand) -> None:
        if isinstance(operand, Var) and self.may_record() and self.requires(operand) and t.differentiable:
            self.roots[t.root].requires_grad = True
        if isinstance(operand, Var) and self.random(operand):
            self.roots[t.root].random = True

    def _targets(self):
        """Tensors an in-place op may write to; now and then (one in ten)
        any tensor at all, so that what the abstract state thinks eager
        refuses is tried too (the oracle discards what eager does refuse)."""
        if self.draw(st.integers(0, 9)) == 9:
            return list(self.vars)
        return [v for v in self.vars if self._may_mutate(v)]

    def _inplace(self, depth) -> Stmt | None:
        targets = self._targets()
        if not targets:
            return None
        t = self.pick_var(targets)
        form = self.pick(["add_", "mul_", "copy_", "zero", "sub_", "init"])
        if form == "zero":
            text = self.pick([f"{t.expr}.mul_(0)", f"{t.expr}.zero_()"])
            return Stmt(text)
        if form == "init":  # a no_grad block no torch-function mode sees
            return Stmt(self.pick([f"torch.nn.init.constant_({t.expr}, 0.5)", f"torch.nn.init.zeros_({t.expr})"]))
        o = self.operand(t.shape, t)
        if form == "copy_" and isinstance(o, str):
            o = f"torch.full_like({t.expr}, {o})"
        o_text = o.expr if isinstance(o, Var) else o
        if form == "mul_" and isinstance(o, Var) and self.may_record() and self.requires(t):
            self.roots[o.root].saved = True
        self._after_mutation(t, o)
        return Stmt(f"{t.expr}.{form}({o_text})")

    def _leaf(self, depth) -> Stmt | None:
        """A value made a leaf that requires grad: "differentiate from here"."""
        a = self.pick_var()
        if a.dtype != "f32":
            return None
        name = self.new_name()
        self.roots[name] = Root("tmp", True, True, random=self.random(a))
        # its own autograd root, in the memory of ``a`` (an operand must not overlap it partially)
        self._add(Var(name, a.shape, a.dtype, name, is_view=a.is_view, storage=a.memory),
                  contiguous=self.contiguous[a.expr])
        return Stmt(f"{name} = {a.expr}.detach().requires_grad_()")

    def _replace_var(self, old: Var, new: Var, contiguous: bool) -> None:
        self.vars[self.vars.index(old)] = new
        self.contiguous[new.expr] = contiguous

    def _relaid_targets(self) -> list[Var]:
        """What a metadata mutation or set_ may change: an intermediate or an
        input, not a view (parameters and buffers keep their shapes: the
        statements using them assume them)."""
        if self.in_branch:
            return []  # a shape the branch may not give
        return [v for v in self._targets() if not v.is_view and v.expr == v.root  # not an alias
                and self.roots[v.root].kind in ("tmp", "input")]

    def _relayout(self, depth) -> Stmt | None:
        """A metadata mutation: ``t_()``, ``transpose_``, ``unsqueeze_``, ``squeeze_``."""
        targets = self._relaid_targets()
        if not targets:
            return None
        t = self.pick_var(targets)
        forms = [(".unsqueeze_(0)", (1,) + t.shape, self.contiguous[t.expr])]
        if len(t.shape) == 2:
            forms += [(".t_()", t.shape[::-1], False), (".transpose_(0, 1)", t.shape[::-1], False)]
        if t.shape and t.shape[0] == 1:
            forms.append((".squeeze_(0)", t.shape[1:], self.contiguous[t.expr]))
        suffix, shape, contiguous = self.pick(forms)
        self._replace_var(t, dataclasses.replace(t, shape=shape), contiguous)
        return Stmt(f"{t.expr}{suffix}")

    def _swap(self, depth) -> Stmt | None:
        """A storage swap, ``t.set_(source)``, under no_grad (in grad mode eager
        has no derivative for it): ``t`` takes ``source``'s memory and layout."""
        targets = self._relaid_targets()
        if not targets:
            return None
        t = self.pick_var(targets)
        sources = [v for v in self.vars if v.dtype == t.dtype and v.expr != t.expr]
        if not sources:
            return None
        source = self.pick_var(sources)
        self._replace_var(t, dataclasses.replace(t, shape=source.shape, is_view=source.is_view,
                                                 storage=source.memory), self.contiguous[source.expr])
        return Stmt("with torch.no_grad():", [Stmt(f"{t.expr}.set_({source.expr})")])

    # random state: draws, seeds, forks, saved states, generators made in the forward
    def _drawn(self, name, shape, dtype, contiguous) -> Var:
        self.roots[name] = Root("tmp", False, False, random=True)
        return self._add(Var(name, shape, dtype, name), contiguous=contiguous)

    def _draw(self, depth) -> Stmt | None:
        """A random draw from torch's generator or one the forward made:
        ``torch.randn``, ``rand_like``, ``bernoulli``, a dropout in training,
        an in-place fill (``normal_``, ``uniform_``, ``bernoulli_``)."""
        a = self.pick_var()
        generators = self.in_scope("generators")
        gen = self.pick(generators) if generators and self.draw(st.integers(0, 2)) else None
        kw = f"generator={gen}" if gen else ""
        form = self.pick(["fill", "randn", "rand_like", "bernoulli", "dropout"])
        if form == "fill":
            targets = self._targets()
            if not targets:
                return None
            t = self.pick_var(targets)
            fill, fill_args = self.pick([("normal_", ""), ("uniform_", "-1.0, 1.0"), ("bernoulli_", "0.5")])
            self.roots[t.root].random = True
            return Stmt(f"{t.expr}.{fill}({', '.join(x for x in (fill_args, kw) if x)})")
        name = self.new_name()
        if form == "randn":
            fn = self.pick(["torch.randn", "torch.rand"])
            self._drawn(name, a.shape, "f32", True)
            return Stmt(f"{name} = {fn}({', '.join(x for x in (_shape_args(a.shape), kw) if x)})")
        if form == "rand_like":
            fn = self.pick(["torch.rand_like", "torch.randn_like"])
            self._drawn(name, a.shape, a.dtype, self.contiguous[a.expr])
            return Stmt(f"{name} = {fn}({a.expr})")
        if form == "bernoulli":
            self._drawn(name, a.shape, a.dtype, self.contiguous[a.expr])
            probabilities = f"torch.full_like({a.expr}, 0.5)"
            return Stmt(f"{name} = torch.bernoulli({', '.join(x for x in (probabilities, kw) if x)})")
        self._fresh(name, a.shape, a.dtype, [a])  # dropout: differentiable, saves its mask only
        self.roots[name].random = True
        return Stmt(f"{name} = torch.nn.functional.dropout({a.expr}, 0.5, training=True)")

    def _rng(self, depth) -> Stmt | None:
        """torch's generator seeded, forked, saved and restored; a generator
        made in the forward, its state read and set."""
        states, generators = self.in_scope("states"), self.in_scope("generators")
        forms = ["generator state", "generator seed"] if generators else []
        forms += ["generator set state"] if generators and states else []
        forms += ["restore", "restore"] if states else []
        forms += ["save", "seed", "generator"] + (["fork", "fork"] if depth < 3 else [])
        form = self.pick(forms)
        if form == "seed":
            return Stmt(f"torch.manual_seed({self.pick(SEEDS)})")
        if form == "fork":
            header = self.pick(["with torch.random.fork_rng(devices=[]):", "with torch.random.fork_rng():"])
            seeded = self.draw(st.integers(0, 1)) == 1
            body = self.body(depth)
            if seeded:  # the common pattern: fixed draws in a fork
                body.insert(0, Stmt(f"torch.manual_seed({self.pick(SEEDS)})"))
            return Stmt(header, body)
        if form in ("save", "generator state"):
            name = f"state{next(self.others)}"
            self.scopes[-1]["states"].append(name)
            source = "torch.get_rng_state()" if form == "save" else f"{self.pick(generators)}.get_state()"
            return Stmt(f"{name} = {source}")
        if form == "restore":
            return Stmt(f"torch.set_rng_state({self.pick(states)})")
        if form == "generator":
            return self.generator()
        if form == "generator seed":
            return Stmt(f"{self.pick(generators)}.manual_seed({self.pick(SEEDS)})")
        return Stmt(f"{self.pick(generators)}.set_state({self.pick(states)})")

    def generator(self) -> Stmt:
        """A ``torch.Generator`` made (and seeded) in the forward."""
        name = f"gen{next(self.others)}"
        self.scopes[-1]["generators"].append(name)
        return Stmt(f"{name} = torch.Generator().manual_seed({self.pick(SEEDS)})")

    # bare grad-mode switches: the mode runs to the next switch or the enclosing grad block's end
    def _switch(self, depth) -> Stmt | None:
        if self.in_branch:
            return None  # the mode after the branch would depend on the data
        # a mode read is mostly passed back at its own nesting (the common pattern); from inside
        # another block now and then (refused where that block sets the mode: the caller's is unknown)
        here = self.scopes[-1]["modes"]
        saved = here + [m for m in self.in_scope("modes") if m not in here]
        if not here and self.draw(st.integers(0, 3)):
            saved = []
        form = self.pick(["set", "set", "C", "save"] + (["restore"] if saved else []))
        call = "torch._C._set_grad_enabled" if form == "C" or self.draw(st.integers(0, 3)) == 0 \
            else "torch.set_grad_enabled"
        if form == "save":  # prev = torch.is_grad_enabled(); ...; torch.set_grad_enabled(prev)
            name = f"prev{next(self.others)}"
            self.scopes[-1]["modes"].append((name, self.grad))
            return Stmt(f"{name} = torch.is_grad_enabled()")
        if form == "restore":
            name, self.grad = self.pick(saved)
            return Stmt(f"{call}({name})")
        value = self.pick([False, True])
        self.grad = ON if value else OFF
        return Stmt(f"{call}({value})")

    # a branch on a tensor's value (exported with data_dependent="specialize")
    def _branch(self, depth) -> Stmt | None:
        candidates = [v for v in self.vars if not self.random(v)]  # the export's draws are not eager's
        if not candidates:
            return None
        a = self.pick_var(candidates)
        item = "{}" + (f"[{', '.join('0' * len(a.shape))}]" if a.shape else "") + ".item()"
        condition = self.pick(["{}.sum() > 0", item + " > 0.5", "{}.mean().item() < 0", "({} > 0).any()"])
        if self.draw(st.integers(0, 2)) == 2:  # a value chosen: v3 = v1 * 2.0 if v0.sum() > 0 else -v1
            c = self.pick_var()
            then, otherwise = self.pick([("{} * 2.0", "-{}"), ("{} + 1.0", "{} * 0.5"), ("-{}", "{}")])
            name = self.new_name()
            self._fresh(name, c.shape, c.dtype, [c])
            return Stmt(f"{name} = {then.format(c.expr)} if {condition.format(a.expr)} else "
                        f"{otherwise.format(c.expr)}")
        vars_before = list(self.vars)
        self.in_branch += 1
        try:
            body = self.body(depth)
        finally:
            self.in_branch -= 1
            self.vars = vars_before  # what the body made may not exist after it
        return Stmt(f"if {condition.format(a.expr)}:", body)

    def _ema(self, depth) -> Stmt | None:
        targets = self._targets()
        if not targets:
            return None
        t = self.pick_var(targets)
        operands = self._operand_tensors(t.shape, t)
        if not operands:
            return None
        o = self.pick_var(operands)
        self._after_mutation(t, o)
        return Stmt(f"{t.expr}.mul_(0.9).add_({o.expr}, alpha=0.1)")

    def _setitem(self, depth) -> Stmt | None:
        targets = [v for v in self._targets() if v.shape]
        if not targets:
            return None
        t = self.pick_var(targets)
        index = [("0", t.shape[1:])]
        if t.shape[0] >= 2:
            index.append(("1:", (t.shape[0] - 1,) + t.shape[1:]))
        if len(t.shape) == 2:
            index.append((":, 0", t.shape[:1]))
            if t.shape[1] >= 3:
                index.append((":, 1:3", (t.shape[0], 2)))
        idx, shape = self.pick(index)
        o = self.operand(shape, t)
        self._after_mutation(t, o)
        return Stmt(f"{t.expr}[{idx}] = {o.expr if isinstance(o, Var) else o}")


@st.composite
def programs(draw, max_statements: int = 12, features=None) -> Program:
    """A random ``Program`` (see the module docstring); ``features`` (of
    :data:`FEATURES`) given, each program may draw those, and no other."""
    if features is None:  # drawn first (a shrink turns them off): each in its share of the programs
        features = [f for f, share in FEATURE_SHARES.items()
                    if draw(st.sampled_from([False] * (100 - share) + [True] * share))]
    features = frozenset(features)
    n_inputs = draw(st.integers(1, len(INPUTS)))
    inputs = list(INPUTS[:n_inputs])
    inputs_require_grad = draw(st.sampled_from([True, True, False]))
    # now and then inputs sharing memory: y is x, z is a row of x (or of y)
    aliasing = draw(st.sampled_from([{}, {}, {}, {}, {"y": "x"}, {"z": "x[0]"}, {"z": "y[1]"},
                                     {"y": "x", "z": "x[2]"}]))
    aliasing = {k: v for k, v in aliasing.items() if k in dict(inputs) and v[0] in dict(inputs)}
    b = _Builder(draw, inputs, inputs_require_grad, max_statements, aliasing, features)
    stmts = []
    if "random state" in features and draw(st.booleans()):  # a sampler's generator, made first
        stmts.append(b.generator())
    stmts += b.statements(0, 8)
    n_out = draw(st.integers(0, 2))
    returns = [b.vars[-1].expr] + [b.pick_var().expr for _ in range(n_out)]
    return Program(stmts, returns, inputs, inputs_require_grad, aliasing)
