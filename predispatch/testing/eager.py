"""Compare an exported program with the eager module it came from (G5).

    >>> assert_matches_eager(MyModule(), (torch.randn(2, 3),))

Runs the eager module and ``ep.module()`` on identical fresh inputs (floating
inputs require grad unless ``inputs_require_grad=False``), backpropagates a
loss over the floating outputs that require grad (under ``no_grad`` too: a
history can outlive the forward's updates), and compares outputs, which
require grad, gradients of inputs and parameters, buffers, parameters and
inputs afterwards (and which have a history), torch's CPU generator afterwards (both runs start
from the same seed), and the grad mode the call leaves its caller in.

With ``inputs_with_history=True`` the inputs are made as a caller's tensors
often are (AOTAutograd's tests make theirs so): each storage the inputs use
is copied once, floating inputs that require grad take a history from a
leaf (copied from it, their layout kept: ``leaf * 1`` but for the
layout), and inputs that share memory stay views of one tensor,
overlapping or not. The loss then runs over the outputs and the inputs
after the call, so an input left with the wrong history (a new layout, the
old ``grad_fn``) sends other gradients to the leaves than eager's; the
leaves' gradients, which outputs and inputs require grad after the call,
are compared too.
"""
from __future__ import annotations

import copy
import dataclasses
import numbers

import torch

from .._torch import pytree


@dataclasses.dataclass
class Run:
    outputs: list
    outputs_with_history: list  # under no_grad too: a history kept across the forward's updates
    input_grads: list
    param_grads: dict
    params: dict
    buffers: dict
    inputs_after: list
    # name -> (size, stride, storage offset) of inputs ("input 0"), parameters and
    # buffers after the call, and which of them share a storage (t_(), resize_(), set_())
    layouts_after: dict
    storage_sharing: list
    rng_state_after: torch.Tensor  # torch's CPU generator after the call and the backward
    # and CUDA's generators, once CUDA is in use (dropout on a GPU draws from them)
    cuda_rng_states_after: list | None = None
    grad_mode_after: bool | None = None  # the grad mode the call left its caller in
    # inputs_with_history only: the gradients of the leaves the inputs were made from, and
    # which outputs and inputs require grad after the call (a view made under no_grad too)
    root_grads: list | None = None
    outputs_require_grad: list | None = None
    inputs_require_grad_after: list | None = None
    # which inputs have a history leading to a leaf after the call (a write gave them one)
    inputs_with_history_after: list | None = None


def _wants_grad(requires_grad, i: int) -> bool:
    """``requires_grad``: one answer for every input, or one per flat input."""
    return bool(requires_grad[i]) if isinstance(requires_grad, (list, tuple)) else bool(requires_grad)


def fresh_inputs(args, kwargs, requires_grad):
    """Copies of the inputs (floating ones leaves requiring grad, if asked:
    ``requires_grad`` a bool, or one per flat input), aliasing as the
    originals do: the same tensor twice is one copy, and a view of another
    input (``f(x, x[0])``) a view of that one's copy."""
    from ..trace.input_aliasing import views_of_covering_inputs

    leaves, spec = pytree.tree_flatten((args, kwargs or {}))
    try:
        views = views_of_covering_inputs(leaves)
    except Exception:  # partially overlapping: copied apart
        views = {}

    def fresh(i, x):
        if not isinstance(x, torch.Tensor):
            return x
        y = torch.empty(0, dtype=x.dtype, device=x.device).set_(
            x.untyped_storage().clone(), x.storage_offset(), x.size(), x.stride()) if x.device.type != "meta" \
            else x.detach().clone()
        return y.requires_grad_(_wants_grad(requires_grad, i) and (y.is_floating_point() or y.is_complex()))

    copies = [None if i in views else fresh(i, x) for i, x in enumerate(leaves)]
    for i, v in views.items():
        copies[i] = copies[v.of] if leaves[i] is leaves[v.of] else copies[v.of].as_strided(v.size, v.stride, v.offset)
    return pytree.tree_unflatten(copies, spec)


