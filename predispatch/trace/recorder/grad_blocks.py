"""Grad-mode blocks: which ``_set_grad_enabled`` node enters and which exits a block.

Grad-mode blocks. The flat graph shows only the values ``_set_grad_enabled``
sets, so nesting would be lost: the recorder marks each marker node with
which block it enters or exits (``meta_keys.GRAD_BLOCK``: phase, block id,
what the mode passed is), as the regions pass reads it. A change of mode no
torch-function mode saw (a library function reached through
``handle_torch_function`` runs its body with every mode off) is marked
before the next op, as a block of its own (:func:`sync_grad_mode`)."""
from __future__ import annotations

import sys

import torch
import torch.fx

from ... import _torch
from ...errors import PACKAGE_DIR, ExportError, frame_location, is_library_file, user_location
from ...ir import meta_keys
from ...ir.records import Kind, write
from ..grad_mode_reads import passed_mode
from ..translations import inside_inference_mode
from . import spans
from .state import HiddenBlock, TorchCall, TraceState


def is_marker(state: TraceState, call: TorchCall) -> bool:
    return call.func is _torch.SET_GRAD_ENABLED


def is_not_a_marker(state: TraceState, call: TorchCall) -> bool:
    return call.func is not _torch.SET_GRAD_ENABLED


def sync_before_call(state: TraceState, call: TorchCall) -> None:
    sync_grad_mode(state)  # a hidden block ended: the bookkeeping after it is the mode's


def on_marker(state: TraceState, call: TorchCall):
    """The module's code sets the grad mode (a block's enter or exit, found on
    the Python stack, or a bare switch); torch setting the mode it has is no
    block."""
    _refuse_grad_on_inside_inference_mode(call.args)
    sync_grad_mode(state)  # a hidden block may have ended with no op after it
    caller = _torch.grad_mode_caller()
    if caller is None and bool(call.args[0]) == torch.is_grad_enabled() and _called_from_torch():
        with _torch.torch_function_off():  # torch setting the mode it has: no block
            return call.func(*call.args, **call.kwargs)
    return _mark(state, call.func, call.args, call.kwargs, caller)


def sync_grad_mode(state: TraceState) -> None:
    """A grad-mode change no torch-function mode saw: a library function
    reached through ``handle_torch_function`` (``nn.init.constant_``) runs
    its body, and the no_grad block in it, with every torch-function mode
    off. Marked before the next op, as a block whose exit restores the
    mode its entry found."""
    actual = torch.is_grad_enabled()
    if actual == state.grad_mode:
        return
    if state.hidden_blocks and state.hidden_blocks[-1].mode_before == actual:
        owner, phase = state.hidden_blocks.pop().owner, "exit"
    else:
        _refuse_a_function_applied_unseen()
        owner, phase = object(), "enter"
        state.hidden_blocks.append(HiddenBlock(owner, state.grad_mode, user_location()))
    with _torch.torch_function_off():  # the marker's bookkeeping runs in the mode before it
        _torch.SET_GRAD_ENABLED(state.grad_mode)
    _refuse_grad_on_inside_inference_mode((actual,))
    _mark(state, _torch.grad_mode_marker, (actual,), {}, caller=(phase, owner))


def _refuse_a_function_applied_unseen() -> None:
    """A grad-mode change inside an autograd.Function's forward that torch's
    own apply runs: an ``apply`` taken before the export (``fn =
    MyFunction.apply`` in ``__init__``), which the capture, wrapping
    ``Function.apply`` while it traces, does not see; torch runs the forward
    under no_grad, and the program would hold its result without the
    Function's history."""
    frame = sys._getframe(2)
    while frame is not None:
        function = _torch.function_running_in(frame)
        if function is not None and not function.__module__.startswith("torch."):
            raise ExportError(
                f"an autograd.Function applied at {frame_location(frame.f_back)} through an apply taken before the "
                "export (fn = MyFunction.apply, kept from before): the capture sees Function.apply as called "
                "while it traces; call MyFunction.apply(...) in the forward")
        frame = frame.f_back


