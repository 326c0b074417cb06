"""Tiny graphs whose best split is known by construction."""

from __future__ import annotations

from typing import Any

import pytest

from fxpipe.partition import (
    Edge,
    InfeasibleMemoryError,
    Node,
    Problem,
    evaluate,
    exact_groups,
    partition,
    violations,
)
from fxpipe.partition.baselines import interval_dp
from fxpipe.partition.coarsen import Coarsening

MS = 1e-3
GiB = 2**30


def chain(times_ms: list[float], *, params: list[int] | None = None, **kwargs: object) -> Problem:
    params = params or [0] * len(times_ms)
    nodes = tuple(Node(f"layer{i}", t * MS / 3, 2 * t * MS / 3, param_bytes=p,
                       module=f"layers.{i}") for i, (t, p) in enumerate(zip(times_ms, params,
                                                                               strict=True)))
    edges = tuple(Edge(i, i + 1) for i in range(len(times_ms) - 1))
    return Problem(nodes, edges, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("heavy_at", [0, 4, 8])
def test_eight_10ms_layers_and_one_40ms_layer_onto_4_gpus(heavy_at: int) -> None:
    times = [10.0] * 8
    times.insert(heavy_at, 40.0)
    result = partition(chain(times, num_stages=4), time_limit_s=10)
    assert result.report.status == "OPTIMAL"
    assert result.report.objective == pytest.approx(40 * MS)
    assert result.report.solved_nodes == 9 and result.report.graph_nodes == 9
    heavy_stage = result.stage_of[heavy_at]
    assert [result.stage_of[i] for i in range(9)].count(heavy_stage) == 1


def test_torchgpipe_balance_10ms_and_20ms_layers() -> None:
    # torchgpipe's test: layers sleeping 10 ms and 20 ms balance to a known split.
    result = partition(chain([10, 10, 20, 10, 10, 20], num_stages=2), time_limit_s=10)
    assert result.report.objective == pytest.approx(40 * MS)
    assert result.stage_of == (0, 0, 0, 1, 1, 1)


def test_uniform_split_overflows_but_a_feasible_split_exists() -> None:
    # Two big layers up front: two layers per stage puts 12 GiB on stage 0.
    params = [6 * GiB, 6 * GiB] + [GiB] * 6
    problem = chain([10] * 8, params=params, num_stages=4, memory_limit=8 * GiB,
                    state_factor=1.0)
    result = partition(problem, time_limit_s=10)
    assert result.baselines["uniform-layers"].fits is False
    assert result.evaluation.estimate.fits
    assert not violations(problem, result.stage_of)
    assert result.stage_of[0] != result.stage_of[1]
    assert result.report.status == "OPTIMAL"
    # Best: [0] [1] [2,3,4] [5,6,7] -> 30 ms.
    assert result.report.objective == pytest.approx(30 * MS)


def test_baselines_are_valid_and_scored_by_evaluate() -> None:
    problem = chain([5, 1, 1, 1, 30, 1, 1, 8], params=[1, 9, 1, 1, 1, 1, 1, 9], num_stages=3)
    result = partition(problem, time_limit_s=10)
    for name, split in result.baseline_splits.items():
        assert not violations(problem, split), name
        assert result.baselines[name] == evaluate(problem, split).estimate
        assert result.baselines[name].bottleneck_s >= result.report.objective
    assert set(result.baselines) == {"uniform-layers", "parameters", "greedy-time"}


def test_one_dominant_layer_is_replicated_and_beats_every_unreplicated_split() -> None:
    """Three 10 ms layers and one 30 ms layer onto 4 GPUs: one stage per GPU is stuck at
    30 ms; giving the slow part more GPUs (PipeDream's "2-2" / "1-1-2") does better, with
    the all-reduce of its gradients counted (1 MB at 100 GB/s: 15 us for two replicas)."""
    params = [10**6] * 4
    link = {"allreduce_bandwidth": 100e9, "allreduce_latency_s": 5e-6}
    one_each = chain([10, 10, 10, 30], params=params, num_stages=4, **link)
    unreplicated = min(evaluate(one_each, s).bottleneck_s for s in _monotone(4, 4))
    assert unreplicated == pytest.approx(30 * MS)
    assert partition(one_each, time_limit_s=10).report.objective == pytest.approx(30 * MS)

    result = partition(chain([10, 10, 10, 30], params=params, num_stages=4, **link),
                       time_limit_s=10, replicate=True)
    assert result.report.status == "OPTIMAL"
    replicas = result.evaluation.replicas
    assert sum(replicas) == 4 and max(replicas) > 1
    assert result.report.objective < 0.55 * unreplicated
    # The same split, replicas and all, scored by the one cost model.
    again = evaluate(result.problem, result.stage_of, replicas)
    assert again.bottleneck_s == result.report.objective
    # per-micro-batch time 15 ms + the all-reduce: (30 ms / 2 or 3 x 10 ms / 2), never 30
    heavy = result.stage_of[3]
    stage = result.evaluation.stages[heavy]
    assert stage.replicas >= 2
    assert stage.forward_s + stage.backward_s == pytest.approx(30 * MS / stage.replicas)
    assert stage.comm_s >= 2 * (stage.replicas - 1) / stage.replicas * 1e6 / 100e9


def _monotone(n: int, K: int) -> list[tuple[int, ...]]:
    """Every non-decreasing assignment of a chain of n nodes to K non-empty stages."""
    import itertools

    return [s for s in itertools.product(range(K), repeat=n)
            if list(s) == sorted(s) and set(s) == set(range(K))]


def test_reported_bound_is_never_below_the_trivial_one() -> None:
    """With no time to prove anything the bound is still max(total / N, slowest node)."""
    from fxpipe.partition.solve import trivial_bound

    problem = chain([10, 10, 10, 30, 5, 5, 20, 10], num_stages=4)
    assert trivial_bound(problem) == pytest.approx(30 * MS)
    result = partition(problem, time_limit_s=10)
    assert result.report.bound >= trivial_bound(problem) * (1 - 1e-9)
    replicated = partition(problem, time_limit_s=10, replicate=True)
    assert replicated.report.bound >= 100 * MS / 4 * (1 - 1e-9)


@pytest.mark.parametrize("returned", [False, True])
def test_kept_outputs_move_the_cut(returned: bool) -> None:
    # x (3 ms) -> y (2 ms) -> z (4 ms) on 2 GPUs, 1F1B, M = 4 (in flight 2, 1). The fastest
    # split, x y | z (5 ms), sends y's 1000 bytes: stage 0 keeps them for 2 micro-batches
    # plus one of their gradients, 3000 bytes, over the 1500-byte limit. Counting only
    # what stage 1 receives (1000 x 1) it would fit. x | y z (6 ms) sends x's 1 byte.
    # With z returned (10 bytes) and a loss, stage 1 of x | y z holds received 1, its
    # output 10 x 2 and the loss 100 + 50: still within the limit.
    nodes = (Node("x", 1 * MS, 2 * MS, output_bytes=1),
             Node("y", 1 * MS, 1 * MS, output_bytes=1000),
             Node("z", 2 * MS, 2 * MS, output_bytes=10, returned=returned))
    loss = {"loss_saved_bytes": 100, "loss_grad_bytes": 50} if returned else {}
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2)), num_stages=2, microbatches=4,
                memory_limit=1500, **loss)  # type: ignore[arg-type]
    fast = evaluate(p, (0, 0, 1))
    old = [s.memory.total - s.memory.outputs - s.memory.loss for s in fast.stages]
    assert max(old) <= p.memory_limit < fast.estimate.max_memory
    assert fast.stages[0].memory.outputs == 1000 * 3
    result = partition(p, time_limit_s=10)
    assert result.report.status == "OPTIMAL"
    assert result.stage_of == (0, 1, 1)
    assert result.report.objective == pytest.approx(6 * MS)
    assert result.evaluation.estimate.fits
    last = result.evaluation.stages[1].memory
    assert (last.received, last.outputs, last.loss) == ((1, 20, 150) if returned else (1, 0, 0))
    unlimited = partition(p.__class__(**{**p.__dict__, "memory_limit": float("inf")}),
                          time_limit_s=10)
    assert unlimited.stage_of == (0, 0, 1)


