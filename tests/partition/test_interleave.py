"""The shared-GPU warm start (``fxpipe.partition.interleave``) and bound
(``bound.shared_gpu_bound``): its prices are ``evaluate``'s, its moves never make the
slowest GPU slower, it balances across rounds, and the bound (tied all-reduces and the
least the cuts send) is below brute force."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fxpipe.partition import (
    Comm,
    Edge,
    Node,
    Problem,
    Recompute,
    TiedGroup,
    TiedPolicy,
    evaluate,
    exact_groups,
    partition,
    violations,
)
from fxpipe.partition import solve as solve_module
from fxpipe.partition.bound import shared_gpu_bound
from fxpipe.partition.interleave import (
    _contiguous,
    _Search,
    round_profiles,
    shared_gpu_search,
    shared_gpu_warm_start,
)
from fxpipe.partition.prices import Prices
from fxpipe.schedules import ScheduleKind

from ._brute import brute_force
from .test_bruteforce import MS, problems, small_enough

shared = st.one_of(problems(layout="interleaved"), problems(layout="v"))


def _gpu_times(problem: Problem, stage_of: tuple[int, ...]) -> list[float]:
    """Per GPU, ``evaluate``'s time, inf where it does not fit."""
    ev = evaluate(problem, stage_of)
    times = [0.0] * problem.devices
    memory = [0] * problem.devices
    for j, stage in enumerate(ev.stages):
        times[problem.device_of(j)] += stage.time_s
        memory[problem.device_of(j)] += stage.memory.total
    return [t if m <= problem.memory_limit else float("inf")
            for t, m in zip(times, memory, strict=True)]


def _cuts(assignment: tuple[int, ...], K: int) -> list[int]:
    return [0, *(sum(1 for s in assignment if s < j) for j in range(1, K)), len(assignment)]


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared, st.data())
def test_prices_are_evaluates(problem: Problem, data: st.DataObject) -> None:
    """On a contiguous split of the order, the search's GPU loads are ``evaluate``'s GPU
    times (inf where nothing fits) for neighbour transport along ordering edges (the
    interval DP's pricing, which the search reuses, is exact there)."""
    problem = replace(problem, comm=Comm.NEIGHBOUR,
                      edges=tuple(replace(e, ordered=True) for e in problem.edges))
    exact = exact_groups(problem)
    K, n = problem.num_stages, exact.num_coarse
    if n < K and not problem.allow_empty_stages:
        return
    sizes = sorted(data.draw(st.lists(st.integers(0, n), min_size=K - 1, max_size=K - 1)))
    assignment = tuple(sum(1 for s in sizes if s <= g) for g in range(n))
    if violations(problem, exact.expand(assignment)):
        return
    loads = _Search(exact, _cuts(assignment, K)).loads()
    times = _gpu_times(problem, exact.expand(assignment))
    ev = evaluate(problem, exact.expand(assignment))
    near_limit = any(abs(s.memory.total - problem.memory_limit) < 16 for s in ev.stages)
    if near_limit:  # evaluate rounds each memory part to whole bytes
        return
    assert loads == pytest.approx(times, rel=1e-9, abs=1e-12)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared, st.data())
def test_pair_prices_are_blocks_priced_one_end_at_a_time(problem: Problem,
                                                          data: st.DataObject) -> None:
    """The window moves price every (start, end) pair at once (``Prices.pairs``): the
    same figures as ``block`` with the end fixed, and the same count of blocks priced."""
    exact = exact_groups(problem)
    n, gap = exact.num_coarse, data.draw(st.integers(0, 1))
    first = data.draw(st.integers(0, n))
    starts = np.arange(first, data.draw(st.integers(first + 1, n + 1)))
    first = data.draw(st.integers(0, n))
    ends = np.arange(first, data.draw(st.integers(first + 1, n + 1)))
    j = data.draw(st.integers(0, problem.num_stages - 1))
    grid, one = Prices(exact), Prices(exact)
    priced = grid.pairs(j, starts, ends, gap)
    for at, x in enumerate(ends.tolist()):
        ok = starts <= x - gap
        alone = one.block(j, starts[ok], np.full(int(ok.sum()), x)) if ok.any() else None
        for i, figures in enumerate(priced):
            assert np.all(figures[~ok, at] == (np.inf if i % 2 == 0 else 0.0))
            if alone is not None:
                assert np.array_equal(figures[ok, at], alone[i])
    assert grid.priced == one.priced


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared, st.integers(0, 5))
def test_search_never_makes_the_slowest_gpu_slower(problem: Problem, which: int) -> None:
    exact = exact_groups(problem)
    K = problem.num_stages
    if exact.num_coarse < K and not problem.allow_empty_stages:
        return
    start = round_profiles(exact)[which]
    found = shared_gpu_search(exact, start)
    before = max(_Search(exact, _cuts(start, K)).loads())
    if found is None:
        assert before == float("inf")
        return
    assert not violations(problem, exact.expand(found))
    assert max(_Search(exact, _cuts(found, K)).loads()) <= before


