"""evaluate(): the one cost model, checked by hand on small cases."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fxpipe.partition import (
    Comm,
    Edge,
    Node,
    Problem,
    Recompute,
    TiedGroup,
    TiedPolicy,
    evaluate,
    violations,
)
from fxpipe.partition.baselines import Blocks, interval_dp, min_max_dp
from fxpipe.partition.coarsen import exact_groups
from fxpipe.partition.cost import Option
from fxpipe.plan import StageRecompute
from fxpipe.schedules import ScheduleKind

NONE, SELECTIVE, FULL = StageRecompute


def fan(comm: Comm, **kwargs: object) -> Problem:
    # a -> b, a -> c, b -> c ; a's value: 8 bytes, 1 s to move
    nodes = (
        Node("a", 1.0, 2.0, param_bytes=100, activation_bytes=10, output_bytes=8, comm_s=1.0),
        Node("b", 1.0, 1.0, param_bytes=50, activation_bytes=5, output_bytes=4, comm_s=0.5),
        Node("c", 2.0, 2.0, activation_bytes=1),
    )
    edges = (Edge(0, 1), Edge(0, 2), Edge(1, 2))
    return Problem(nodes, edges, comm=comm, **kwargs)  # type: ignore[arg-type]


def test_neighbour_comm_charges_each_boundary_crossed() -> None:
    p = fan(Comm.NEIGHBOUR, num_stages=3, microbatches=4, schedule=ScheduleKind.GPIPE)
    ev = evaluate(p, [0, 1, 2])
    # a crosses boundaries 0 and 1 (read on 1 and 2): 1 s on stages 0,1 and 1,2.
    # b crosses boundary 1: 0.5 s on stages 1, 2.
    assert [s.comm_s for s in ev.stages] == [1.0, 2.5, 1.5]
    # received (x M=4 in flight): stage 1 gets a; stage 2 gets a (passed on) and b.
    assert [s.memory.received for s in ev.stages] == [0, 32, 48]
    assert [s.time_s for s in ev.stages] == [4.0, 4.5, 5.5]


def test_direct_comm_charges_sender_once_and_each_reader() -> None:
    p = fan(Comm.DIRECT, num_stages=3)
    ev = evaluate(p, [0, 1, 2])
    # a: once on its own stage, once on 1, once on 2; b: once on 1, once on 2
    assert [s.comm_s for s in ev.stages] == [1.0, 1.5, 1.5]
    assert evaluate(p, [0, 0, 0]).stages[0].comm_s == 0.0


def test_memory_kinds_state_factor_and_in_flight() -> None:
    p = fan(Comm.NEIGHBOUR, num_stages=2, microbatches=8, state_factor=4.0,
            workspace_bytes=7)
    ev = evaluate(p, [0, 0, 1])
    m0, m1 = ev.stages[0].memory, ev.stages[1].memory
    # 1F1B: stage 0 keeps min(8, 2) = 2 micro-batches, stage 1 keeps 1.
    assert (m0.params, m0.grads, m0.optimizer) == (150, 150, 300)
    assert m0.activations == 15 * 2 and m1.activations == 1
    assert m1.received == (8 + 4) * 1
    assert m0.workspace == m1.workspace == 7
    # stage 0 sends a and b to c: kept for 2 micro-batches, + one of their gradients
    assert m0.outputs == (8 + 4) * (2 + 1) and m1.outputs == 0
    assert m0.loss == m1.loss == 0
    assert m0.total == 150 * 4 + 30 + 36 + 7
    assert ev.estimate.max_memory == m0.total


def test_recompute_keeps_one_micro_batch_of_activations() -> None:
    p = fan(Comm.NEIGHBOUR, num_stages=2, microbatches=8, schedule=ScheduleKind.GPIPE,
            recompute=Recompute.FULL)
    ev = evaluate(p, [0, 1, 1])
    assert ev.recompute == (FULL, FULL)
    assert ev.stages[1].memory.activations == 6  # b + c, once
    assert ev.stages[1].memory.received == 8 * 8  # a's value kept per micro-batch
    # and pays its forward (b + c: 3 s) again in the backward
    assert ev.stages[1].forward_s == 3.0
    assert ev.stages[1].backward_s == 3.0 + 3.0


def test_recompute_given_per_stage() -> None:
    p = fan(Comm.NEIGHBOUR, num_stages=2, microbatches=8, schedule=ScheduleKind.GPIPE)
    ev = evaluate(p, [0, 1, 1], recompute=(FULL, NONE))
    assert ev.recompute == (FULL, NONE)
    assert [s.memory.activations for s in ev.stages] == [10, 6 * 8]
    assert [s.backward_s for s in ev.stages] == [2.0 + 1.0, 3.0]
    assert evaluate(p, [0, 1, 1]).recompute == (NONE, NONE)  # the policy: none


def test_a_selective_stage_keeps_its_kept_ops_per_micro_batch_and_reruns_the_rest() -> None:
    """Recomputed selectively, a stage keeps what SAC keeps for each micro-batch in flight
    but the one in its backward, which holds all its activations, and reruns the forward
    of its ops that SAC does not keep."""
    nodes = (Node("a", 1.0, 2.0, activation_bytes=10, output_bytes=8, comm_s=1.0),
             Node("b", 2.0, 4.0, activation_bytes=30, selective_bytes=(12,),
                  selective_kept_s=(1.5,), output_bytes=4))
    p = Problem(nodes, (Edge(0, 1),), num_stages=2, microbatches=8,
                schedule=ScheduleKind.GPIPE, recompute=Recompute.SELECTIVE)
    ev = evaluate(p, [0, 1])
    assert ev.recompute == (SELECTIVE, SELECTIVE)
    # GPipe: 8 micro-batches in flight on both stages
    assert ev.stages[0].memory.activations == 10  # nothing kept: as recomputed in full
    assert ev.stages[1].memory.activations == 30 + 12 * 7
    assert ev.stages[0].backward_s == 2.0 + 1.0
    assert ev.stages[1].backward_s == 4.0 + (2.0 - 1.5)
    assert ev.stages[1].memory.received == 8 * 8  # its inputs, as in full recompute


def test_auto_takes_selective_where_it_fits_and_is_faster_than_full() -> None:
    """Four equal layers under 1F1B (stage j holds 4 - j micro-batches): a limit where
    stage 0 fits only recomputed in full, stage 1 selectively and the others as they
    are."""
    nodes = tuple(Node(f"l{i}", 1.0, 2.0, activation_bytes=100, selective_bytes=(60,),
                       selective_kept_s=(0.75,), output_bytes=1) for i in range(4))
    edges = tuple(Edge(i, i + 1) for i in range(3))
    problem = Problem(nodes, edges, num_stages=4, microbatches=8, recompute=Recompute.AUTO)
    split = (0, 1, 2, 3)
    by_mode = {mode: evaluate(problem, split, recompute=(mode,) * 4).stages
               for mode in (NONE, SELECTIVE, FULL)}
    # in flight 4, 3, 2, 1: on stage 0, activations 400 kept / 100 + 60 * 3 selectively
    assert [s.memory.activations for s in by_mode[SELECTIVE]] == [280, 220, 160, 100]
    limit = by_mode[SELECTIVE][1].memory.total
    assert by_mode[SELECTIVE][0].memory.total > limit >= by_mode[FULL][0].memory.total
    assert by_mode[NONE][1].memory.total > limit >= by_mode[NONE][2].memory.total
    ev = evaluate(replace(problem, memory_limit=limit), split)
    assert ev.recompute == (FULL, SELECTIVE, NONE, NONE)
    assert ev.estimate.fits
    assert [s.backward_s for s in ev.stages] == [3.0, 2.25, 2.0, 2.0]
    # a model that writes in place into a kept output anywhere: none or full only
    written = (replace(nodes[0], writes_kept=True), *nodes[1:])
    ev = evaluate(replace(problem, nodes=written, memory_limit=limit), split)
    assert ev.recompute == (FULL, FULL, NONE, NONE)


def test_auto_recomputes_in_full_where_sacs_host_time_makes_selective_slower() -> None:
    """Torch's SAC costs the host time on every op of both runs, which short ops do not
    hide (``Node.selective_host_s``): there a stage recomputed in full runs faster than
    one recomputed selectively, and auto takes full where both fit. The interval DP,
    which takes each block's fastest choice that fits, finds the split evaluate prices."""
    nodes = tuple(Node(f"l{i}", 1.0, 2.0, activation_bytes=100, selective_bytes=(60,),
                       selective_kept_s=(0.75,), selective_host_s=1.5, output_bytes=1)
                  for i in range(4))
    edges = tuple(Edge(i, i + 1) for i in range(3))
    problem = Problem(nodes, edges, num_stages=2, microbatches=8, recompute=Recompute.AUTO)
    split = (0, 0, 1, 1)
    by_mode = {mode: evaluate(problem, split, recompute=(mode,) * 2).stages
               for mode in (NONE, SELECTIVE, FULL)}
    # run again: 2 x (1.0 - 0.75 + 1.5) selectively against 2 x 1.0 in full; SAC's host
    # time (2 x 1.5) is half the first run's, half the run again's
    assert [(s.forward_s, s.backward_s) for s in by_mode[SELECTIVE]] == [(3.5, 6.0)] * 2
    assert [(s.forward_s, s.backward_s) for s in by_mode[FULL]] == [(2.0, 6.0)] * 2
    limit = by_mode[SELECTIVE][0].memory.total  # 2 in flight: stage 0 fits kept selectively
    assert by_mode[NONE][0].memory.total > limit >= by_mode[FULL][0].memory.total
    limited = replace(problem, memory_limit=limit)
    ev = evaluate(limited, split)
    assert ev.recompute == (FULL, NONE) and ev.estimate.fits
    groups = exact_groups(limited)
    best, _ = min_max_dp(Blocks.of(groups), 4, upper_s=float("inf"), allow_empty=False)
    assert best[-1][-1] == ev.estimate.bottleneck_s == 8.0
    assert interval_dp(groups) == split


