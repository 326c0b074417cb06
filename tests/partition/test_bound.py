"""The block bound (``fxpipe.partition.bound``): never above the best split brute force
finds, tight where the relaxation drops nothing, and what lets ``partition`` stop early
on a model too big for CP-SAT."""

from __future__ import annotations

import math
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from fxpipe import forked
from fxpipe.partition import (
    Edge,
    Node,
    Problem,
    Recompute,
    chain,
    evaluate,
    exact_groups,
    interval_dp,
    partition,
)
from fxpipe.partition import solve as solve_module
from fxpipe.partition.baselines import min_max_dp
from fxpipe.partition.bound import block_bound, relaxation
from fxpipe.schedules import ScheduleKind

from ._brute import brute_force
from .test_bruteforce import MS, problems, small_enough


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_block_bound_is_below_every_split_that_fits(problem: Problem) -> None:
    assume(small_enough(problem))
    best, _, _ = brute_force(problem)
    bound = block_bound(exact_groups(problem))
    if best is None or bound is None:
        return
    assert bound <= best


@st.composite
def layered(draw: st.DrawFn, *, comm: bool, branches: bool = True, limited: bool = True,
            transients: bool = False, exact: bool = False, residual: bool = False) -> Problem:
    """Identical layers in a chain, each a diamond (in -> two branches -> out) or, always
    without ``branches``, a single node, under a memory limit that may force recompute
    (unless not ``limited``), on up to 3 stages; ``comm``: values cost time and bytes to
    send (the bound counts the least a cut sends, and of what a stage keeps for later,
    what crosses one cut and not the other); ``transients``: nodes have a backward
    transient; ``exact``: distinct times (no two ideals of a layer share a cell) and
    empty stages allowed even with comm and a limit; ``residual``: a layer's last node also
    reads what its first reads (a diamond's input; of single nodes, the one two back), a
    value that crosses the cut inside the layer beside the layer's own."""
    diamond = branches and draw(st.booleans())
    layers = draw(st.integers(1, 3 if diamond else 8))
    size = 4 if diamond else 1
    # Distinct times unless comm may make ties: no two ideals of a layer share a cell.
    distinct = exact or not comm or not limited
    times = draw(st.lists(st.integers(0 if not distinct else 1, 9), min_size=size,
                          max_size=size, unique=distinct))
    shape = [(t, draw(st.integers(0, 5)), draw(st.integers(0, 4)), draw(st.integers(0, 3)),
              draw(st.integers(0, 4)) if transients else 0)
             for t in times]
    # what a selective recompute keeps of each node (of its activations) and does not rerun,
    # at two keep levels: the first keeps part of what the second (all) keeps
    selective = [(sorted(draw(st.integers(0, act)) for _ in range(2)),
                  sorted(draw(st.integers(0, t)) for _ in range(2)))
                 for t, _, act, _, _ in shape]
    host = [draw(st.sampled_from([0, 0, 2, 9])) for _ in shape]  # SAC's, on both runs
    nodes, edges = [], []
    for layer in range(layers):
        first = len(nodes)
        for i, (t, params, act, out, grad) in enumerate(shape):
            kept, kept_t = selective[i]
            nodes.append(Node(f"l{layer}n{i}", forward_s=t * MS / 3, backward_s=2 * t * MS / 3,
                              param_bytes=params * 100, activation_bytes=act * 10,
                              selective_bytes=tuple(k * 10 for k in kept),
                              selective_kept_s=tuple(k * MS / 3 for k in kept_t),
                              selective_host_s=host[i] * MS / 3,
                              output_bytes=out * 10 if comm else 0,
                              comm_s=out * MS if comm else 0.0, grad_bytes=grad * 100))
        if layer:
            edges.append(Edge(first - 1, first))
        if diamond:
            edges += [Edge(first, first + 1), Edge(first, first + 2), Edge(first + 1, first + 3),
                      Edge(first + 2, first + 3)]
        if residual and first >= 2 - diamond:
            edges.append(Edge(first - 2 + diamond, first + 3 * diamond))
    K = draw(st.integers(1, min(3, len(nodes))))
    limits = [float("inf"), 800, 1500, 3000] if limited else [float("inf")]
    return Problem(nodes=tuple(nodes), edges=tuple(edges), num_stages=K,
                   memory_limit=draw(st.sampled_from(limits)),
                   schedule=ScheduleKind.ONE_F_ONE_B, microbatches=draw(st.integers(1, 4)) * K,
                   recompute=draw(st.sampled_from(Recompute)), keep_levels=((8, 2), (0, 0)),
                   # Without comm or a limit, empty stages allowed, as the bound allows them.
                   allow_empty_stages=exact or not comm or not limited or draw(st.booleans()))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(layered(comm=True), layered(comm=True, residual=True)))
