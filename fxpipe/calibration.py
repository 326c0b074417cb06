"""A plan made again with the costs a training step measured (``fxpipe split --calibrate``,
``fxpipe report --model``): the driver's half of calibration.

``cost_models/calibrate.py`` fits a factor per stage and cost and rescales the node costs;
here the measured plan and its measurement (``measured.json`` as read back, ``Measured``)
become the figures it fits (``figures``), the plan's notes say what was calibrated
(``calibrate_graph``), and the measured plan's own cut, scored under the calibrated costs,
is kept where the solver's answer does worse (``against_measured``).
"""

from __future__ import annotations

import torch.fx

from fxpipe.cost_models import calibrate
from fxpipe.cost_models.calibrate import Calibration, StageFigures
from fxpipe.lower import Lowered
from fxpipe.partition import Evaluation, Problem, evaluate, violations
from fxpipe.plan import Plan
from fxpipe.report.card import check_measures, overlap_caveat
from fxpipe.runtime.measured_file import Measured
from fxpipe.units import format_ms

__all__ = ["against_measured", "calibrate_graph", "figures"]


def calibrate_graph(gm: torch.fx.GraphModule, plan: Plan, measured: Measured) -> str:
    """Rescale ``gm``'s node costs (in place) by ``measured``, a measurement of ``plan``
    (a ValueError where it is not: ``check_measures``); the note that says what was
    calibrated, by how much, and what was not."""
    check_measures(plan, measured)
    fitted = calibrate.fit(*figures(plan, measured), efficiency=plan.compute_efficiency)
    new_ops = calibrate.apply(gm, fitted)
    return _note(measured, fitted, new_ops, plan.tp)


def figures(plan: Plan, measured: Measured) -> tuple[list[StageFigures], list[StageFigures]]:
    """(predicted, measured) per stage, for a calibration; memory only where a measured
    peak is the stage's own (no other stage shared its device), and only its part that
    varies with the split."""
    shared = {k for stages in measured.shared.values() for k in stages}
    predicted, seen = [], []
    for stage, m in zip(plan.stages, measured.stages, strict=True):
        fixed = (stage.memory.params + stage.memory.grads + stage.memory.optimizer
                 + stage.memory.stashed)
        peak = None if stage.index in shared else m.peak_memory_bytes
        predicted.append(StageFigures(stage.nodes, stage.forward_s, stage.backward_s,
                                      stage.memory.total - fixed if peak is not None else None,
                                      stage.recompute_s, stage.collective_s))
        seen.append(StageFigures(stage.nodes, m.forward_s, m.backward_s,
                                 float(peak - fixed) if peak is not None else None))
    return predicted, seen


def _note(measured: Measured, fitted: Calibration, new_ops: int, tp: int) -> str:
    def factors(values: list[float | None]) -> str:
        return ", ".join("-" if v is None else f"×{v:.2f}" for v in values)

    m = measured
    line = (f"calibrated with a measurement on {m.device} ({m.steps} steps, {m.clock} clock): "
            f"forward per stage {factors([f.forward for f in fitted.stages])}, backward "
            f"{factors([f.backward for f in fitted.stages])}")
    memory = [f.memory for f in fitted.stages]
    if any(v is not None for v in memory):
        line += f", activation memory {factors(memory)}"
    else:
        line += ", memory not calibrated (no per-stage peak measured)"
    line += "; communication not calibrated"
    if tp > 1:
        line += f", tensor parallelism's all-reduces inside the stages (tp {tp}) included"
    for device, stages in m.overlapped.items():
        line += f"; {overlap_caveat(device, stages)}"
    if new_ops:
        median = fitted.median
        line += (f"; {new_ops} ops the measured plan did not have took the median factors "
                 f"×{median.forward:.2f} forward, ×{median.backward:.2f} backward")
    return line


def against_measured(lowered: Lowered, problem: Problem, evaluation: Evaluation,
                     measured: Plan) -> tuple[Evaluation, str]:
    """The solver's answer, or the measured plan's own cut where that scores better under
    the calibrated costs (a time-limited solve can stop short of it); and a note saying
    how the two compare and which ops moved."""
    names = [op.name for op in lowered.ops]
    old = measured.stage_of()
    if measured.num_stages != problem.num_stages or any(n not in old for n in names):
        return evaluation, ("the measured plan has other stages or ops than this one; its "
                            "cut is not compared")
    old_cut = tuple(old[n] for n in names)
    previous = evaluate(problem, old_cut)
    valid = previous.estimate.fits and not violations(problem, old_cut)
    if valid and previous.bottleneck_s < evaluation.bottleneck_s:
        evaluation = previous
    moved = sum(a != b for a, b in zip(old_cut, evaluation.stage_of, strict=True))
    line = (f"under the calibrated costs the measured plan's cut has a bottleneck of "
            f"{format_ms(previous.bottleneck_s)}"
            + ("" if valid else " (and does not fit)")
            + f", this plan {format_ms(evaluation.bottleneck_s)}; ")
    line += (f"{moved} of {len(names)} ops moved to another stage" if moved
             else "the cut is unchanged")
    assert not valid or evaluation.bottleneck_s <= previous.bottleneck_s
    return evaluation, line
