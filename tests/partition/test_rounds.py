"""Two rounds of an interleaved split re-cut together (``fxpipe.partition.rounds``)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import Edge, Node, Problem, exact_groups, violations
from fxpipe.partition.interleave import _Search
from fxpipe.partition.rounds import _Rounds, _Vee, recut_rounds, recut_vee
from fxpipe.schedules import ScheduleKind

from ._brute import policies
from .test_bruteforce import MS


@st.composite
def _chains(draw: st.DrawFn, *, exact: bool = False, vee: bool = False
            ) -> tuple[Problem, list[int], int]:
    """Chains of 6-9 layers on 2-3 GPUs x 2-3 rounds (two in a V where ``vee``: ZB-V,
    DualPipeV), a contiguous split of them as cuts, and the first of two rounds to
    re-cut. Memory sometimes binds, transfers cost time, and empty stages are sometimes
    allowed; where ``exact``, no transfer, no memory limit, and empty stages allowed."""
    gpus = draw(st.integers(2, 3))
    v = 2 if gpus == 3 or vee else draw(st.integers(2, 3))
    schedule = (draw(st.sampled_from([s for s in ScheduleKind if s.spec.v_placed])) if vee
                else ScheduleKind.INTERLEAVED)
    n = draw(st.integers(gpus * v, 9 if gpus == 3 else 10))
    nodes = tuple(Node(f"n{i}", forward_s=draw(st.integers(0, 9)) * MS,
                       backward_s=draw(st.integers(0, 9)) * MS,
                       activation_bytes=draw(st.integers(0, 30)),
                       param_bytes=draw(st.integers(0, 20)),
                       output_bytes=0 if exact else draw(st.sampled_from([0, 10, 200])),
                       comm_s=0.0 if exact else draw(st.integers(0, 9)) * MS)
                  for i in range(n))
    empty = True if exact else draw(st.booleans())
    problem = Problem(nodes=nodes, edges=tuple(Edge(i, i + 1) for i in range(n - 1)),
                      num_stages=gpus * v, virtual_stages=v,
                      schedule=schedule, microbatches=2 * gpus,
                      memory_limit=float("inf") if exact
                      else draw(st.sampled_from([300.0, 600.0, float("inf")])),
                      recompute=draw(st.sampled_from(policies(schedule))),
                      allow_empty_stages=empty)
    low, m = (0 if empty else 1), exact_groups(problem).num_coarse
    inner = sorted(draw(st.lists(st.integers(low, m - low), min_size=gpus * v - 1,
                                 max_size=gpus * v - 1, unique=not empty)))
    return problem, [0, *inner, m], draw(st.integers(0, v - 2))


def _loads(problem: Problem, cuts: list[int]) -> list[float]:
    return _Search(exact_groups(problem), list(cuts)).loads()


def _recut(problem: Problem, cuts: list[int], r: int) -> tuple[float, list[int] | None]:
    search = _Search(exact_groups(problem), list(cuts))
    now = max(search.loads())
    if problem.schedule.spec.v_placed:
        return now, recut_vee(search.prices, search.stage, search.cuts, search.gap, now)
    return now, recut_rounds(search.prices, search.stage, search.cuts, search.gap, r, now)


def _either(**kw: bool) -> st.SearchStrategy[tuple[Problem, list[int], int]]:
    return st.one_of(_chains(**kw), _chains(vee=True, **kw))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_either())
def test_a_recut_only_moves_its_rounds_and_lowers_every_gpu(
        case: tuple[Problem, list[int], int]) -> None:
    """What the move returns re-cuts only rounds r and r + 1 (a V: both arms), keeps
    every stage (none empty unless allowed), and has every GPU, priced afresh, faster
    than the slowest GPU before."""
    problem, cuts, r = case
    N = problem.devices
    now, found = _recut(problem, cuts, r)
    if found is None:
        return
    moved = [j for j, (a, b) in enumerate(zip(cuts, found, strict=True)) if a != b]
    assert all(r * N < j < (r + 2) * N for j in moved)
    gap = 0 if problem.allow_empty_stages else 1
    assert all(b - a >= gap for a, b in itertools.pairwise(found)), (cuts, found, now)
    assert max(_loads(problem, found)) < now
    expanded = exact_groups(problem).expand(
        tuple(j for j in range(problem.num_stages) for _ in range(found[j], found[j + 1])))
    assert not violations(problem, expanded)


def _best_recut(problem: Problem, cuts: list[int], r: int) -> float:
    """The slowest GPU of the best re-cut of rounds r and r + 1, trying every one (no
    memory limit: each stage at its fastest recompute choice)."""
    search = _Search(exact_groups(problem), list(cuts))
    N, K, m = problem.devices, problem.num_stages, cuts[-1]
    places = np.arange(m + 1)
    # time[j][a, b]: stage j on [a, b) at its fastest choice, inf where b < a
    time = [np.min(search.prices.pairs(j, places, places, 0)[::2], axis=0) for j in range(K)]
    lo, hi = cuts[r * N], cuts[(r + 2) * N]
    inner = np.array(list(itertools.combinations_with_replacement(range(lo, hi + 1),
                                                                  2 * N - 1)))
    every = np.concatenate([np.tile(cuts[:r * N + 1], (len(inner), 1)), inner,
                            np.tile(cuts[(r + 2) * N:], (len(inner), 1))], axis=1)
    loads = np.zeros((len(inner), N))
    for j in range(K):
        loads[:, problem.device_of(j)] += time[j][every[:, j], every[:, j + 1]]
    return float(loads.max(axis=1).min())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_either(exact=True))
def test_a_recut_is_the_best_split_of_its_rounds_where_furthest_is_best(
        case: tuple[Problem, list[int], int]) -> None:
    """With no transfers, no memory limit and empty stages allowed, a later cut never
    costs a later GPU more, so the table is exact: the move finds the best re-cut of the
    two rounds (found by trying every one) to the bisection's 0.003 %, and finds none
    only where nothing beats the split already there."""
    problem, cuts, r = case
    best = _best_recut(problem, cuts, r)
    now, found = _recut(problem, cuts, r)
    if best >= now * (1 - 1e-9):
        assert found is None
        return
    assert found is not None
    assert max(_loads(problem, found)) <= best * (1 + 1e-4) + 1e-12


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_either(), st.floats(0.5, 1.0), st.data())
def test_the_table_only_finds_splits_that_meet_its_time(
        case: tuple[Problem, list[int], int], share: float, data: st.DataObject) -> None:
    """Whatever split the dynamic program finds at time T (interleaved: and a middle cut),
    priced afresh, has every GPU at or under T: transfers and the values kept past a
    block's end make its price fall as well as rise along the end, which the running
    maxima cover."""
    problem, cuts, r = case
    search = _Search(exact_groups(problem), list(cuts))
    now = max(search.loads())
    if now == float("inf"):
        return
    T = now * share
    if problem.schedule.spec.v_placed:
        vee = _Vee(search.prices, search.stage, search.cuts, search.gap)
        back = vee.fits(T)
        found = None if back is None else vee.cuts_of(back)
    else:
        rounds = _Rounds(search.prices, search.stage, search.cuts, search.gap, r)
        s = data.draw(st.integers(0, max(0, rounds.middle.size - 1)))
        back = rounds.fits(T, s) if rounds.middle.size else None
        found = None if back is None else rounds.cuts_of(s, back)
    if found is not None:
        assert max(_loads(problem, found)) <= T * (1 + 1e-12)
