"""Fake tensors carrying real values, and the branches the shape environment took on them.

A Python branch on a tensor's value (``if mask.all():``, ``x.item() > 0``, a
loop over ``nonzero()``) asks the shape environment to decide an expression
over an unbacked symbol, which a fake tensor cannot. With real values
propagated (torch's ``draft_export`` does the same), every fake tensor
carries a copy of its example value and every op runs on it too; the
shape environment then decides such a guard by the example's value and
defers it to a run-time assert, which torch.export's runtime-assert pass
writes into the graph as ``aten._assert_scalar`` on the recomputed condition.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import re

import sympy
import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .patching import patched

# torch's run-time check of a symbolic condition, in graphs: ``_assert_scalar(cond, message)``
ASSERT_SCALAR = torch.ops.aten._assert_scalar.default



# the message torch's runtime-assert pass gives a check it writes
_TORCH_CHECK_MESSAGE = re.compile(r"^(Runtime assertion failed for expression .* on node ')([^']*)(')$", re.S)


def checks_named_by_their_conditions(gm: torch.fx.GraphModule) -> None:
    """Each check torch's runtime-assert pass wrote names the node of its
    condition: a check a program exported again runs itself (an op of its
    graph, traced again) keeps the message of the first export, naming a
    node the new graph may call otherwise (G7)."""
    for node in gm.graph.find_nodes(op="call_function", target=ASSERT_SCALAR):
        condition, message = node.args[0], node.args[1] if len(node.args) > 1 else None
        match = _TORCH_CHECK_MESSAGE.match(message) if isinstance(message, str) else None
        if match and isinstance(condition, torch.fx.Node) and match.group(2) != condition.name:
            node.args = (condition, f"{match.group(1)}{condition.name}{match.group(3)}", *node.args[2:])
    gm.recompile()


def checks_say_their_conditions(gm: torch.fx.GraphModule, written=None) -> None:
    """Each check torch's runtime-assert pass wrote says its condition with
    its symbols named u0, u1, ... in the order the graph reads them: torch
    numbers them as the trace made them (symbols of storage offsets, and
    ones it made and dropped, counted too), and a program exported again
    keeps its own checks' words beside checks torch writes anew (G7).
    ``written``, where given: (condition node -> the expression its nodes
    compute, or None; graph -> each of its symbols' first node's position),
    the words of every check where each is read so: a condition's value
    reads ``True`` where a check before pinned a value it reads
    (``torch._check(mask.all().item())``), in one export and not in the same
    program exported again, whose shape environment does not pin it."""
    checks = [(node, node.args[0], node.args[1]) for node in gm.graph.find_nodes(
        op="call_function", target=ASSERT_SCALAR) if len(node.args) > 1 and isinstance(node.args[1], str)]
    checks = [(node, c) for node, c, m in checks if _TORCH_CHECK_MESSAGE.match(m)
              and isinstance(c, torch.fx.Node) and isinstance(c.meta.get("val"), torch.SymBool)]
    if not checks:
        return
    said = [written[0](c) for _, c in checks] if written is not None else []
    if said and all(e is not None for e in said):
        read_at = written[1](gm.graph)
    else:  # as the values read: their symbols where the graph binds them
        said = [c.meta["val"].node.expr for _, c in checks]
        read_at = {s: i for i, n in enumerate(gm.graph.nodes) for s in (n.meta.get("unbacked_bindings") or {})}
    symbols = sorted({s for e in said for s in e.free_symbols}, key=lambda s: (read_at.get(s, len(read_at)), str(s)))
    names = {s: sympy.Symbol(f"u{i}", integer=s.is_integer) for i, s in enumerate(symbols)}
    for (node, condition), expr in zip(checks, said):
        node.args = (condition, f"Runtime assertion failed for expression {expr.xreplace(names)} on node "
                     f"'{condition.name}'", *node.args[2:])
    gm.recompile()


def kept_as_they_are(gm: torch.fx.GraphModule, keep) -> bool:
    """The ``_assert_scalar`` nodes ``keep(message)`` names are checks the
    module made itself (a program exported again runs its own): torch's
    runtime-assert pass keeps them as a ``torch._check`` the user wrote.
    Whether there were any."""
    kept = False
    for node in gm.graph.find_nodes(op="call_function", target=ASSERT_SCALAR):
        if len(node.args) > 1 and isinstance(node.args[1], str) and keep(node.args[1]):
            node.meta["_fx_runtime_assert_preserve"] = True
            kept = True
    return kept


# the message the shape environment gives a guard it decided by a real value
_SPECIALIZED = "propagate_real_tensors: "


_propagating: list[bool] = []


def real_values_propagating() -> bool:
    """Inside :func:`real_values_propagated`: the real values' random ops
    draw from torch's generators while the forward is traced."""
    return bool(_propagating)


