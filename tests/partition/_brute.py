"""Plain brute force over every valid split, scored by ``evaluate``: the tests' oracle."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Iterator

from fxpipe.partition import Problem, Recompute, evaluate, violations
from fxpipe.partition.cost import Option, recompute_options
from fxpipe.schedules import ScheduleKind


def valid_splits(problem: Problem) -> Iterator[tuple[int, ...]]:
    """Every assignment of nodes to stages that ``violations`` accepts.

    Walks the nodes in a topological order of the ordering edges, giving each node every
    stage from its predecessors' largest up; ``violations`` judges the rest.
    """
    for stage_of in _monotone(problem, problem.num_stages):
        if not violations(problem, stage_of):
            yield stage_of


def _monotone(problem: Problem, stages: int) -> Iterator[tuple[int, ...]]:
    """Every assignment of nodes to ``stages`` stages in which no ordering edge goes back."""
    n = len(problem.nodes)
    preds: list[list[int]] = [[] for _ in range(n)]
    indegree = [0] * n
    for e in problem.edges:
        if e.ordered:
            preds[e.dst].append(e.src)
            indegree[e.dst] += 1
    order: list[int] = []
    ready = [v for v in range(n) if indegree[v] == 0]
    while ready:
        v = ready.pop()
        order.append(v)
        for e in problem.edges:
            if e.ordered and e.src == v:
                indegree[e.dst] -= 1
                if indegree[e.dst] == 0:
                    ready.append(e.dst)
    assert len(order) == n, "ordering edges form a cycle"

    stage = [0] * n

    def walk(i: int) -> Iterator[tuple[int, ...]]:
        if i == n:
            yield tuple(stage)
            return
        v = order[i]
        for s in range(max((stage[u] for u in preds[v]), default=0), stages):
            stage[v] = s
            yield from walk(i + 1)

    yield from walk(0)


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def policies(schedule: ScheduleKind) -> list[Recompute]:
    """The recompute policies ``schedule`` takes (selective recompute runs a backward once:
    not with the schedules that split it)."""
    return [r for r in Recompute
            if not (r is Recompute.SELECTIVE and schedule.spec.splits_backward)]


def recompute_choices(problem: Problem) -> list[tuple[Option, ...]]:
    """Every per-stage recompute choice ``problem.recompute`` allows (AUTO: all (2 + L)^K
    with L keep levels, or 2^K where the schedule splits the backward)."""
    return list(itertools.product(recompute_options(problem), repeat=problem.num_stages))


def brute_force_size(problem: Problem, stage_counts: Iterable[int] | None = None, *,
                     limit: int) -> int:
    """The splits ``brute_force`` evaluates for each of ``stage_counts`` (default: the
    problem's own), added up: every assignment no ordering edge goes back in, every way
    to share the GPUs, every recompute choice; counted up to just past ``limit``."""
    devices = problem.devices
    total = 0
    for stages in stage_counts or (problem.num_stages,):
        shared = problem.replicates and stages < devices
        each = (math.comb(devices - 1, stages - 1) if shared else 1) * (
            len(recompute_options(problem)) ** stages)
        for _ in _monotone(problem, stages):
            total += each
            if total > limit:
                return total
    return total


def brute_force(problem: Problem) -> tuple[float | None, float | None, bool]:
    """(best bottleneck among splits that fit, least max-memory of any split, any valid split);
    a replicated problem tries every split with every way to share the GPUs among stages,
    and every problem every recompute choice its policy allows (not ``evaluate``'s own)."""
    best_time: float | None = None
    least_memory: float | None = None
    any_valid = False
    sharing: list[tuple[int, ...] | None] = [None]
    if problem.replicates:
        sharing = list(compositions(problem.devices, problem.num_stages))
    choices = recompute_choices(problem)
    for stage_of, replicas, recompute in (
            (s, r, c) for s in valid_splits(problem) for r in sharing for c in choices):
        any_valid = True
        estimate = evaluate(problem, stage_of, replicas, recompute).estimate
        if least_memory is None or estimate.max_memory < least_memory:
            least_memory = estimate.max_memory
        if estimate.fits and (best_time is None or estimate.bottleneck_s < best_time):
            best_time = estimate.bottleneck_s
    return best_time, least_memory, any_valid