def test_block_bound_on_layers_is_below_brute_force(problem: Problem) -> None:
    best, _, _ = brute_force(problem)
    bound = block_bound(exact_groups(problem))
    assert bound is not None  # layers in a chain: always enumerable
    if best is not None:
        assert bound <= best


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(), layered(comm=True)))
def test_a_segment_with_too_many_ideals_keeps_the_bound_below_every_split(
        problem: Problem) -> None:
    """Where a segment has more ideals than the bound enumerates (a preamble of masks
    beside the embedding), one cell stands for all but its empty and full ones
    (``_any_ideal``): the bound is still there and still below every split that fits.
    MAX_IDEALS is lowered to 2 so that every segment of two groups or more is such a one."""
    assume(small_enough(problem))
    best, _, _ = brute_force(problem)
    with mock.patch.object(chain, "MAX_IDEALS", 2):
        bound = block_bound(exact_groups(problem))
    assert bound is not None
    if best is not None:
        assert bound <= best


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layered(comm=False, branches=False))
def test_block_bound_is_the_optimum_when_nothing_is_left_out(problem: Problem) -> None:
    """A chain with no transfers, no kept values, no transients, empty stages allowed: the
    relaxation is the problem itself, so the bound is the best split (up to its float
    margin). (With branches it may be lower: a stage between two cells of a segment is
    priced as if the later cell's ideal held the earlier one's.)"""
    best, _, _ = brute_force(problem)
    bound = block_bound(exact_groups(problem))
    assert bound is not None
    if best is not None:
        assert bound == pytest.approx(best, rel=1e-6, abs=1e-12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(*(layered(comm=True, branches=False, transients=True, exact=True,
                           residual=residual) for residual in (False, True))))
def test_block_bound_is_the_optimum_of_a_chain_that_keeps_and_sends(problem: Problem) -> None:
    """A chain with transfers, backward transients and a memory limit, empty stages
    allowed: a stage keeps the values its last cut sends that it made (its last node's,
    and with residuals the one before's) and the largest transient of its nodes, and the
    bound prices each so (``_Cells``): it is the best split."""
    best, _, _ = brute_force(problem)
    bound = block_bound(exact_groups(problem))
    assert bound is not None
    if best is None:
        assert bound == float("inf")
    else:
        assert bound == pytest.approx(best, rel=1e-6, abs=1e-12)


def _two_diamonds() -> Problem:
    """Two diamond layers (in -> a, b -> out; a twice b's compute, out the most parameters)
    onto 3 stages, memory for 750 parameter bytes a stage: the best split (3 ms) cuts after
    the first layer's a and b and after the second's a. In the relaxation the second
    layer's cell holding b alone comes before the one holding a alone (less compute) and
    holds more parameters, so a stage to it fits nowhere while one to the later cell does."""
    nodes, edges = [], []
    for layer in range(2):
        first = len(nodes)
        for i, (t, params) in enumerate(((0, 100), (2, 100), (1, 200), (1, 500))):
            nodes.append(Node(f"l{layer}n{i}", forward_s=t * MS / 3, backward_s=2 * t * MS / 3,
                              param_bytes=params))
        if layer:
            edges.append(Edge(first - 1, first))
        edges += [Edge(first, first + 1), Edge(first, first + 2), Edge(first + 1, first + 3),
                  Edge(first + 2, first + 3)]
    return Problem(nodes=tuple(nodes), edges=tuple(edges), num_stages=3, memory_limit=3000,
                   schedule=ScheduleKind.ONE_F_ONE_B, microbatches=3, recompute=Recompute.AUTO)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(), layered(comm=True), layered(comm=True, residual=True)))
@example(_two_diamonds())
def test_the_pruned_dp_over_the_cells_is_the_dp_that_prices_every_cell(
        problem: Problem) -> None:
    """The min-max DP prices only the cells a best split can pass through, which assumes
    things of its blocks (the first start tried grows with the end); the bound's cells,
    unlike an order's blocks, need not grow in every sum. Over the relaxation, its value is
    the one of the DP that prices every (stage, start, end)."""
    assume(small_enough(problem))
    exact = exact_groups(problem)
    if block_bound(exact) is None:
        return
    blocks = relaxation(exact)
    n, K = len(blocks.T) - 1, problem.num_stages
    best, _ = min_max_dp(blocks, n, upper_s=math.inf, allow_empty=True)
    every = np.full((K, n + 1), math.inf)
    for end in range(n + 1):
        starts = np.arange(end + 1)
        load = blocks.loads(end, starts, np.arange(K), allow_empty=True,
                            sent=blocks.outputs(end, starts, np.zeros(starts.size)),
                            peak=blocks.peaks(end, starts))
        every[0, end] = load[0, 0]
        for j in range(1, K):
            every[j, end] = np.min(np.maximum(every[j - 1, :end + 1], load[j]))
    assert best[K - 1, n] == every[K - 1, n]