@contextlib.contextmanager
def real_values_propagated():
    """Fake modes made meanwhile copy their inputs' real values and run every
    op on them too, deciding data-dependent guards by them (deferred to
    run-time asserts). torch's global random generators are left as they were:
    the real values' random ops draw from them."""
    with torch.random.fork_rng(), \
            torch._functorch.config.patch(fake_tensor_propagate_real_tensors=True), \
            patched(FakeTensorMode, "_maybe_infer_fake_kernel_from_pytree_out", _cross_check_unguarded):
        _propagating.append(True)
        try:
            yield
        finally:
            _propagating.pop()


def _cross_check_unguarded(check):
    """The fake mode's check of each op's fake result against its real one
    compares symbolic storage offsets with ``!=``: a guard, which real values
    would decide, specializing an unbacked size (``nonzero``'s) on every op
    that reads it, or fail on, where the op made that size. The check decides
    nothing of the program: no guard it asks is kept, and one it cannot
    decide skips it (the fake result stands, as without real values). Nor
    does a fake kernel whose metadata differs from the real kernel's fail
    the trace (CPU ``native_layer_norm`` and ``native_group_norm`` of bf16,
    under autocast, return float32 statistics where their fake kernels say
    bf16): the fake result stands, as the trace without real values has it;
    a real value that is off can only fail a check on the example itself."""
    from torch._subclasses.fake_tensor import MetadataMismatchError
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    def unguarded(mode, func, fake_in, real_in, fake_out, real_out):
        with mode.shape_env.suppress_guards() if mode.shape_env is not None else contextlib.nullcontext():
            try:
                return check(mode, func, fake_in, real_in, fake_out, real_out)
            except (GuardOnDataDependentSymNode, MetadataMismatchError):
                return fake_out
    return unguarded


@dataclasses.dataclass(frozen=True)
class SpecializedGuard:
    """A guard the shape environment decided by the example's real values:
    ``condition`` (over unbacked symbols such as ``u0``) was ``value``;
    ``frames``: the Python stack that asked (outermost first)."""

    condition: str
    value: str
    frames: list
    symbols: frozenset  # names of the unbacked symbols in the condition
    assumed: object = None  # the condition as decided (negated where False): what a check must check


def specialized_guards(gm: torch.fx.GraphModule) -> list[SpecializedGuard]:
    """The guards the shape environment of ``gm``'s trace decided by real
    values, as it deferred them (read before torch.export ends: it then
    drops their stacks); read before torch's runtime-assert pass writes
    their checks, each bound on a float value put in its range (so the pass
    checks it: :func:`_bounds_in_ranges`)."""
    from torch._export.utils import _get_shape_env_from_gm

    shape_env = _get_shape_env_from_gm(gm)
    if shape_env is None:
        return []
    found = []
    for asserts in shape_env.deferred_runtime_asserts.values():
        for ra in asserts:
            if ra.msg.startswith(_SPECIALIZED):
                condition, _, value = ra.msg[len(_SPECIALIZED):].rpartition(" == ")
                found.append(SpecializedGuard(condition, value, list(ra.stack.summary()),
                                              frozenset(str(s) for s in ra.expr.free_symbols), ra.expr))
    _bounds_in_ranges(shape_env, found)
    return found


