"""report.md: the plan for a person, stage by stage, next to the baselines."""

from __future__ import annotations

from collections.abc import Callable

from fxpipe.plan import Estimate, Plan, StagePlan, StageRecompute
from fxpipe.report.layouts import layout_lines
from fxpipe.schedules import kind_of
from fxpipe.units import format_bytes, format_count, format_indices, format_ms

__all__ = ["compared", "overview", "render_report", "summary_rows"]


def compared(plan: Plan) -> list[tuple[str, Estimate]]:
    """The plan's estimate ("fxpipe (cp-sat)") first, then each baseline's, by name."""
    return [("fxpipe (" + plan.solver.method + ")", plan.estimate),
            *sorted(plan.baselines.items())]


def summary_rows(plan: Plan) -> list[tuple[str, str, str, str, str]]:
    """(method, bottleneck, iteration, max memory, fits) for the plan and each baseline."""
    return [
        (
            name,
            format_ms(e.bottleneck_s),
            format_ms(e.iteration_s),
            format_bytes(e.max_memory),
            "yes" if e.fits else "NO",
        )
        for name, e in compared(plan)
    ]


def _throughput(plan: Plan, estimate: Estimate) -> str:
    if estimate.iteration_s <= 0:
        return "-"
    return f"{plan.microbatches / estimate.iteration_s:.1f} micro-batches/s"


def bubble_text(plan: Plan) -> str:
    """The predicted bubble with the formulas the schedule kind gives it (K pipeline
    positions: stages, GPUs when interleaved; v stage modules per GPU; M micro-batches):
    its share of the whole step, and of the ideal (bubble-free) time.
    """
    v, M = plan.virtual_stages, plan.microbatches
    K = plan.num_devices if v > 1 else plan.num_stages
    e = plan.estimate
    spec = kind_of(plan.schedule).spec
    if spec.splits_backward:
        per = "chunk " if v > 1 else ""
        return (
            f"bubble {e.bubble_fraction:.1%} of the step, {e.bubble_ratio:.1%} of the ideal "
            f"time: {spec.bubble_formula} with K={K}, M={M} and T_F, T_B, T_W the {per}"
            f"forward, input-gradient and weight-gradient times (Zero Bubble's fill; the "
            f"weight gradients fill the rest)"
        )
    return (
        f"bubble {e.bubble_fraction:.1%} of the step = {spec.bubble_formula} with K={K}, "
        f"v={v}, M={M}; {e.bubble_ratio:.1%} of the ideal time = {spec.bubble_ratio_formula}"
    )


def _layout(plan: Plan) -> str:
    if plan.virtual_stages > 1:
        return (f"{plan.num_stages} stage modules on {plan.num_devices} GPUs "
                f"({plan.virtual_stages} per GPU)")
    if any(stage.replicas > 1 for stage in plan.stages):
        return (f"{plan.num_stages} stages on {plan.num_devices} GPUs, configuration "
                f"{plan.configuration} (GPUs per stage, data-parallel within a stage)")
    return f"{plan.num_stages} stages"


def overview(plan: Plan) -> list[str]:
    """The plan in a few lines: layout, schedule, recompute, tracing, input shapes, the
    solver's answer and the predicted step (report.md's list, report.html's too)."""
    limit = "none" if plan.memory_limit == float("inf") else format_bytes(plan.memory_limit)
    solver = plan.solver
    schedule = kind_of(plan.schedule).spec.summary.format(
        v=plan.virtual_stages, n=plan.num_devices, k1=plan.num_stages - 1)
    return [
        f"{_layout(plan)} on {plan.device}, {plan.schedule} schedule, "
        f"{plan.microbatches} micro-batches per step, optimizer {plan.optimizer}, "
        f"precision {plan.precision}, memory limit {limit} per GPU",
        f"schedule: {schedule}",
        f"recompute: {_recompute(plan)}",
        f"traced with {plan.tracer}",
        f"input shapes: {_dynamic(plan)}",
        f"solver: {solver.method}, status {solver.status}, bottleneck "
        f"{format_ms(solver.objective)}, bound {format_ms(solver.bound)}, "
        f"gap {solver.gap:.2%}, "
        f"on a graph of {solver.solved_nodes} nodes "
        f"(coarsened from {solver.graph_nodes})",
        f"predicted bottleneck {format_ms(plan.estimate.bottleneck_s)}, iteration "
        f"{format_ms(plan.estimate.iteration_s)}, {bubble_text(plan)}, throughput "
        f"{_throughput(plan, plan.estimate)}",
    ]


