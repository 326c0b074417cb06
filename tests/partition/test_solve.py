"""The order of ``partition``'s steps on a program too big for CP-SAT: which DP runs
first, what bounds the next, and what is not computed twice."""

from __future__ import annotations

import math

import pytest

from fxpipe.partition import Edge, Node, Problem, Recompute, partition
from fxpipe.partition.bound import block_bound
from fxpipe.partition.evaluate import evaluate
from fxpipe.schedules import ScheduleKind

GiB = 2**30


def _memory_binds_every_baseline() -> Problem:
    """12 equal ops of 1 GiB of activations onto 3 stages under 1F1B in 10 GiB: the
    baselines cut 4 / 4 / 4, and stage 0 keeps 3 micro-batches of its 4 GiB (12 GiB);
    the interval DP keeps 3 on stage 0 (9 GiB) and 5 on one of the others."""
    nodes = tuple(Node(f"n{i}", 1.0, 1.0, activation_bytes=GiB) for i in range(12))
    return Problem(nodes, tuple(Edge(i, i + 1) for i in range(11)), num_stages=3,
                   memory_limit=10 * GiB, schedule=ScheduleKind.ONE_F_ONE_B, microbatches=6,
                   recompute=Recompute.NONE)


def test_the_dp_first_where_no_baseline_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing bounds the interval DP nor the block bound where memory binds every
    baseline: the DP runs first, and its split's bottleneck bounds the block bound (one
    run of it, 9.7 -> 5.9 s on Llama-3-405B onto 128 stages in 160 GiB). A bound the
    caller gives is not computed again (the layout search's final solve ran it twice)."""
    from fxpipe import forked
    from fxpipe.partition import solve

    uppers: list[float] = []

    def recorded(exact: object, upper_s: float = math.inf) -> float | None:
        uppers.append(upper_s)
        return block_bound(exact, upper_s=upper_s)  # type: ignore[arg-type]

    monkeypatch.setattr(solve, "block_bound", recorded)
    monkeypatch.setattr(forked, "_can_fork", lambda: False)  # the calls in this process
    monkeypatch.setattr(solve, "BOUND_FIRST", 1)  # the bound beside the DP, as at 10,000
    monkeypatch.setattr(solve, "HUGE_MODEL", 1)  # and no CP-SAT, as beyond 200,000
    problem = _memory_binds_every_baseline()
    found = partition(problem, time_limit_s=10)
    assert not any(b.fits for b in found.baselines.values())
    slowest = evaluate(problem, found.stage_of).bottleneck_s
    assert found.stage_of.count(0) == 3 and slowest == 10.0  # 5 ops of 2 s
    assert uppers == [slowest]
    assert found.report.bound <= found.report.objective == slowest

    uppers.clear()
    again = partition(problem, time_limit_s=10, bound_s=found.report.bound,
                      hint=found.stage_of)
    assert uppers == []
    assert (again.stage_of, again.report.bound) == (found.stage_of, found.report.bound)
