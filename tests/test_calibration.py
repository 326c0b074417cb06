"""plan_split calibrates from plain data, the measured plan and its ``Measured``: a
measurement that is not of that plan is refused in one line before any cost is
rescaled, the figures fitted are the plan's and the measurement's, per stage, and the
calibrated costs predict the measured plan's own stages as measured, whatever they
recompute and whatever speed the plan assumed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe import meta
from fxpipe.calibration import figures
from fxpipe.compiler import SplitOptions, _lowered, analyze, analyze_file, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced
from fxpipe.options import ClusterOptions, Recompute
from fxpipe.partition import evaluate
from fxpipe.partition.cost import StageCost
from fxpipe.passes.base import OP_NODES
from fxpipe.plan import Plan, StageRecompute
from fxpipe.runtime.measured_file import Measured, StageMeasure, plan_identity
from fxpipe.schedules import ScheduleKind
from tests.cost_models.test_calibrate import _mlp_plan

GPT = str(Path(__file__).resolve().parents[1] / "examples" / "gpt.py")


def _measured(plan: Plan, *, devices: list[str], peak: int | None = None) -> Measured:
    """Forward twice and backward three times the plan's, on ``devices``."""
    return Measured("cuda-name", "cuda-events", plan.microbatches, 2, 1.0, tuple(
        StageMeasure(s.index, 2 * s.forward_s, 3 * s.backward_s, s.comm_s, peak, device)
        for s, device in zip(plan.stages, devices, strict=True)),
        plan=plan_identity(plan.to_dict()))


def test_a_measurement_of_another_plan_is_refused_and_nothing_rescaled() -> None:
    source, traced, options, plan = _mlp_plan()
    measured = _measured(plan, devices=["cuda:0", "cuda:1", "cuda:2"])
    times = {n.name: meta.TIME.get(n) for n in traced.gm.graph.nodes if n.op in OP_NODES}
    other = replace(measured, microbatches=plan.microbatches + 1)
    with pytest.raises(ValueError, match=rf"ran {plan.microbatches + 1} micro-batches per "
                                         rf"step but the plan has {plan.microbatches}"):
        plan_split(traced, label=source.label, options=options, calibrate_from=(plan, other))
    assert times == {n.name: meta.TIME.get(n) for n in traced.gm.graph.nodes
                     if n.op in OP_NODES}
    with pytest.raises(ValueError, match="has 2 stages but the plan has 3"):
        plan_split(traced, label=source.label, options=options,
                   calibrate_from=(plan, replace(measured, stages=measured.stages[:2])))


def test_the_figures_are_the_plan_and_the_measurement_per_stage() -> None:
    _, _, _, plan = _mlp_plan()
    peak = 10 * max(s.memory.total for s in plan.stages)
    predicted, seen = figures(plan, _measured(plan, devices=["cuda:0", "cuda:1", "cuda:1"],
                                              peak=peak))
    assert [f.nodes for f in predicted] == [f.nodes for f in seen] == [
        s.nodes for s in plan.stages]
    assert [(f.forward_s, f.backward_s) for f in seen] == [
        (2 * s.forward_s, 3 * s.backward_s) for s in plan.stages]
    assert [(f.forward_s, f.backward_s) for f in predicted] == [
        (s.forward_s, s.backward_s) for s in plan.stages]
    # stages 1 and 2 shared cuda:1: their peak is theirs together, no stage's own
    assert [f.memory is None for f in seen] == [False, True, True]
    assert [f.memory is None for f in predicted] == [False, True, True]
    fixed = plan.stages[0].memory.total - predicted[0].memory  # type: ignore[operator]
    assert seen[0].memory == peak - fixed


def _scored_again(traced: Traced, options: SplitOptions, plan: Plan) -> list[StageCost]:
    """The stages of ``plan``'s own cut under the graph's (calibrated) costs, lowered as
    plan_split lowers them calibrated: every op at the costs' own speed."""
    lowered = _lowered(traced, replace(options, compute_efficiency=1.0))
    cut = plan.stage_of()
    return list(evaluate(lowered.problem, [cut[op.name] for op in lowered.ops]).stages)


