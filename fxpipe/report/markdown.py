"""report.md: the plan for a person, stage by stage, next to the baselines."""

from __future__ import annotations

from fxpipe.partition.plan import Estimate, Plan
from fxpipe.partition.units import format_bytes

__all__ = ["render_report", "summary_rows"]

BUBBLE_DEFINITION = "(K − 1) / (M + K − 1) of the whole step (GPipe's definition)"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _flops(value: float) -> str:
    return f"{value / 1e9:.2f} GFLOP"


def summary_rows(plan: Plan) -> list[tuple[str, str, str, str, str]]:
    """(method, bottleneck, iteration, max memory, fits) for the plan and each baseline."""
    rows = [("fxpipe (" + plan.solver.method + ")", plan.estimate)]
    rows += sorted(plan.baselines.items())
    return [
        (
            name,
            _ms(e.bottleneck_s),
            _ms(e.iteration_s),
            format_bytes(e.max_memory),
            "yes" if e.fits else "NO",
        )
        for name, e in rows
    ]


def _throughput(plan: Plan, estimate: Estimate) -> str:
    if estimate.iteration_s <= 0:
        return "-"
    return f"{plan.microbatches / estimate.iteration_s:.1f} micro-batches/s"


def render_report(plan: Plan) -> str:
    limit = "none" if plan.memory_limit == float("inf") else format_bytes(plan.memory_limit)
    solver = plan.solver
    lines = [
        f"# fxpipe plan: {plan.model}",
        "",
        f"- {plan.num_stages} stages on {plan.device}, {plan.schedule} schedule, "
        f"{plan.microbatches} micro-batches per step, optimizer {plan.optimizer}, "
        f"memory limit {limit} per device",
        f"- traced with {plan.tracer}",
        f"- solver: {solver.method}, status {solver.status}, bottleneck "
        f"{_ms(solver.objective)}, bound {_ms(solver.bound)}, gap {solver.gap:.2%}, "
        f"on a graph of {solver.solved_nodes} nodes "
        f"(coarsened from {solver.graph_nodes})",
        f"- predicted bottleneck {_ms(plan.estimate.bottleneck_s)}, iteration "
        f"{_ms(plan.estimate.iteration_s)}, bubble {plan.estimate.bubble_fraction:.1%} "
        f"({BUBBLE_DEFINITION}), throughput {_throughput(plan, plan.estimate)}",
        "",
        "## Stages",
        "",
        "| stage | ops | params | fwd FLOPs | fwd | bwd | comm | params+grads+opt "
        "| activations | received | total memory |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for stage in plan.stages:
        m = stage.memory
        lines.append(
            f"| {stage.index} | {len(stage.nodes)} | {len(stage.parameters)} | "
            f"{_flops(stage.flops_forward)} | {_ms(stage.forward_s)} | {_ms(stage.backward_s)} | "
            f"{_ms(stage.comm_s)} | {format_bytes(m.params + m.grads + m.optimizer)} | "
            f"{format_bytes(m.activations)} | {format_bytes(m.received)} | "
            f"{format_bytes(m.total)} |"
        )
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
        "The partition diagram is `partition.svg` (source `partition.dot`); the schedule's "
        "timeline with these predicted times is `schedule.svg`:",
        "",
        "![schedule](schedule.svg)",
        "",
        "This report and `plan.json` are byte-identical for the same model and flags; the "
        "wall times of the run that wrote them are in `timing.json`.",
        "",
    ]
    return "\n".join(lines)
