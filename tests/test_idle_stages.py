"""Stages that compute nothing or hold no parameters are named in the plan's notes."""

from __future__ import annotations

import json
from pathlib import Path

from fxpipe.plan import SolverReport, StagePlan
from fxpipe.planning import idle_notes
from tests._cli import fxpipe

ROOT = Path(__file__).resolve().parents[1]


def _stage(k: int, flops: int, params: tuple[str, ...]) -> StagePlan:
    return StagePlan(index=k, nodes=(f"n{k}",), parameters=params, flops_forward=flops)


def test_idle_and_parameter_free_stages_are_named_with_what_the_search_proved() -> None:
    stages = [_stage(0, 0, ()), _stage(1, 10, ()), _stage(2, 10, ("w",)), _stage(3, 0, ())]
    optimal = SolverReport("cp-sat", "OPTIMAL", 1.0, 1.0)
    (note,) = idle_notes(stages, optimal, "1f1b")
    assert note.startswith("stages 0, 3 compute nothing (no FLOPs); stage 1 holds no parameters")
    assert "proved no other split better" in note
    feasible = SolverReport("cp-sat", "FEASIBLE", 1.0, 0.9)
    (note,) = idle_notes([*stages[:2], _stage(2, 5, ("w",))], feasible, "zbv")
    assert "stage 0 computes nothing" in note and "gap of 10.00%" in note
    assert "under a V each GPU runs two stages" in note
    assert "raise --work-limit" in note
    # within 1 % of the bound a longer search is no fix: the note says how close it is
    (note,) = idle_notes(stages, SolverReport("interval-dp", "FEASIBLE", 1.0, 0.9991), "1f1b")
    assert "within 0.09% of its bound, so no split is faster by more than that" in note
    assert "--work-limit" not in note
    assert idle_notes([_stage(0, 1, ("w",))], optimal, "1f1b") == []


def test_a_zbv_plan_with_parameter_free_stages_says_so_in_its_report(tmp_path: Path) -> None:
    ran = fxpipe("split", ROOT / "examples" / "gpt.py", "--gpus", "2", "--schedule", "zbv",
                 "--out", tmp_path / "out", cwd=tmp_path)
    assert ran.returncode == 0, ran.stderr
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    idle = [s["index"] for s in plan["stages"] if s["flops_forward"] == 0]
    assert idle, "the plan changed: this GPT at --gpus 2 zbv no longer has an idle stage"
    assert any("compute nothing" in n or "computes nothing" in n for n in plan["notes"])
    assert "nothing (no FLOPs)" in (tmp_path / "out" / "report.md").read_text()