def test_a_later_cell_holding_fewer_parameters_is_still_reached() -> None:
    """``_two_diamonds``: the DP stopped at the earlier cell, as if no later end could
    start a stage before it, and the bound was inf, "no split fits" where one did (found
    by hypothesis, 2026-11-29)."""
    problem = _two_diamonds()
    best, _, _ = brute_force(problem)
    assert best == pytest.approx(3 * MS)
    bound = block_bound(exact_groups(problem))
    assert bound is not None and bound <= best


@pytest.mark.parametrize("limit", [200, 300, 400, 500, 600, 700, 800, 900, 1200])
def test_a_middle_stage_keeps_the_residual_it_makes(limit: int) -> None:
    """Eight nodes in a chain, each also reading the one two back, onto 3 stages under
    memory limits from tight to loose: the middle stage keeps both values its last cut
    sends, its last node's and the residual made just before, which crossed no cut
    before it. The bound counts both (``_Through``) and is the best split at every limit;
    it counted the last node's alone, and at 500, 800 and 900 bytes was below it (so was
    Llama-3-405B's onto 128 stages in 160 GiB: a 37 % gap against the interval DP's
    split, 0.09 % counted)."""
    nodes = tuple(Node(f"n{i}", forward_s=MS / 3, backward_s=2 * MS / 3, output_bytes=100)
                  for i in range(8))
    edges = [Edge(i - 1, i) for i in range(1, 8)] + [Edge(i - 2, i) for i in range(2, 8)]
    problem = Problem(nodes=nodes, edges=tuple(edges), num_stages=3, memory_limit=limit,
                      schedule=ScheduleKind.ONE_F_ONE_B, microbatches=6,
                      recompute=Recompute.AUTO, allow_empty_stages=True)
    best, _, _ = brute_force(problem)
    assert best is not None
    assert block_bound(exact_groups(problem)) == pytest.approx(best, rel=1e-6)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layered(comm=True, branches=False, limited=False))
def test_block_bound_counts_what_each_cut_sends(problem: Problem) -> None:
    """A chain with transfers and no memory limit: each cut sends exactly the value it
    crosses, to both stages beside it, and the bound charges it so: the bound is the
    best split."""
    best, _, _ = brute_force(problem)
    bound = block_bound(exact_groups(problem))
    assert bound is not None
    if best is not None:
        assert bound == pytest.approx(best, rel=1e-6, abs=1e-12)


def _chain_of_blocks(layers: int, stages: int, *, unit: int = 1, sinks: bool = False,
                     sink_host_s: float = 0.0) -> Problem:
    """Transformer-like: each block a norm, two parallel projections, a mix, with costs
    that make early stages (more micro-batches in flight) recompute; bytes in ``unit``s.
    ``sinks``: each block's projection ``a`` also reads a one-byte parameter of its own
    from a node that reads nothing (GPT-OSS's attention sinks), which a split may put in
    any stage up to the block's; ``sink_host_s``: the host time SAC gives each sink."""
    nodes, edges = [], []
    for layer in range(layers):
        first = len(nodes)
        for name, t, params, act in (("norm", 1, 0, 4), ("a", 6, 50, 10), ("b", 5, 40, 12),
                                     ("mix", 3, 10, 20)):
            nodes.append(Node(f"{layer}.{name}", forward_s=t * MS, backward_s=2 * t * MS,
                              param_bytes=params * unit, activation_bytes=act * unit,
                              output_bytes=8 * unit, comm_s=0.001 * MS))
        if layer:
            edges.append(Edge(first - 1, first))
        edges += [Edge(first, first + 1), Edge(first, first + 2), Edge(first + 1, first + 3),
                  Edge(first + 2, first + 3)]
    for layer in range(layers if sinks else 0):
        nodes.append(Node(f"{layer}.sink", forward_s=0.0, backward_s=0.0, param_bytes=1,
                          output_bytes=1, selective_host_s=sink_host_s))
        edges.append(Edge(len(nodes) - 1, 4 * layer + 1))
    return Problem(nodes=tuple(nodes), edges=tuple(edges), num_stages=stages,
                   memory_limit=2000 * unit, schedule=ScheduleKind.ONE_F_ONE_B,
                   microbatches=2 * stages, recompute=Recompute.AUTO)


