"""When no split fits, the one-line answer says what would, and every fix it names is
true: the command run again with that fix (its flags replacing the same ones) plans.
What it says cannot fit does not: more GPUs, when an op alone is too big for one."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from fxpipe.cli import main
from tests.test_error_table import DEEP

# eight 256-wide layers and a 256 -> 4096 head whose parameters and state alone (16 MiB
# in float32 with Adam) exceed the limits below: no number of GPUs holds it
HEADED = """
import torch


def build_model():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 256) for _ in range(8)]
    return torch.nn.Sequential(*layers, torch.nn.Linear(256, 4096))


def example_inputs():
    return (torch.ones(4, 256),)
"""


def _split(tmp_path: Path, model: Path, flags: list[str],
           capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = main(["split", str(model), "--device", "h100", "--microbatches", "8",
                 "--out", str(tmp_path / "out"), "--force", *flags])
    return code, capsys.readouterr().err


def _fixes(message: str) -> list[list[str]]:
    """The flags of each fix the message names after "Use", e.g. --precision bf16-true
    --gpus 4 as one fix."""
    tail = message.split(". Use ", 1)[1].rstrip().rstrip(".")
    return [re.findall(r"--[a-z-]+|\S+", fix) for fix in re.split(r", | or ", tail)]


def _with(flags: list[str], fix: list[str]) -> list[str]:
    """``flags`` with each flag of ``fix`` set to its value there."""
    given = dict(zip(flags[::2], flags[1::2], strict=True))
    given.update(zip(fix[::2], fix[1::2], strict=True))
    return [part for pair in given.items() for part in pair]


def _model(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(text))
    return path


@pytest.mark.parametrize(("text", "flags", "named"), [
    # 2 GPUs: 4 hold the layers, bf16-true halves their state
    (DEEP, ["--gpus", "2", "--memory", "3MiB"], ["--gpus 4", "--precision bf16-true"]),
    # one layer per GPU in float32; in bfloat16 two, but not on 2 GPUs
    (DEEP, ["--gpus", "2", "--memory", "1.5MiB"], ["--gpus 8", "--precision bf16-true --gpus 4"]),
])
def test_every_fix_named_fits(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                              text: str, flags: list[str], named: list[str]) -> None:
    model = _model(tmp_path, text)
    code, err = _split(tmp_path, model, flags, capsys)
    assert code == 2, err
    message = err.strip()
    assert message.count("\n") == 0 and message.startswith("fxpipe: error: No split")
    fixes = _fixes(message)
    assert fixes[0][0] == "--memory"
    for fix in named:
        assert fix.split() in fixes, message
    for fix in fixes:
        code, again = _split(tmp_path, model, _with(flags, fix), capsys)
        assert code == 0, (fix, again)


def test_an_op_too_big_for_one_gpu_rules_out_every_gpu_count(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = _model(tmp_path, HEADED)
    flags = ["--gpus", "2", "--memory", "12MiB"]
    code, err = _split(tmp_path, model, flags, capsys)
    assert code == 2, err
    assert "and op _8 of 8 alone needs" in err  # the head, the Sequential's ninth module
    assert "so no number of GPUs fits" in err
    assert "--gpus" not in err.split(". Use ")[1].split("--precision")[0]  # no count named
    for gpus in ("4", "9"):  # proved, not searched: nor does any other count
        code, again = _split(tmp_path, model, _with(flags, ["--gpus", gpus]), capsys)
        assert code == 2 and "No split" in again, again
    for fix in _fixes(err.strip()):
        code, again = _split(tmp_path, model, _with(flags, fix), capsys)
        assert code == 0, (fix, again)
