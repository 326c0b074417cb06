"""The report card: a plan run with runner.measure on the CPU, its measured.json, and
`fxpipe report` comparing the two."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from fxpipe.calibration import figures
from fxpipe.cli import main
from fxpipe.compiler import SplitOptions, analyze_file, output_files, plan_split
from fxpipe.cost_models import get_device
from fxpipe.output import write_folder
from fxpipe.plan import Plan
from fxpipe.report.card import TIE, compare, render_card
from fxpipe.runtime import load_measured, load_package
from fxpipe.runtime.measured_file import FORMAT, VERSION, plan_identity
from fxpipe.units import format_bytes, format_ms

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")
K, M, STEPS, WARMUP = 3, 4, 3, 1


@pytest.fixture(scope="module")
def measured_plan(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Plan]:
    """A 3-stage plan of the example MLP written as a package, and 3 steps of it run on
    the CPU inside runner.measure(warmup=1), saved as measured.json beside plan.json."""
    out = tmp_path_factory.mktemp("card") / "out"
    cpu = get_device("cpu")
    source, traced = analyze_file(MLP, device=cpu)
    options = SplitOptions(gpus=K, device=cpu, memory_limit=float(cpu.memory_bytes),
                           microbatches=M)
    plan = plan_split(traced, label=source.label, options=options)
    write_folder(out, output_files(traced, plan, label=source.label))
    package = load_package(out)
    runner = package.PipelineRunner(package.build_stages(source.model))
    inputs = tuple(torch.cat([x] * M) for x in source.args)
    target = torch.cat([source.target] * M)
    with runner.measure(warmup=WARMUP) as card:
        for _ in range(STEPS):
            runner.step(inputs, target, source.loss_fn)
    card.save(out / "measured.json")
    return out, plan


def test_measured_json_has_the_documented_fields(measured_plan: tuple[Path, Plan]) -> None:
    out, plan = measured_plan
    data = json.loads((out / "measured.json").read_text())
    assert data["format"] == FORMAT and data["version"] == VERSION
    # it names the plan.json beside the package's runtime, the plan it measured
    on_disk = plan_identity(json.loads((out / "plan.json").read_text()))
    assert data["plan"] == {"model": on_disk.model, "fingerprint": on_disk.fingerprint}
    assert on_disk == plan_identity(plan.to_dict()) and on_disk.model == plan.model
    assert (data["device"], data["clock"]) == ("cpu", "wall")
    assert data["microbatches"] == M and data["warmup_steps"] == WARMUP
    assert data["steps"] == STEPS - WARMUP
    assert [s["index"] for s in data["stages"]] == list(range(K))
    for stage in data["stages"]:
        assert stage["forward_s"] > 0 and stage["backward_s"] > 0 and stage["comm_s"] >= 0
        assert stage["peak_memory_bytes"] is None  # not measured on the CPU
    # Every stage's work is inside the step and the CPU runs them one after another: over
    # the two measured steps (median = mean) the stages' time is at most the step's.
    work = sum(M * (s["forward_s"] + s["backward_s"] + s["comm_s"]) for s in data["stages"])
    assert 0 < work <= data["step_s"] * (1 + 1e-9)


def test_card_figures_are_the_plan_against_the_measurement(
    measured_plan: tuple[Path, Plan],
) -> None:
    out, plan = measured_plan
    measured = load_measured(out / "measured.json")
    card = compare(plan, measured)
    for row, stage, m in zip(card.rows, plan.stages, measured.stages, strict=True):
        assert row.predicted == (stage.forward_s, stage.backward_s, stage.comm_s)
        assert row.measured == (m.forward_s, m.backward_s, m.comm_s)
        assert row.ratios == pytest.approx((m.forward_s / stage.forward_s,
                                            m.backward_s / stage.backward_s,
                                            m.comm_s / stage.comm_s))
        assert row.predicted_memory == stage.memory.total and row.memory_ratio is None
    times = [s.time_s for s in measured.stages]
    assert card.measured_bottleneck == times.index(max(times))
    planned = [s.time_s for s in plan.stages]
    assert card.planned_bottleneck == planned.index(max(planned))
    assert card.holds == (times[card.planned_bottleneck] >= (1 - TIE) * max(times))


def _synthetic(plan: Plan, scale: list[float]) -> dict[str, Any]:
    """A measured.json of ``plan`` whose stage k took ``scale[k]`` times its predicted
    seconds."""
    identity = plan_identity(plan.to_dict())
    return {
        "format": FORMAT, "version": VERSION, "device": "cpu", "clock": "wall",
        "plan": {"model": identity.model, "fingerprint": identity.fingerprint},
        "microbatches": plan.microbatches, "warmup_steps": 1, "steps": 2,
        "step_s": plan.estimate.iteration_s * max(scale),
        "stages": [{"index": s.index, "forward_s": s.forward_s * f,
                    "backward_s": s.backward_s * f, "comm_s": s.comm_s * f,
                    "peak_memory_bytes": None, "device": "cpu"}
                   for s, f in zip(plan.stages, scale, strict=True)],
    }


def test_report_names_the_real_bottleneck(measured_plan: tuple[Path, Plan], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    out, plan = measured_plan
    planned = max(plan.stages, key=lambda s: s.time_s).index
    other = (planned + 1) % K
    slow = tmp_path / "slow.json"
    scale = [10.0 if k == other else 1.0 for k in range(K)]
    slow.write_text(json.dumps(_synthetic(plan, scale)))
    card = compare(plan, load_measured(slow))
    assert (card.planned_bottleneck, card.measured_bottleneck) == (planned, other)
    assert not card.holds
    assert card.rows[other].ratios == pytest.approx((10.0, 10.0, 10.0))
    assert main(["report", str(out), str(slow)]) == 0
    text = capsys.readouterr().out
    assert text == render_card(card)
    behind = 1 - card.rows[planned].measured_s / card.rows[other].measured_s
    assert behind > 0.5
    assert (f"Bottleneck: planned stage {planned}, measured stage {other}; stage {planned} "
            f"measured {behind:.1%} below it — the plan's choice does not hold.") in text
    assert "(×10.00)" in text and "Step: predicted" in text

    # with the model, the report re-plans: a stage 10x slower than planned gives up work
    assert main(["report", str(out), str(slow), "--model", MLP]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert re.fullmatch(r"Re-planned mlp\.py:build_model with these measurements: [1-9]\d* of "
                        r"\d+ nodes move to another stage; predicted bottleneck .*", last), last

    # a stage measured 1 % slower than the planned bottleneck ties with it: balanced
    # stages trade places from one step to the next
    times = {s.index: s.time_s for s in plan.stages}
    tie = tmp_path / "tie.json"
    scale = [1.01 * times[planned] / times[k] if k == other else 1.0 for k in range(K)]
    tie.write_text(json.dumps(_synthetic(plan, scale)))
    card = compare(plan, load_measured(tie))
    assert (card.planned_bottleneck, card.measured_bottleneck) == (planned, other)
    assert card.behind == pytest.approx(1 - 1 / 1.01) and card.holds
    assert (f"Bottleneck: planned stage {planned}, measured stage {other}; stage {planned} "
            f"measured 1.0% below it, within the 2% of a tie — the plan's choice holds."
            ) in render_card(card)

    even = tmp_path / "even.json"
    even.write_text(json.dumps(_synthetic(plan, [1.5] * K)))
    card = compare(plan, load_measured(even))
    assert card.holds and card.measured_bottleneck == planned
    assert all(r.ratios == pytest.approx((1.5, 1.5, 1.5)) for r in card.rows)


@pytest.mark.parametrize(("change", "message"), [
    (None, r"measured\.json: no such file; write one with runner\.measure"),
    ({"version": 99}, r"measurement version 99, this fxpipe reads version 1"),
    ({"format": "other"}, r"not an fxpipe measurement"),
    ({"stages": "drop"}, r"has 2 stages but the plan has 3; measure the package this plan"),
    ({"microbatches": 7}, r"ran 7 micro-batches per step but the plan has 4"),
])
def test_a_bad_measurement_is_one_line_exit_2(
    measured_plan: tuple[Path, Plan], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    change: dict[str, Any] | None, message: str,
) -> None:
    out, plan = measured_plan
    path = tmp_path / "measured.json"
    if change is not None:
        data = _synthetic(plan, [1.0] * K)
        if change.get("stages") == "drop":
            data["stages"] = data["stages"][:2]
        else:
            data.update(change)
        path.write_text(json.dumps(data))
    for argv in (["report", str(out), str(path)],
                 ["split", MLP, "--gpus", "3", "--calibrate", str(path),
                  "--out", str(tmp_path / "never")]):
        if argv[0] == "split" and change is not None:
            (tmp_path / "plan.json").write_text((out / "plan.json").read_text())
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("fxpipe: error: ") and err.count("\n") == 1
        assert re.search(message, err), err
    assert not (tmp_path / "never").exists()


def _on_devices(plan: Plan, devices: list[str], peaks: list[int | None], *,
                serial: bool = False) -> Any:
    """The plan measured exactly as predicted, stage k on ``devices[k]`` with ``peaks[k]``."""
    data = _synthetic(plan, [1.0] * K)
    data["serial"] = serial
    for stage, device, peak in zip(data["stages"], devices, peaks, strict=True):
        stage["device"], stage["peak_memory_bytes"] = device, peak
    return data


def test_stages_sharing_a_gpu_are_compared_as_one_device(
    measured_plan: tuple[Path, Plan], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """On one GPU a peak is every stage's together and the stages' work runs one after
    another: no per-stage memory ratio, a step predicted as M x sum(F + B), and a word on
    overlapping streams unless the stages were measured one after another."""
    out, plan = measured_plan
    peak = 3 * 2**30
    path = tmp_path / "one-gpu.json"
    path.write_text(json.dumps(_on_devices(plan, ["cuda:0"] * K, [peak] * K)))
    card = compare(plan, load_measured(path))
    assert card.measured.shared == {"cuda:0": tuple(range(K))}
    assert card.measured.overlapped == {"cuda:0": tuple(range(K))}
    assert all(r.shared and r.memory_ratio is None for r in card.rows)
    work = M * sum(s.forward_s + s.backward_s for s in plan.stages)
    assert work > plan.estimate.iteration_s
    assert card.predicted_step_s == pytest.approx(work)
    predicted, measured = figures(plan, card.measured)  # nothing to calibrate memory from
    assert all(f.memory is None for f in [*predicted, *measured])
    assert main(["report", str(out), str(path)]) == 0
    text = capsys.readouterr().out
    assert "→ shared cuda:0 |" in text
    together = sum(s.memory.total for s in plan.stages)
    assert (f"Stages 0, 1 and 2 shared cuda:0: the step predicted there is their work one "
            f"after another, M × Σ (forward + backward); its peak, 3.0 GiB, is theirs "
            f"together (predicted at most {format_bytes(together)} with every stage at its "
            f"peak at once: ×{peak / together:.2f}).") in text
    assert ("Stages 0, 1 and 2 ran side by side on cuda:0, on streams of their own, so each "
            "one's times include the others' kernels") in text
    assert f"Step: predicted {format_ms(work)}" in text

    path.write_text(json.dumps(_on_devices(plan, ["cuda:0"] * K, [peak] * K, serial=True)))
    card = compare(plan, load_measured(path))
    assert card.measured.serial and card.measured.overlapped == {}
    assert "side by side" not in render_card(card)


def test_a_stage_with_a_gpu_of_its_own_keeps_its_memory_ratio(
    measured_plan: tuple[Path, Plan], tmp_path: Path,
) -> None:
    _, plan = measured_plan
    peaks = [2 * s.memory.total for s in plan.stages]
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(_on_devices(plan, ["cuda:0", "cuda:1", "cuda:1"], peaks)))
    card = compare(plan, load_measured(path))
    assert card.measured.shared == {"cuda:1": (1, 2)}
    assert card.rows[0].memory_ratio == pytest.approx(2.0)
    assert [r.memory_ratio for r in card.rows[1:]] == [None, None]
    predicted, measured = figures(plan, card.measured)
    assert predicted[0].memory is not None and measured[0].memory is not None
    assert [f.memory for f in predicted[1:]] == [None, None]
    pair = M * sum(s.forward_s + s.backward_s for s in plan.stages[1:])
    assert card.predicted_step_s == pytest.approx(max(pair, plan.estimate.iteration_s))

    path.write_text(json.dumps(_on_devices(plan, ["cuda:0", "cuda:1", "cuda:2"], peaks)))
    card = compare(plan, load_measured(path))
    assert card.measured.shared == {} and card.predicted_step_s == plan.estimate.iteration_s
    assert all(r.memory_ratio == pytest.approx(2.0) for r in card.rows)
