"""The trace of the capture stage, in one pass.

``make_fx(pre_dispatch=True)`` over a function that runs the module under a
FunctionalTensorMode on the PreDispatch key, then returns the new values of
mutated inputs (parameters, buffers, user inputs, in that order) followed by
the outputs: the graph ``aot_export_module(pre_dispatch=True)`` makes, from
one trace instead of its two (a metadata pass, then the graph).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.utils._pytree as pytree

from .. import _torch
from . import eager_layout, input_aliasing, layer_reuse, recorder
from ..errors import ExportError
from .patching import patched


@dataclasses.dataclass(frozen=True)
class LayoutChange:
    """How a parameter, buffer or input ends up after ``t_()``, ``resize_()``,
    ``set_()`` and the like: its storage (``"own"``; ``"other"``: that of the
    input ``source`` names; ``"value"``: one the forward made; ``"shared"``:
    the one the forward made that input ``source`` took before it) and its
    size, strides and storage offset there, counted from where that
    storage's owner starts (``"shared"``: where ``source`` ends up; None where
    symbolic: the new value's own are taken at run time)."""

    storage: str
    source: str | None
    size: tuple | None
    stride: tuple | None
    offset: int | None

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def functional_trace(mod: torch.nn.Module, args, kwargs, keep=frozenset, on_layout_change=None,
                     on_retrace=None):
    """(graph module, aot-style GraphSignature, the user inputs seen as views
    of others: see :mod:`predispatch.trace.input_aliasing`) of ``mod(*args, **kwargs)``.
    Dead code goes, except the nodes ``keep()`` names. ``on_layout_change(key,
    LayoutChange)`` hears of each input whose layout or storage changed (keys
    as ``"param:<name>"``, ``"buffer:<name>"``, ``"input:<flat index>"``);
    ``on_retrace()`` of a second trace (inputs overlapping in memory, one mutated)."""
    kwargs = kwargs or {}
    named_parameters = dict(mod.named_parameters(remove_duplicate=False))
    named_buffers = dict(mod.named_buffers(remove_duplicate=False))
    state_flat, state_spec = pytree.tree_flatten({**named_parameters, **named_buffers})
    keys = [*(f"param:{n}" for n in named_parameters), *(f"buffer:{n}" for n in named_buffers)]
    call = _torch.create_functional_call(mod, state_spec, len(state_flat), store_orig_mod=True)
    flat_fn, out_spec = _torch.create_tree_flattened_fn(call, [*state_flat, *args], kwargs)
    flat_args, in_spec = pytree.tree_flatten(([*state_flat, *args], kwargs))
    n_state = len(state_flat)
    mutated: list[int] = []

    views: dict[int, input_aliasing.View] = {}  # user input -> seen through another

    @functools.wraps(flat_fn)  # carries the module: make_fx records nn_module_stack and stack traces
    def functionalized(*flat):
        # make_fx made and tracked the inputs with torch-function modes off (trace_once): on for the module
        with torch._C._EnableTorchFunction():
            return functionalized_call(*flat)

    def functionalized_call(*flat):
        mode = _torch.functional_mode()
        wrapped = {}  # a tied parameter or buffer (one tensor, two names) is wrapped once

        def wrap(i, a):
            if i >= n_state:  # user inputs: distinct unless seen through another
                return _torch.to_functional(a)
            if id(a) not in wrapped:
                wrapped[id(a)] = _torch.to_functional(a)
            return wrapped[id(a)]

        with mode:
            # the wrappers' own metadata reads (some twenty per input) are not the module's torch calls:
            # no torch-function mode sees them (make_fx's would count each, at ~100 us an input)
            with torch._C.DisableTorchFunction():
                inputs = [None if i - n_state in views else wrap(i, a) for i, a in enumerate(flat)]
            for j, v in views.items():
                cover = inputs[n_state + v.of]
                if flat[n_state + j] is flat[n_state + v.of]:  # the same tensor twice
                    inputs[n_state + j] = cover
                    continue
                inputs[n_state + j] = cover.as_strided(v.size, v.stride, v.offset)
                recorder.mark_view(inputs[n_state + j], cover)
            with torch._C.DisableTorchFunction():
                storages = [_torch.storage_of(f) for f in inputs]
                offsets = [_torch.storage_offset(f) for f in inputs]
                start = eager_layout.shadow_inputs(inputs)
            outputs = flat_fn(*inputs)
        for cover in sorted({v.of for v in views.values()}):
            if _torch.storage_changed(inputs[n_state + cover]) and any(
                    _torch.has_data_mutation(inputs[n_state + j]) for j, v in views.items()
                    if v.of == cover and inputs[n_state + j] is not inputs[n_state + cover]):
                input_aliasing.refuse_moved_cover(cover, recorder.user_swap_location(inputs[n_state + cover]))
        # an input seen through another is written back through it
        new_values, done = [], {id(inputs[n_state + j]) for j, v in views.items()
                                if inputs[n_state + j] is not inputs[n_state + v.of]}
        made = {}  # storage the forward made -> (the first input laid on it, its offset there)
        for i, f in enumerate(inputs):
            if not isinstance(f, _torch.FunctionalTensor) or id(f) in done:
                continue  # a tied tensor's mutation is written back once, under its first name
            done.add(id(f))
            torch._sync(f)
            relaid = _torch.has_metadata_mutation(f) or _torch.storage_changed(f)
            if relaid and on_layout_change is not None:
                on_layout_change(input_key(i), _layout_change(i, f, storages, offsets, start, made, input_key))
            if relaid or _torch.has_data_mutation(f):
                mutated.append(i)
                new_values.append(_torch.from_functional(f))
        # an input seen through another and returned as it is: the caller's tensor, as in eager
        returned_as_is = {id(inputs[n_state + j]): flat[n_state + j] for j in views
                          if inputs[n_state + j] is not inputs[n_state + views[j].of]
                          and not _torch.has_metadata_mutation(inputs[n_state + j])}
        for j in views:
            if id(inputs[n_state + j]) in returned_as_is and any(o is inputs[n_state + j] for o in outputs):
                cover = inputs[n_state + views[j].of]
                input_aliasing.refuse_relaid_cover(views[j].of, j, cover.shape != flat[n_state + views[j].of].shape,
                                                   recorder.user_swap_location(cover))
        return (*new_values, *[returned_as_is.get(id(o)) if id(o) in returned_as_is
                               else _torch.from_functional(o) for o in outputs])

    def input_key(i: int) -> str:
        return keys[i] if i < n_state else f"input:{i - n_state}"

    def trace_once():
        # make_fx's own work around the module's call (making, tracking and reading the inputs and outputs:
        # metadata reads, not the module's torch calls) with torch-function modes off, at ~250 us an input
        with _torch.enable_python_dispatcher(), \
                patched(_torch.FunctionalTensor, "__new__", _torch.wrapper_sized_by_wrapped_storage), \
                patched(torch.Tensor, "_make_wrapper_subclass", _torch.wrapper_subclass_with_known_size), \
                torch._C.DisableTorchFunction():
            return _torch.make_fx(functionalized, record_module_stack=True, pre_dispatch=True)(*flat_args)

    def trace():
        try:
            return trace_once()
        except layer_reuse.Retrace:  # a stamped layer's tensors were mutated later: trace every layer
            mutated.clear()
            if on_retrace is not None:
                on_retrace()
            with layer_reuse.reuse_layers(False):
                return trace_once()

    gm = trace()
    overlapping = input_aliasing.views_of_covering_inputs(
        flat_args[n_state:], [i - n_state for i in mutated if i >= n_state]) if _some_share_storage(
        flat_args[n_state:]) else {}
    if overlapping:
        views.update(overlapping)
        mutated.clear()
        if on_retrace is not None:
            on_retrace()
        gm = trace()
    _drop_storage_swaps_of_constants(gm)
    kept = keep()
    impure = _torch.impure_by_op(impure_random=True)  # Node.is_impure's default
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n in kept or impure(n))
    gm.recompile()
    return gm, _signature(gm, named_parameters, named_buffers, mutated, in_spec, out_spec.spec), views