# The stage table's columns: (header, the cell of a stage, whether the column applies to
# a plan). A memory kind applies where some stage holds any; B and W where the schedule
# runs them apart, else one backward column; GPUs where a stage's are not its index.
_Column = tuple[str, Callable[[Plan, StagePlan], str], Callable[[Plan], bool]]


def _memory(header: str, kind: str) -> _Column:
    return (header, lambda _p, s: format_bytes(getattr(s.memory, kind)),
            lambda p: any(getattr(s.memory, kind) for s in p.stages))


def _splits(plan: Plan) -> bool:
    return kind_of(plan.schedule).spec.splits_backward


_COLUMNS: tuple[_Column, ...] = (
    ("stage", lambda _p, s: str(s.index), lambda _p: True),
    ("GPUs", lambda p, s: ", ".join(str(d) for d in p.devices_of(s.index)),
     lambda p: any(p.devices_of(s.index) != (s.index,) for s in p.stages)),
    ("ops", lambda _p, s: str(len(s.nodes)), lambda _p: True),
    ("params", lambda _p, s: str(len(s.parameters)), lambda _p: True),
    ("fwd FLOPs", lambda _p, s: format_count(s.flops_forward, "FLOP"), lambda _p: True),
    ("fwd (F)", lambda _p, s: format_ms(s.forward_s), lambda _p: True),
    ("bwd", lambda _p, s: format_ms(s.backward_s), lambda p: not _splits(p)),
    ("bwd input (B)", lambda _p, s: format_ms(s.backward_input_s), _splits),
    ("bwd weight (W)", lambda _p, s: format_ms(s.backward_weight_s), _splits),
    ("comm", lambda _p, s: format_ms(s.comm_s), lambda p: any(s.comm_s for s in p.stages)),
    ("params+grads+opt", lambda _p, s: format_bytes(s.memory.params + s.memory.grads
                                                    + s.memory.optimizer), lambda _p: True),
    _memory("activations", "activations"),
    _memory("received", "received"),
    _memory("outputs", "outputs"),
    _memory("loss", "loss"),
    _memory("backward", "backward"),
    _memory("stashed", "stashed"),
    _memory("deferred W", "deferred"),
    _memory("workspace", "workspace"),
    ("total memory", lambda _p, s: format_bytes(s.memory.total), lambda _p: True),
)


def stage_table(plan: Plan) -> list[str]:
    """report.md's stage table, with only the columns that apply to the plan (no
    stashed column of 0 B on every stage of a 1F1B plan)."""
    columns = [(header, cell) for header, cell, applies in _COLUMNS if applies(plan)]
    return [
        "| " + " | ".join(header for header, _ in columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(cell(plan, stage) for _, cell in columns) + " |"
          for stage in plan.stages),
    ]