@pytest.mark.parametrize("efficiency", [1.0, 0.5])
@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_the_measured_plans_own_stages_are_predicted_again_as_measured(
        recompute: str, efficiency: float) -> None:
    """Forward measured twice the plan's and backward three times: under the calibrated
    costs the measured plan's cut has those times, its weight-gradient part three times
    the plan's too. A recomputed forward (and SAC's host time) takes the forward's factor,
    the rest of the backward what is left; the costs, not the plan's times, are rescaled
    where the plan ran every op at half the cost model's speed."""
    source, traced, options, _ = _mlp_plan()
    options = replace(options, recompute=Recompute(recompute),
                      cluster=ClusterOptions(pp=3, compute_efficiency=efficiency))
    plan = plan_split(traced, label=source.label, options=options)
    assert {s.recompute for s in plan.stages} == {StageRecompute(recompute)}
    assert all((s.recompute_s > 0) == (recompute != "none") for s in plan.stages)
    # the measured backward, beyond the forward run again at the forward's factor, is
    # more than twice what the plan predicted beyond it: the two factors differ
    measured = _measured(plan, devices=["cuda:0", "cuda:1", "cuda:2"])

    analyze(traced, device=options.device)  # fresh costs: calibration rescales them
    again = plan_split(traced, label=source.label, options=options,
                       calibrate_from=(plan, measured))
    stages = _scored_again(traced, replace(options, cluster=None), plan)
    assert [s.recompute for s in stages] == [s.recompute for s in plan.stages]
    assert [(s.forward_s, s.backward_s) for s in stages] == [
        (pytest.approx(m.forward_s), pytest.approx(m.backward_s)) for m in measured.stages]
    # W takes the backward's factor: of the 3 B measured, what is not the 2 R run again
    assert [s.backward_weight_s for s in stages] == [pytest.approx(
        s.backward_weight_s * (3 * s.backward_s - 2 * s.recompute_s)
        / (s.backward_s - s.recompute_s)) for s in plan.stages]
    assert all(s.backward_weight_s > 0 for s in plan.stages)
    assert again.layout is not None and again.layout.calibrated


@pytest.mark.parametrize("recompute", ["none", "full", "selective"])
def test_a_tensor_parallel_plans_own_stages_are_predicted_again_as_measured(
        recompute: str) -> None:
    """The stages' all-reduces are communication: left as they are, the compute beside
    them takes the rest of what was measured, and the note says so."""
    cpu = get_device("cpu")
    source, traced = analyze_file(GPT, device=cpu)
    options = SplitOptions(gpus=4, device=cpu, memory_limit=float(cpu.memory_bytes),
                           microbatches=4, schedule=ScheduleKind.ONE_F_ONE_B,
                           recompute=Recompute(recompute), cluster=ClusterOptions(pp=2, tp=2))
    plan = plan_split(traced, label=source.label, options=options)
    assert plan.layout is not None and plan.layout.tp == 2
    assert all(0 < s.collective_s[0] < s.forward_s for s in plan.stages)
    assert all(s.collective_s[0] < s.collective_s[1] < s.backward_s for s in plan.stages
               if s.recompute is not StageRecompute.NONE)
    measured = _measured(plan, devices=["cuda:0", "cuda:1"])
    analyze(traced, device=cpu)
    again = plan_split(traced, label=source.label, options=options,
                       calibrate_from=(plan, measured))
    note = next(n for n in again.notes if n.startswith("calibrated with a measurement"))
    assert ("communication not calibrated, tensor parallelism's all-reduces inside the "
            "stages (tp 2) included") in note
    stages = _scored_again(traced, replace(options, cluster=None, gpus=2,
                                           tensor_parallel=2), plan)
    assert [s.collective_s for s in stages] == [s.collective_s for s in plan.stages]
    assert [(s.forward_s, s.backward_s) for s in stages] == [
        (pytest.approx(m.forward_s), pytest.approx(m.backward_s)) for m in measured.stages]