def test_auto_takes_the_keep_level_that_fits_where_keeping_all_does_not() -> None:
    """Two keep levels: the first keeps 20 of each layer's 100 bytes and skips 0.25 s of
    its forward run again, the second (all) 60 bytes and 0.75 s. Where stage 0 (4
    micro-batches in flight) fits keeping at the first level but not keeping all, auto
    recomputes it selectively at the first level: faster than in full."""
    nodes = tuple(Node(f"l{i}", 1.0, 2.0, activation_bytes=100, selective_bytes=(20, 60),
                       selective_kept_s=(0.25, 0.75), output_bytes=1) for i in range(4))
    edges = tuple(Edge(i, i + 1) for i in range(3))
    problem = Problem(nodes, edges, num_stages=4, microbatches=8, recompute=Recompute.AUTO,
                      keep_levels=((8, 2), (0, 0)))
    split = (0, 1, 2, 3)
    lean = evaluate(problem, split, recompute=(Option(SELECTIVE, 0),) * 4).stages
    assert [s.memory.activations for s in lean] == [160, 140, 120, 100]
    assert [s.backward_s for s in lean] == [2.75] * 4
    every = evaluate(problem, split, recompute=(SELECTIVE,) * 4).stages  # the last level
    assert every[0].memory.activations == 280 and every[0].backward_s == 2.25
    ev = evaluate(replace(problem, memory_limit=lean[0].memory.total), split)
    assert ev.options[0] == Option(SELECTIVE, 0)
    assert ev.stages[0].backward_s < evaluate(problem, split, recompute=(FULL,) * 4).stages[
        0].backward_s
    assert ev.recompute[3] is NONE and ev.estimate.fits


