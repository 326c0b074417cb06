"""The repair of a split the search did not prove (``fxpipe.partition.repair``): an idle
stage one pair move from a better split takes work, a split proved OPTIMAL is left
alone, and what the repair answers is a valid split that fits and is better by
``evaluate``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fxpipe.partition import (
    Edge,
    Evaluation,
    Node,
    Problem,
    evaluate,
    exact_groups,
    partition,
    violations,
)
from fxpipe.partition import solve as solve_module
from fxpipe.partition.ilp import IlpResult
from fxpipe.partition.interleave import pair_sweeps
from fxpipe.partition.repair import SWEEPS, TOLERANCE, better, gpu_times, repair
from fxpipe.schedules import ScheduleKind

from ._brute import valid_splits
from .test_bruteforce import MS, problems

shared = st.one_of(problems(), problems(layout="interleaved"), problems(layout="v"))


def chain(times: list[int], *, stages: int, activations: list[int] | None = None,
          comm: list[float] | None = None, **kwargs: object) -> Problem:
    """A chain of nodes, node i taking times[i] ms forward and as long backward (0: a
    size or arange, no work), each sending 8 bytes on, in comm[i] ms (default none)."""
    saved = activations or [0] * len(times)
    sends = comm or [0.0] * len(times)
    nodes = tuple(Node(f"n{i}", t * MS, t * MS, activation_bytes=a, output_bytes=8,
                       comm_s=c * MS)
                  for i, (t, a, c) in enumerate(zip(times, saved, sends, strict=True)))
    edges = tuple(Edge(i, i + 1) for i in range(len(times) - 1))
    return Problem(nodes, edges, num_stages=stages, **kwargs)  # type: ignore[arg-type]


def _idle(problem: Problem, stage_of: tuple[int, ...]) -> list[int]:
    """The stages without compute."""
    work = [0.0] * problem.num_stages
    for node, j in zip(problem.nodes, stage_of, strict=True):
        work[j] += node.forward_s + node.backward_s
    return [j for j, w in enumerate(work) if w == 0]


def test_idle_stage_takes_work_where_that_lowers_the_bottleneck() -> None:
    # stage 0 holds only a size node; stage 1 two layers
    p = chain([0, 1, 1, 1], stages=3)
    idle = (0, 1, 1, 2)
    found = repair(exact_groups(p), idle)
    assert found is not None
    assert found.stage_of == (0, 0, 1, 2)
    assert found.bottleneck_s == pytest.approx(evaluate(p, idle).bottleneck_s / 2)
    assert _idle(p, found.stage_of) == []


def test_idle_stage_takes_work_where_the_bottleneck_stays() -> None:
    # the head (last node) alone is the bottleneck no split lowers, as GPT-2 XL's onto 32
    p = chain([0, 1, 1, 4], stages=3)
    idle = (0, 1, 1, 2)
    found = repair(exact_groups(p), idle)
    assert found is not None and found.stage_of == (0, 0, 1, 2)
    before = evaluate(p, idle)
    assert found.bottleneck_s == before.bottleneck_s
    assert better(p, found, before) and not better(p, before, found)
    assert _idle(p, idle) == [0] and _idle(p, found.stage_of) == []


def test_idle_stage_takes_work_at_cheap_cuts_where_balance_would_lengthen_the_step(
) -> None:
    # three layers of two nodes, each layer's first sending a wide value (1 ms), its
    # second a narrow one (0.1 ms), then a head (26 ms) no split makes faster. Halving
    # the layers between stages 0 and 1 cuts through a layer: balanced (13 ms each), but
    # 1.8 ms more sent per micro-batch, a longer step; the repair cuts between layers.
    p = chain([0, 2, 2, 2, 2, 2, 2, 13], stages=3, microbatches=8,
              comm=[0.1, 1.0, 0.1, 1.0, 0.1, 1.0, 0.1, 0.0])
    idle = (0, 1, 1, 1, 1, 1, 1, 2)
    exact = exact_groups(p)
    halved = exact.expand(pair_sweeps(exact, exact.restrict(idle), sweeps=SWEEPS) or ())
    assert halved == (0, 0, 0, 0, 1, 1, 1, 2)
    before = evaluate(p, idle)
    assert evaluate(p, halved).estimate.iteration_s > before.estimate.iteration_s
    found = repair(exact, idle)
    assert found is not None and found.stage_of == (0, 0, 0, 0, 0, 1, 1, 2)
    assert found.bottleneck_s == before.bottleneck_s
    assert found.estimate.iteration_s == pytest.approx(before.estimate.iteration_s)
    assert _idle(p, found.stage_of) == []


def test_no_move_past_the_memory_limit() -> None:
    # 1F1B, M = 4: stage 0 keeps 3 micro-batches' activations, stage 1 two. n1 on stage 0
    # would need 3 x 100 bytes: the idle stage stays idle rather than not fit.
    p = chain([0, 1, 1, 1], stages=3, activations=[0, 100, 0, 0], microbatches=4,
              memory_limit=250)
    idle = (0, 1, 1, 2)
    assert evaluate(p, idle).estimate.fits
    assert not evaluate(p, (0, 0, 1, 2)).estimate.fits
    assert repair(exact_groups(p), idle) is None
    assert repair(exact_groups(chain([0, 1, 1, 1], stages=3, activations=[0, 100, 0, 0],
                                     microbatches=4)), idle) is not None


def _stopped_search(monkeypatch: pytest.MonkeyPatch, split: tuple[int, ...]) -> None:
    """Make ``partition``'s search stop, unproved, with ``split`` its only answer: what
    CP-SAT at its work or time limit does on a big model."""
    def search(problem: Problem, exact: object, *args: object, **kwargs: object
               ) -> tuple[object, list[IlpResult], IlpResult]:
        stopped = IlpResult("FEASIBLE", None, split, 0.0, 0.0, 0.0, len(problem.nodes))
        return exact, [stopped], stopped

    monkeypatch.setattr(solve_module, "_search", search)
    monkeypatch.setattr(solve_module, "_baselines", lambda problem, exact: ({}, {}, []))


def test_partition_repairs_a_split_its_search_left_idle(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    p = chain([0, 1, 1, 1], stages=3)
    _stopped_search(monkeypatch, (0, 1, 1, 2))
    result = partition(p)
    assert result.stage_of == (0, 0, 1, 2)
    assert _idle(p, result.stage_of) == []
    assert result.evaluation == evaluate(p, result.stage_of)
    assert result.report.objective == result.evaluation.bottleneck_s
    # the repaired split meets the block bound: proved
    assert result.report.status == "OPTIMAL"


def test_partition_leaves_a_proved_split_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, ...]] = []

    def spy(exact: object, stage_of: tuple[int, ...], **kwargs: object) -> None:
        calls.append(tuple(stage_of))

    monkeypatch.setattr(solve_module, "repair", spy)
    p = chain([0, 1, 1, 4], stages=3)
    result = partition(p)
    assert result.report.status == "OPTIMAL"
    assert calls == []
    # stopped unproved (the bound cannot prove 8 ms here: the head is its own stage's)
    _stopped_search(monkeypatch, (0, 1, 1, 2))
    monkeypatch.setattr(solve_module, "block_bound", lambda exact, upper_s=None: None)
    monkeypatch.setattr(solve_module, "shared_gpu_bound", lambda exact, upper_s=None: None)
    assert partition(p).report.status == "FEASIBLE"
    assert calls == [(0, 1, 1, 2)]


@given(st.data())
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_repair_answers_a_valid_fitting_better_split(data: st.DataObject) -> None:
    p = data.draw(shared)
    assume(not p.replicates)
    splits = list(itertools.islice(valid_splits(p), 400))
    fitting = [s for s in splits if evaluate(p, s).estimate.fits]
    assume(fitting)
    start = data.draw(st.sampled_from(fitting))
    exact = exact_groups(p)
    found = repair(exact, start)
    assert repair(exact, start) == found  # deterministic
    if found is None:
        return
    before = evaluate(p, start)
    assert not violations(p, found.stage_of)
    assert found.estimate.fits
    assert found.bottleneck_s <= before.bottleneck_s
    assert better(p, found, before)
    assert found == evaluate(p, found.stage_of)
    _no_longer_step(found, before)


def _no_longer_step(after: Evaluation, before: Evaluation) -> None:
    """Where the slowest GPU is no faster, the step is no longer either."""
    if after.bottleneck_s >= before.bottleneck_s * (1 - TOLERANCE):
        was = before.estimate.iteration_s
        assert after.estimate.iteration_s <= was * (1 + TOLERANCE)


@st.composite
def chains(draw: st.DrawFn) -> tuple[Problem, tuple[int, ...]]:
    """A random chain (some nodes without work) under a random memory limit, and a
    contiguous split of it that fits."""
    n = draw(st.integers(2, 12))
    K = draw(st.integers(2, min(n, 5)))
    times = [draw(st.sampled_from([0, 0, 1, 2, 3, 5, 8])) for _ in range(n)]
    saved = [draw(st.integers(0, 4)) * 10 for _ in range(n)]
    schedule = draw(st.sampled_from([ScheduleKind.ONE_F_ONE_B, ScheduleKind.GPIPE]))
    cuts = sorted(draw(st.lists(st.integers(1, n - 1), min_size=K - 1, max_size=K - 1,
                                unique=True)))
    start = tuple(sum(i >= c for c in cuts) for i in range(n))
    unlimited = chain(times, stages=K, activations=saved, microbatches=4, schedule=schedule)
    need = evaluate(unlimited, start).estimate.max_memory
    limit = need + draw(st.integers(0, 200))
    return chain(times, stages=K, activations=saved, microbatches=4, schedule=schedule,
                 memory_limit=limit), start


@given(chains())
@settings(max_examples=200, deadline=None)
def test_repair_on_chains_keeps_order_and_memory(case: tuple[Problem, tuple[int, ...]]
                                                 ) -> None:
    p, start = case
    found = repair(exact_groups(p), start)
    if found is None:
        return
    assert all(a <= b for a, b in itertools.pairwise(found.stage_of))  # a chain: monotone
    assert set(found.stage_of) == set(range(p.num_stages))  # no stage left empty
    assert found.estimate.max_memory <= p.memory_limit
    before = evaluate(p, start)
    assert found.bottleneck_s <= before.bottleneck_s
    assert sorted(gpu_times(p, found), reverse=True) < sorted(gpu_times(p, before),
                                                              reverse=True)
    _no_longer_step(found, before)