def test_one_byte_parameters_beside_the_layers_leave_the_bound_as_it_was() -> None:
    """A node reading nothing but a parameter a millionth of the model's is not in the
    layers' chain: counted, it left no separator and a single segment with too many
    ideals to enumerate (no bound: GPT-OSS-20B went to CP-SAT's 19 % gap). Too light to
    count, it is zeroed, and the bound is the one of the layers alone."""
    unit = 1000
    with_sinks = block_bound(exact_groups(_chain_of_blocks(24, 6, unit=unit, sinks=True)))
    alone = block_bound(exact_groups(_chain_of_blocks(24, 6, unit=unit)))
    assert with_sinks is not None and alone is not None
    assert with_sinks == pytest.approx(alone, rel=1e-9)
    problem = _chain_of_blocks(24, 6, unit=unit, sinks=True)
    exact = exact_groups(problem)
    assert with_sinks <= evaluate(problem, exact.expand(interval_dp(exact) or ())).bottleneck_s


def test_sacs_host_time_leaves_a_light_node_light() -> None:
    """SAC's host time falls on every node a selective stage dispatches, the lightest too:
    counted in what makes a node light, it made the sinks above heavy, and the bound of a
    Llama-3-8B onto 4 fell from 108 ms to 13 ms (onto 2 from "nothing fits" to 20 ms).
    Left out of it, the sinks stay light and are zeroed, their host time with them."""
    problem = _chain_of_blocks(24, 6, unit=1000, sinks=True, sink_host_s=0.12 * MS)
    assert len(problem.keep_levels) == 1 and problem.nodes[-1].selective(0)[1] > 0
    with_host = block_bound(exact_groups(problem))
    alone = block_bound(exact_groups(_chain_of_blocks(24, 6, unit=1000)))
    assert with_host is not None and alone is not None
    assert with_host == pytest.approx(alone, rel=1e-9)


@pytest.mark.parametrize("fork", [True, False], ids=["bound in a child", "one process"])
def test_partition_stops_at_the_block_bound_on_a_large_model(monkeypatch: pytest.MonkeyPatch,
                                                             fork: bool) -> None:
    """Beyond LARGE_MODEL placement variables, CP-SAT is not run when the bound is within
    GAP of the interval DP's split: that split is the answer and the bound is reported,
    the same whether the bound is found in a forked child or after the DP."""
    problem = _chain_of_blocks(layers=24, stages=6)
    monkeypatch.setattr(solve_module, "LARGE_MODEL", 50)
    monkeypatch.setattr(solve_module, "BOUND_FIRST", 50)
    if not fork:
        monkeypatch.setattr(forked, "_can_fork", lambda: False)
    result = partition(problem, workers=1)
    exact = exact_groups(problem)
    dp = evaluate(problem, exact.expand(interval_dp(exact) or ())).bottleneck_s
    assert result.phases == ()
    assert result.report.method == "interval-dp"
    assert result.report.objective == dp
    bound = block_bound(exact, upper_s=dp)
    assert bound is not None
    assert result.report.bound == pytest.approx(min(dp, bound))
    assert result.report.gap <= solve_module.GAP
    # the bound sees memory: more than all compute spread evenly (the trivial bound)
    assert result.report.bound > solve_module.trivial_bound(problem)


def test_partition_below_the_size_proves_with_cp_sat_and_keeps_the_bound() -> None:
    problem = _chain_of_blocks(layers=12, stages=4)
    result = partition(problem, workers=1)
    assert result.phases  # CP-SAT ran
    assert result.report.status == "OPTIMAL"
    bound = block_bound(exact_groups(problem))
    assert bound is not None
    assert bound <= result.report.objective


def test_empty_stages_in_a_row_before_the_only_one_that_fits() -> None:
    """One returned node, 400 B on a stage of 1 micro-batch in flight, 4 stages, empty
    ones allowed: it fits only on the last stage, after three empty ones. The min-max DP
    priced an empty stage from the previous row of the same column before that row was
    known, so the bound found no split that fits and ``partition`` said none did
    (found by the brute-force property test)."""
    problem = Problem(
        nodes=(Node("n0", forward_s=MS, backward_s=0.0, output_bytes=200, returned=True),),
        edges=(), num_stages=4, memory_limit=400, schedule=ScheduleKind.ONE_F_ONE_B,
        microbatches=4, state_factor=1.0, recompute=Recompute.AUTO, allow_empty_stages=True)
    exact = exact_groups(problem)
    assert block_bound(exact) == pytest.approx(MS)
    assert interval_dp(exact) == (3,)
    result = partition(problem, workers=1)
    assert result.report.status == "OPTIMAL" and result.stage_of == (3,)


