"""The block grain (``grain.py``) on random chains of equal blocks: it finds the blocks'
ends, its interval DP equals the best split with cuts only there priced over the exact
groups, and a split it finds fits is one the exact groups' DP finds too (never better)."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import Edge, Node, Problem, Recompute, exact_groups
from fxpipe.partition.baselines import Blocks, interval_dp, min_max_dp
from fxpipe.partition.grain import block_grain, grain_split
from fxpipe.partition.nothing_fits import dp_fits
from fxpipe.schedules import ScheduleKind

MS = 1e-3


@st.composite
def block_chains(draw: st.DrawFn) -> tuple[Problem, int]:
    """(problem, blocks): a light source (a rotary table every block reads), an
    embedding, then 4-7 equal blocks of 6-8 ops, each block's input read by its first op
    and again by its last (a residual add), onto 2-4 stages, memory binding or not."""
    blocks, size, K = draw(st.integers(4, 7)), draw(st.integers(6, 8)), draw(st.integers(2, 4))
    ops = [(draw(st.integers(1, 9)), draw(st.integers(0, 5)), draw(st.sampled_from([10, 30])))
           for _ in range(size)]
    nodes = [Node(name="rope", forward_s=0.0, backward_s=0.0, output_bytes=0),
             Node(name="embed", forward_s=MS, backward_s=MS, param_bytes=300,
                  activation_bytes=10, output_bytes=10, comm_s=MS)]
    edges = []
    for b in range(blocks):
        for i, (ms, params, out) in enumerate(ops):
            v = len(nodes)
            nodes.append(Node(name=f"b{b}_{i}", forward_s=ms * MS, backward_s=2 * ms * MS,
                              param_bytes=params * 100, activation_bytes=out, grad_bytes=40,
                              output_bytes=out, comm_s=MS * (out > 10)))
            edges.append(Edge(v - 1, v))  # the op before, or the block before's output
            if i == size - 1:
                edges.append(Edge(v - size, v))  # the residual: the block's input again
            if i == 1:
                edges.append(Edge(0, v))  # the light table, read in every block
    problem = Problem(nodes=tuple(nodes), edges=tuple(edges), num_stages=K,
                      memory_limit=draw(st.sampled_from([math.inf, 3000, 6000])),
                      schedule=draw(st.sampled_from([ScheduleKind.GPIPE,
                                                     ScheduleKind.ONE_F_ONE_B])),
                      microbatches=2 * K, state_factor=2.0,
                      recompute=draw(st.sampled_from([Recompute.NONE, Recompute.FULL])))
    return problem, blocks


def _price(blocks: Blocks, cuts: tuple[int, ...], n: int) -> float:
    """The bottleneck of the split of positions [0, n) at ``cuts``, each block priced by
    ``blocks`` as the interval DP prices it."""
    K = blocks.problem.num_stages
    bounds = (0, *cuts, n)
    worst = 0.0
    for j in range(K):
        a, end = bounds[j], bounds[j + 1]
        starts = np.array([a])
        made = np.array([float(sum(size for last, at, size in blocks.sends
                                   if a <= at < end and last >= end))])
        load = blocks.loads(end, starts, np.array([j]), sent=blocks.outputs(end, starts, made),
                            peak=blocks.peaks(end, starts), allow_empty=False)
        worst = max(worst, float(load[0, 0]))
    return worst


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_chains())
def test_grain_dp_is_the_best_split_at_block_ends(case: tuple[Problem, int]) -> None:
    problem, count = case
    exact = exact_groups(problem)
    grain = block_grain(exact)
    assert grain is not None
    # a grain block per layer (the table and the embedding before them: one or two)
    size = (len(problem.nodes) - 2) // count
    layer_of = [{grain.group_of[2 + b * size + i] for i in range(size)} for b in range(count)]
    assert all(len(held) == 1 for held in layer_of)
    assert len(set.union(*layer_of)) == count
    assert count + 1 <= grain.num_coarse <= count + 2
    count = grain.num_coarse
    K = problem.num_stages
    exact_blocks = Blocks.of(exact)
    # the exact positions of the block ends: where the next block's first group starts
    starts = [min(exact.group_of[v] for v in grain.groups[b]) for b in range(1, count)]
    brute = min((_price(exact_blocks, cuts, exact.num_coarse)
                 for cuts in itertools.combinations(starts, K - 1)), default=math.inf)
    best, _ = min_max_dp(Blocks.of(grain), count, upper_s=math.inf, allow_empty=False)
    assert math.isclose(float(best[K - 1, count]), brute, rel_tol=1e-12) or (
        brute == math.inf and best[K - 1, count] == math.inf)
    op_best, _ = min_max_dp(exact_blocks, exact.num_coarse, upper_s=math.inf,
                            allow_empty=False)
    # (prefix sums over fewer items round otherwise: equal within a few ulps)
    assert op_best[K - 1, exact.num_coarse] <= best[K - 1, count] * (1 + 1e-12)
    split = grain_split(exact)
    assert (split is None) == (brute == math.inf)
    if split is not None:
        assert interval_dp(exact) is not None
        assert dp_fits(problem)


def test_no_grain_for_a_plain_chain() -> None:
    """A chain of single ops may be cut after any of them: its blocks are its groups, and
    there is no coarser grain to plan at first."""
    n = 40
    nodes = tuple(Node(name=f"n{i}", forward_s=MS, backward_s=MS, output_bytes=10)
                  for i in range(n))
    edges = tuple(Edge(i - 1, i) for i in range(1, n))
    problem = Problem(nodes=nodes, edges=edges, num_stages=2, memory_limit=math.inf)
    assert block_grain(exact_groups(problem)) is None
    assert grain_split(exact_groups(problem)) is None


def test_a_residual_add_is_no_light_group() -> None:
    """A residual add does next to no compute, holds no parameters and saves nothing, but
    sends a layer's width on to the next add: the places inside a layer, which that value
    crosses, are no block's end. Taken for a light group (a rotary table), it let every
    place pass for one, and Llama-3-405B had no grain at all."""
    nodes = [Node(name="embed", forward_s=MS, backward_s=MS, param_bytes=100,
                  activation_bytes=30, output_bytes=30)]
    edges = []
    for b in range(6):
        before = len(nodes) - 1  # the block's input: the embedding or the add before
        for i in range(4):
            nodes.append(Node(name=f"b{b}_mm{i}", forward_s=5 * MS, backward_s=10 * MS,
                              param_bytes=100, activation_bytes=30, output_bytes=30))
            edges.append(Edge(len(nodes) - 2, len(nodes) - 1))
        nodes.append(Node(name=f"b{b}_add", forward_s=0.0, backward_s=0.0, output_bytes=30))
        edges += [Edge(len(nodes) - 2, len(nodes) - 1), Edge(before, len(nodes) - 1)]
    problem = Problem(nodes=tuple(nodes), edges=tuple(edges), num_stages=2)
    exact = exact_groups(problem)
    grain = block_grain(exact)
    assert grain is not None and grain.num_coarse == 7  # the embedding, then one a block