def test_backward_transient_moves_the_cut() -> None:
    # x (3 ms) -> y (2 ms) -> z (4 ms) on 2 GPUs, 1500 bytes each. The fastest split,
    # x y | z (5 ms), holds x's and y's 400 parameter bytes and, while y runs backward,
    # its 800 gradient bytes: 1600. x | y z (6 ms) holds 400 + max(800, 400) = 1200
    # there; summed instead of the largest it would be 1600 too, and nothing would fit.
    nodes = (Node("x", 1 * MS, 2 * MS, param_bytes=400, grad_bytes=500),
             Node("y", 1 * MS, 1 * MS, param_bytes=400, grad_bytes=800),
             Node("z", 2 * MS, 2 * MS, grad_bytes=400))
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2)), num_stages=2, microbatches=4,
                state_factor=1.0, memory_limit=1500)
    fast = evaluate(p, (0, 0, 1))
    assert [s.memory.backward for s in fast.stages] == [800, 400]
    assert fast.estimate.max_memory == 1600
    result = partition(p, time_limit_s=10)
    assert result.report.status == "OPTIMAL"
    assert result.stage_of == (0, 1, 1)
    assert result.report.objective == pytest.approx(6 * MS)
    assert [s.memory.total for s in result.evaluation.stages] == [900, 1200]
    assert interval_dp(exact_groups(p)) == (0, 1, 1)  # the warm start counts it too
    unlimited = partition(p.__class__(**{**p.__dict__, "memory_limit": float("inf")}),
                          time_limit_s=10)
    assert unlimited.stage_of == (0, 0, 1)
    with pytest.raises(InfeasibleMemoryError) as tight:
        partition(p.__class__(**{**p.__dict__, "memory_limit": 1100}), time_limit_s=10)
    assert tight.value.needed == 1200


