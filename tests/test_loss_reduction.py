"""A loss that sums over the samples is said at split time (loss_reduction.py): a pipeline
averages its M micro-batches' losses, which gives a summed loss divided by M."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxpipe.frontend import load_model_file, trace_source
from fxpipe.loss_reduction import summed_loss_note
from tests._cli import fxpipe

MODEL = '''
import torch
from torch import nn
import torch.nn.functional as F


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def example_inputs():
    return (torch.randn({rows}, 8, generator=torch.Generator().manual_seed(1)),)


def example_target():
    return torch.randn({rows}, 4, generator=torch.Generator().manual_seed(2))


def loss_fn(output, target):
    return F.mse_loss(output, target, reduction="{reduction}")
'''


def _note(tmp_path: Path, reduction: str, rows: int = 4) -> str | None:
    path = tmp_path / f"{reduction}_{rows}.py"
    path.write_text(MODEL.format(reduction=reduction, rows=rows))
    source = load_model_file(str(path))
    return summed_loss_note(source, trace_source(source))


@pytest.mark.parametrize("rows", [4, 5])
def test_a_summed_loss_is_told_from_a_mean(tmp_path: Path, rows: int) -> None:
    assert _note(tmp_path, "mean", rows) is None
    note = _note(tmp_path, "sum", rows)
    assert note is not None and note.startswith("loss_fn sums over the samples: on the "
                                                "example micro-batch it gives ")
    assert "divided by M" in note and "\n" not in note


def test_nothing_to_tell_from_one_row(tmp_path: Path) -> None:
    assert _note(tmp_path, "sum", rows=1) is None


def test_split_says_so_in_its_output_and_the_report(tmp_path: Path) -> None:
    (tmp_path / "model.py").write_text(MODEL.format(reduction="sum", rows=4))
    ran = fxpipe("split", "model.py", "--gpus", "2", "--out", "out", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    said = [line.strip() for line in ran.stdout.splitlines() if "loss_fn sums" in line]
    assert len(said) == 1 and said[0].startswith("note: loss_fn sums over the samples"), said
    assert f"- {said[0].removeprefix('note: ')}" in (tmp_path / "out" / "report.md").read_text()
