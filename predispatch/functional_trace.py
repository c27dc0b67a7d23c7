"""The trace of the capture stage, in one pass.

``make_fx(pre_dispatch=True)`` over a function that runs the module under a
FunctionalTensorMode on the PreDispatch key, then returns the new values of
mutated inputs (parameters, buffers, user inputs, in that order) followed by
the outputs: the graph ``aot_export_module(pre_dispatch=True)`` makes, from
one trace instead of its two (a metadata pass, then the graph).
"""
from __future__ import annotations

import functools

import torch
import torch.utils._pytree as pytree

from . import _torch
from .errors import ExportError


class InputLayoutChanged(ExportError):
    """An input's shape, strides or storage changed in place."""


def _refuse_aliased_mutated_inputs(flat_args, mutated: list[int]) -> None:
    """Inputs sharing memory (the same tensor twice, x and x[0]), one of them
    mutated: the program treats its inputs as distinct."""
    from torch.multiprocessing.reductions import StorageWeakRef

    seen = {}
    for i, a in enumerate(flat_args):
        if isinstance(a, torch.Tensor) and a.device.type != "meta":
            seen.setdefault(StorageWeakRef(a.untyped_storage()), []).append(i)
    for positions in seen.values():
        if len(positions) > 1 and any(p in mutated for p in positions):
            raise ExportError(
                "inputs that share memory (the same tensor twice, or views of one tensor) are "
                "passed and one is mutated in the forward: the program cannot know at run time "
                "whether its inputs alias; pass distinct tensors (e.g. x and x.clone())")


def functional_trace(mod: torch.nn.Module, args, kwargs, keep=frozenset):
    """(graph module, aot-style GraphSignature) of ``mod(*args, **kwargs)``.
    Dead code goes, except the nodes ``keep()`` names."""
    kwargs = kwargs or {}
    named_parameters = dict(mod.named_parameters(remove_duplicate=False))
    named_buffers = dict(mod.named_buffers(remove_duplicate=False))
    state_flat, state_spec = pytree.tree_flatten({**named_parameters, **named_buffers})
    call = _torch.create_functional_call(mod, state_spec, len(state_flat), store_orig_mod=True)
    flat_fn, out_spec = _torch.create_tree_flattened_fn(call, [*state_flat, *args], kwargs)
    flat_args, in_spec = pytree.tree_flatten(([*state_flat, *args], kwargs))
    n_state = len(state_flat)
    mutated: list[int] = []

    @functools.wraps(flat_fn)  # carries the module: make_fx records nn_module_stack and stack traces
    def functionalized(*flat):
        mode = _torch.functional_mode()
        wrapped = {}  # a tied parameter or buffer (one tensor, two names) is wrapped once

        def wrap(i, a):
            if i >= n_state:  # user inputs: the same tensor twice is refused below if mutated
                return _torch.to_functional(a)
            if id(a) not in wrapped:
                wrapped[id(a)] = _torch.to_functional(a)
            return wrapped[id(a)]

        with mode:
            inputs = [wrap(i, a) for i, a in enumerate(flat)]
            outputs = flat_fn(*inputs)
        new_values, done = [], set()
        for i, f in enumerate(inputs):
            if not isinstance(f, _torch.FunctionalTensor) or id(f) in done:
                continue  # a tied tensor's mutation is written back once, under its first name
            done.add(id(f))
            torch._sync(f)
            if _torch.has_metadata_mutation(f) or _torch.storage_changed(f):
                raise InputLayoutChanged(
                    "an input's shape, strides or storage is changed in place (e.g. x.t_(), "
                    "x.resize_(), x.set_()): cannot be exported soundly")
            if _torch.has_data_mutation(f):
                mutated.append(i)
                new_values.append(_torch.from_functional(f))
        return (*new_values, *[_torch.from_functional(o) for o in outputs])

    with _torch.enable_python_dispatcher():
        gm = _torch.make_fx(functionalized, record_module_stack=True, pre_dispatch=True)(*flat_args)
    _refuse_aliased_mutated_inputs(flat_args[n_state:], [i - n_state for i in mutated])
    kept = keep()
    gm.graph.eliminate_dead_code(is_impure_node=lambda n: n in kept or n.is_impure())
    gm.recompile()
    return gm, _signature(gm, named_parameters, named_buffers, mutated, in_spec, out_spec.spec)


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