def chain_1f1b(limit: float) -> Problem:
    """Four equal layers, 1F1B over 4 stages and 8 micro-batches: stage j holds 4 - j."""
    nodes = tuple(Node(f"l{i}", 1.0, 2.0, activation_bytes=100, output_bytes=1)
                  for i in range(4))
    edges = tuple(Edge(i, i + 1) for i in range(3))
    return Problem(nodes, edges, num_stages=4, microbatches=8, memory_limit=limit,
                   recompute=Recompute.AUTO)


def test_auto_recomputes_exactly_the_stages_that_do_not_fit() -> None:
    split = (0, 1, 2, 3)
    plain = evaluate(chain_1f1b(float("inf")), split)
    assert plain.recompute == (NONE,) * 4  # nothing to gain without a limit
    held = [s.memory.total for s in plain.stages]
    assert held == sorted(held, reverse=True)  # the first stages hold the most
    limit = held[2]  # stages 2 and 3 fit as they are, 0 and 1 do not
    ev = evaluate(chain_1f1b(limit), split)
    assert ev.recompute == (FULL, FULL, NONE, NONE)
    assert ev.estimate.fits
    assert [s.time_s for s in ev.stages][:2] == [4.0 + plain.stages[0].comm_s,
                                                 4.0 + plain.stages[1].comm_s]
    # nothing fits even recomputed: recompute everywhere (the least memory it can show)
    tight = evaluate(chain_1f1b(1), split)
    assert tight.recompute == (FULL,) * 4 and not tight.estimate.fits


