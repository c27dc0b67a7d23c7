"""Regenerate (or check) the example graphs in design/*.md from real exports.

A page marks an example like this:

    <!-- example: seed -->
    ```python
    class Seed(torch.nn.Module): ...
    module, args = Seed(), (torch.ones(2),)     # optional: kwargs, export_kwargs
    ```
    <!-- graph: seed -->
    ```
    (written by this tool: the program as predispatch.format_program prints it)
    ```
    <!-- end graph -->

The python block runs with ``torch`` and ``predispatch`` imported and must
define ``module`` and ``args`` (and may define ``kwargs``, ``export_kwargs``, and
``after_export``, called once the example is exported: e.g. to destroy the
process group a sharded example initialised).

A page may also hold a block made from the code itself (:data:`GENERATED`):

    <!-- generated: stages -->
    (the pipeline's stages, from predispatch.pipeline.STAGES)
    <!-- end generated -->

``stages`` is the table of the pipeline's stages, ``tree`` the package's
folders and modules, each with the first line of its docstring.

    python tools/design_docs.py            # rewrite the graphs in place
    python tools/design_docs.py --check    # exit 1 if any page is stale
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

DESIGN = Path(__file__).resolve().parent.parent / "design"

EXAMPLE = re.compile(
    r"<!-- example: (?P<name>[\w-]+) -->\n```python\n(?P<code>.*?)```\n"
    r"(?:<!-- graph: (?P=name) -->\n```\n.*?```\n<!-- end graph -->\n)?",
    re.S)


def render_example(name: str, code: str) -> str:
    import torch

    import predispatch

    scope = {"torch": torch, "predispatch": predispatch, "__name__": f"design_{name}"}
    exec(compile(code, f"<design example {name}>", "exec"), scope)
    if "module" not in scope or "args" not in scope:
        raise ValueError(f"design example {name!r} must define `module` and `args`")
    torch.manual_seed(0)
    try:
        ep = predispatch.export_predispatch(scope["module"], scope["args"], scope.get("kwargs"),
                                            **scope.get("export_kwargs", {}))
        return predispatch.format_program(ep)
    finally:
        scope.get("after_export", lambda: None)()  # e.g. a process group the example set up


def render_stages() -> str:
    """The pipeline's stages as a table: name, the modules doing the work, what it does."""
    from predispatch.pipeline import STAGES

    rows = ["| stage | modules | what it does |", "|---|---|---|"]
    for stage in STAGES:
        modules = ", ".join(f"`{_path(m)}`" for m in stage.modules)
        rows.append(f"| {stage.name} | {modules} | {stage.does} |")
    return "\n".join(rows) + "\n"


def _path(module) -> str:
    path = Path(module.__file__).resolve().relative_to(PACKAGE.parent)
    return f"{path.parent}/" if path.name == "__init__.py" else str(path)


# the package's layers, lowest first (tests/test_layout.py checks that imports point down them)
TREE_ORDER = ("__init__.py", "_torch", "errors.py", "ir", "policies", "trace", "passes", "program", "distributed",
              "pipeline.py", "api.py", "downstream", "testing", "cli.py", "__main__.py")


def render_tree() -> str:
    """The package's folders and modules, in layer order, each with the first line of its docstring."""
    import ast

    def key(path: Path):
        top = path.relative_to(PACKAGE).parts[0]
        return (TREE_ORDER.index(top), str(path.parent), path.name != "__init__.py", path.name)

    rows = []
    for path in sorted(PACKAGE.rglob("*.py"), key=key):
        rel = path.relative_to(PACKAGE.parent)
        doc = (ast.get_docstring(ast.parse(path.read_text())) or "").strip().splitlines()
        rows.append((f"{rel.parent}/" if path.name == "__init__.py" else str(rel), doc[0] if doc else ""))
    width = max(len(shown) for shown, _ in rows) + 3  # the longest path, then three spaces
    lines = ["```", *(f"{shown:<{width}}{first}".rstrip() for shown, first in rows)]
    return "\n".join(lines + ["```"]) + "\n"


def render_history_steps() -> str:
    """The history stage's steps, in order."""
    from predispatch.passes.history import STEPS

    return "".join(f"{i}. {step.name} (`{step.run.__module__.rsplit('.', 1)[-1]}.{step.run.__name__}`)\n"
                   for i, step in enumerate(STEPS, 1))


def render_history_kinds() -> str:
    """The recorder's event kinds, with how the history stage keeps and refuses each."""
    from predispatch.ir.records import Kind
    from predispatch.passes.history.keep import KEEPERS
    from predispatch.passes.history.refusals import REFUSALS

    rows = ["| kind | kept by | refused by |", "|---|---|---|"]
    for kind in Kind:
        keeper = f"`{KEEPERS[kind].__name__}`" if kind in KEEPERS else ""
        refused = ", ".join(r.name for r in REFUSALS if kind in r.kinds)
        rows.append(f"| {kind.value} | {keeper} | {refused} |")
    return "\n".join(rows) + "\n"


def render_history_refusals() -> str:
    """The history stage's refusal table: name, kinds, when checked."""
    from predispatch.passes.history.refusals import REFUSALS

    rows = ["| refusal | kinds | checked |", "|---|---|---|"]
    for r in REFUSALS:
        kinds = ", ".join(sorted(k.value for k in r.kinds))
        rows.append(f"| {r.name} (`{r.applies.__name__}`) | {kinds} | {r.when} |")
    return "\n".join(rows) + "\n"


PACKAGE = Path(__file__).resolve().parent.parent / "predispatch"
GENERATED = {"stages": render_stages, "tree": render_tree, "history-steps": render_history_steps,
             "history-kinds": render_history_kinds, "history-refusals": render_history_refusals}
BLOCK = re.compile(r"<!-- generated: (?P<name>[\w-]+) -->\n.*?<!-- end generated -->\n", re.S)


def render_page(text: str) -> str:
    def replace(match: re.Match) -> str:
        name, code = match["name"], match["code"]
        graph = render_example(name, code)
        return (f"<!-- example: {name} -->\n```python\n{code}```\n"
                f"<!-- graph: {name} -->\n```\n{graph}```\n<!-- end graph -->\n")

    def generate(match: re.Match) -> str:
        name = match["name"]
        return f"<!-- generated: {name} -->\n{GENERATED[name]()}<!-- end generated -->\n"

    return BLOCK.sub(generate, EXAMPLE.sub(replace, text))


def stale_pages(pages) -> list[Path]:
    return [p for p in pages if render_page(p.read_text()) != p.read_text()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if a page is stale; write nothing")
    parser.add_argument("pages", nargs="*", type=Path, help="pages (default: design/*.md)")
    opts = parser.parse_args(argv)
    pages = opts.pages or sorted(DESIGN.glob("*.md"))
    if opts.check:
        stale = stale_pages(pages)
        for page in stale:
            print(f"stale: {page} (run python tools/design_docs.py)")
        return 1 if stale else 0
    for page in pages:
        text = page.read_text()
        new = render_page(text)
        if new != text:
            page.write_text(new)
            print(f"updated {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