def _chain(layers: int, gpus: int, v: int, activation: int = 10, **kw: object) -> Problem:
    nodes = tuple(Node(f"l{i}", forward_s=MS, backward_s=2 * MS, activation_bytes=activation,
                       param_bytes=100) for i in range(layers))
    edges = tuple(Edge(i, i + 1) for i in range(layers - 1))
    return Problem(nodes=nodes, edges=edges, num_stages=gpus * v, virtual_stages=v,
                   schedule=ScheduleKind.INTERLEAVED, microbatches=2 * gpus, **kw)  # type: ignore[arg-type]


def test_search_moves_work_between_rounds() -> None:
    """8 equal layers, 2 GPUs x 2 modules, from 1 | 1 | 1 | 5 (GPU 0: 2 layers, GPU 1: 6):
    GPU 1's second-round work reaches GPU 0's second-round module, 4 layers each."""
    problem = _chain(8, gpus=2, v=2)
    exact = exact_groups(problem)
    found = shared_gpu_search(exact, (0, 1, 2, 3, 3, 3, 3, 3))
    assert found is not None
    assert max(_gpu_times(problem, exact.expand(found))) == pytest.approx(4 * 3 * MS)


def test_window_moves_big_ops_along_a_chain_of_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Single cut moves stall where the op to move is bigger than the difference between
    two GPUs (here at 9 ms); re-cutting consecutive stages at once passes work along a
    chain of GPUs, down to all compute spread evenly (18 ms on 3 GPUs)."""
    times = [1, 5, 5, 1, 3, 1, 1, 1]
    nodes = tuple(Node(f"n{i}", forward_s=t * MS, backward_s=0.0) for i, t in enumerate(times))
    edges = tuple(Edge(i, i + 1) for i in range(len(times) - 1))
    problem = Problem(nodes=nodes, edges=edges, num_stages=6, virtual_stages=2,
                      schedule=ScheduleKind.INTERLEAVED, microbatches=3)
    exact = exact_groups(problem)
    start = (0, 1, 1, 2, 3, 4, 4, 5)
    found = shared_gpu_search(exact, start)
    assert found is not None
    assert max(_gpu_times(problem, exact.expand(found))) == pytest.approx(6 * MS)
    monkeypatch.setattr(_Search, "window_around_slowest", lambda self: False)
    pairs_only = shared_gpu_search(exact, start)
    assert pairs_only is not None
    assert max(_gpu_times(problem, exact.expand(pairs_only))) == pytest.approx(9 * MS)


def test_two_round_window_balances_what_windows_leave(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    """3 GPUs x 2 rounds: from this start, single cuts and windows of one round stall at
    12 ms; re-cutting two GPUs' stages in both rounds at once reaches 11 ms, the best
    contiguous split (found by trying them all)."""
    times = [1, 2, 2, 1, 8, 1, 5, 4, 5, 2]
    nodes = tuple(Node(f"n{i}", forward_s=t * MS, backward_s=0.0) for i, t in enumerate(times))
    edges = tuple(Edge(i, i + 1) for i in range(len(times) - 1))
    problem = Problem(nodes=nodes, edges=edges, num_stages=6, virtual_stages=2,
                      schedule=ScheduleKind.INTERLEAVED, microbatches=3)
    exact = exact_groups(problem)
    start = (0, 1, 2, 3, 3, 3, 4, 4, 4, 5)
    guesses = [tuple(j for j, size in enumerate(sizes) for _ in range(size))
               for sizes in itertools.product(range(1, 6), repeat=6) if sum(sizes) == 10]
    best = min(max(_gpu_times(problem, s)) for s in guesses)
    found = shared_gpu_search(exact, start)
    assert found is not None
    assert max(_gpu_times(problem, exact.expand(found))) == pytest.approx(best)
    assert best == pytest.approx(11 * MS)
    monkeypatch.setattr(_Search, "rounds_around_slowest", lambda self: False)
    one_round = shared_gpu_search(exact, start)
    assert one_round is not None
    assert max(_gpu_times(problem, exact.expand(one_round))) == pytest.approx(12 * MS)


@st.composite
def _rounds_chains(draw: st.DrawFn) -> tuple[Problem, tuple[int, ...]]:
    """Chains of 7-12 layers on 3 GPUs x 2-3 rounds, memory sometimes binding, and a
    contiguous split of them."""
    gpus, v = 3, draw(st.integers(2, 3))
    n = draw(st.integers(gpus * v, 12))
    nodes = tuple(Node(f"n{i}", forward_s=draw(st.integers(0, 9)) * MS,
                       backward_s=draw(st.integers(0, 9)) * MS,
                       activation_bytes=draw(st.integers(0, 30)),
                       param_bytes=draw(st.integers(0, 20))) for i in range(n))
    problem = Problem(nodes=nodes, edges=tuple(Edge(i, i + 1) for i in range(n - 1)),
                      num_stages=gpus * v, virtual_stages=v,
                      schedule=ScheduleKind.INTERLEAVED, microbatches=2 * gpus,
                      memory_limit=draw(st.sampled_from([300.0, 600.0, float("inf")])),
                      recompute=draw(st.sampled_from(list(Recompute))))
    sizes = sorted(draw(st.lists(st.integers(1, n - 1), min_size=gpus * v - 1,
                                 max_size=gpus * v - 1, unique=True)))
    return problem, tuple(sum(1 for s in sizes if s <= g) for g in range(n))


@settings(max_examples=90, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_rounds_chains())
def test_two_round_window_lowers_the_gpu_times(case: tuple[Problem, tuple[int, ...]]
                                                 ) -> None:
    """When the two-round move applies, the GPU times sorted from the slowest decrease
    lexicographically (what ends the search), the split stays contiguous with no stage
    empty, and its loads are those priced afresh."""
    problem, start = case
    exact = exact_groups(problem)
    K = problem.num_stages
    search = _Search(exact, _cuts(start, K))
    before = search.loads()
    if not search.rounds_around_slowest():
        return
    assert all(a < b for a, b in itertools.pairwise(search.cuts))
    after = search.loads()
    assert sorted(after, reverse=True) < sorted(before, reverse=True)
    assert after == pytest.approx(_Search(exact, list(search.cuts)).loads())


def test_large_shared_gpu_problems_skip_the_exact_solves(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Beyond SHARED_LARGE placement variables no CP-SAT program runs on the exact groups;
    the search's split and the shared-GPU bound still prove an even chain. Below it the
    exact program runs."""
    problem = _chain(24, gpus=2, v=2)
    exact = exact_groups(problem)
    solved = partition(problem, workers=1)
    assert any(phase.num_nodes == exact.num_coarse for phase in solved.phases)
    monkeypatch.setattr(solve_module, "SHARED_LARGE", exact.num_coarse * problem.num_stages - 1)
    monkeypatch.setattr(solve_module, "SHARED_SMALL", 0)
    skipped = partition(problem, workers=1)
    assert all(phase.num_nodes < exact.num_coarse for phase in skipped.phases)
    assert not violations(problem, skipped.stage_of)
    assert skipped.report.status == "OPTIMAL"
    assert skipped.report.objective == pytest.approx(solved.report.objective)


