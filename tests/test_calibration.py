"""plan_split calibrates from plain data, the measured plan and its ``Measured``: a
measurement that is not of that plan is refused in one line before any cost is
rescaled, and the figures fitted are the plan's and the measurement's, per stage."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe import meta
from fxpipe.calibration import figures
from fxpipe.compiler import plan_split
from fxpipe.passes.base import OP_NODES
from fxpipe.plan import Plan
from fxpipe.runtime.measured_file import Measured, StageMeasure, plan_identity
from tests.cost_models.test_calibrate import _mlp_plan


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
