"""Shared pytest configuration: the run says what it ran against."""
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
