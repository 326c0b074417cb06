"""The ILP against plain enumeration of every valid split, on random small DAGs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from fxpipe.partition import (
    Comm,
    Edge,
    InfeasibleMemoryError,
    Node,
    Problem,
    Recompute,
    StageModel,
    TiedGroup,
    TiedPolicy,
    TooManyStagesError,
    evaluate,
    exact_groups,
    partition,
    violations,
)
from fxpipe.partition.baselines import Blocks
from fxpipe.partition.cost import Option, memory_parts, recompute_options
from fxpipe.plan import StageRecompute
from fxpipe.schedules import ScheduleKind

from ._brute import brute_force, brute_force_size, policies, valid_splits

NONE, SELECTIVE, FULL = StageRecompute

MS = 1e-3


# Splits a brute-force check may evaluate (a third of a millisecond each on a CI core):
# a draw of 5 GPUs and 7 nodes with every recompute choice is 2.5 million, minutes; a
# wide graph of 8 nodes on 4 stages a million, which made one draw of a test take 30 s.
BRUTE_FORCE_LIMIT = 30_000


def small_enough(problem: Problem, stage_counts: range | None = None) -> bool:
    """Whether brute force evaluates at most BRUTE_FORCE_LIMIT splits on ``problem``."""
    return brute_force_size(problem, stage_counts, limit=BRUTE_FORCE_LIMIT) <= BRUTE_FORCE_LIMIT


@st.composite
def problems(draw: st.DrawFn, layout: str = "one per GPU") -> Problem:
    """Random small problems; ``layout``: "one per GPU", "interleaved" (N GPUs x 2 stage
    modules), "v" (N GPUs x 2 stage modules in a V: ZB-V, DualPipeV) or "replicated"
    (N GPUs > K stages)."""
    K = draw(st.integers(1, 4))
    v, devices = 1, 0
    two_per_gpu = [s for s in ScheduleKind if s.spec.interleaved or s.spec.v_placed]
    schedule = draw(st.sampled_from([s for s in ScheduleKind if s not in two_per_gpu]))
    if layout == "interleaved":
        v, schedule = 2, ScheduleKind.INTERLEAVED
        K = 2 * draw(st.integers(1, 2))
    elif layout == "v":
        v, schedule = 2, draw(st.sampled_from([s for s in ScheduleKind if s.spec.v_placed]))
        K = 2 * draw(st.integers(1, 2))
    elif layout == "replicated":
        K = draw(st.integers(1, 3))
        devices = K + draw(st.integers(1, 2))
    n = draw(st.integers(1, 7 if K < 4 else 6))
    backward = [draw(st.integers(0, 9)) for _ in range(n)]
    forward = [draw(st.integers(0, 9)) for _ in range(n)]
    saved = [draw(st.integers(0, 3)) for _ in range(n)]
    # per node, what selective recompute keeps and does not rerun at two keep levels: the
    # first keeps part of what the second (all) keeps
    kept = [sorted(draw(st.integers(0, saved[i])) for _ in range(2)) for i in range(n)]
    kept_s = [sorted(draw(st.integers(0, forward[i])) for _ in range(2)) for i in range(n)]
    nodes = tuple(
        Node(
            name=f"n{i}",
            forward_s=forward[i] * MS,
            backward_s=backward[i] * MS,
            backward_weight_s=draw(st.integers(0, backward[i])) * MS,
            deferred_bytes=draw(st.integers(0, 3)) * 10,
            param_bytes=draw(st.integers(0, 5)) * 100,
            activation_bytes=saved[i] * 10,
            selective_bytes=tuple(b * 10 for b in kept[i]),
            selective_kept_s=tuple(s * MS for s in kept_s[i]),
            # SAC's host time, which can make a selective stage slower than a full one
            selective_host_s=draw(st.sampled_from([0, 0, 1, 6])) * MS,
            grad_bytes=draw(st.sampled_from([0, 0, 40, 250])),
            output_bytes=draw(st.sampled_from([0, 10, 30, 200])),
            comm_s=draw(st.integers(0, 4)) * MS,
            returned=draw(st.integers(0, 3)) == 0,
        )
        for i in range(n)
    )
    edges = []
    for w in range(n):
        for u in range(w):
            if draw(st.integers(0, 99)) < 35:
                edges.append(Edge(u, w, ordered=draw(st.integers(0, 9)) < 8))
    tied: tuple[TiedGroup, ...] = ()
    if n >= 2 and draw(st.booleans()):
        members = draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=3, unique=True))
        tied = (TiedGroup("w", tuple(sorted(members)), draw(st.integers(1, 5)) * 100,
                          allreduce_s=draw(st.integers(0, 3)) * MS),)
    colocate: tuple[tuple[int, ...], ...] = ()
    if n >= 3 and draw(st.integers(0, 3)) == 0:
        colocate = (tuple(sorted(draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2,
                                                unique=True)))),)
    limited = draw(st.booleans())
    return Problem(
        nodes=nodes,
        edges=tuple(edges),
        num_stages=K,
        memory_limit=draw(st.integers(0, 3000)) if limited else float("inf"),
        schedule=schedule,
        microbatches=max(draw(st.integers(1, 4)) * (K // v),
                         K if schedule is ScheduleKind.DUALPIPEV else 1),
        state_factor=float(draw(st.integers(1, 4))),
        recompute=draw(st.sampled_from(policies(schedule))),
        keep_levels=((8, 2), (0, 0)),
        workspace_bytes=draw(st.integers(0, 2)) * 50,
        loss_saved_bytes=draw(st.integers(0, 2)) * 10,
        loss_grad_bytes=draw(st.integers(0, 2)) * 10,
        comm=draw(st.sampled_from(Comm)),
        tied=tied,
        tied_policy=draw(st.sampled_from(TiedPolicy)),
        colocate=colocate,
        allow_empty_stages=draw(st.booleans()),
        virtual_stages=v,
        num_devices=devices,
        allreduce_bandwidth=draw(st.sampled_from([1e5, 1e6])),
        allreduce_latency_s=draw(st.integers(0, 2)) * MS,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_ilp_matches_brute_force(problem: Problem) -> None:
    assume(small_enough(problem))
    best, least_memory, any_valid = brute_force(problem)
    try:
        result = partition(problem, time_limit_s=20, workers=1)
    except TooManyStagesError:
        assert not any_valid
        return
    except InfeasibleMemoryError as error:
        assert any_valid and best is None
        assert error.needed == least_memory
        assert problem.memory_limit < error.needed
        return
    assert best is not None
    assert not violations(problem, result.stage_of)
    evaluation = evaluate(problem, result.stage_of)
    assert evaluation.estimate.fits
    assert evaluation.estimate.max_memory <= problem.memory_limit
    assert result.report.status == "OPTIMAL"
    assert result.report.objective == evaluation.bottleneck_s
    assert result.report.objective == pytest.approx(best, abs=1e-12)
    assert result.report.bound <= result.report.objective
    assert result.report.gap < 1e-6
    for estimate in result.baselines.values():
        assert estimate.bottleneck_s >= best - 1e-12 or not estimate.fits


@settings(max_examples=60, deadline=None)
@given(problems())
def test_model_objective_equals_evaluate(problem: Problem) -> None:
    """The CP-SAT objective, in seconds, is evaluate()'s bottleneck of its own answer."""
    exact = exact_groups(problem)
    if not problem.allow_empty_stages and exact.num_coarse < problem.num_stages:
        return
    model = StageModel(exact)
    result = model.solve(time_limit_s=20, workers=1)
    if result.stage_of is None:
        assert result.status == "INFEASIBLE"
        return
    assert result.status == "OPTIMAL"
    assert result.objective == pytest.approx(evaluate(problem, result.stage_of).bottleneck_s,
                                             abs=1e-12)
    # with the recompute choice the model made (it may recompute a stage off the critical
    # path), and evaluate's own (the fewest stages): the same bottleneck
    assert result.recompute is not None
    ours = evaluate(problem, result.stage_of, recompute=result.recompute)
    assert ours.estimate.fits
    assert result.objective == pytest.approx(ours.bottleneck_s, abs=1e-12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(problems(), problems(layout="interleaved"), problems(layout="v")), st.data())