def kept_values(comm: Comm, **kwargs: object) -> Problem:
    """a, e on stage 0; b, c on 1; d on 2.  a -> b, a -> d, b -> c, c -> d; d and e are
    returned (e from stage 0, read by nothing)."""
    nodes = (
        Node("a", 1, 1, output_bytes=10),
        Node("e", 1, 1, output_bytes=5, returned=True),
        Node("b", 1, 1, output_bytes=20),
        Node("c", 1, 1, output_bytes=30),
        Node("d", 1, 1, output_bytes=40, returned=True),
    )
    edges = (Edge(0, 2), Edge(0, 4), Edge(2, 3), Edge(3, 4))
    return Problem(nodes, edges, num_stages=3, microbatches=4, comm=comm,
                   loss_saved_bytes=100, loss_grad_bytes=50, **kwargs)  # type: ignore[arg-type]


SPLIT = (0, 0, 1, 1, 2)


@pytest.mark.parametrize("comm", list(Comm))
def test_outputs_and_loss_by_hand_1f1b(comm: Comm) -> None:
    ev = evaluate(kept_values(comm), SPLIT)
    # 1F1B, K=3, M=4: in flight 3, 2, 1. Kept: stage 0 a (read on 1, 2) and e (returned);
    # stage 1 c (b is read on its own stage; a is passed on, in received); stage 2 d.
    # Each x (in flight + 1 for their gradients).
    assert [s.memory.outputs for s in ev.stages] == [(10 + 5) * 4, 30 * 3, 40 * 2]
    # the loss on the last stage: saved x 1 in flight + its gradient
    assert [s.memory.loss for s in ev.stages] == [0, 0, 100 + 50]
    # NEIGHBOUR passes a on through stage 1: received there, not one of its outputs
    assert [s.memory.received for s in ev.stages] == [0, 10 * 2, (10 + 30) * 1]
    m = ev.stages[2].memory
    assert m.total == m.received + m.outputs + m.loss == 40 + 80 + 150


