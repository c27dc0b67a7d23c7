"""Shared pytest configuration: the run says what it ran against; the garbage collector spares what collection made."""
import gc
from importlib import metadata


def _versions() -> str:
    def version(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"
    return "versions: " + ", ".join(
        f"{p} {version(p)}" for p in ("torch", "transformers", "torchao", "onnxruntime", "torchvision", "timm",
                                          "predispatch"))


def pytest_report_header(config):
    """The versions a failure depends on (constraints.txt pins them)."""
    return _versions()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Again at the end, where ``-q`` (which hides the header) shows failures."""
    if config.get_verbosity() < 0:
        terminalreporter.write_line(_versions())


def pytest_collection_finish(session):
    """What collection made (torch, transformers, every test module) lives to
    the end: moved out of the collector's sight, so the full collections a
    fake-tensor-heavy test triggers do not walk it each time (the suite ~12%
    faster)."""
    gc.freeze()
