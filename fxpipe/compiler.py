"""The compiler's phases end to end, as library calls.

    traced = frontend.trace_source(load_model_file("model.py"))
    analyze(traced, device=get_device("h100"))            # passes + a cost model
    plan = plan_split(traced, label="model.py", options=SplitOptions(gpus=8, ...))
    files = output_files(traced, plan, label="model.py")  # plan.json, stages, diagrams

The CLI, the benchmarks and the tests all drive fxpipe through these calls, so
the sequence frontend → passes → cost models → lower → partition → codegen is
written once. ``progress`` wraps each slow phase (the CLI shows a spinner).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from fxpipe.codegen import generate, schedule_table
from fxpipe.codegen.timeline import draw_timeline
from fxpipe.cost_models import Device, analytic, measured
from fxpipe.frontend import Traced
from fxpipe.lower import lower
from fxpipe.partition import Recompute, Schedule, partition
from fxpipe.partition.plan import Plan
from fxpipe.passes import annotate_all
from fxpipe.planning import build_plan
from fxpipe.profile import auto_depth
from fxpipe.report import partition_dot, render_report, render_svg

__all__ = ["SplitOptions", "analyze", "output_files", "plan_split"]

Progress = Callable[[str], AbstractContextManager[object]]


def _silent(label: str) -> AbstractContextManager[object]:
    return nullcontext()


def analyze(
    traced: Traced, *, device: Device, measure: bool = False, progress: Progress = _silent
) -> Traced:
    """Annotate every node: shapes, modules, FLOPs, bytes, and time (roofline or measured)."""
    with progress("shapes, FLOPs and bytes"):
        annotate_all(traced.gm, *traced.flat_inputs)
    if measure:
        on_cuda = any(isinstance(v, torch.Tensor) and v.is_cuda for v in traced.flat_inputs)
        kind: Literal["cpu", "cuda"] = "cuda" if on_cuda else "cpu"
        with progress(f"timing every node ({kind})"):
            measured.annotate_times(traced.gm, *traced.flat_inputs, device=kind)
    else:
        with progress(f"roofline times for {device.name}"):
            analytic.annotate_times(traced.gm, device)
    return traced


@dataclass(frozen=True)
class SplitOptions:
    gpus: int
    device: Device
    memory_limit: float  # bytes per GPU
    microbatches: int
    schedule: Schedule = Schedule.ONE_F_ONE_B
    optimizer: str = "adam"
    recompute: Recompute = Recompute.AUTO  # per stage: none, all, or chosen by the solver
    time_limit_s: float = 30.0
    virtual_stages: int = 1  # interleaved schedule: stage modules per GPU
    replicate: bool = False  # let the solver give a stage several GPUs ("2-1-1")


def plan_split(
    traced: Traced, *, label: str, options: SplitOptions, progress: Progress = _silent
) -> Plan:
    """Cut an analysed model into ``options.gpus`` stages: lower, solve, apply to the graph."""
    lowered = lower(
        traced.gm,
        num_stages=options.gpus * options.virtual_stages,
        virtual_stages=options.virtual_stages,
        num_devices=options.gpus,
        device=options.device,
        memory_limit=options.memory_limit,
        schedule=options.schedule,
        microbatches=options.microbatches,
        optimizer=options.optimizer,
        recompute=options.recompute,
        block_depth=auto_depth(traced.gm),
    )
    with progress(f"solving ({len(lowered.problem.nodes)} nodes onto {options.gpus} GPUs)"):
        result = partition(lowered.problem, time_limit_s=options.time_limit_s,
                           replicate=options.replicate)
    notes = list(traced.notes)
    if traced.fallback_reason:
        notes.append(f"symbolic_trace failed ({traced.fallback_reason}); used torch.export")
    return build_plan(
        lowered,
        result.problem,
        result.evaluation,
        result.report,
        baselines=result.baselines,
        model=label,
        tracer=traced.tracer,
        device=options.device.name,
        optimizer=options.optimizer,
        notes=notes,
    )


def output_files(
    traced: Traced,
    plan: Plan,
    *,
    label: str,
    diagram: str = "module",
    progress: Progress = _silent,
) -> dict[str, str | bytes]:
    """Every file of the output folder but timing.json: plan, report, diagrams, package."""
    dot = partition_dot(
        traced.gm,
        plan.stage_of(),
        num_stages=plan.num_stages,
        level=diagram,
        depth=auto_depth(traced.gm),
        title=label,
    )
    files: dict[str, str | bytes] = {
        "plan.json": plan.to_json(),
        "report.md": render_report(plan),
        "partition.dot": dot,
    }
    with progress("drawing the partition and the schedule"):
        svg = render_svg(dot)
        if svg is not None:
            files["partition.svg"] = svg
        files["schedule.svg"] = schedule_svg(plan)
    with progress("writing the stage modules"):
        files.update(generate(traced, plan))
    return files


def schedule_svg(plan: Plan) -> bytes:
    """The plan's schedule as a Gantt chart with predicted times (schedule.svg).

    Each stage's communication is split evenly between its forward (activations out)
    and its backward (gradients back).
    """
    schedule = schedule_table(plan)
    forward = [s.forward_s + s.comm_s / 2 for s in plan.stages]
    backward = [s.backward_s + s.comm_s / 2 for s in plan.stages]
    devices = None
    if plan.virtual_stages > 1:  # one row per GPU, its stage modules in turn
        devices = [plan.devices_of(j)[0] for j in range(plan.num_stages)]
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "schedule.svg"
        title = f"{plan.model}: {plan.schedule}, K={plan.num_stages}, M={plan.microbatches}"
        draw_timeline(schedule, forward, backward, path, title=title, devices=devices)
        return path.read_bytes()
