"""§5: predispatch export FILE.py:FUNC."""
import subprocess
import sys
import textwrap

import pytest
import torch

import predispatch
from predispatch.cli import main

MODEL = textwrap.dedent("""
    import torch

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)
            self.register_buffer("calls", torch.zeros(()))

        def forward(self, x, scale=1.0):
            with torch.no_grad():
                self.calls.add_(1)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y = self.lin(x)
            return y.float() * scale

    def make():
        return M(), (torch.randn(4, 3),)

    def make_with_kwargs():
        return M(), (torch.randn(4, 3),), {"scale": 2.0}

    def wrong():
        return torch.nn.Linear(2, 2)

    def not_a_module():
        return "model", (torch.randn(2),)

    def data_dependent():
        class D(torch.nn.Module):
            def forward(self, x):
                return x if x.sum() > 0 else -x
        return D(), (torch.randn(2),)

    def fails():
        raise RuntimeError("boom\\nsecond line")

    def exits():
        raise SystemExit(3)

    class Abort(BaseException):
        pass

    def aborts():
        raise Abort("config missing")

    def aborts_in_forward():
        class A(torch.nn.Module):
            def forward(self, x):
                raise Abort("no config")
        return A(), (torch.randn(2),)

    def bad_shape():
        return M(), (torch.randn(4, 5),)
""")


@pytest.fixture
def model_file(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(MODEL)
    return path


def test_prints_program_summary_and_policy(model_file, capsys):
    assert main(["export", f"{model_file}:make", "--on-backward-autocast-mismatch", "warn"]) == 0
    out = capsys.readouterr().out
    assert "wrap_with_set_grad_enabled(False, self.no_grad_0" in out
    assert "wrap_with_autocast('cpu', torch.bfloat16, True" in out
    assert "BUFFER_MUTATION -> calls" in out
    assert "kept composites: aten.linear.default" in out
    assert "on_backward_autocast_mismatch='warn'" in out


def test_kwargs_save_and_dynamic_batch(model_file, tmp_path, capsys):
    saved = tmp_path / "m.pt2"
    assert main(["export", f"{model_file}:make_with_kwargs", "--save", str(saved)]) == 0
    ep = predispatch.load(saved)
    assert ep.module()(torch.randn(4, 3), scale=2.0).shape == (4, 3)
    assert main(["export", f"{model_file}:make", "--dynamic-batch"]) == 0
    assert "saved to" in capsys.readouterr().out


@pytest.mark.parametrize("target, message", [
    ("missing.py:make", "no such file"),
    ("{model}:nothing", "has no function 'nothing'"),
    ("{model}:wrong", "must return (module, args)"),
    ("{model}:not_a_module", "where a torch.nn.Module belongs"),
    ("{model}:data_dependent", "cannot export: data-dependent Python control flow"),
    ("{model}", "expected FILE.py:FUNC"),
    ("{model}:fails", "model.py:fails() failed: RuntimeError: boom"),
    ("{model}:exits", "model.py:exits() called sys.exit(3)"),
    ("{model}:aborts", "model.py:aborts() failed: Abort: config missing"),
    ("{model}:aborts_in_forward", "export failed: Abort: no config"),
    ("{exits_on_import}:make", "importing {exits_on_import} called sys.exit(0)"),
])
def test_errors_are_one_line_with_exit_code_2(model_file, target, message, capsys):
    exits_on_import = model_file.with_name("exits_on_import.py")
    exits_on_import.write_text("raise SystemExit(0)\n")
    names = {"model": model_file, "exits_on_import": exits_on_import}
    assert main(["export", target.format(**names)]) == 2
    err = capsys.readouterr().err
    assert message.format(**names) in err and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("where", ["missing/m.pt2", "."])
def test_bad_save_path_is_one_line_with_exit_code_2(model_file, tmp_path, where, capsys):
    path = tmp_path / where
    assert main(["export", f"{model_file}:make", "--save", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"predispatch: error: --save {path}:") and err.count("\n") == 1


def test_failing_save_is_one_line_with_exit_code_2(model_file, tmp_path, monkeypatch, capsys):
    def refuse(ep, path):
        raise RuntimeError("open file failed with strerror: Permission denied\nmore")
    monkeypatch.setattr(torch.export, "save", refuse)
    assert main(["export", f"{model_file}:make", "--save", str(tmp_path / "m.pt2")]) == 2
    err = capsys.readouterr().err
    assert "cannot write: RuntimeError: open file failed" in err and err.count("\n") == 1


def test_python_dash_m(model_file):
    ok = subprocess.run([sys.executable, "-m", "predispatch", "export", f"{model_file}:make"],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0 and "autocast policy:" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "predispatch", "export", f"{model_file}:nothing"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.startswith("predispatch: error:") and "Traceback" not in bad.stderr


def test_shape_error_is_one_line_without_torch_log(model_file):
    # torch's fake tensor logger would print its own traceback on stderr.
    bad = subprocess.run([sys.executable, "-m", "predispatch", "export", f"{model_file}:bad_shape"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    # torch's error while tracing is an ExportError naming the call and the line, torch's text in it
    assert bad.stderr.startswith("predispatch: error: cannot export: ")
    assert "model.py" in bad.stderr and "(RuntimeError: " in bad.stderr


def test_a_script_without_the_py_suffix_is_loaded(model_file, capsys):
    script = model_file.with_name("model_script")
    script.write_text(model_file.read_text())
    assert main(["export", f"{script}:make"]) == 0
    assert "autocast policy" in capsys.readouterr().out.lower()
