"""The torch releases predispatch supports, and the refusal of any other at import."""
import ast
import re
from pathlib import Path

import pytest
import torch

from predispatch._torch import release

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_release_is_supported_and_declared():
    assert release.RELEASE in release.SUPPORTED
    declared = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    low, high = declared.groups()
    assert release.SUPPORTED[0] == low
    assert tuple(map(int, release.SUPPORTED[-1].split("."))) < tuple(map(int, high.split(".")))


def test_another_release_is_refused_naming_the_range_and_the_installed_version(monkeypatch):
    monkeypatch.setattr(release, "RELEASE", "2.11")
    with pytest.raises(ImportError, match=rf"supports torch 2\.13 to 2\.15.*torch {re.escape(torch.__version__)}"):
        release.check_supported()


def test_the_seam_checks_the_release_before_importing_anything_else_of_torch():
    """An unsupported torch lacks internals the seam imports: the check comes
    first, so the error is this ImportError, not an AttributeError."""
    body = ast.parse((ROOT / "predispatch" / "_torch" / "__init__.py").read_text()).body
    statements = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    first, second = statements[:2]
    assert isinstance(first, ast.ImportFrom) and first.module == "release"
    assert ast.unparse(second) == "check_supported()"
