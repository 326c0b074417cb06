"""A model file's way out that is no Exception (``class Stop(BaseException)``, sys.exit,
GeneratorExit), raised while fxpipe loads, traces or runs it: one line naming the file's
line and the fix, exit status 2, where it was a traceback with status 1 (or, sys.exit in
forward, no word at all and the model's status). Ctrl-C keeps its meaning."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fxpipe import cli
from tests._cli import fxpipe

ERRORS = (Path(__file__).resolve().parents[1] / "docs" / "errors.md").read_text()

MODEL = """
import torch


class Stop(BaseException):
    pass


class Net(torch.nn.Sequential):
    def forward(self, x):
        FORWARD
        return super().forward(x)


def build_model():
    BUILD
    return Net(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def example_inputs():
    INPUTS
    return (torch.ones(4, 8),)
"""


def model(tmp_path: Path, *, top: str = "", forward: str = "pass", build: str = "pass",
          inputs: str = "pass") -> None:
    text = textwrap.dedent(MODEL).replace("FORWARD", forward).replace("BUILD", build)
    (tmp_path / "model.py").write_text(text.replace("INPUTS", inputs) + top)


# (situation in docs/errors.md's table, what the file does, the line printed)
CASES = {
    "factory raises a BaseException of its own": (
        {"build": "raise Stop('enough')"},
        "model.py:16: build_model() raised Stop: enough; fix build_model() and run again"),
    "importing the file raises a BaseException of its own": (
        {"top": "\nraise Stop('at import')\n"},
        "model.py:24: importing the file raised Stop: at import; fix the file and run again"),
    "example_inputs raises GeneratorExit": (
        {"inputs": "raise GeneratorExit()"},
        "model.py:21: example_inputs() raised GeneratorExit; fix example_inputs() and run "
        "again"),
    "forward raises a BaseException of its own": (
        {"forward": "raise Stop('in forward')"},
        "model.py:11: the model raised Stop: in forward while fxpipe ran it; fix the model "
        "and run again"),
    "forward calls sys.exit": (
        {"forward": "import sys; sys.exit(3)"},
        "model.py:11: sys.exit(3) was called while fxpipe ran the model; return or raise an "
        "exception instead"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_model_s_own_base_exception_is_one_line_naming_its_line(case: str,
                                                                   tmp_path: Path) -> None:
    does, line = CASES[case]
    model(tmp_path, **does)
    done = fxpipe("split", "model.py", "--gpus", "2", "--out", "out", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"fxpipe: error: {line}"]
    assert not (tmp_path / "out").exists()
    assert f"| {case} | `{line}` |" in ERRORS, f"docs/errors.md lacks the row for {case}"


def test_ctrl_c_in_build_model_still_interrupts(tmp_path: Path) -> None:
    model(tmp_path, build="raise KeyboardInterrupt")
    done = fxpipe("split", "model.py", "--gpus", "2", "--out", "out", cwd=tmp_path)
    assert done.returncode == 130
    assert done.stderr.strip().splitlines() == [
        "fxpipe: interrupted by SIGINT; nothing was written, a previous --out is as it was"]


def test_fxpipe_s_own_exits_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    """--help ends argparse's way, by SystemExit(0) from the standard library: that is no
    model's exit and stays what it was."""
    with pytest.raises(SystemExit) as ended:
        cli.main(["split", "--help"])
    assert ended.value.code == 0
    assert "--recompute" in capsys.readouterr().out