def test_a_split_the_first_solve_found_but_did_not_prove_hints_the_last(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The first exact solve (hinted with the interval DP's split) often finds the optimum
    and runs out of work proving it; the last solve must start from that split, not from
    the DP's or the coarse one's, or it spends its work finding it again (transformers'
    Falcon onto 4 GPUs: 7.1 of CP-SAT's 8.6 units of work)."""
    from fxpipe.partition import ilp, solve

    # a -> {b, c} -> d: the DP's order a, b, c, d holds no balanced split; {a, c} | {b, d} is
    nodes = tuple(Node(n, t * MS / 3, 2 * t * MS / 3) for n, t in
                  (("a", 1.0), ("b", 1.0), ("c", 3.0), ("d", 3.0)))
    edges = (Edge(0, 1), Edge(0, 2), Edge(1, 3), Edge(2, 3))
    problem = Problem(nodes, edges, num_stages=2)
    best = (0, 1, 0, 1)
    hints: list[tuple[int, ...] | None] = []

    class Model(ilp.StageModel):
        def __init__(self, coarsening: Coarsening, **kwargs: Any) -> None:
            super().__init__(coarsening, **kwargs)
            hint = kwargs.get("hint")
            self.hinted = None if hint is None else coarsening.expand(hint)

        def solve(self, **kwargs: Any) -> ilp.IlpResult:
            hints.append(self.hinted)
            if len(hints) == 1:  # found, not proved
                return ilp.IlpResult("FEASIBLE", best, best, 4 * MS, 0.0, 0.0, 4)
            return super().solve(**kwargs)

    monkeypatch.setattr(solve, "StageModel", Model)
    result = partition(problem, time_limit_s=10)
    dp = interval_dp(exact_groups(problem))
    assert dp is not None and evaluate(problem, dp).bottleneck_s > 4 * MS
    assert hints[-1] == best
    assert result.stage_of == best and result.report.status == "OPTIMAL"