# how torch's runtime-assert pass names the expression each check it writes checks
_TORCH_CHECK = re.compile(r"Runtime assertion failed for expression (.*) on node '[^']*'$", re.S)
_BOUND = re.compile(r"(\S+) (<=|>=) (\S+)")


def checks_guard(check: torch.fx.Node, guard: SpecializedGuard) -> bool:
    """Whether torch's run-time check ``check`` (an ``_assert_scalar`` its
    pass wrote, or a user's ``torch._check`` it kept: its message names the
    expression) checks ``guard``'s condition as decided: that condition, or,
    for a bound on one value, the bound of that value's range on that side
    (``u0 >= 6`` checks ``u0 >= 4``). A check that merely reads the same
    value (another branch on it) does not."""
    message = check.args[1] if len(check.args) > 1 and isinstance(check.args[1], str) else ""
    found = _TORCH_CHECK.match(message)
    if found is None:
        return False
    if found.group(1) == str(guard.assumed):
        return True
    bound, checked = _bound_of(guard.assumed), _BOUND.fullmatch(found.group(1))
    if bound is None or checked is None or checked.group(1, 2) != (str(bound[0]), bound[1]):
        return False
    number = float(checked.group(3))
    return number <= bound[2] if bound[1] == "<=" else number >= bound[2]


def _bound_of(expr) -> tuple | None:
    """``(symbol, "<=" or ">=", number)`` where ``expr`` bounds one value
    (``zuf0 <= 5.0``, ``5 >= u0``): what torch's runtime-assert pass takes
    as implied by the value's range."""
    import sympy

    if expr.func not in (sympy.LessThan, sympy.GreaterThan) or len(expr.args) != 2:
        return None
    (value, number), side = expr.args, "<=" if expr.func is sympy.LessThan else ">="
    if isinstance(number, sympy.Symbol) and isinstance(value, sympy.Number):
        value, number, side = number, value, {"<=": ">=", ">=": "<="}[side]
    if not (isinstance(value, sympy.Symbol) and isinstance(number, sympy.Number) and number.is_finite):
        return None
    return value, side, number


def _bounds_in_ranges(shape_env, guards: list) -> None:
    """Each decided guard that bounds one value that is not an integer
    (``x.item() > 5`` decided False: ``zuf0 <= 5.0``) in that value's range.
    torch's runtime-assert pass writes no check of a bound on one value,
    taking it as implied by the value's range, whose bounds it checks
    instead; but the shape environment narrows the ranges of integers only
    (a float ``item()``'s stays unbounded), so the bound went unchecked.
    Narrowed here, after the trace (nothing it decided was decided by the
    narrower range), the pass checks it as it does an integer's."""
    import sympy
    from torch.utils._sympy.value_ranges import ValueRanges

    for guard in guards:
        bound = _bound_of(guard.assumed)
        if bound is None or bound[0].is_integer or bound[0] not in shape_env.var_to_range:
            continue
        value, side, number = bound
        shape_env._update_var_to_range(
            value, ValueRanges(-sympy.oo, number) if side == "<=" else ValueRanges(number, sympy.oo))


