"""``32-true`` and ``64-true`` train the model as it is (the runtime casts nothing), so a
plan at either is made at the model's own dtype: a float64 model planned at 32-true was
costed at float32, half the parameter bytes its run holds, without a word; now it is
planned at 64-true, 8 bytes a parameter, with a note saying so and how to train
float32. A precision the user casts the model to (bf16-true) is planned as asked."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxpipe.compiler import SplitOptions, analyze_file, plan_split
from fxpipe.cost_models import get_device
from fxpipe.precision import Precision

MODEL_FILE = '''
import torch
from torch import nn

DTYPE = torch.DTYPE_NAME


def build_model():
    return nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32)).to(DTYPE)


def example_inputs():
    return (torch.randn(4, 32, dtype=DTYPE),)
'''

PARAMETERS = 2 * (32 * 32 + 32)


@pytest.mark.parametrize(("model_dtype", "asked", "planned", "size"), [
    ("float64", Precision.TRUE_32, Precision.TRUE_64, 8),
    ("float32", Precision.TRUE_64, Precision.TRUE_32, 4),
    ("float64", Precision.TRUE_64, Precision.TRUE_64, 8),
    ("float64", Precision.BF16_TRUE, Precision.BF16_TRUE, 2),
])
def test_a_plan_costs_the_dtype_the_run_trains_in(tmp_path: Path, model_dtype: str,
                                                  asked: Precision, planned: Precision,
                                                  size: int) -> None:
    path = tmp_path / "model.py"
    path.write_text(MODEL_FILE.replace("DTYPE_NAME", model_dtype), encoding="utf-8")
    device = get_device("h100")
    said: list[str] = []
    source, traced = analyze_file(str(path), device=device, precision=asked,
                                  notify=said.append)
    options = SplitOptions(gpus=2, device=device, memory_limit=float("inf"), microbatches=2,
                           precision=asked, time_limit_s=10)
    plan = plan_split(traced, label=source.label, options=options)
    assert plan.precision == planned.value
    assert sum(stage.memory.params for stage in plan.stages) == PARAMETERS * size
    notes = [line for line in said if f"precision {asked.value} trains the model as it is"
             in line]
    assert len(notes) == (planned is not asked), said
    assert sum("trains the model as it is" in note for note in plan.notes) == len(notes)
    if notes:
        assert f"planned at {planned.value}" in notes[0]
        assert f"model.to({asked.dtype})" in notes[0]
    assert next(source.model.parameters()).dtype == (
        torch.bfloat16 if planned is Precision.BF16_TRUE else planned.dtype)
