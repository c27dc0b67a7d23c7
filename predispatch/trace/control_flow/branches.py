"""A control-flow operator's branches (or bodies) traced by the pipeline, on the same inputs.

Each branch is traced as an autograd.Function's forward is
(:func:`predispatch.trace.autograd_function.subgraphs.subgraph`: the whole
pipeline, with the running trace suspended), on fresh fake inputs: the
operands, then every tensor of the forward it may read (:mod:`.reads`). The
subgraphs then take the same inputs, as torch's operators require: the
operands, the reads some branch used, and the tensor constants of every
branch (each branch's own constants, lifted to its last inputs, become
inputs of all).
"""
from __future__ import annotations

import dataclasses
import inspect

import torch

from ... import _torch
from ..._torch import control_flow, pytree
from ..._torch.patching import patches_suspended
from ...errors import ExportError, node_location
from ...ir.autograd_function_op import placeholders
from ..autograd_function.subgraphs import subgraph
from .reads import Read, reads_of, swapped_in, user_functions


_TENSOR = object()  # an output leaf that is a tensor
_NUMBER = object()  # an int output the branches disagree on: a symbolic int of the operator's


@dataclasses.dataclass(frozen=True)
class Symbolic:
    """An output leaf that is a symbolic number of the branch's trace (a
    size, ``.item()``'s value, a comparison of them: a while_loop's condition
    may return one): the operator's output there."""

    kind: type  # int, bool or float


_SYMBOLIC_KINDS = {torch.SymInt: int, torch.SymBool: bool, torch.SymFloat: float}


def _leaf(o) -> object:
    """How :class:`Outputs` keeps a returned leaf."""
    if isinstance(o, torch.Tensor):
        return _TENSOR
    return Symbolic(_SYMBOLIC_KINDS[type(o)]) if type(o) in _SYMBOLIC_KINDS else o


def _kind(leaf) -> type:
    return leaf.kind if isinstance(leaf, Symbolic) else type(leaf)


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What a branch returned: its tree and leaves (a tensor leaf
    :data:`_TENSOR`, a symbolic number :class:`Symbolic`, a number as it
    is). The subgraph returns every leaf, numbers too, as torch's operators do."""

    spec: object
    leaves: tuple

    def rebuilt(self, results) -> object:
        """The branch's result from the operator's: a number all branches
        return is that number, as torch's graph uses it."""
        return pytree.tree_unflatten([leaf if _is_constant(leaf) else r
                                      for leaf, r in zip(self.leaves, results)], self.spec)

    @property
    def all_tensors(self) -> bool:
        return all(leaf is _TENSOR for leaf in self.leaves)

    @property
    def is_predicate(self) -> bool:
        """One tensor, bool or symbolic bool (a while_loop's condition)."""
        return len(self.leaves) == 1 and (self.leaves[0] is _TENSOR or _kind(self.leaves[0]) is bool)

    def merged(self, other: "Outputs") -> "Outputs | None":
        """What both branches return (an int they disagree on, or one symbolic
        in either: :data:`_NUMBER`), or None where their trees or kinds of leaf differ."""
        if self.spec != other.spec:
            return None
        leaves = []
        for a, b in zip(self.leaves, other.leaves):
            if a is _TENSOR or b is _TENSOR:
                if a is not b:
                    return None
                leaves.append(a)
            elif _is_constant(a) and _is_constant(b) and a == b and type(a) is type(b):
                leaves.append(a)
            elif _kind(a) is int and _kind(b) is int:
                leaves.append(_NUMBER)
            else:
                return None
        return Outputs(self.spec, tuple(leaves))


def _is_constant(leaf) -> bool:
    return leaf is not _TENSOR and leaf is not _NUMBER and not isinstance(leaf, Symbolic)


@dataclasses.dataclass
class Branches:
    """The traced subgraphs (inputs: operands, ``reads``, ``constants``) and
    what each returned."""

    gms: list
    reads: list[Read]
    constants: list
    outputs: list[Outputs]

    def extra_inputs(self) -> list:
        """The operator's inputs after the operands, in the forward's trace: a
        constant that is a value of the forward (a tensor the branch reached
        through a list, a dict: not found as a read) is that value."""
        return [*(r.outer for r in self.reads),
                *(c if _torch.is_traced(c) else _torch.traced_constant(c) for c in self.constants)]


