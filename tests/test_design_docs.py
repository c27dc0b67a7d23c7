"""design/ pages show real exports: the tool regenerates them, CI checks them."""
import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("design_docs", ROOT / "tools" / "design_docs.py")
design_docs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(design_docs)


def test_design_pages_are_up_to_date():
    pages = sorted((ROOT / "design").glob("*.md"))
    assert any(design_docs.EXAMPLE.search(p.read_text()) for p in pages)
    stale = design_docs.stale_pages(pages)
    assert not stale, f"run python tools/design_docs.py: stale {stale}"


def test_a_stale_page_is_caught(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "<!-- example: tiny -->\n```python\n"
        "module, args = torch.nn.Linear(2, 2), (torch.randn(1, 2),)\n```\n"
        "<!-- graph: tiny -->\n```\nold graph\n```\n<!-- end graph -->\n")
    assert design_docs.stale_pages([page]) == [page]
    assert design_docs.main([str(page)]) == 0
    assert "aten.linear.default" in page.read_text() and design_docs.stale_pages([page]) == []
    assert design_docs.main(["--check", str(page)]) == 0


def test_code_the_pages_name_exists():
    """Paths (``predispatch/.../x.py``, ``tools/x.py``, ``tests/x.py``), module file
    names (``x.py``) and seam names (``_torch.x``) the pages and the README cite
    in backquotes exist: a moved or renamed module cannot leave a page behind."""
    import re

    from predispatch import _torch

    files = {p.name for p in (ROOT / "predispatch").rglob("*.py")} | {p.name for p in (ROOT / "tools").rglob("*.py")} \
        | {p.name for p in (ROOT / "tests").glob("*.py")}
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "design").glob("*.md"))]:
        text = page.read_text()
        for path in re.findall(r"`((?:predispatch|tools|tests)/[\w/]+(?:\.py)?)`", text):
            if not (ROOT / path).exists() and not (ROOT / path.rstrip("/")).exists():
                missing.append(f"{page.name}: {path}")
        for name in re.findall(r"`((?:\w+/)*\w+\.py)`", text):
            if name.split("/")[-1] not in files or ("/" in name and not any(
                    (ROOT / top / name).exists() for top in ("", "predispatch"))):
                missing.append(f"{page.name}: {name}")
        for name in re.findall(r"`_torch\.(\w+)", text):
            if not hasattr(_torch, name):
                missing.append(f"{page.name}: _torch.{name}")
    assert not missing, "pages cite code that does not exist:\n" + "\n".join(missing)