def test_outputs_and_loss_gpipe_recompute_and_replicas() -> None:
    gpipe = evaluate(kept_values(Comm.NEIGHBOUR, schedule=ScheduleKind.GPIPE), SPLIT)
    assert [s.memory.outputs for s in gpipe.stages] == [15 * 5, 30 * 5, 40 * 5]
    assert gpipe.stages[2].memory.loss == 100 * 4 + 50
    # recompute: outputs still kept until the backward; the loss is computed there, once
    again = evaluate(kept_values(Comm.NEIGHBOUR, schedule=ScheduleKind.GPIPE,
                                 recompute=Recompute.FULL), SPLIT)
    assert [s.memory.outputs for s in again.stages] == [15 * 5, 30 * 5, 40 * 5]
    assert again.stages[2].memory.loss == 100 + 50
    # stage 0 on 2 GPUs, stage 2 on 2: each replica keeps half
    replicated = evaluate(kept_values(Comm.NEIGHBOUR, num_devices=5), SPLIT, (2, 1, 2))
    assert [s.memory.outputs for s in replicated.stages] == [15 * 4 // 2, 30 * 3, 40 * 2 // 2]
    assert replicated.stages[2].memory.loss == 150 // 2


def test_backward_transient_is_the_largest_node_once() -> None:
    # a (grad 40) and b (grad 70) on stage 0, c (grad 25) on stage 1: a stage holds the
    # largest of its nodes' backward gradients, once -- not per micro-batch in flight,
    # not summed, and whole on each replica (its parameter part is not split)
    nodes = tuple(Node(name, 1.0, 1.0, grad_bytes=g) for name, g in zip("abc", (40, 70, 25),
                                                                       strict=True))
    edges = (Edge(0, 1), Edge(1, 2))
    for schedule in (ScheduleKind.GPIPE, ScheduleKind.ONE_F_ONE_B):
        ev = evaluate(Problem(nodes, edges, num_stages=2, microbatches=4, schedule=schedule),
                      [0, 0, 1])
        assert [s.memory.backward for s in ev.stages] == [70, 25]
        assert [s.memory.total for s in ev.stages] == [70, 25]
    replicated = evaluate(Problem(nodes, edges, num_stages=2, num_devices=3), [0, 0, 1], (2, 1))
    assert [s.memory.backward for s in replicated.stages] == [70, 25]
    moved = evaluate(Problem(nodes, edges, num_stages=2), [0, 1, 1])
    assert [s.memory.backward for s in moved.stages] == [40, 70]


def test_estimate_formulas() -> None:
    p = fan(Comm.DIRECT, num_stages=3, microbatches=5)
    ev = evaluate(p, [0, 1, 2])
    times = [s.time_s for s in ev.stages]
    assert ev.estimate.bottleneck_s == max(times)
    assert ev.estimate.iteration_s == pytest.approx(4 * max(times) + sum(times))
    assert ev.estimate.bubble_fraction == pytest.approx(2 / 7)
    assert ev.estimate.fits
    assert not evaluate(p.__class__(**{**p.__dict__, "memory_limit": 10}), [0, 1, 2]).estimate.fits


def test_tied_replicate_charges_copies_and_allreduce() -> None:
    nodes = (Node("emb", 1, 1), Node("mid", 1, 1), Node("head", 1, 1))
    tied = (TiedGroup("wte", (0, 2), param_bytes=1000, allreduce_s=0.25),)
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2)), num_stages=2, tied=tied, state_factor=2.0,
                tied_policy=TiedPolicy.COPY)
    split = evaluate(p, [0, 0, 1])
    assert [s.memory.params for s in split.stages] == [1000, 1000]
    assert [s.memory.grads for s in split.stages] == [1000, 1000]
    assert [s.comm_s for s in split.stages] == [0.25, 0.25]
    together = evaluate(p, [0, 1, 1])
    assert [s.memory.params for s in together.stages] == [1000, 1000]
    one = evaluate(Problem(nodes, (Edge(0, 1),), num_stages=2, tied=tied), [0, 1, 0])
    assert [s.memory.params for s in one.stages] == [1000, 0]
    assert [s.comm_s for s in one.stages] == [0.0, 0.0]


def test_violations() -> None:
    nodes = tuple(Node(n, 1, 1) for n in "abc")
    p = Problem(nodes, (Edge(0, 1), Edge(1, 2, ordered=False)), num_stages=3,
                colocate=((0, 2),))
    assert violations(p, [0, 0, 0]) == ["stages [1, 2] are empty"]
    assert any("goes back" in v for v in violations(p, [1, 0, 1]))
    assert any("split" in v for v in violations(p, [0, 1, 2]))
    assert violations(p.__class__(**{**p.__dict__, "allow_empty_stages": True}), [1, 1, 1]) == []
    # an unordered edge may go back: only communication
    assert violations(Problem(nodes, (Edge(1, 0, ordered=False),), num_stages=3), [0, 1, 2]) == []