def test_model_rows_equal_the_stage_cost_formula(problem: Problem, data: st.DataObject) -> None:
    """For any valid split and any recompute choice, each GPU's linear memory row is
    evaluate()'s memory to the byte, and its time row evaluate()'s time up to the rounding
    margin of the scaled rows: the CP-SAT rows are the stage cost formula."""
    problem = replace(problem, recompute=Recompute.AUTO,  # z[j], s[j] variables, all rows
                      memory_limit=10**12)
    exact = exact_groups(problem)
    # The program places exact groups; a split that parts a group (a cost-free node away
    # from the group it was merged into) is not one of its assignments.
    splits = [split for split in valid_splits(problem)
              if all(len({split[v] for v in group}) == 1 for group in exact.groups)]
    if not splits:
        return
    split = data.draw(st.sampled_from(splits))
    choice = data.draw(st.tuples(*[st.sampled_from(recompute_options(problem))]
                                 * problem.num_stages))
    model = StageModel(exact)
    times, memories = model.rows_at(exact.restrict(split), choice)
    evaluation = evaluate(problem, split, recompute=choice)
    on = [[s for j, s in enumerate(evaluation.stages) if problem.device_of(j) == d]
          for d in range(problem.devices)]
    assert memories == [sum(s.memory.total for s in held) for held in on]
    margin = model._rounding_terms * 0.5 / model.scale
    for ticks, held in zip(times, on, strict=True):
        assert ticks / model.scale == pytest.approx(sum(s.time_s for s in held), abs=margin)


