"""The compute efficiency the layout search assumes: every op's seconds are the cost
model's divided by it, communication's are not; the plan and its report say it, and under
``--calibrate`` the measured costs stand at their own speed, whatever was assumed."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.compiler import _lowered, plan_split
from fxpipe.options import ClusterOptions
from fxpipe.partition.layout import COMPUTE_EFFICIENCY
from fxpipe.report.layouts import layout_lines
from tests.cost_models.test_calibrate import _mlp_plan
from tests.test_calibration import _measured


def test_ops_run_at_the_efficiency_and_communication_does_not() -> None:
    _, traced, options, _ = _mlp_plan()
    full = _lowered(traced, options).problem
    half = _lowered(traced, replace(options, compute_efficiency=0.5)).problem
    assert any(n.forward_s > 0 for n in full.nodes) and any(n.comm_s > 0 for n in full.nodes)
    for a, b in zip(full.nodes, half.nodes, strict=True):
        assert b.forward_s == pytest.approx(2 * a.forward_s)
        assert b.backward_s == pytest.approx(2 * a.backward_s)
        assert b.backward_weight_s == pytest.approx(2 * a.backward_weight_s)
        assert b.comm_s == a.comm_s
        # the seconds a selective stage runs again, but SAC's host time: no op's
        assert b.selective(0)[1] - b.selective_host_s == pytest.approx(
            2 * (a.selective(0)[1] - a.selective_host_s))
    assert any(b.selective_host_s < a.selective_host_s
               for a, b in zip(full.nodes, half.nodes, strict=True))  # slower ops hide more


def test_the_layout_states_the_efficiency_it_assumed_and_calibration_measures_it() -> None:
    source, traced, options, _ = _mlp_plan()
    searched = replace(options, cluster=ClusterOptions(pp=3))
    assumed = plan_split(traced, label=source.label, options=searched)
    assert assumed.layout is not None
    assert assumed.layout.compute_efficiency == COMPUTE_EFFICIENCY == 1.0
    half = replace(searched, cluster=ClusterOptions(pp=3, compute_efficiency=0.5))
    slower = plan_split(traced, label=source.label, options=half)
    assert slower.layout is not None and slower.layout.compute_efficiency == 0.5
    assert not slower.layout.calibrated
    forward = sum(s.forward_s for s in assumed.stages)
    assert sum(s.forward_s for s in slower.stages) == pytest.approx(2 * forward)
    assert "runs at 0.50 of the cost model's speed" in " ".join(layout_lines(slower))
    with pytest.raises(ValueError, match=r"a compute efficiency of 0\.0 is no share"):
        plan_split(traced, label=source.label, options=replace(
            searched, cluster=ClusterOptions(pp=3, compute_efficiency=0.0)))
    # measured forward twice the plan's: the calibrated costs, not halved again
    measured = _measured(assumed, devices=["cuda:0", "cuda:1", "cuda:2"])
    calibrated = plan_split(traced, label=source.label, options=half,
                            calibrate_from=(assumed, measured))
    assert calibrated.layout is not None and calibrated.layout.calibrated
    assert calibrated.layout.compute_efficiency == 1.0
    assert sum(s.forward_s for s in calibrated.stages) == pytest.approx(2 * forward)
    assert "a training step measured (--calibrate)" in " ".join(layout_lines(calibrated))

