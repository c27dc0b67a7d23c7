"""``predispatch export FILE.py:FUNC`` — export a module from the command line.

FUNC returns ``(module, args)`` or ``(module, args, kwargs)``. Prints the
program (graph, subgraphs, signature), the kept/decomposed op summary and the
autocast policy; ``--save PATH.pt2`` writes it with ``torch.export.save``.
Errors are one line on stderr with exit code 2, never a traceback.
"""
from __future__ import annotations

import argparse
import collections
import importlib.machinery
import importlib.util
import os
import sys
from pathlib import Path

from . import _torch

EXIT_USAGE = 2


class CliError(Exception):
    """A one-line error for the user."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="predispatch", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export FILE.py:FUNC and print the program")
    export.add_argument("target", help="FILE.py:FUNC; FUNC returns (module, args[, kwargs])")
    export.add_argument("--save", metavar="PATH.pt2", help="also write the program with torch.export.save")
    export.add_argument("--dynamic-batch", action="store_true",
                        help="make dimension 0 of every tensor input dynamic")
    export.add_argument("--eval", action="store_true", help="export the module in eval mode")
    export.add_argument("--backward-pass-autocast", default="same_as_forward",
                        choices=["same_as_forward", "off"])
    export.add_argument("--on-backward-autocast-mismatch", default="error",
                        choices=["error", "warn", "do_nothing"])
    return parser


def load_target(target: str):
    """Import FILE.py and call FUNC: (module, args, kwargs)."""
    path_text, sep, func_name = target.rpartition(":")
    if not sep or not path_text or not func_name:
        raise CliError(f"expected FILE.py:FUNC, got {target!r}")
    path = Path(path_text)
    if not path.is_file():
        raise CliError(f"no such file: {path}")
    # loaded as Python source whatever its suffix (spec_from_file_location knows only .py)
    loader = importlib.machinery.SourceFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_loader(path.stem, loader)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent.resolve()))
    try:
        _run_user_code(f"importing {path}", lambda: spec.loader.exec_module(module))
    finally:
        sys.path.pop(0)
    func = getattr(module, func_name, None)
    if not callable(func):
        raise CliError(f"{path} has no function {func_name!r}")
    result = _run_user_code(f"{path}:{func_name}()", func)
    return _unpack(result, func_name)


def _run_user_code(what: str, fn):
    """Call the user's code; any failure of it, sys.exit() included, is one line."""
    try:
        return fn()
    except SystemExit as e:  # would otherwise end the CLI silently with the user's code
        raise CliError(f"{what} called sys.exit({e.code!r})") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # not only Exception: user code may raise any BaseException
        raise CliError(f"{what} failed: {_one_line(e)}") from e


def _one_line(e: BaseException) -> str:
    """``Type: first line``: torch's messages can run to pages; the first line says what broke."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _check_save_path(path: str) -> None:
    """Refuse a bad --save path before exporting, not after the work is done."""
    if Path(path).is_dir():
        raise CliError(f"--save {path}: is a directory; give a file path such as model.pt2")
    if not Path(path).parent.is_dir():
        raise CliError(f"--save {path}: no such directory {Path(path).parent}")


def _unpack(result, func_name):
    import torch

    if not isinstance(result, tuple) or len(result) not in (2, 3):
        raise CliError(f"{func_name}() must return (module, args) or (module, args, kwargs), "
                       f"got {type(result).__name__}")
    module, args, kwargs = (*result, None) if len(result) == 2 else result
    if not isinstance(module, torch.nn.Module):
        raise CliError(f"{func_name}() returned {type(module).__name__} where a torch.nn.Module belongs")
    if not isinstance(args, tuple):
        raise CliError(f"{func_name}() returned args of type {type(args).__name__}; expected a tuple")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise CliError(f"{func_name}() returned kwargs of type {type(kwargs).__name__}; expected a dict")
    return module, args, kwargs


def op_summary(ep, policy) -> str:
    """Which composites the program keeps, and which ops it uses, by count."""
    import torch

    from .ir.regions import graph_modules

    counts = collections.Counter(
        node.target for gm in graph_modules(ep.graph_module) for node in gm.graph.nodes
        if node.op == "call_function" and isinstance(node.target, _torch.OpOverload))
    kept = sorted(str(op) for op in counts if policy.should_decompose(op) is False)
    lines = [f"ops: {sum(counts.values())} calls of {len(counts)} ops",
             f"kept composites: {', '.join(kept) if kept else 'none'}",
             "decomposed: every other composite (aliasing/mutating schema, tagged, audit liars, non-aten)"]
    return "\n".join(lines)


def export_command(opts) -> int:
    import torch

    import predispatch

    if opts.save:
        _check_save_path(opts.save)
    module, args, kwargs = load_target(opts.target)
    module.train(not opts.eval)
    dynamic_shapes = None
    if opts.dynamic_batch:
        pytree = _torch.pytree

        batch = torch.export.Dim("batch")
        to_spec = lambda x: {0: batch} if isinstance(x, torch.Tensor) and x.dim() > 0 else None  # noqa: E731
        dynamic_shapes = (*pytree.tree_map(to_spec, args),) if not kwargs else None
        if kwargs:
            raise CliError("--dynamic-batch supports positional inputs only")
    policy = predispatch.OpPolicy.default()
    try:
        with _torch.fake_tensor_log_quiet():
            ep = predispatch.export_predispatch(
                module, args, kwargs, dynamic_shapes=dynamic_shapes, op_policy=policy,
                backward_pass_autocast=opts.backward_pass_autocast,
                on_backward_autocast_mismatch=opts.on_backward_autocast_mismatch)
    except predispatch.ExportError as e:  # ours: every line names the construct, so keep all
        raise CliError(f"cannot export: {' '.join(str(e).split())}") from e
    except SystemExit as e:  # sys.exit() in the user's forward
        raise CliError(f"{opts.target}: the module's forward called sys.exit({e.code!r})") from None
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        raise CliError(f"export failed: {_one_line(e)}") from e
    print(predispatch.format_program(ep), end="")
    print(op_summary(ep, policy))
    if opts.save:
        try:
            torch.export.save(ep, opts.save)
        except (OSError, RuntimeError) as e:  # e.g. no permission; torch says "open file failed"
            raise CliError(f"--save {opts.save}: cannot write: {_one_line(e)}") from e
        print(f"saved to {opts.save}")
    return 0


def main(argv=None) -> int:
    opts = _parser().parse_args(argv)
    try:
        return export_command(opts)
    except CliError as e:
        print(f"predispatch: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("predispatch: interrupted", file=sys.stderr)
        return 128 + 2  # the shell's code for death by SIGINT
    except BrokenPipeError:  # `predispatch export ... | head`: the reader left
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
