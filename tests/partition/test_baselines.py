"""The interval DP (``min_max_dp``) against the plain O(K n^2) DP it prunes: the same best
bottleneck and the same split, with and without an upper bound."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import Edge, Node, Problem, Recompute, exact_groups
from fxpipe.partition.baselines import Blocks, _walk_back, min_max_dp
from fxpipe.partition.evaluate import evaluate
from fxpipe.schedules import ScheduleKind

from .test_bruteforce import problems

MS = 1e-3


def plain_dp(blocks: Blocks, n: int, *, allow_empty: bool) -> tuple[Any, Any]:
    """best[j, end] and back[j, end] over every stage and every start, each block's kept
    outputs summed value by value: what ``min_max_dp`` computes without pruning."""
    K = blocks.problem.num_stages
    best = np.full((K, n + 1), math.inf)
    back = np.zeros((K, n + 1), dtype=np.int64)
    gap = 0 if allow_empty else 1
    for end in range(gap, n + 1):
        starts = np.arange(0, end - gap + 1)
        made = np.array([sum(size for last, made_at, size in blocks.sends
                             if a <= made_at < end and last >= end) for a in starts], dtype=float)
        load = blocks.loads(end, starts, np.arange(K), sent=blocks.outputs(end, starts, made),
                            peak=blocks.peaks(end, starts), allow_empty=allow_empty)
        best[0, end] = load[0, 0]
        for j in range(1, K):
            # the empty block [end, end) last: best[j - 1, end] is known by now
            tried = np.maximum(load[j], best[j - 1, starts])
            if gap == 0:
                tried[-1] = max(load[j, -1], best[j - 1, end])
            i = int(np.argmin(tried))
            best[j, end], back[j, end] = tried[i], starts[i]
    return best, back


@st.composite
def chains(draw: st.DrawFn) -> Problem:
    """A chain of 12-40 ops, each reading the one before (and some an earlier one too),
    onto 3-12 stages, memory binding or not: enough stages for the DP to leave most
    cells unpriced."""
    n = draw(st.integers(12, 40))
    K = draw(st.integers(3, 12))
    nodes = tuple(
        Node(name=f"n{i}", forward_s=draw(st.integers(1, 9)) * MS,
             backward_s=draw(st.integers(1, 9)) * MS, param_bytes=draw(st.integers(0, 5)) * 100,
             activation_bytes=draw(st.integers(0, 3)) * 10, grad_bytes=40,
             output_bytes=draw(st.sampled_from([10, 30, 200])), comm_s=draw(st.integers(0, 2)) * MS)
        for i in range(n))
    edges = [Edge(i - 1, i) for i in range(1, n)]
    edges += [Edge(i - draw(st.integers(2, 4)), i) for i in range(4, n) if draw(st.booleans())]
    return Problem(nodes=nodes, edges=tuple(edges), num_stages=K,
                   memory_limit=draw(st.sampled_from([math.inf, 4000, 8000])),
                   schedule=draw(st.sampled_from([ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B])),
                   microbatches=2 * K, state_factor=2.0,
                   recompute=draw(st.sampled_from([Recompute.NONE, Recompute.FULL])),
                   allow_empty_stages=draw(st.booleans()))


def _check(problem: Problem) -> None:
    exact = exact_groups(problem)
    blocks = Blocks.of(exact)
    n, K = exact.num_coarse, problem.num_stages
    allow_empty = problem.allow_empty_stages
    want, want_back = plain_dp(blocks, n, allow_empty=allow_empty)
    got, got_back = min_max_dp(blocks, n, upper_s=math.inf, allow_empty=allow_empty)
    assert got[K - 1, n] == want[K - 1, n]
    if want[K - 1, n] == math.inf:
        return
    split = _walk_back(want_back, n, K)
    assert _walk_back(got_back, n, K) == split
    # bounded by the best split's own bottleneck (or a slower one): the same answer
    slowest = evaluate(problem, exact.expand(split)).bottleneck_s
    for upper in (float(want[K - 1, n]), slowest, 2 * slowest):
        bounded, bounded_back = min_max_dp(blocks, n, upper_s=upper, allow_empty=allow_empty)
        assert bounded[K - 1, n] == want[K - 1, n]
        assert _walk_back(bounded_back, n, K) == split


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_pruned_dp_equals_the_plain_dp(problem: Problem) -> None:
    """On random small graphs (every schedule, recompute policy, memory limit, empty
    stages or not), the DP that prices only the cells a best split can pass through finds
    the plain DP's bottleneck and split."""
    _check(problem)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains())
def test_pruned_dp_equals_the_plain_dp_on_long_chains(problem: Problem) -> None:
    """The same on chains of up to 40 ops onto up to 12 stages, where most cells are
    left unpriced (starts beyond the upper bound, stages that cannot end there)."""
    _check(problem)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_the_leanest_block_prices_full_recompute_alone(problem: Problem) -> None:
    """The leanest-split DP prices a block by its leanest recompute choice; where the
    policy allows full recompute it prices that one alone: the same bytes as the least
    over every choice, on every block and stage of random graphs (auto, selective levels
    included)."""
    from dataclasses import fields, replace

    from fxpipe.partition.baselines import _LeanBlocks

    problem = replace(problem, recompute=Recompute.AUTO, memory_limit=math.inf)
    exact = exact_groups(problem)
    blocks = Blocks.of(exact)
    lean = _LeanBlocks(*(getattr(blocks, f.name) for f in fields(blocks)))
    n, K = exact.num_coarse, problem.num_stages
    assert len(blocks.options) > 1
    for end in range(1, n + 1):
        starts, stages = np.arange(0, end), np.arange(K)
        made = np.array([sum(size for last, at, size in blocks.sends
                             if a <= at < end and last >= end) for a in starts], dtype=float)
        sent, peak = blocks.outputs(end, starts, made), blocks.peaks(end, starts)
        every = np.min([blocks.memory(end, starts, stages, sent=sent, peak=peak, recompute=o)
                        for o in blocks.options], axis=0)
        got = lean.loads(end, starts, stages, sent=sent, peak=peak, allow_empty=True)
        assert np.array_equal(got, every)


def test_full_recompute_prunes_by_the_forward_run_again() -> None:
    """Under full recompute a block's seconds are its compute and its forward once more:
    the DP tries no start whose block passes the upper bound so, though its compute alone
    would not (on GPipe's 1,663 layers it priced 33 stages an end for want of it)."""
    from dataclasses import replace

    from fxpipe.partition.baselines import _first_starts

    nodes = tuple(Node(name=f"n{i}", forward_s=1 * MS, backward_s=1 * MS, param_bytes=0,
                       activation_bytes=0, output_bytes=10) for i in range(4))
    chain = Problem(nodes=nodes, edges=tuple(Edge(i - 1, i) for i in range(1, 4)),
                    num_stages=2, memory_limit=math.inf, microbatches=4,
                    recompute=Recompute.FULL)
    exact = exact_groups(chain)
    assert exact.num_coarse == 4
    # two ops: 4 ms of compute, within 5 ms; 6 ms with the forward again, beyond
    firsts = _first_starts(Blocks.of(exact), 4, upper_s=5 * MS, gap=1)
    assert firsts.tolist() == [-1, 0, 1, 2, 3]  # (end 0: before any start)
    plain = replace(chain, recompute=Recompute.NONE)
    assert _first_starts(Blocks.of(exact_groups(plain)), 4, upper_s=5 * MS,
                         gap=1).tolist() == [-1, 0, 0, 1, 2]