def _check_against_brute_force(problem: Problem) -> None:
    """``partition`` proves the best bottleneck plain enumeration finds, or fails as it
    says: too many stages only when no split is valid, out of memory only when none fits."""
    assume(small_enough(problem))
    best, _least, any_valid = brute_force(problem)
    try:
        result = partition(problem, time_limit_s=20, workers=1)
    except TooManyStagesError:
        assert not any_valid
        return
    except InfeasibleMemoryError:
        assert any_valid and best is None
        return
    assert best is not None
    evaluation = evaluate(problem, result.stage_of)
    assert evaluation.estimate.fits
    assert result.report.status == "OPTIMAL"
    assert result.report.objective == pytest.approx(best, rel=1e-9, abs=1e-12)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(layout="interleaved"))
def test_interleaved_ilp_matches_brute_force(problem: Problem) -> None:
    """K = N * v stage modules, GPU d running modules d, d + N, ...: per-GPU time and
    memory (the sum over its modules) are what the ILP bounds."""
    _check_against_brute_force(problem)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(layout="v"))
def test_v_placement_ilp_matches_brute_force(problem: Problem) -> None:
    """ZB-V and DualPipeV: K = 2N stage modules, GPU d running stages d and K - 1 - d, so
    one GPU's time and memory add up a stage near the input and one near the output, its
    waiting weight gradients included: the ILP chooses the cuts of both chunks together."""
    assert [problem.device_of(j) for j in range(problem.num_stages)] == (
        [0, 0] if problem.num_stages == 2 else [0, 1, 1, 0])
    _check_against_brute_force(problem)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(layout="replicated"))
def test_replicated_stage_model_matches_brute_force(problem: Problem) -> None:
    """For a fixed stage count K < N GPUs the ILP chooses cuts and replicas together."""
    assume(small_enough(problem))
    best, _least, any_valid = brute_force(problem)
    exact = exact_groups(problem)
    if not problem.allow_empty_stages and exact.num_coarse < problem.num_stages:
        assert not any_valid
        return
    result = StageModel(exact).solve(time_limit_s=20, workers=1)
    if result.stage_of is None:
        assert result.status == "INFEASIBLE" and best is None
        return
    assert result.status == "OPTIMAL" and result.replicas is not None
    assert not violations(problem, result.stage_of, result.replicas)
    evaluation = evaluate(problem, result.stage_of, result.replicas)
    assert evaluation.estimate.fits
    # the model's time is in ticks of about 1e-9 of the total (see ilp_inputs.TARGET_TICKS)
    assert result.objective == pytest.approx(evaluation.bottleneck_s, rel=1e-6)
    assert best is not None
    assert evaluation.bottleneck_s == pytest.approx(best, rel=1e-6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(layout="replicated"))
def test_replicated_partition_is_the_best_stage_count(problem: Problem) -> None:
    """``partition`` tries N stages of one GPU, then every K < N with replicas: its answer
    is the best of all of them, by brute force over every K."""
    N = problem.devices
    assume(small_enough(problem, range(1, N + 1)))
    candidates = [brute_force(replace(problem, num_stages=K, num_devices=0 if K == N else N))[0]
                  for K in range(1, N + 1)]
    fitting = [c for c in candidates if c is not None]
    try:
        result = partition(problem, time_limit_s=20, workers=1)
    except (TooManyStagesError, InfeasibleMemoryError):
        assert not fitting
        return
    assert fitting
    assert result.report.status == "OPTIMAL"
    assert result.report.objective == pytest.approx(min(fitting), rel=1e-6)
    assert sum(result.evaluation.replicas) == N
    assert result.problem.num_stages == len(result.evaluation.replicas)