@dataclasses.dataclass(frozen=True)
class Call:
    """A control-flow call being traced: for messages and for the traces."""

    op: str  # "torch.cond", "while_loop", "map", "scan"
    where: str  # the user's line


def trace_branches(call: Call, roles: list[str], fns: list, operands: list, unflatten) -> Branches:
    """Each of ``fns`` (named by ``roles``: "true branch"...) traced on the
    flat traced ``operands`` (a :class:`Row`: a row of one; :class:`Carried`:
    a loop's), called as ``fn(*unflatten(operands))``."""
    reads = reads_of(fns)
    fake_mode = _torch.fake_mode_of(_some_tensor([*operands, *(r.outer for r in reads)]))
    traced, outputs = [], []
    cache = _torch.autocast_cache_default()  # eager's, read before the trace's patches are suspended
    codes = [getattr(f, "__func__", f).__code__ for fn in fns for f in user_functions(fn)]
    with control_flow.branch_traced_apart(fake_mode, codes), patches_suspended():
        for role, fn in zip(roles, fns):
            # fresh inputs for each: a fake tensor remembers what .item() gave it, and a symbol a branch
            # binds is its own (its checks go to its graph only)
            inputs = [_fake_like(t, fake_mode) for t in [*operands, *(r.outer for r in reads)]]
            body, returned = _body(call, role, fn, len(operands), reads, unflatten)
            names = [*_operand_names(fn, len(operands)), *(r.name for r in reads)]
            result = subgraph(body, inputs, names, cache)
            if result.updated:
                k, at = result.updated[0], _first_update_location(result.gm, len(result.updated))
                raise _refused(call, role, fn, f"updates its input {names[k]!r} in place" if k < len(operands) else
                               f"updates {names[k]!r} in place, a tensor it reads (a buffer updated by a "
                               "BatchNorm in training mode too: compute the new value outside the operator)", at)
            control_flow.write_runtime_asserts(result.gm, fake_mode)
            traced.append(result)
            outputs.append(returned[0])
    gms = [t.gm for t in traced]
    for t in traced:
        _copied_once(t.gm, len(t.constants))
    kept = _prune_unread(gms, len(operands), len(reads))
    constants = _share_constants(gms, [t.constants for t in traced])
    return Branches(gms, [reads[i] for i in kept], constants, outputs)


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of a mapped tensor: what a map's body takes (contiguous, as torch traces it)."""

    of: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Carried:
    """A value a loop carries from one iteration to the next: an int of it
    may be any int there (a fresh unbacked symbol, as torch traces it)."""

    of: object  # a tensor, an int or a symbolic int


def _fake_like(t, fake_mode):
    if isinstance(t, Carried):
        return control_flow.any_int(fake_mode) if isinstance(t.of, (int, torch.SymInt)) else _fake_like(t.of, None)
    if not isinstance(t, (torch.Tensor, Row)):  # a symbolic size: itself
        return t
    if isinstance(t, Row):
        return torch.empty(t.of.shape[1:], dtype=t.of.dtype, device=t.of.device)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)


def _some_tensor(values) -> torch.Tensor | None:
    values = [v.of if isinstance(v, (Row, Carried)) else v for v in values]
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _body(call: Call, role: str, fn, n_operands: int, reads: list[Read], unflatten):
    """``fn`` as a flat function of the operands and the reads, returning its
    leaves; what it returned (:class:`Outputs`, once traced)."""
    returned = [None]

    def body(*tensors):
        with swapped_in(reads, tensors[n_operands:]):
            out = fn(*unflatten(list(tensors[:n_operands])))
        flat, spec = pytree.tree_flatten(out)
        for o in flat:
            if not isinstance(o, (torch.Tensor, bool, int, float, *_SYMBOLIC_KINDS)):
                raise _refused(call, role, fn, f"returns {type(o).__name__} {o!r}, neither a tensor nor a number")
            if isinstance(o, torch.Tensor) and any(_aliases(o, t) for t in tensors):
                raise _refused(call, role, fn, "returns one of its inputs or a view of one (an alias); "
                               "return a new tensor (.clone())")
        returned[0] = Outputs(spec, tuple(_leaf(o) for o in flat))
        return tuple(flat)

    return body, returned