def _some_share_storage(inputs) -> bool:
    storages = [input_aliasing.storage(t) for t in inputs
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel() > 0]
    return len(storages) != len(set(storages))


def _drop_storage_swaps_of_constants(gm: torch.fx.GraphModule) -> None:
    """Functionalization turns ``a.set_(b)`` into data flow (``a`` reads ``b``'s
    storage from then on) and also runs ``set_`` on its wrappers' inner
    tensors, which the tracer records on constants it does not know: drop them."""
    for node in list(gm.graph.nodes):
        if (node.op == "call_function" and getattr(node.target, "overloadpacket", None) is torch.ops.aten.set_
                and any(a.op == "get_attr" for a in node.all_input_nodes)):
            constants = [a for a in node.all_input_nodes if a.op == "get_attr"]
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
            for c in constants:
                if not c.users:
                    gm.graph.erase_node(c)
                    if hasattr(gm, c.target):
                        delattr(gm, c.target)


def _layout_change(i: int, f, storages: list, offsets: list, start: eager_layout.Start,
                   made: dict, key_of) -> LayoutChange:
    """Where input ``i`` (``f``, after the forward) keeps its elements, and how
    (its offset counted from where the owner of that storage started): as
    its shadow says (see :mod:`predispatch.trace.eager_layout`), else as
    functionalization's tensors do (symbolic sizes; memory the forward made,
    ``made``: where earlier inputs took some)."""
    if (shadow := eager_layout.of(f)) is not None:
        size, stride, offset, storage = shadow
        storages, offsets = start.storages, start.offsets
    else:
        storage = _torch.storage_of(f)
        size, stride, offset = _torch.layout(f)
    owner = i if storages[i] == storage else next(
        (j for j, s in enumerate(storages) if s is not None and s == storage), None)
    place = "value" if owner is None else "own" if owner == i else "other"
    if owner is not None:
        offset -= offsets[owner]
    elif storage in made:  # x.set_(v); z.set_(v): z shares the memory x took
        place, (owner, first_offset) = "shared", made[storage]
        offset -= first_offset
    elif isinstance(offset, int):
        made[storage] = (i, offset)
    if not all(isinstance(v, int) for v in (*size, *stride, offset)):
        size = stride = offset = None
    return LayoutChange(place, key_of(owner) if place in ("other", "shared") else None, size, stride, offset)


def _signature(gm, named_parameters, named_buffers, mutated, in_spec, out_spec):
    inputs, outputs = _torch.graph_input_names(gm), _torch.graph_output_names(gm)
    params, buffers = list(named_parameters), list(named_buffers)
    n_params, n_state = len(params), len(params) + len(buffers)
    to_mutate = {"param": {}, "buffer": {}, "input": {}}
    for out_name, i in zip(outputs, mutated):
        if i < n_params:
            to_mutate["param"][out_name] = params[i]
        elif i < n_state:
            to_mutate["buffer"][out_name] = buffers[i - n_params]
        else:
            to_mutate["input"][out_name] = inputs[i]
    return _torch.GraphSignature(
        parameters=params, buffers=buffers, user_inputs=inputs[n_state:],
        user_outputs=outputs[len(mutated):],
        inputs_to_parameters=dict(zip(inputs[:n_params], params)),
        inputs_to_buffers=dict(zip(inputs[n_params:n_state], buffers)),
        buffers_to_mutate=to_mutate["buffer"], parameters_to_mutate=to_mutate["param"],
        user_inputs_to_mutate=to_mutate["input"], in_spec=in_spec, out_spec=out_spec,
        backward_signature=None, input_tokens=[], output_tokens=[])
