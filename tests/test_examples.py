"""The README's Python examples and the public API's docstring examples run,
and print what they say they print, so they never drift from the code."""
import contextlib
import doctest
import io
import re
from pathlib import Path

import pytest
import torch

import predispatch
import predispatch.testing

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
# the public API: the package's names, and the expect-test kit of contract §4
PUBLIC = {**{name: getattr(predispatch, name) for name in predispatch.__all__},
          "testing.GraphTestCase": predispatch.testing.GraphTestCase,
          "testing.assert_matches_eager": predispatch.testing.assert_matches_eager}
NEEDS_TORCHAO = {"prepare_pt2e", "prepare_qat_pt2e", "convert_pt2e"}


def _docstring_tests(name, obj):
    """The doctests of a public object and of the methods its class defines."""
    finder = doctest.DocTestFinder(exclude_empty=True)
    return [t for t in finder.find(obj, f"predispatch.{name}", globs={"torch": torch, "predispatch": predispatch})
            if t.examples]


def _run(test) -> None:
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    runner.run(test, out=out.write)
    assert runner.failures == 0, out.getvalue()


@pytest.mark.parametrize("name", ["package", *PUBLIC])
def test_docstring_examples_run(name):
    if name in NEEDS_TORCHAO:
        pytest.importorskip("torchao")
    obj = predispatch if name == "package" else PUBLIC[name]
    tests = _docstring_tests(name, obj)
    assert tests, f"predispatch.{name} has no docstring example"
    for test in tests:
        _run(test)


@pytest.mark.parametrize("name", list(PUBLIC))
def test_docstrings_open_with_an_example(name):
    """The paragraph after the summary is an example (the fx style), so
    ``python -m pydoc predispatch`` shows how to call each name first."""
    paragraphs = [p for p in re.split(r"\n\s*\n", PUBLIC[name].__doc__ or "") if p.strip()]
    assert len(paragraphs) > 1 and paragraphs[1].lstrip().startswith(">>>"), \
        f"predispatch.{name}'s docstring does not open with an example"


def readme_examples(text: str):
    """(code, expected output or None) for each ```python block of the
    README; an untagged block right after it, with only "prints" between,
    is what it prints."""
    blocks = list(re.finditer(r"```(\w*)\n(.*?)```", text, re.S))
    for block, after in zip(blocks, [*blocks[1:], None]):
        if block[1] != "python":
            continue
        between = text[block.end():after.start()].strip() if after else None
        printed = after is not None and after[1] == "" and between == "prints"
        yield block[2], (after[2] if printed else None)


def test_readme_examples_run_and_print_what_it_shows(tmp_path, monkeypatch):
    examples = list(readme_examples(README.read_text()))
    assert examples and any(expected for _, expected in examples)
    monkeypatch.chdir(tmp_path)  # an example may save a file
    scope = {"__name__": "readme"}
    for code, expected in examples:  # one namespace: a later example continues an earlier one
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(code, str(README), "exec"), scope)
        if expected is not None:  # print() adds a newline to a text that ends in one
            assert out.getvalue().rstrip("\n") == expected.rstrip("\n")


def test_readme_keeps_the_set_up_and_run_commands():
    """.ci/run runs the README's test command verbatim; both commands start from a fresh venv."""
    commands = [line for line in README.read_text().splitlines() if line.startswith("python3 -m venv .venv && ")]
    assert len(commands) == 2 and commands[1].endswith("-m pytest -q -p no:cacheprovider")
    assert commands[1] in (ROOT / ".ci" / "run").read_text().splitlines()
    assert "bash tools/venv_for_torch.sh" in README.read_text()


def test_a_drifted_readme_example_is_caught():
    text = "```python\nprint(1 + 1)\n```\n\nprints\n\n```\n3\n```\n"
    [(code, expected)] = readme_examples(text)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    assert expected == "3\n" and out.getvalue().rstrip("\n") != expected.rstrip("\n")
