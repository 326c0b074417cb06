"""A program the hint solves has a solution, whatever CP-SAT says: OR-Tools 9.15's
presolve proved such a program INFEASIBLE (Llama-3-70B's exact groups at --gpus 64 --pp 8
--tp 8, with one worker; with two interleaved ones it aborted the process), and read as
proof that made the hint "OPTIMAL" where a 0.9 % better split existed."""

from __future__ import annotations

import pytest

from fxpipe.partition import StageModel, evaluate, exact_groups, ilp, interval_dp
from fxpipe.partition.ilp_search import Search
from tests.partition.test_coarsen import random_problem


def test_infeasible_is_no_proof_where_the_hint_solves_the_program(
        monkeypatch: pytest.MonkeyPatch) -> None:
    exact = exact_groups(random_problem(5, n=40, K=4))
    split = interval_dp(exact)
    assert split is not None
    monkeypatch.setattr(ilp, "run_search", lambda model, **_: Search(
        "INFEASIBLE", (), 0.0, 0.0, 0.0, wall_clock_stopped=False))
    hinted = StageModel(exact, hint=split)
    assert hinted.upper_ticks == hinted.hint_ticks
    assert hinted.solve().status == "UNKNOWN"
    # a split to beat: INFEASIBLE is the proof that none is better
    bottleneck = evaluate(exact.problem, exact.expand(split)).bottleneck_s
    beaten = StageModel(exact, hint=split, upper_s=bottleneck)
    assert beaten.upper_ticks is not None and beaten.upper_ticks < beaten.hint_ticks
    assert beaten.solve().status == "INFEASIBLE"
    assert StageModel(exact).solve().status == "INFEASIBLE"
