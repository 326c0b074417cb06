"""The ILP against plain enumeration of every valid split, on random small DAGs."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fxpipe.partition import (
    Comm,
    Edge,
    InfeasibleMemoryError,
    Node,
    Problem,
    Schedule,
    StageModel,
    TiedGroup,
    TiedPolicy,
    TooManyStagesError,
    evaluate,
    exact_groups,
    partition,
    violations,
)

from ._brute import brute_force

MS = 1e-3


@st.composite
def problems(draw: st.DrawFn) -> Problem:
    K = draw(st.integers(1, 4))
    n = draw(st.integers(1, 7 if K < 4 else 6))
    nodes = tuple(
        Node(
            name=f"n{i}",
            forward_s=draw(st.integers(0, 9)) * MS,
            backward_s=draw(st.integers(0, 9)) * MS,
            param_bytes=draw(st.integers(0, 5)) * 100,
            activation_bytes=draw(st.integers(0, 3)) * 10,
            output_bytes=draw(st.integers(0, 3)) * 10,
            comm_s=draw(st.integers(0, 4)) * MS,
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
        schedule=draw(st.sampled_from(Schedule)),
        microbatches=draw(st.integers(1, 4)),
        state_factor=float(draw(st.integers(1, 4))),
        recompute=draw(st.booleans()),
        workspace_bytes=draw(st.integers(0, 2)) * 50,
        comm=draw(st.sampled_from(Comm)),
        tied=tied,
        tied_policy=draw(st.sampled_from(TiedPolicy)),
        colocate=colocate,
        allow_empty_stages=draw(st.booleans()),
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_ilp_matches_brute_force(problem: Problem) -> None:
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