def test_small_shared_gpu_problems_solve_the_exact_program_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Up to SHARED_SMALL placement variables the exact program is the only CP-SAT solve,
    on the whole work limit; beyond, the first exact solve gets a share of it, as for one
    module per GPU. Either way the split is valid and proved on an even chain."""
    solves: list[tuple[int, float]] = []  # (groups, work limit) of each CP-SAT solve
    solve = solve_module.StageModel.solve

    def spied(self: Any, *, work_limit: float, **kw: Any) -> Any:
        solves.append((self.coarsening.num_coarse, work_limit))
        return solve(self, work_limit=work_limit, **kw)

    monkeypatch.setattr(solve_module.StageModel, "solve", spied)
    problem = _chain(24, gpus=2, v=2)
    exact = exact_groups(problem)
    once = partition(problem, work_limit=4.0, workers=1)
    assert solves == [(exact.num_coarse, 4.0)]
    solves.clear()
    monkeypatch.setattr(solve_module, "SHARED_SMALL", exact.num_coarse * problem.num_stages - 1)
    phased = partition(problem, work_limit=4.0, workers=1)
    assert solves[0] == (exact.num_coarse, pytest.approx(4.0 * solve_module.PROOF_SHARE))
    for solved in (once, phased):
        assert not violations(problem, solved.stage_of)
        assert solved.report.status == "OPTIMAL"
    assert once.report.objective == pytest.approx(phased.report.objective)


def test_warm_start_balances_memory_bound_layers() -> None:
    """Early rounds keep more micro-batches: under a limit that binds, the warm start is
    as fast as the best contiguous split of up to 4 layers a stage (found by trying
    them all), which is slower than the best without the limit."""
    problem = _chain(12, gpus=3, v=2, activation=100, memory_limit=2500.0,
                     recompute=Recompute.AUTO)
    split = shared_gpu_warm_start(exact_groups(problem), [])
    assert split is not None
    assert not violations(problem, split) and evaluate(problem, split).estimate.fits
    guesses = [tuple(j for j, size in enumerate(sizes) for _ in range(size))
               for sizes in itertools.product((1, 2, 3, 4), repeat=problem.num_stages)
               if sum(sizes) == len(problem.nodes)]
    best = min(max(_gpu_times(problem, s)) for s in guesses)
    unlimited = replace(problem, memory_limit=float("inf"))
    assert best > min(max(_gpu_times(unlimited, s)) for s in guesses)
    assert evaluate(problem, split).bottleneck_s <= best


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared, st.sampled_from([1.0, 1.5, 4.0]), st.sets(st.integers(0, 6), max_size=2))
def test_shared_gpu_bound_is_below_every_faster_split(problem: Problem, slack: float,
                                                      light: set[int]) -> None:
    """Also with nodes made free (no time, parameters or bytes kept, though they may send):
    the light groups the bound zeroes, which a stage may hold alone."""
    free = {"forward_s": 0.0, "backward_s": 0.0, "backward_weight_s": 0.0, "param_bytes": 0,
            "activation_bytes": 0, "grad_bytes": 0, "deferred_bytes": 0, "returned": False,
            "selective_bytes": (), "selective_kept_s": ()}
    problem = replace(problem, nodes=tuple(replace(node, **free) if i in light else node
                                           for i, node in enumerate(problem.nodes)))
    assume(small_enough(problem))
    best, _, _ = brute_force(problem)
    if best is None:
        return
    bound = shared_gpu_bound(exact_groups(problem), upper_s=best * slack + 1e-12)
    assert bound is not None
    assert bound <= best


def test_shared_gpu_bound_counts_every_cut() -> None:
    """Each layer sends 1 ms to the next: whatever the split, its 3 cuts send 3 ms, charged
    to both sides, so no split beats (24 + 6) / 2 ms, which 2 layers a stage reach. The
    bound knew this before of the last round's cut alone (it must follow 9 ms of compute
    in a split that fast); the other two cuts may lie anywhere, but not at one ideal."""
    base = _chain(8, gpus=2, v=2)
    problem = replace(base, comm=Comm.NEIGHBOUR,
                      nodes=tuple(replace(node, comm_s=MS) for node in base.nodes))
    exact = exact_groups(problem)
    assert shared_gpu_bound(exact) == pytest.approx(15 * MS)
    result = partition(problem, workers=1)
    assert result.report.status == "OPTIMAL"
    assert result.report.objective == pytest.approx(15 * MS)
    assert result.report.bound >= 15 * MS * (1 - 1e-6)


def test_shared_gpu_bound_counts_a_tied_all_reduce() -> None:
    """A parameter tied between the first and last layer: a stage holding both holds
    everything, so any faster split pays the all-reduce on two stages."""
    base = _chain(8, gpus=2, v=2)
    problem = replace(base, tied=(TiedGroup("w", (0, 7), 100, allreduce_s=2 * MS),),
                      tied_policy=TiedPolicy.COPY)
    exact = exact_groups(problem)
    total = 8 * 3 * MS
    assert shared_gpu_bound(exact) == pytest.approx(total / 2)
    assert shared_gpu_bound(exact, upper_s=total) == pytest.approx((total + 4 * MS) / 2)
    result = partition(problem, workers=1)
    assert result.report.bound >= (total + 4 * MS) / 2 * (1 - 1e-6)
    assert np.isclose(result.report.objective, (total + 4 * MS) / 2)


def test_a_contiguous_split_of_fewer_groups_than_stages_keeps_one_stage_a_group() -> None:
    """Stage starts found by summing compute can pass the order's end by a rounding (3
    groups, 4 stages, a start of 4): the split still has one stage per group, in order
    (it had 4 entries for 3 groups, which repair's search refused with an assert)."""
    split = _contiguous(np.array([0, 0, 4]), 4, 3)
    assert len(split) == 3 and list(split) == sorted(split)