def write_check(gm: torch.fx.GraphModule, guard: SpecializedGuard, binders: list, message: str) -> bool:
    """Write ``_assert_scalar(<guard's condition as decided>, message)``
    into ``gm`` just after the last of ``binders`` (the nodes binding its
    unbacked symbols), the condition recomputed from them as torch's
    runtime-assert pass recomputes one; False, the graph as it was, where it
    cannot be (a binder gone, an expression torch cannot write as graph
    ops: ``ToFloat``...)."""
    from torch._export.passes._node_metadata_hook import _node_metadata_hook, _set_node_metadata_hook
    from torch.utils._sympy.interp import sympy_interp
    from torch.utils._sympy.reference import PythonReferenceAnalysis

    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    paths = {s: (n, tuple(path)) for n in binders if n in order
             for s, path in (n.meta.get("unbacked_bindings") or {}).items()}
    if not guard.assumed.free_symbols <= paths.keys():
        return False
    last = max((paths[s][0] for s in guard.assumed.free_symbols), key=order.__getitem__)
    before, tracer = set(order), torch.fx.proxy.GraphAppendingTracer(graph)
    try:
        with graph.inserting_before(last.next), _set_node_metadata_hook(
                gm, functools.partial(_node_metadata_hook, metadata={"stack_trace": last.meta.get("stack_trace")})):
            env = {s: torch.fx.Proxy(graph._resolve_unbacked_binding(*paths[s], lower_symint=_not_written), tracer)
                   for s in guard.assumed.free_symbols}
            condition = sympy_interp(PythonReferenceAnalysis, env, guard.assumed)
            if not isinstance(condition, torch.fx.Proxy):
                raise TypeError(f"{guard.assumed} is not computed from the graph")
            graph.call_function(ASSERT_SCALAR, (condition.node, message))
    except Exception:  # noqa: BLE001 -- torch's interpreter fails in many ways on what it cannot write
        for node in reversed([n for n in graph.nodes if n not in before]):
            graph.erase_node(node)
        return False
    _read_once(graph, [n for n in graph.nodes if n not in before])
    return True


def _read_once(graph: torch.fx.Graph, made: list) -> None:
    """Nodes after one of ``made`` that compute what it computes (a size
    torch's pass reads again) read it instead: the graph a re-export makes,
    which has each once."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in made:
        first = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
        twins = [] if first is None else [
            t for t in first.users if t is not node and t.target is node.target and t.args == node.args
            and t.kwargs == node.kwargs and order[t] > order[node]]
        for twin in twins:
            twin.replace_all_uses_with(node)
            graph.erase_node(twin)


def _not_written(symint):
    raise TypeError(f"a binding divided by {symint}")


def unbacked_symbols_bound(node: torch.fx.Node) -> frozenset:
    """The names of the unbacked symbols ``node`` binds (``item``, ``nonzero``...)."""
    return frozenset(str(s) for s in (node.meta.get("unbacked_bindings") or {}))


def forget_real_values(tensors) -> None:
    """Fake tensors made to stand for values the trace does not know (an
    autograd.Function's inputs, traced apart): they carry no real value, so
    no branch is decided by one (their memory is uninitialized)."""
    for t in tensors:
        if isinstance(t, FakeTensor):
            t.real_tensor = None


def real_values_restored(fakes: dict, reals: dict) -> None:
    """Each fake tensor of ``fakes`` (name -> fake) carries the value of the
    real tensor of that name in ``reals``. torch 2.13 fakes an
    ``nn.Parameter`` with a real value of uninitialized memory: copied in
    place, the real value's storage stays the one its views share."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction(), torch.no_grad():
        for name, fake in fakes.items():
            real = reals.get(name)
            if isinstance(fake, FakeTensor) and fake.real_tensor is not None and isinstance(real, torch.nn.Parameter):
                fake.real_tensor.copy_(real)


def real_values_dropped(fake_mode, gm: torch.fx.GraphModule) -> None:
    """After the trace: the fake mode and the graph's values no longer carry
    real ones. Later traces of the program (``run_decompositions``, a second
    export) run on fake values as any program's do, and the program does not
    hold a copy of every value the example computed."""
    fake_mode.propagate_real_tensors = False
    if fake_mode.shape_env is not None:
        fake_mode.shape_env.real_tensor_prop_unbacked_vals.clear()
    for node in gm.graph.nodes:
        forget_real_values(torch.utils._pytree.tree_leaves(node.meta.get("val")))