def test_regression_presolve_with_large_coefficients() -> None:
    """Two cases CP-SAT's presolve got wrong when seconds were scaled to ~1e12 ticks: a
    15 ms split reported OPTIMAL where a 14 ms one exists (an unordered edge and an upper
    bound from the warm start), and a feasible replicated model reported INFEASIBLE."""
    costs = [(5, 0), (6, 2), (3, 0), (2, 0), (7, 0), (1, 0)]
    nodes = tuple(Node(f"n{i}", 0.0, b * MS, comm_s=c * MS) for i, (b, c) in enumerate(costs))
    edges = (Edge(0, 1, ordered=False), Edge(0, 2), Edge(1, 4), Edge(3, 4), Edge(0, 5),
             Edge(4, 5))
    problem = Problem(nodes=nodes, edges=edges, num_stages=2, schedule=ScheduleKind.GPIPE,
                      microbatches=2, state_factor=1.0, tied_policy=TiedPolicy.COLOCATE)
    result = partition(problem, time_limit_s=20, workers=1)
    assert result.report.objective == pytest.approx(14 * MS)
    assert result.stage_of == (0, 1, 0, 0, 1, 1)

    one = Problem(nodes=(Node("n0", 0.0, 1 * MS, param_bytes=100),), edges=(), num_stages=2,
                  schedule=ScheduleKind.GPIPE, microbatches=2, state_factor=1.0,
                  allow_empty_stages=True, num_devices=3, allreduce_bandwidth=1e5)
    replicated = StageModel(exact_groups(one)).solve(time_limit_s=20, workers=1)
    assert replicated.status == "OPTIMAL"
    assert replicated.objective == pytest.approx(1 * MS)


def test_auto_recomputes_the_early_stages_where_none_does_not_fit() -> None:
    """Eight equal layers on 4 stages, 1F1B with 8 micro-batches: stage j holds 4 - j of
    them. In 250 bytes no split fits without recompute (stage 0 holds 4 x 100 bytes for
    even one layer); with AUTO the first stages recompute, the last never does (it holds
    one micro-batch either way), and the answer is the brute-force optimum over splits
    and recompute choices -- faster than recomputing everywhere."""
    nodes = tuple(Node(f"l{i}", 1 * MS, 2 * MS, activation_bytes=100, output_bytes=1)
                  for i in range(8))
    chain = Problem(nodes, tuple(Edge(i, i + 1) for i in range(7)), num_stages=4,
                    microbatches=8, memory_limit=250)
    with pytest.raises(InfeasibleMemoryError):
        partition(replace(chain, recompute=Recompute.NONE), time_limit_s=20, workers=1)
    auto = partition(replace(chain, recompute=Recompute.AUTO), time_limit_s=20, workers=1)
    everywhere = partition(replace(chain, recompute=Recompute.FULL), time_limit_s=20, workers=1)
    recompute = auto.evaluation.recompute
    assert recompute[:2] == (FULL, FULL) and recompute[3] is NONE
    assert auto.report.status == "OPTIMAL"
    best, _, _ = brute_force(replace(chain, recompute=Recompute.AUTO))
    assert auto.report.objective == pytest.approx(best, abs=1e-12)
    assert auto.evaluation.estimate.iteration_s < everywhere.evaluation.estimate.iteration_s
    # the baselines take the same choice: each cut recomputes where it does not fit
    for name, split in auto.baseline_splits.items():
        chosen = evaluate(auto.problem, split)
        assert auto.baselines[name] == chosen.estimate
        plain = evaluate(auto.problem, split, recompute=(NONE,) * 4)
        for j, stage in enumerate(plain.stages):
            assert (chosen.recompute[j] is FULL) == (stage.memory.total > chain.memory_limit)



@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(), st.data())
def test_interval_dp_prices_each_stage_by_the_stage_cost_formula(
        problem: Problem, data: st.DataObject) -> None:
    """The interval DP prices a block for every stage at once, each row with that stage's
    micro-batches in flight and the loss on the last row alone: every row is the stage
    cost formula's bytes for that stage, under each recompute choice."""
    exact = exact_groups(problem)
    blocks = Blocks.of(exact)
    n, K = exact.num_coarse, problem.num_stages
    end = data.draw(st.integers(0, n))
    starts = np.arange(end + 1)
    sent = np.array(data.draw(st.lists(st.integers(0, 300), min_size=end + 1,
                                       max_size=end + 1)), dtype=float)
    peak = np.array(data.draw(st.lists(st.integers(0, 300), min_size=end + 1,
                                       max_size=end + 1)), dtype=float)
    for recompute in (Option(NONE), Option(SELECTIVE, 0), Option(SELECTIVE, 1), Option(FULL)):
        rows = blocks.memory(end, starts, np.arange(K), sent=sent, peak=peak,
                             recompute=recompute)
        level = recompute.level
        for j in range(K):
            for a in starts:
                parts = memory_parts(
                    problem, j, flight=int(blocks.flights[j, 0]), recompute=recompute.mode,
                    params=max(blocks.P[end] - blocks.P0[a], 0.0),
                    activations=max(blocks.A[end] - blocks.A0[a], 0.0),
                    received=blocks.cut_bytes[a], kept=sent[a], transient=peak[a],
                    selective=max(blocks.S[end, level] - blocks.S0[a, level], 0.0))
                assert rows[j, a] == pytest.approx(sum(parts.values()), rel=1e-12)