def fresh_inputs_with_history(args, kwargs, requires_grad):
    """Copies of the inputs made as a caller's tensors often are, and the
    leaves they come from: ``((args, kwargs), roots)``.

        >>> (x,), _ = fresh_inputs_with_history((torch.ones(2),), None, True)[0]
        >>> x.is_leaf, type(x.grad_fn).__name__
        (False, 'CopyBackwards')

    Each storage the inputs use is copied once, into a tensor of the layout
    of the input covering all the memory the others of that storage reach
    (not a view), or, where none does (``x[:2]`` and ``x[2:]``, ``x[:, 0]``
    and ``x[:, 1]``), over the whole storage; every other input of the
    storage is a view of it, the same tensor twice one copy. Where an input
    of the storage is to require grad (``requires_grad``: a bool, or one per
    flat input), that tensor takes its values from a leaf by ``copy_``: a
    history, its layout kept. ``roots``: those leaves, in input order."""
    leaves, spec = pytree.tree_flatten((args, kwargs or {}))
    copies, roots = list(leaves), []
    for group in _storage_groups(leaves):
        tensors = [leaves[i] for i in group]
        cover = _cover(tensors)
        base, root = _copy_storage(tensors[0], cover, any(_wants_grad(requires_grad, i) for i in group))
        made = {id(cover): base}  # the same tensor twice: one copy
        for i, x in zip(group, tensors):
            if id(x) not in made:
                made[id(x)] = base.as_strided(x.size(), x.stride(), x.storage_offset())
            copies[i] = made[id(x)]
        roots += [root] if root is not None else []
    return pytree.tree_unflatten(copies, spec), roots


def _storage_groups(leaves) -> list[list[int]]:
    """Positions of the tensor inputs, grouped by the storage they use."""
    from ..trace.input_aliasing import storage

    groups: dict = {}
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            key = storage(x) if x.device.type != "meta" else ("meta", i)
            groups.setdefault(key, []).append(i)
    return list(groups.values())


def _span(t: torch.Tensor) -> tuple[int, int]:
    return t.storage_offset(), t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0)


def _cover(tensors: list):
    """The tensor whose span holds every other's, or None (``x[:2]``, ``x[2:]``)."""
    spans = [_span(t) for t in tensors]
    whole = (min(a for a, _ in spans), max(b for _, b in spans))
    return next((t for t, s in zip(tensors, spans) if s == whole), None)