def _aliases(out: torch.Tensor, given) -> bool:
    return out is given or isinstance(given, torch.Tensor) and _torch.shares_storage(out, given)


def _refused(call: Call, role: str, fn, why: str, at: str | None = None) -> ExportError:
    """What torch refuses in a branch, said at the line inside the branch
    that does it (``at``; else where the branch is defined) and the call's."""
    user = (user_functions(fn) or [fn])[0]
    name = getattr(user, "__qualname__", None) or type(user).__name__
    at = at or _defined_at(user)
    return ExportError(f"the {role} of {call.op} cannot be exported soundly, at {at}: the {role} ({name}) "
                       f"{why}; torch's control-flow operators take functional branches, as torch.export "
                       f"requires ({call.op} called at {call.where})")


def _defined_at(fn) -> str:
    code = getattr(getattr(fn, "__func__", fn), "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno} in {code.co_name}" if code is not None else "unknown location"


def _first_update_location(gm: torch.fx.GraphModule, n_updated: int) -> str | None:
    """The user's line inside the branch that made the new value of the
    first input it updates (the last outputs of its graph)."""
    values = gm.graph.output_node().args[0]
    node = values[len(values) - n_updated] if n_updated <= len(values) else None
    where = node_location(node.stack_trace) if isinstance(node, torch.fx.Node) else "unknown location"
    return None if where == "unknown location" else where


def _operand_names(fn, count: int) -> list[str]:
    """The user's parameter names (torch's wrapper's, such as while_loop's
    ``flat_body_fn(*args)``, say nothing), where one names each operand."""
    fn = (user_functions(fn) or [fn])[0]
    if isinstance(fn, torch.nn.Module):  # (a program's branch, exported again: its placeholders' names)
        fn = fn.forward
    try:
        params = [p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[:count] if len(params) >= count else [f"arg{i}" for i in range(count)]


def _copied_once(gm: torch.fx.GraphModule, n_constants: int) -> None:
    """A constant the branch makes (``torch.tensor(data)``) is copied where
    the operator's caller passes it (a fresh copy each call): its copy in the
    branch goes."""
    for node in placeholders(gm)[len(placeholders(gm)) - n_constants:] if n_constants else []:
        for user in list(node.users):
            if user.target is torch.ops.aten.lift_fresh_copy.default:
                user.replace_all_uses_with(node)
                gm.graph.erase_node(user)
    gm.recompile()


def _prune_unread(gms: list, n_operands: int, n_reads: int) -> list[int]:
    """The reads no subgraph uses dropped from all; the kept ones' positions."""
    read_nodes = [placeholders(gm)[n_operands:n_operands + n_reads] for gm in gms]
    kept = [i for i in range(n_reads) if any(nodes[i].users for nodes in read_nodes)]
    for gm, nodes in zip(gms, read_nodes):
        for i, node in enumerate(nodes):
            if i not in kept:
                gm.graph.erase_node(node)
        gm.recompile()
    return kept


def _share_constants(gms: list, constants: list[list]) -> list:
    """Each subgraph's lifted constants (its last inputs) made inputs of
    all, in branch order: a subgraph takes the others' as unused inputs."""
    own = [placeholders(gm)[len(placeholders(gm)) - len(cs):] for gm, cs in zip(gms, constants)]
    for k, gm in enumerate(gms):
        before = [n for j in range(k) for n in own[j]]
        after = [n for j in range(k + 1, len(gms)) for n in own[j]]
        anchor = own[k][0] if own[k] else None
        for i, other in enumerate([*before, *after]):
            _unused_input(gm, f"other_constant_{i}", other, before=anchor if i < len(before) else None)
        gm.recompile()
    return [c for cs in constants for c in cs]


def _unused_input(gm: torch.fx.GraphModule, name: str, like: torch.fx.Node, before) -> None:
    """A placeholder ``name`` with ``like``'s metadata, before ``before`` or after the last."""
    last = placeholders(gm)[-1] if placeholders(gm) else None
    where = gm.graph.inserting_before(before) if before is not None else (
        gm.graph.inserting_after(last) if last is not None else gm.graph.inserting_before(None))
    with where:
        node = gm.graph.placeholder(name)
    node.meta.update(like.meta)