def chain(n: int, schedule: ScheduleKind, stages: int, microbatches: int, **kwargs: object
          ) -> Problem:
    """n equal layers in a chain: F = 1 s, backward 2 s of which W = 1 s (F = B = W)."""
    nodes = tuple(Node(f"l{i}", 1.0, 2.0, backward_weight_s=1.0, activation_bytes=10,
                       deferred_bytes=3) for i in range(n))
    edges = tuple(Edge(i, i + 1) for i in range(n - 1))
    return Problem(nodes, edges, num_stages=stages, schedule=schedule,
                   microbatches=microbatches, **kwargs)  # type: ignore[arg-type]


def test_zb1p_step_is_the_papers_bubble_and_w_keeps_its_inputs() -> None:
    """K = 4 one-layer stages, M = 8: 1F1B takes (M + K - 1)(F + B); ZB-H1 takes
    M (F + B) + (K - 1)(T_F + T_B - T_W), B the input gradient; stage j keeps j + 1
    micro-batches' deferred bytes for its waiting weight gradients."""
    k, m = 4, 8
    one = evaluate(chain(k, ScheduleKind.ONE_F_ONE_B, k, m), tuple(range(k)))
    zb = evaluate(chain(k, ScheduleKind.ZB1P, k, m), tuple(range(k)))
    assert one.estimate.iteration_s == pytest.approx((m + k - 1) * 3.0)
    assert zb.estimate.iteration_s == pytest.approx(m * 3.0 + (k - 1) * (1 + 1 - 1))
    assert zb.estimate.bubble_ratio == pytest.approx((k - 1) / (m * 3.0))
    assert [s.memory.deferred for s in zb.stages] == [3 * (j + 1) for j in range(k)]
    assert [s.memory.activations for s in zb.stages] == [
        s.memory.activations for s in one.stages], "1F1B's activation memory"
    assert all(s.memory.deferred == 0 for s in one.stages)
    assert [s.backward_weight_s for s in zb.stages] == [1.0] * k


@pytest.mark.parametrize("schedule", [ScheduleKind.ZBV, ScheduleKind.DUALPIPEV])
def test_v_schedules_pair_stage_j_with_k_minus_1_minus_j(schedule: ScheduleKind) -> None:
    """8 layers on 4 GPUs as 8 one-layer chunks: GPU d runs chunks d and 7 - d, its
    time per micro-batch 2 x 3 s; the fill is (K - 1)(T_F + T_B - T_W) in chunk times."""
    gpus, m = 4, 8
    problem = chain(8, schedule, 2 * gpus, m, virtual_stages=2)
    assert [problem.device_of(j) for j in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    result = evaluate(problem, tuple(range(8)))
    assert result.estimate.bottleneck_s == pytest.approx(6.0)
    assert result.estimate.iteration_s == pytest.approx(m * 6.0 + (gpus - 1) * 1.0)
    one = evaluate(chain(8, ScheduleKind.ONE_F_ONE_B, gpus, m), (0, 0, 1, 1, 2, 2, 3, 3))
    assert one.estimate.iteration_s == pytest.approx((m + gpus - 1) * 6.0)
    # GPU d holds 2K + 1 chunks' activations (1F1B's first stage: K stages' worth)
    flights = [s.memory.activations // 10 for s in result.stages]
    assert [flights[d] + flights[7 - d] for d in range(gpus)] == [2 * gpus + 1] * gpus


def test_v_schedule_errors_say_what_to_use() -> None:
    with pytest.raises(ValueError, match="use 2"):
        chain(4, ScheduleKind.ZBV, 4, 4)
    with pytest.raises(ValueError, match="use 8 micro-batches"):
        chain(8, ScheduleKind.DUALPIPEV, 8, 4, virtual_stages=2)
