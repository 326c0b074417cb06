"""The report card under torchrun: ``train_torchrun.py --measure`` times each rank's
stages inside torch's schedules, rank 0 writes every stage into one measured.json, and
``fxpipe report`` reads it against the plan, as it reads the single-process runner's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fxpipe import cli
from fxpipe.runtime import load_measured
from fxpipe.runtime.launch import main
from fxpipe.runtime.measured_file import plan_identity

from ._helpers import EXAMPLES, contiguous_plan, import_package, load, torchrun
from ._helpers import write_package as write

M = 4

# (schedule, stage modules per rank): 1F1B one stage per rank; ZB-V two per rank in a V
# (rank 0 runs stages 0 and 3), its backward split into B and W calls.
CASES = [("1f1b", 1), pytest.param("zbv", 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("schedule", "v"), CASES)
def test_torchrun_measures_every_stage_for_fxpipe_report(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], schedule: str, v: int) -> None:
    model_file = EXAMPLES / "gpt.py"
    _, traced = load(str(model_file))
    plan = contiguous_plan(traced.gm.graph, 2 * v, schedule=schedule, microbatches=M,
                           virtual_stages=v)
    write(tmp_path / "pkg", traced, plan)
    measured = tmp_path / "measured.json"
    result = torchrun(2, tmp_path / "pkg" / "train_torchrun.py", "--model", str(model_file),
                      "--steps", "3", "--measure", str(measured))
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    assert f"measured 2 steps into {measured}" in result.stdout

    card = load_measured(measured)
    # it names the plan it measured: the plan.json of the package torchrun ran
    assert card.plan == plan_identity(json.loads((tmp_path / "pkg" / "plan.json").read_text()))
    assert (card.steps, card.microbatches, card.clock, card.device) == (2, M, "wall", "cpu")
    assert card.serial  # torch's schedule runs a rank's stages one after another
    assert [s.index for s in card.stages] == list(range(2 * v))
    for s in card.stages:
        assert s.forward_s > 0 and s.backward_s > 0 and s.comm_s >= 0, s
        # a stage's spans are disjoint parts of its rank's step, per micro-batch
        assert s.time_s * M <= card.step_s * 1.01, (s, card.step_s)
        assert s.peak_memory_bytes is None  # no CUDA device

    # each rank's stages share its device (rank 0 runs stages 0 and 3 of the V); another
    # rank's cpu is another process's, which runs beside it, not in turn
    ranks = [0, 1] if v == 1 else [0, 1, 1, 0]
    assert [s.device for s in card.stages] == [f"cpu on rank {r}" for r in ranks]

    capsys.readouterr()
    assert cli.main(["report", str(tmp_path / "pkg"), str(measured)]) == 0
    printed, warned = capsys.readouterr()
    assert warned == ""  # the plan is the one measured: nothing to warn of
    assert f"Measured 2 steps (wall clock), {M} micro-batches each" in printed
    assert all(f"\n| {k} | " in printed for k in range(2 * v))
    assert ("shared cpu on rank 0" in printed) == (v == 2)


def test_measure_needs_a_step_after_the_warm_up(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, traced = load(str(EXAMPLES / "gpt.py"))
    write(tmp_path / "pkg", traced, contiguous_plan(traced.gm.graph, 2, microbatches=M))
    package = import_package(tmp_path / "pkg", "fxpipe_measure_steps")
    argv = ["--model", str(EXAMPLES / "gpt.py"), "--steps", "1", "--measure", "m.json"]
    assert main(package.distributed.PIPELINE, argv) == 2  # before joining any job
    assert capsys.readouterr().err.strip().splitlines() == [
        "train_torchrun: error: --measure times the steps after the first (a warm-up); use "
        "--steps 2 or more, got 1"]