@pytest.mark.parametrize(("layers", "stages", "settled"), [(24, 6, True), (24, 7, False)],
                         ids=["bound proves the DP's split", "bound 2 % below it"])
def test_a_big_program_is_solved_only_where_the_bound_leaves_a_gap(
        monkeypatch: pytest.MonkeyPatch, layers: int, stages: int, settled: bool) -> None:
    """Beyond BOUND_FIRST placement variables (and below LARGE_MODEL) the block bound runs
    before CP-SAT: where the interval DP's split is within PROVED of it, that split is
    the answer, OPTIMAL, and no CP-SAT program is built; where it is further, CP-SAT
    searches as before, with the bound kept for its report."""
    problem = _chain_of_blocks(layers=layers, stages=stages)
    monkeypatch.setattr(solve_module, "BOUND_FIRST", 50)
    result = partition(problem, workers=1)
    exact = exact_groups(problem)
    dp = evaluate(problem, exact.expand(interval_dp(exact) or ())).bottleneck_s
    bound = block_bound(exact, upper_s=dp)
    assert bound is not None
    assert (dp <= bound * (1 + solve_module.PROVED)) == settled
    assert (result.phases == ()) == settled
    assert result.report.method == ("interval-dp" if settled else "cp-sat")
    assert result.report.status == "OPTIMAL"
    assert result.report.bound >= min(bound, result.report.objective) * (1 - 1e-12)
    # The bound still out when the DP is done: the first program is built meanwhile, the
    # same program, so the same answer.
    monkeypatch.setattr(forked.Forked, "ready", lambda self: False)
    late = partition(problem, workers=1)
    assert (late.stage_of, late.report.status, late.report.bound) == \
        (result.stage_of, result.report.status, result.report.bound)
    monkeypatch.setattr(solve_module, "BOUND_FIRST", 10**9)
    searched = partition(problem, workers=1)
    assert searched.phases != ()
    assert result.report.objective == pytest.approx(searched.report.objective, rel=1e-9)


def test_a_bound_and_split_found_already_are_not_worked_out_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The layout search plans its chosen layout in full from its quick answer: given
    that answer's bound and split, ``partition`` runs neither the interval DP nor the
    block bound again, and answers as it did."""
    problem = _chain_of_blocks(layers=24, stages=6)
    monkeypatch.setattr(solve_module, "LARGE_MODEL", 50)
    monkeypatch.setattr(solve_module, "BOUND_FIRST", 50)
    quick = partition(problem, workers=1, quick=True, advise=False)

    def again(*_: object, **__: object) -> None:
        raise AssertionError("worked out again")

    monkeypatch.setattr(solve_module, "interval_dp", again)
    monkeypatch.setattr(solve_module, "block_bound", again)
    full = partition(problem, workers=1, bound_s=quick.report.bound, hint=quick.stage_of)
    assert full.stage_of == quick.stage_of
    assert full.report.bound == quick.report.bound
    assert full.report.status == quick.report.status


@pytest.mark.parametrize("fork", [True, False], ids=["DP in a child", "one process"])
def test_the_layout_search_bounds_a_layout_and_finds_its_dp_split_at_once(
        monkeypatch: pytest.MonkeyPatch, fork: bool) -> None:
    """Once a layout is planned, the next is bounded (the block bound, cut off at the
    slowest stage that could still win) while a child works out its interval DP's split:
    handed on where the bound does not prune it, dropped where it does."""
    from fxpipe.cluster import _slowest_stage

    if not fork:
        monkeypatch.setattr(forked, "_can_fork", lambda: False)
    problem = _chain_of_blocks(layers=24, stages=6)
    exact = exact_groups(problem)
    dp = exact.expand(interval_dp(exact) or ())
    dp_s = evaluate(problem, dp).bottleneck_s
    bound = block_bound(exact)
    assert bound is not None and bound <= dp_s
    slowest, split = _slowest_stage(problem, 2 * dp_s)
    assert split == dp and slowest == pytest.approx(bound)
    cut, none = _slowest_stage(problem, bound / 2)  # no split is that fast: pruned
    assert cut == bound / 2 and none is None
