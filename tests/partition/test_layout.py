"""The cluster's layouts as plain data: which are considered, what sharding and syncing
cost, and the search that plans them in the order of their bounds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fxpipe.partition import InfeasibleMemoryError
from fxpipe.partition.layout import (
    Cluster,
    Link,
    Totals,
    candidates,
    layout_bound,
    pipeline_crosses_hosts,
    search,
    sharded,
    sync_crosses_hosts,
    sync_s,
)
from fxpipe.partition.problem import Node, Problem

GB = 1e9
NVLINK, IB = Link(450 * GB, 1e-6), Link(50 * GB, 5e-6)


def _cluster(n: int, g: int = 8) -> Cluster:
    return Cluster(n, g, NVLINK, IB)


def test_every_pipeline_degree_dividing_the_gpus_with_whole_micro_batches() -> None:
    # ddp moves fsdp's bytes and holds more: planned only when asked for
    assert candidates(_cluster(8), 16) == [
        (1, 8, "fsdp", 2, 1), (2, 4, "fsdp", 4, 1), (4, 2, "fsdp", 8, 1),
        (8, 1, "ddp", 16, 1)]
    assert candidates(_cluster(8), 16, dp_mode="ddp")[0] == (1, 8, "ddp", 2, 1)
    # 12 micro-batches do not split over 8 or 4 pipelines
    assert {p for p, *_ in candidates(_cluster(8), 12)} == {2, 4, 8}
    assert candidates(_cluster(8), 16, pp=4, dp_mode="ddp") == [(4, 2, "ddp", 8, 1)]


def test_a_cluster_fills_whole_hosts() -> None:
    with pytest.raises(ValueError, match="12 GPUs do not fill hosts of 8"):
        _cluster(12)
    assert _cluster(4, 8).gpus == 4  # fewer GPUs than a host: one host


def test_fsdp_divides_only_the_optimizer_state() -> None:
    p = Problem((Node("a", 1, 1, param_bytes=100),), (), num_stages=1, state_factor=4.0)
    assert sharded(p, 8, "fsdp").state_factor == 1 + 1 + 2 / 8
    assert sharded(p, 8, "ddp").state_factor == 4.0
    assert sharded(p, 1, "fsdp").state_factor == 4.0
    sgd = Problem((Node("a", 1, 1),), (), num_stages=1, state_factor=2.0)
    assert sharded(sgd, 8, "fsdp").state_factor == 2.0  # nothing to shard


def test_which_link_each_collective_rides() -> None:
    # 64 GPUs, 8 per host, pipeline innermost: 8 stages fill a host; 16 cross hosts
    assert not pipeline_crosses_hosts(_cluster(64), 8)
    assert pipeline_crosses_hosts(_cluster(64), 16)
    assert sync_crosses_hosts(_cluster(64), 8)  # the 8 copies of a stage, one per host
    assert not sync_crosses_hosts(_cluster(64), 64)  # one copy: no sync
    assert not sync_crosses_hosts(_cluster(8), 2)  # one host


def test_the_sync_is_a_ring() -> None:
    assert sync_s(1e9, 1, NVLINK) == 0.0
    assert sync_s(1e9, 4, NVLINK) == pytest.approx(2 * 3 / 4 * 1e9 / NVLINK.bandwidth
                                                  + 6 * NVLINK.latency_s)


@dataclass
class _Evaluation:
    @dataclass
    class _Estimate:
        iteration_s: float
        max_memory: int

    @dataclass
    class _Stage:
        @dataclass
        class _Memory:
            params: int

        memory: _Memory

    estimate: _Estimate
    stages: list[_Stage]


@dataclass
class _Report:
    status: str = "OPTIMAL"
    bound: float = 0.0


@dataclass
class _Result:
    evaluation: _Evaluation
    problem: Problem
    report: _Report


def _result(step: float, p: int, params: int = 0) -> _Result:
    stages = [_Evaluation._Stage(_Evaluation._Stage._Memory(params // p)) for _ in range(p)]
    problem = Problem((Node("a", 1, 1),), (), num_stages=1, state_factor=4.0)
    return _Result(_Evaluation(_Evaluation._Estimate(step, 1), stages), problem, _Report())


def test_the_search_plans_in_bound_order_and_prunes_what_cannot_win() -> None:
    totals = Totals(compute_s=1.0, grad_bytes=0.0)
    layouts = candidates(_cluster(4), 8, dp_mode="ddp")  # p = 1, 2, 4
    bounds = [layout_bound(totals, p, d, m, NVLINK) for p, d, _, m, _ in layouts]
    assert bounds == sorted(bounds)  # fewer pipeline stages, less fill and drain here
    asked = []

    def solve(p: int, d: int, mode: str, m: int, t: int, slowest: float | None,
              split: object) -> _Result:
        asked.append(p)
        return _result(bounds[[q for q, *_ in layouts].index(p)], p)

    tried = search(_cluster(4), layouts, {1: totals}, solve)
    assert asked == [1]  # its step meets its bound: nothing else can be faster
    assert [t.status for t in tried] == ["chosen", "pruned", "pruned"]


def test_a_layout_that_does_not_fit_says_why_and_the_next_is_planned() -> None:
    totals = Totals(compute_s=1.0, grad_bytes=0.0)
    layouts = candidates(_cluster(2), 4, dp_mode="ddp")  # p = 1, 2

    def solve(p: int, d: int, mode: str, m: int, t: int, slowest: float | None,
              split: object) -> _Result:
        if p == 1:
            raise InfeasibleMemoryError(devices=1, limit=1.0, needed=2.0)
        return _result(5.0, p)

    tried = search(_cluster(2), layouts, {1: totals}, solve)
    assert [t.status for t in tried] == ["no fit", "chosen"]
    assert "fits in" in tried[0].why


def test_a_layout_whose_slowest_stage_cannot_beat_the_best_is_pruned_unsolved() -> None:
    """Once a layout is solved, each one after it is bounded by its slowest stage (the
    block bound, cut off where it cannot beat the best step) before it is solved: pruned
    where it cannot win, else solved with that bound handed on."""
    totals = Totals(compute_s=1.0, grad_bytes=0.0)
    layouts = candidates(_cluster(4), 8, dp_mode="ddp")  # p = 1, 2, 4; M = 2, 4, 8
    bounds = [layout_bound(totals, p, d, m, NVLINK) for p, d, _, m, _ in layouts]
    assert bounds == [2.0, 2.5, 2.75]
    solved, bounded = [], []

    def solve(p: int, d: int, mode: str, m: int, t: int, slowest: float | None,
              split: object) -> _Result:
        solved.append((p, slowest, split))
        return _result(3.0 if p == 1 else 2.9, p)

    def bottleneck(p: int, d: int, mode: str, m: int, t: int, upper_s: float
                   ) -> tuple[float, object]:
        # a split beating the best step (3.0) has its slowest of (M - 1) under 3.0 - 1.0
        assert upper_s == pytest.approx(2.0 / (m - 1))
        bounded.append(p)
        # p = 2: no split that fits is faster; p = 4: and the split found meanwhile
        return (upper_s, None) if p == 2 else (0.26, "the DP's split")

    tried = search(_cluster(4), layouts, {1: totals}, solve, bottleneck)
    assert bounded == [2, 4]
    assert solved == [(1, None, None), (4, 0.26, "the DP's split")]
    assert [t.status for t in tried] == ["solved", "pruned", "chosen"]
    assert tried[1].bound_s == 3.0  # no better than the best step when it was pruned
    assert tried[2].bound_s == pytest.approx(7 * 0.26 + 1.0)


def test_tp_is_one_more_dimension_of_the_layouts() -> None:
    # p x d x t = N; tp innermost: a stage's t GPUs and a pipeline's p t share a host
    found = candidates(_cluster(8), 16, tp=(1, 2, 4))
    assert all(p * d * t == 8 for p, d, _, _, t in found)
    assert (2, 2, "fsdp", 8, 2) in found and (1, 2, "fsdp", 8, 4) in found
    assert candidates(_cluster(8), 16, pp=4, tp=(4,)) == []  # 16 GPUs per pipeline
    assert not pipeline_crosses_hosts(_cluster(16), 2, 4)  # 8 GPUs: one host
    assert pipeline_crosses_hosts(_cluster(16), 4, 4)  # 16 GPUs: two
    assert sync_crosses_hosts(_cluster(16), 2, 4)  # 2 copies, one per host
    assert not sync_crosses_hosts(_cluster(16), 4, 4)  # one copy: no sync


def test_the_search_chooses_the_tp_degree_by_each_ones_totals() -> None:
    layouts = candidates(_cluster(4), 4, pp=1, dp_mode="fsdp", tp=(1, 2, 4))
    assert [t for *_, t in layouts] == [1, 2, 4]
    # torch's DDP takes no DTensor parameters: no ddp copies of split stages (t = 4 is one)
    assert [(d, t) for _, d, _, _, t in candidates(_cluster(4), 4, pp=1, dp_mode="ddp",
                                                   tp=(1, 2, 4))] == [(4, 1), (1, 4)]
    # t = 2 halves the compute and pays a little for its all-reduces, t = 4 more; with the
    # global batch fixed, each t has fewer pipelines and so more micro-batches each
    totals = {1: Totals(1.0, 0.0), 2: Totals(0.55, 0.0), 4: Totals(0.3, 0.0)}
    bounds = [layout_bound(totals[t], p, d, m, NVLINK) for p, d, _, m, t in layouts]
    assert bounds == sorted(bounds)

    def solve(p: int, d: int, mode: str, m: int, t: int, slowest: float | None,
              split: object) -> _Result:
        if t == 1:  # the whole model does not fit one GPU
            raise InfeasibleMemoryError(devices=1, limit=1.0, needed=2.0)
        return _result(layout_bound(totals[t], p, d, m, NVLINK), p)

    tried = search(_cluster(4), layouts, totals, solve)
    assert [(t.t, t.status) for t in tried] == [(1, "no fit"), (2, "chosen"), (4, "pruned")]


def test_a_layout_is_bounded_by_its_slowest_op_which_some_stage_holds_whole() -> None:
    # 4 stages of 1.0 s of compute: 0.25 s each at best, but one op alone takes 0.5 s
    spread = layout_bound(Totals(1.0, 0.0), 4, 1, 3, NVLINK)
    assert spread == pytest.approx(2 * 0.25 + 1.0)
    assert layout_bound(Totals(1.0, 0.0, largest_s=0.5), 4, 1, 3, NVLINK) == \
        pytest.approx(2 * 0.5 + 1.0)
