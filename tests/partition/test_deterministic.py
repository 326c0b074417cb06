"""The same problem gives the same answer at any machine load: the search is bounded by
CP-SAT's deterministic time, not by the wall clock."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fxpipe.partition import Partition, StageModel, exact_groups, partition
from tests.partition.test_coarsen import random_problem


@contextmanager
def busy_machine() -> Iterator[None]:
    """Every core kept busy by spinning child processes for the duration."""
    spin = [sys.executable, "-c", "while True: pass"]
    children = [subprocess.Popen(spin) for _ in range(os.cpu_count() or 2)]
    try:
        yield
    finally:
        for child in children:
            child.kill()
            child.wait()


def answer(result: Partition) -> tuple[object, ...]:
    report = result.report
    return (result.stage_of, report.status, report.objective, report.bound,
            report.wall_clock_stopped, tuple(phase.status for phase in result.phases))


@pytest.mark.parametrize("work_limit", [0.001, 1.0])
def test_same_answer_on_a_quiet_and_a_busy_machine(work_limit: float) -> None:
    # 0.001: the work limit stops every CP-SAT search before it proves anything (the
    # answer is wherever the searches had got to; the block bound proves it here);
    # 1.0: CP-SAT proves the optimum.
    problem = random_problem(3, n=600, K=16)
    quiet = partition(problem, work_limit=work_limit, coarsen=False)
    with busy_machine():
        busy = partition(problem, work_limit=work_limit, coarsen=False)
    assert not quiet.report.wall_clock_stopped
    searches = [phase.status for phase in quiet.phases]
    if work_limit < 0.01:
        assert searches and "OPTIMAL" not in searches
    else:
        assert searches[-1] == "OPTIMAL"
    assert answer(busy) == answer(quiet)


def test_the_wall_clock_safety_net_is_reported() -> None:
    # No warm start and a big program: no machine proves it within 10 ms of wall clock,
    # while the work limit alone would let the search go on (a small program with a warm
    # start can be proved within 10 ms on a quiet machine, so the net would not fire).
    # (800 x 16: 12,800 placement variables; here nothing found within the 10 ms.)
    model = StageModel(exact_groups(random_problem(3, n=800, K=16)))
    result = model.solve(work_limit=1000.0, time_limit_s=0.01)
    assert result.wall_clock_stopped
    assert result.status not in ("OPTIMAL", "INFEASIBLE")
