"""report.md's stage table: only the columns that apply to the plan."""

from __future__ import annotations

from fxpipe.plan import Estimate, Plan, SolverReport, StageMemory, StagePlan
from fxpipe.report import render_report
from fxpipe.report.markdown import stage_table


def _plan(schedule: str = "1f1b", stages: int = 2, virtual: int = 1, **held: int) -> Plan:
    """A hand-written plan whose last stage also holds ``held`` (StageMemory's kinds)."""
    def stage(j: int) -> StagePlan:
        memory = StageMemory(params=1 << 20, grads=1 << 20, optimizer=2 << 20,
                             activations=3 << 20, **(held if j == stages - 1 else {}))
        return StagePlan(j, (f"op{j}",), forward_s=1e-3, backward_s=2e-3,
                         backward_weight_s=1e-3, memory=memory)

    estimate = Estimate(bottleneck_s=3e-3, iteration_s=1e-2, bubble_fraction=0.2,
                        max_memory=7 << 20, fits=True)
    return Plan(num_stages=stages, schedule=schedule, microbatches=4,
                stages=tuple(stage(j) for j in range(stages)),
                solver=SolverReport("hand-written", "HEURISTIC", 3e-3, 3e-3),
                estimate=estimate, virtual_stages=virtual)


def _columns(plan: Plan) -> list[str]:
    header, rule, *rows = stage_table(plan)
    columns = header.strip("|").split(" | ")
    assert rule.count("---") == len(columns)
    assert all(row.count(" | ") == len(columns) - 1 for row in rows), rows
    return [column.strip() for column in columns]


def test_a_1f1b_plan_has_no_column_of_nothing() -> None:
    columns = _columns(_plan())
    assert columns == ["stage", "ops", "params", "fwd FLOPs", "fwd (F)", "bwd",
                       "params+grads+opt", "activations", "total memory"]
    report = render_report(_plan())
    assert "0 B |" not in report and "deferred W is what" not in report


def test_a_kind_some_stage_holds_is_a_column() -> None:
    assert {"stashed", "outputs"} <= set(_columns(_plan("pipedream", stashed=5 << 20,
                                                         outputs=1 << 10)))
    assert "workspace" in _columns(_plan(workspace=1 << 10))


def test_a_split_backward_shows_b_and_w_and_a_shared_gpu_its_gpus() -> None:
    columns = _columns(_plan("zb1p", deferred=1 << 20))
    assert "bwd" not in columns and {"bwd input (B)", "bwd weight (W)", "deferred W"} <= set(
        columns)
    assert "deferred W is what the waiting weight gradients keep" in render_report(
        _plan("zb1p", deferred=1 << 20))
    interleaved = _columns(_plan("interleaved", stages=4, virtual=2))
    assert interleaved[:2] == ["stage", "GPUs"]
    assert "| 2 | 0 |" in "\n".join(stage_table(_plan("interleaved", stages=4, virtual=2)))
