"""Calibration: per-stage factors fitted from a report card rescale node times, and a
re-plan with them moves work away from the stage that measured slow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.fx
from torch import nn

from fxpipe import meta
from fxpipe.compiler import SplitOptions, analyze, analyze_file, plan_split
from fxpipe.cost_models import get_device
from fxpipe.cost_models.calibrate import StageFigures, apply, fit
from fxpipe.frontend import ModelSource, Traced
from fxpipe.lower import lower
from fxpipe.partition import evaluate
from fxpipe.plan import Plan
from fxpipe.profile import auto_depth
from fxpipe.runtime.measured_file import Measured, StageMeasure, plan_identity
from fxpipe.schedules import ScheduleKind

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")


def test_factors_are_measured_over_predicted_and_follow_the_op() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)))
    ops = [n for n in gm.graph.nodes if n.op == "call_module"]
    for node in ops:
        meta.TIME.set(node, meta.TimeInfo(1.0, 2.0, "analytic:test"))
    a, b, c = (n.name for n in ops)
    # the measured plan had a on stage 0 and b on stage 1; c is new
    predicted = [StageFigures((a,), 1.0, 2.0), StageFigures((b,), 1.0, 2.0)]
    measured = [StageFigures((a,), 3.0, 2.0), StageFigures((b,), 1.0, 8.0)]
    fitted = fit(predicted, measured)
    assert [(f.forward, f.backward) for f in fitted.stages] == [(3.0, 1.0), (1.0, 4.0)]
    assert (fitted.median.forward, fitted.median.backward) == (2.0, 2.5)
    assert apply(gm, fitted) == 1  # c took the median
    times = {n.name: meta.TIME.get(n) for n in ops}
    assert (times[a].forward_s, times[a].backward_s) == (3.0, 2.0)
    assert (times[b].forward_s, times[b].backward_s) == (1.0, 8.0)
    assert (times[c].forward_s, times[c].backward_s) == (2.0, 5.0)
    assert times[c].source == "analytic:test+calibrated"


def test_a_recomputing_stages_backward_factor_is_of_what_it_does_not_run_again() -> None:
    """1 s of a stage's 3 s backward is its forward run again: measured at the forward's
    factor (2), the other 2 s measured 8 - 2 = 6 s take factor 3. Where the measured
    backward is less than the forward run again at that factor, the whole ratio stands.
    SAC's host time takes the forward's factor; the costs', factor / the plan's speed."""
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    ops = [n for n in gm.graph.nodes if n.op == "call_module"]
    for node in ops:
        meta.TIME.set(node, meta.TimeInfo(1.0, 2.0, "analytic:test", backward_weight_s=1.0))
    a, b = (n.name for n in ops)
    predicted = [StageFigures((a,), 1.0, 3.0, recompute_s=1.0),
                 StageFigures((b,), 1.0, 3.0, recompute_s=1.0)]
    measured = [StageFigures((a,), 2.0, 8.0), StageFigures((b,), 2.0, 1.5)]
    fitted = fit(predicted, measured, efficiency=0.5)
    assert [(f.forward, f.backward) for f in fitted.stages] == [(2.0, 3.0), (2.0, 0.5)]
    apply(gm, fitted)
    time = meta.TIME.get(ops[0])
    assert (time.forward_s, time.backward_s, time.backward_weight_s) == (4.0, 12.0, 6.0)
    assert time.host_scale == 2.0


def _mlp_plan() -> tuple[ModelSource, Traced, SplitOptions, Plan]:
    """The example MLP analysed for the CPU, and its 3-stage 1F1B plan."""
    cpu = get_device("cpu")
    options = SplitOptions(gpus=3, device=cpu, memory_limit=float(cpu.memory_bytes),
                           microbatches=4, schedule=ScheduleKind.ONE_F_ONE_B)
    source, traced = analyze_file(MLP, device=cpu)
    return source, traced, options, plan_split(traced, label=source.label, options=options)


def test_a_stage_measured_twice_as_slow_gives_up_work() -> None:
    source, traced, options, plan = _mlp_plan()
    cpu = options.device
    slow = 1
    measured = Measured("cpu", "wall", plan.microbatches, 2, plan.estimate.iteration_s, tuple(
        StageMeasure(s.index, s.forward_s * (2 if s.index == slow else 1),
                     s.backward_s * (2 if s.index == slow else 1), s.comm_s)
        for s in plan.stages), plan=plan_identity(plan.to_dict()))

    analyze(traced, device=cpu)  # fresh costs: calibration rescales them in place
    again = plan_split(traced, label=source.label, options=options,
                       calibrate_from=(plan, measured))

    assert len(again.stages[slow].nodes) < len(plan.stages[slow].nodes)
    assert set(again.stages[slow].nodes) < set(plan.stages[slow].nodes)
    assert any("forward per stage ×1.00, ×2.00, ×1.00, backward ×1.00, ×2.00, ×1.00" in note
               for note in again.notes)
    assert any("ops moved to another stage" in note for note in again.notes)

    # Under the calibrated costs (the graph now holds them) the new plan is no worse
    # than the measured plan's cut, and strictly better here.
    lowered = lower(traced.gm, num_stages=3, device=cpu, memory_limit=options.memory_limit,
                    schedule=options.schedule, microbatches=options.microbatches,
                    block_depth=auto_depth(traced.gm))
    names = [op.name for op in lowered.ops]
    old_cut, new_cut = plan.stage_of(), again.stage_of()
    before = evaluate(lowered.problem, [old_cut[n] for n in names])
    after = evaluate(lowered.problem, [new_cut[n] for n in names])
    assert after.bottleneck_s == pytest.approx(again.estimate.bottleneck_s)
    assert after.bottleneck_s < before.bottleneck_s
    # the slow stage's calibrated time is twice what the plan predicted for the same ops
    assert before.stages[slow].forward_s == pytest.approx(2 * plan.stages[slow].forward_s)


def test_calibrating_from_stages_that_overlapped_on_one_gpu_says_so() -> None:
    source, traced, options, plan = _mlp_plan()

    def notes(device: str, serial: bool) -> str:
        measured = Measured("cuda-name", "cuda-events", plan.microbatches, 2, 1.0, tuple(
            StageMeasure(s.index, s.forward_s, s.backward_s, s.comm_s, device=device)
            for s in plan.stages), serial=serial, plan=plan_identity(plan.to_dict()))
        analyze(traced, device=options.device)
        again = plan_split(traced, label=source.label, options=options,
                           calibrate_from=(plan, measured))
        return " ".join(again.notes)

    warning = "stages 0, 1 and 2 ran side by side on cuda:0, on streams of their own"
    assert warning in notes("cuda:0", serial=False)
    assert warning not in notes("cuda:0", serial=True)
    assert "side by side" not in notes("cpu", serial=False)  # the CPU runs stages in turn


def test_memory_factor_scales_saved_activations() -> None:
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    ops = [n for n in gm.graph.nodes if n.op == "call_module"]
    for node in ops:
        meta.TIME.set(node, meta.TimeInfo(1.0, 1.0, "analytic:test"))
        meta.BYTES.set(node, meta.MemoryInfo(param_bytes=24, buffer_bytes=0, output_bytes=8,
                                             saved_bytes=100))
    a, b = (n.name for n in ops)
    predicted = [StageFigures((a,), 1.0, 1.0, 1000.0), StageFigures((b,), 1.0, 1.0, None)]
    measured = [StageFigures((a,), 1.0, 1.0, 1500.0), StageFigures((b,), 1.0, 1.0, None)]
    fitted = fit(predicted, measured)
    assert [f.memory for f in fitted.stages] == [1.5, None]
    apply(gm, fitted)
    saved = {n.name: meta.BYTES.get(n).saved_bytes for n in ops}
    assert saved == {a: 150, b: 100}  # b's stage had no memory of its own measured
    assert meta.BYTES.get(ops[0]).param_bytes == 24  # parameters are exact, never scaled


def test_a_model_mostly_of_ops_the_measured_plan_lacks_is_refused_untouched() -> None:
    """Most ops taking the median factor is a measurement of another model, not a
    calibration: refused before any op is rescaled. Half of them is still calibrated."""
    gm = torch.fx.symbolic_trace(nn.Sequential(*(nn.Linear(2, 2) for _ in range(4))))
    ops = [n for n in gm.graph.nodes if n.op == "call_module"]
    for node in ops:
        meta.TIME.set(node, meta.TimeInfo(1.0, 1.0, "analytic:test"))
    names = [n.name for n in ops]
    one = [StageFigures((names[0],), 1.0, 1.0)]
    fitted = fit(one, [StageFigures((names[0],), 2.0, 2.0)])
    named = f"(this model has {', '.join(names[1:])}, that plan {names[0]})"
    with pytest.raises(ValueError, match=r"^only 1 of this model's 4 ops are in the plan that "
                                         r"was measured " + re.escape(named)):
        apply(gm, fitted)
    assert all(meta.TIME.get(n).forward_s == 1.0 for n in ops)
    two = [StageFigures(tuple(names[:2]), 1.0, 1.0)]
    assert apply(gm, fit(two, [StageFigures(tuple(names[:2]), 2.0, 2.0)])) == 2
    assert [meta.TIME.get(n).forward_s for n in ops] == [2.0] * 4  # the median: the one stage