def refuse_unrestored_hidden_blocks(state: TraceState) -> None:
    sync_grad_mode(state)
    if state.hidden_blocks:
        raise ExportError(
            f"grad mode changed inside the library call at {state.hidden_blocks[-1].where} and "
            "not restored by the end of the forward: the program cannot know what mode its "
            "caller is left in; restore it before returning")


def _mark(state: TraceState, func, args, kwargs, caller) -> None:
    """Call the marker ``func`` (``caller``: the block's (phase, owner), None
    for a bare switch) with the spans it ends and starts noted around it."""
    state.after_a_grad_marker = True
    was_enabled, enabling = torch.is_grad_enabled(), bool(args[0])
    replaced = spans.before_marker(state, was_enabled, enabling)
    node = func(*args, **kwargs)
    if isinstance(node, torch.fx.Node):
        node.meta[meta_keys.GRAD_BLOCK] = _block_mark(state, caller)
        for old, new, view, swapped, where in replaced:
            state.record.note(write(Kind.NO_GRAD_WRITE, old, new, node, eager_view=view, swapped=swapped,
                                    where=where))
    spans.after_marker(state, was_enabled, enabling)
    state.grad_mode = torch.is_grad_enabled()
    return None  # what eager's call returns (make_fx hands back its node)


def _block_mark(state: TraceState, caller):
    """(phase, block id, what the mode passed is: see :func:`passed_mode`)."""
    if caller is None:  # a bare switch to prev: what it passes is read as for a toggle
        state.bare_switches += 1
        frame = _caller_frame()
        user = frame is not None and not is_library_file(frame.f_code.co_filename)
        return ("bare", None, passed_mode(frame) if user else None)
    phase, owner = caller
    if id(owner) not in state.block_ids:
        state.block_ids[id(owner)] = len(state.block_ids)
        state.owners.append(owner)
    passed = (passed_mode(_torch.grad_mode_call_frame())
              if isinstance(owner, torch.set_grad_enabled) and phase == "enter" and not _entered_by_decorator()
              else None)
    return (phase, state.block_ids[id(owner)], passed)


_GRAD_MODE = torch.autograd.grad_mode.__file__


def _entered_by_decorator() -> bool:
    """Is the ``set_grad_enabled`` being entered the copy torch's decorator
    makes of the decorating object for one call of the function it decorates
    (``clone()``, called by torch)? Its mode is that object's, fixed where
    the function was decorated: before the forward (a constant of the
    program), or in it, where the block the decorating opened and closed
    read it. Nothing the code at the call passes: not a user's switch."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename != _GRAD_MODE:
        frame = frame.f_back
    while frame is not None and frame.f_code.co_filename == _GRAD_MODE and frame.f_code.co_name != "clone":
        frame = frame.f_back
    return (frame is not None and frame.f_code.co_filename == _GRAD_MODE
            and frame.f_back is not None and is_library_file(frame.f_back.f_code.co_filename))


def _refuse_grad_on_inside_inference_mode(args) -> None:
    if bool(args[0]) and inside_inference_mode():
        raise ExportError(
            f"grad mode switched on inside a torch.inference_mode() block at {user_location()} "
            "cannot be exported soundly: in eager autograd still records nothing there, which "
            "a grad-mode region cannot express; use torch.inference_mode(False) to record, "
            "or leave grad mode off")


_OVERRIDES = torch.overrides.__file__


def _caller_frame():
    """The frame making the torch call being handled (past this package's
    frames and the torch-function dispatch), or None."""
    frame = sys._getframe(1)
    while frame is not None and (frame.f_code.co_filename == _OVERRIDES
                                 or frame.f_code.co_filename.startswith(PACKAGE_DIR)):
        frame = frame.f_back
    return frame


def _called_from_torch() -> bool:
    """Is the torch call being handled made by torch's own code?"""
    frame = _caller_frame()
    return frame is not None and is_library_file(frame.f_code.co_filename)
