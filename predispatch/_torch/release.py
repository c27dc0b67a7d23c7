"""Which torch release is installed, and whether predispatch supports it.

Behaviour that differs between releases is decided by feature detection in
the seam (what an object is, what a function accepts), never by comparing
versions; the release name serves twice only: to refuse an unsupported torch
at import (before any of its missing internals raises an AttributeError deep
inside a trace), and to pick the data generated per release (the composite
audit).
"""
from __future__ import annotations

import torch

SUPPORTED = ("2.13", "2.14", "2.15")  # as pyproject.toml declares: torch>=2.13,<2.16
RELEASE = ".".join(torch.__version__.split("+")[0].split(".")[:2])  # "2.15" of "2.15.0+cu132"


def check_supported() -> None:
    """ImportError naming the supported range and the installed version, on another release."""
    if RELEASE not in SUPPORTED:
        raise ImportError(
            f"predispatch supports torch {SUPPORTED[0]} to {SUPPORTED[-1]} (torch>=2.13,<2.16); "
            f"torch {torch.__version__} is installed: install a supported release, e.g. "
            f"pip install 'torch>=2.13,<2.16'")