def render_report(plan: Plan, *, svg: bool = True) -> str:
    """report.md; ``svg``: partition.svg was drawn (Graphviz installed), so link it."""
    lines = [
        f"# fxpipe plan: {plan.model}",
        "",
        *(f"- {line}" for line in overview(plan)),
        "",
        "The same plan drawn (the stages over the model's layers, memory per GPU against "
        "the limit, the schedule, the baselines) is [report.html](report.html).",
        "",
        *layout_lines(plan),
        "## Stages",
        "",
        "Times and memory are per GPU of the stage (a replicated stage's GPUs each take "
        "1/r of every micro-batch; its comm includes the all-reduce of its gradients).",
        "",
    ]
    if _splits(plan):
        lines += [
            "The backward is B (the input gradient, what the previous stage waits for) and "
            "W (the weight gradient, which a zero-bubble schedule defers); deferred W is "
            "what the waiting weight gradients keep.",
            "",
        ]
    lines += stage_table(plan)
    lines += [
        "",
        "## Against the baselines",
        "",
        "| partition | bottleneck | iteration | max memory | fits |",
        "|---|---|---|---|---|",
    ]
    lines += [f"| {' | '.join(row)} |" for row in summary_rows(plan)]
    if plan.tied:
        lines += ["", "## Tied parameters", ""]
        lines += [f"- `{name}`: {how}" for name, how in sorted(plan.tied.items())]
    lines += ["", "## Stage boundaries", ""]
    for stage in plan.stages:
        received = ", ".join(f"`{v}`" for v in stage.inputs) or "the mini-batch inputs only"
        lines.append(f"- stage {stage.index} receives {received}")
    if plan.notes:
        lines += ["", "## Notes", ""] + [f"- {note}" for note in plan.notes]
    lines += [
        "",
        ("The partition diagram is `partition.svg` (source `partition.dot`)" if svg else
         "The partition diagram's source is `partition.dot` (Graphviz was not installed to "
         "draw it: `dot -Tsvg partition.dot -o partition.svg`)")
        + "; the schedule's timeline with these predicted times is `schedule.svg`:",
        "",
        "![schedule](schedule.svg)",
        "",
        "This report and `plan.json` are byte-identical for the same model and flags; the "
        "wall times of the run that wrote them are in `timing.json`.",
        "",
    ]
    return "\n".join(lines)


def _recompute(plan: Plan) -> str:
    """How the stages recompute (``_modes``), and which selective stages keep only some
    of their matmuls' and attention's outputs."""
    rules: dict[tuple[int, int], list[int]] = {}
    for stage in plan.stages:
        if stage.keeps is not None:
            rules.setdefault(stage.keeps, []).append(stage.index)
    said = _modes(plan)
    if rules:
        said += "; of those outputs, " + "; ".join(
            f"{_stages(indices)} keep{'s' * (len(indices) == 1)} only the ones doing more "
            f"than {work} FLOPs per element, or {work} into at most {width} columns"
            for (work, width), indices in sorted(rules.items(), reverse=True))
    skipped = sorted({made for stage in plan.stages for made in stage.skips})
    if skipped:
        said += ("; none keeps the ones the model writes into in place (" + ", ".join(
            f"{work} FLOPs per element into {width} columns" for work, width in skipped) + ")")
    return said


def _modes(plan: Plan) -> str:
    """How the stages recompute: which rerun their forward in the backward, keeping only
    their inputs, and which rerun all of it but their matmuls and attention."""
    by_mode = {mode: [stage.index for stage in plan.stages if stage.recompute is mode]
               for mode in StageRecompute}
    none, selective, full = (by_mode[mode] for mode in StageRecompute)
    if len(none) == len(plan.stages):
        return "none (every stage keeps its activations for its micro-batches in flight)"
    if len(full) == len(plan.stages):
        return "every stage (each keeps its inputs and reruns its forward in the backward)"
    if len(selective) == len(plan.stages):
        return ("every stage selectively (each keeps its inputs and its matmuls' and "
                "attention's outputs, and reruns the rest of its forward in the backward)")
    parts = [f"{_stages(full)} in full"] if full else []
    if selective:
        parts.append(f"{_stages(selective)} selectively")
    return (" and ".join(parts) + " (in full a stage keeps its inputs and reruns its "
            "forward in the backward; selectively also its matmuls' and attention's "
            "outputs, and reruns the rest); the others keep their activations")


def _stages(indices: list[int]) -> str:
    return f"stage {indices[0]}" if len(indices) == 1 else f"stages {format_indices(indices)}"


def _dynamic(plan: Plan) -> str:
    """Which input dimensions the stages accept at any size, and the costing shape."""
    if not plan.dynamic_dims:
        return "every dimension fixed at its traced size"
    dims = ", ".join(
        f"{d.input}[{d.dim}] (traced {d.traced}, "
        f"{f'at least {d.low}' if d.high is None else f'{d.low} to {d.high}'})"
        for d in plan.dynamic_dims
    )
    return (
        f"dynamic {dims}; every other dimension fixed at its traced size; costs, memory "
        "and the cut are computed at the traced shape"
    )