def _copy_storage(first, cover, wants_grad: bool):
    """(a copy of ``first``'s storage as ``cover``'s layout, or the whole of
    it where None; the leaf it takes its values and history from, or None)."""
    if first.device.type == "meta":
        base = first.detach().clone()
    else:
        copied = first.untyped_storage().clone()
        layout = (cover.storage_offset(), cover.size(), cover.stride()) if cover is not None else \
            (0, (copied.nbytes() // first.element_size(),), (1,))
        base = torch.empty(0, dtype=first.dtype, device=first.device).set_(copied, *layout)
    if not (wants_grad and (base.is_floating_point() or base.is_complex())):
        return base, None
    root = base.detach().clone().requires_grad_()
    with torch.enable_grad():
        base.copy_(root)
    return base, root


def _loss(outputs):
    total = None
    for i, o in enumerate(outputs):
        if isinstance(o, torch.Tensor) and o.requires_grad and o.is_floating_point():
            term = (o.float() * (1.0 + 0.1 * i)).square().sum()
            total = term if total is None else total + term
    return total


def _has_history(o) -> bool:
    """Does a gradient of ``o`` reach a leaf? Not the same as ``requires_grad``:
    eager's view made under no_grad reports requires_grad and has no history
    (nor do views of it), which a graph neither can nor needs to copy. A
    view of a tensor that does not require grad, made to (``requires_grad_()``),
    is a leaf of its own."""
    if not (isinstance(o, torch.Tensor) and o.requires_grad):
        return False
    if o.grad_fn is None:  # a leaf; not a view made under no_grad of one that requires grad
        return o._base is None or not o._base.requires_grad
    seen, todo = set(), [o.grad_fn]
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "AccumulateGrad":
            return True
        todo.extend(f for f, _ in fn.next_functions)
    return False


def _call_mode(grad_mode):
    """The mode a module is called in: grad on (True), off (False) or ``"inference_mode"``."""
    return torch.inference_mode() if grad_mode == "inference_mode" else torch.set_grad_enabled(grad_mode)


def run_module(module, args, kwargs, *, grad_mode=True, inputs_require_grad=True, seed=0,
               inputs_with_history=False) -> Run:
    if inputs_with_history:
        (args, kwargs), roots = fresh_inputs_with_history(args, kwargs, inputs_require_grad)
    else:
        (args, kwargs), roots = fresh_inputs(args, kwargs, inputs_require_grad), None
    leaves = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
    torch.manual_seed(seed)
    with _call_mode(grad_mode):
        out = module(*args, **kwargs)
        grad_mode_after = torch.is_grad_enabled()
    outputs = [o for o in pytree.tree_leaves(out)]
    # under no_grad too, over the outputs that still have a history (and, given
    # inputs with a history, the inputs as the call left them)
    loss = _loss(outputs + (leaves if roots is not None else []))
    if loss is not None:
        loss.backward()
    rng_state_after = torch.get_rng_state()
    cuda_rng_states_after = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    detach = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
    state = {**{f"input {i}": x for i, x in enumerate(leaves)},
             **{f"parameter {n}": p for n, p in module.named_parameters()},
             **{f"buffer {n}": b for n, b in module.named_buffers()}}
    return Run(
        outputs=[detach(o) for o in outputs],
        outputs_with_history=[_has_history(o) for o in outputs],
        input_grads=[detach(x.grad) if x.is_leaf else None for x in leaves],
        param_grads={n: detach(p.grad) for n, p in module.named_parameters()},
        params={n: detach(p) for n, p in module.named_parameters()},
        buffers={n: detach(b) for n, b in module.named_buffers()},
        inputs_after=[detach(x) for x in leaves],
        layouts_after={n: (tuple(t.shape), t.stride(), t.storage_offset()) for n, t in state.items()},
        storage_sharing=_storage_sharing(state),
        rng_state_after=rng_state_after,
        cuda_rng_states_after=cuda_rng_states_after,
        grad_mode_after=grad_mode_after,
        inputs_with_history_after=[_has_history(x) for x in leaves],
        **(_history_fields(roots, outputs, leaves) if roots is not None else {}),
    )


def _history_fields(roots, outputs, inputs) -> dict:
    """What ``inputs_with_history`` adds to a run: the roots' gradients, and
    which outputs and inputs require grad after the call."""
    return dict(root_grads=[None if r.grad is None else r.grad.clone() for r in roots],
                outputs_require_grad=[isinstance(o, torch.Tensor) and o.requires_grad for o in outputs],
                inputs_require_grad_after=[x.requires_grad for x in inputs])


def _storage_sharing(tensors: dict) -> list[list[str]]:
    """Groups of names of ``tensors`` sharing a storage (more than one)."""
    groups: dict = {}
    for name, t in tensors.items():
        if t.device.type != "meta":
            groups.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    return sorted(g for g in groups.values() if len(g) > 1)


def assert_runs_match(eager: Run, exported: Run, *, rtol=None, atol=None, what="") -> None:
    def close(a, b, msg):
        # assert_close knows tensors and numbers only; a string, dtype or
        # device output (on either side) must simply be equal.
        if not all(isinstance(x, (torch.Tensor, numbers.Number, type(None))) for x in (a, b)):
            assert type(a) is type(b) and a == b, f"{what}{msg}: {a!r} != {b!r}"
            return
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol, equal_nan=True,
                                   msg=lambda m: f"{what}{msg}: {m}")
    assert len(eager.outputs) == len(exported.outputs), f"{what}number of outputs differs"
    assert eager.grad_mode_after == exported.grad_mode_after, (
        f"{what}grad mode after the call: {eager.grad_mode_after} in eager, "
        f"{exported.grad_mode_after} in the program")
    for i, (a, b) in enumerate(zip(eager.outputs, exported.outputs)):
        close(a, b, f"output {i}")
    assert eager.outputs_with_history == exported.outputs_with_history, (
        f"{what}which outputs require grad (with a history leading to a leaf): eager "
        f"{eager.outputs_with_history}, program {exported.outputs_with_history}")
    for i, (a, b) in enumerate(zip(eager.input_grads, exported.input_grads)):
        close(a, b, f"gradient of input {i}")
    assert eager.inputs_with_history_after == exported.inputs_with_history_after, (
        f"{what}which inputs have a history leading to a leaf after the call: eager "
        f"{eager.inputs_with_history_after}, program {exported.inputs_with_history_after}")
    if eager.root_grads is not None:
        _assert_histories_match(eager, exported, close, what)
    for field in ("param_grads", "params", "buffers"):
        mine, theirs = getattr(eager, field), getattr(exported, field)
        assert set(mine) <= set(theirs), f"{what}{field}: missing {set(mine) - set(theirs)}"
        for name in mine:
            close(mine[name], theirs[name], f"{field}[{name}]")
    for i, (a, b) in enumerate(zip(eager.inputs_after, exported.inputs_after)):
        close(a, b, f"input {i} after the call")
    assert torch.equal(eager.rng_state_after, exported.rng_state_after), (
        f"{what}torch's random generator after the call: the program left it in another "
        "state than eager (drew more or less, or seeded or restored it otherwise)")
    if eager.cuda_rng_states_after is not None and exported.cuda_rng_states_after is not None:
        assert all(map(torch.equal, eager.cuda_rng_states_after, exported.cuda_rng_states_after)), (
            f"{what}CUDA's random generator after the call: the program left it in another state than eager")
    for name, layout in eager.layouts_after.items():  # the program may hold more (lifted constants)
        if name not in exported.layouts_after:
            continue  # a state the comparison above finds missing, or names otherwise
        assert layout == exported.layouts_after[name], (
            f"{what}{name} after the call: (size, stride, storage offset) {layout} in eager, "
            f"{exported.layouts_after[name]} in the program")
    known = set(eager.layouts_after) & set(exported.layouts_after)
    shared = sorted(g for g in ([n for n in group if n in known] for group in exported.storage_sharing)
                    if len(g) > 1)
    expected = sorted(g for g in ([n for n in group if n in known] for group in eager.storage_sharing)
                      if len(g) > 1)
    assert expected == shared, (
        f"{what}which inputs, parameters and buffers share a storage after the call: "
        f"eager {expected}, program {shared}")


def _assert_histories_match(eager: Run, exported: Run, close, what: str) -> None:
    """``inputs_with_history``: which outputs and inputs require grad after
    the call (a view made under no_grad counts), and the gradients a loss over
    outputs and inputs sends to the leaves the inputs were made from."""
    assert eager.outputs_require_grad == exported.outputs_require_grad, (
        f"{what}which outputs require grad: eager {eager.outputs_require_grad}, "
        f"program {exported.outputs_require_grad}")
    assert eager.inputs_require_grad_after == exported.inputs_require_grad_after, (
        f"{what}which inputs require grad after the call: eager {eager.inputs_require_grad_after}, "
        f"program {exported.inputs_require_grad_after}")
    for i, (a, b) in enumerate(zip(eager.root_grads, exported.root_grads)):
        close(a, b, f"gradient of leaf {i} the inputs were made from (a loss over the outputs and the "
                    "inputs after the call)")


def _fresh_module(ep):
    """``ep.module()`` with its own copy of the state (ep.module() shares
    ep's): the module of a copy of ``ep`` holding copies of its parameters,
    buffers and constants (tensors that shared memory still do), run by the
    code ``ep.module()`` gives a user (a deepcopy of the module would
    generate plain code again, at a codegen's cost)."""
    own = copy.copy(ep)
    own._state_dict, own._constants = copy.deepcopy((ep._state_dict, ep._constants))
    return own.module()


def assert_matches_eager(module, args, kwargs=None, *, export=None, grad_modes=(True, False),
                         inputs_require_grad=True, rtol=None, atol=None, check_reexport=True,
                         inputs_with_history=False, **export_kwargs):
    """Export a copy of ``module`` and check it against eager under each grad mode.

        >>> class EMA(torch.nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.ones(2))
        ...     def forward(self, x):
        ...         with torch.no_grad():
        ...             self.w.mul_(0.5)      # a parameter updated under no_grad
        ...         return x * self.w
        >>> ep = predispatch.testing.assert_matches_eager(EMA(), (torch.randn(2),))

    Compares outputs and their ``requires_grad``, the gradients of inputs
    and parameters, and the buffer and input states after the call; also
    that the graph holds G1/G3 and that re-exporting ``ep.module()`` gives
    the same graph (G7). Raises ``AssertionError`` naming what differs;
    returns the program.

    ``grad_modes`` may hold ``"inference_mode"``; ``inputs_require_grad`` a
    bool per flat input. ``inputs_with_history=True`` exports and calls with
    inputs made by :func:`fresh_inputs_with_history` (not leaves; memory
    shared as the given inputs share it, overlapping or not) and checks the
    inputs' history after the call: the leaves' gradients from a loss over
    the outputs and the inputs, and which outputs and inputs require grad."""
    from .. import export_predispatch
    from ..program.printing import format_program
    from .invariants import assert_invariants

    export = export or export_predispatch
    example = fresh_inputs_with_history(args, kwargs, False)[0] if inputs_with_history else \
        fresh_inputs(args, kwargs, False)
    ep = export(copy.deepcopy(module), *example, **export_kwargs)
    assert_invariants(ep)
    for grad_mode in grad_modes:
        run = dict(grad_mode=grad_mode, inputs_require_grad=inputs_require_grad,
                   inputs_with_history=inputs_with_history)
        eager = run_module(copy.deepcopy(module), args, kwargs, **run)
        exported = run_module(_fresh_module(ep), args, kwargs, **run)
        assert_runs_match(eager, exported, rtol=rtol, atol=atol, what=f"[grad_mode={grad_mode}] ")
    if check_reexport:
        example = fresh_inputs_with_history(args, kwargs, False)[0] if inputs_with_history else \
            fresh_inputs(args, kwargs, False)
        again = export(ep.module(), *example, **export_kwargs)
        first, second = format_program(ep), format_program(again)
        if first != second:
            raise AssertionError(f"G7: re-exporting ep.module() changed the graph:\n{first}\n---\n{second}")
    return ep
