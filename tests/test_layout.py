"""The package's shape (issue 27): folders that are layers, imports that point down.

Measured on the source, as ../shared/tools/layout_check.py measures it, with
the layers declared here: a module imports (at module level or deferred)
only from its own layer or the layers below, the seam imports nothing of the
package, no import cycle, every private PyTorch API reached through the seam,
no function over 60 lines, no class over 300, every module saying what it
owns. Each check prints what breaks it.
"""
import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "predispatch"
# lowest first; a module may import from its own layer and those below
LAYERS = (
    ("_torch",),  # the seam: every private torch API, nothing of the package
    ("errors",),
    ("ir",),  # records, node-meta keys, our ops, regions in a graph
    ("policies",),  # what a user decides
    ("trace",),  # the capture stage
    ("passes",),  # history, dead code, writes, regions, functional check, signature
    ("program",),  # the ExportedProgram, its write-backs and run-time calls
    ("distributed",),  # sharded modules, lowered around the pipeline
    ("pipeline",),  # the stages, defined once
    ("api", "downstream"),  # export_predispatch; training, quantization, inlining
    ("testing", "cli", "__main__", "__init__"),
)
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}
PRIVATE = re.compile(r"\btorch(\.(?!ops\b)[A-Za-z]\w*)*\._[A-Za-z]")  # torch._C, torch.utils._pytree (op names aside)
# private attributes of torch's objects (nn.Module's tables and hooks, an op's names, FSDP2's and
# DTensor's records, a program's internals): reached through the seam's adapters too
PRIVATE_ATTRIBUTE = re.compile(r"\.(_parameters|_buffers|_modules|_non_persistent_buffers_set|_forward_hooks|"
                               r"_forward_pre_hooks|_backward_hooks|_backward_pre_hooks|_opname|_overloadname|"
                               r"_update|_boxed_call|_local_tensor|_spec|_op|_fsdp_param_groups|"
                               r"_get_fsdp_state|_export_root)\b")
MAX_FUNCTION, MAX_CLASS = 60, 300


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        yield (parts[:-1] if parts[-1] == "__init__" else parts) or ("__init__",), path


def _imported(parts: tuple, is_package: bool, node: ast.ImportFrom) -> list[tuple]:
    """The package modules an import names (relative or absolute), as part tuples."""
    if node.level == 0:
        if not (node.module or "").startswith("predispatch"):
            return []
        base = tuple(node.module.split(".")[1:])
    else:
        here = parts if is_package else parts[:-1]
        base = here[: len(here) - (node.level - 1)] + (tuple(node.module.split(".")) if node.module else ())
    return [base + (a.name,) for a in node.names] + [base]


def _layer(parts: tuple) -> int:
    return LAYER[parts[0] if parts else "__init__"]


def _graph():
    modules = dict(_modules())
    known = set(modules)
    edges = {}
    for parts, path in modules.items():
        tree = ast.parse(path.read_text())
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                targets |= {t for t in _imported(parts, path.name == "__init__.py", node) if t in known}
        edges[parts] = targets - {parts}
    return modules, edges


def test_imports_point_down():
    _, edges = _graph()
    upward = [f"{'.'.join(a)} -> {'.'.join(b)}" for a, targets in edges.items() for b in targets
              if _layer(b) > _layer(a) and a != ("__init__",)]
    assert not upward, "imports pointing up a layer:\n" + "\n".join(sorted(upward))


def test_the_seam_imports_nothing_of_the_package():
    _, edges = _graph()
    out = [f"{'.'.join(a)} -> {'.'.join(b)}" for a, targets in edges.items() if a[0] == "_torch"
           for b in targets if b[0] != "_torch"]
    assert not out, "\n".join(out)


def test_no_import_cycle():
    _, edges = _graph()
    edges = {a: {b for b in t if b != ("__init__",) and not (a == ("__init__",))} for a, t in edges.items()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(".".join(w))
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in list(edges):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_private_torch_apis_only_through_the_seam():
    found = []
    for parts, path in _modules():
        if parts[0] == "_torch":
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0]
            if (PRIVATE.search(code) and not re.search(r"""["'][^"']*torch\.[\w.]*_""", code)  # prose in a message
                    or PRIVATE_ATTRIBUTE.search(code)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert not found, "private torch APIs outside predispatch/_torch:\n" + "\n".join(found)


def test_short_functions_and_classes():
    long = []
    for _, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and size > MAX_FUNCTION:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({size} lines)")
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} class {node.name} ({size} lines)")
    assert not long, "\n".join(long)


def test_every_module_says_what_it_owns():
    missing = [str(path.relative_to(PACKAGE.parent)) for parts, path in _modules()
               if parts != ("__main__",) and not ast.get_docstring(ast.parse(path.read_text()))]
    assert not missing, f"modules without a docstring: {missing}"
