"""The one cost model: what an assignment of nodes to stages costs.

Every figure fxpipe reports -- the ILP's result and every baseline -- comes from
``evaluate``, so they are comparable, and the ILP's objective equals ``evaluate``'s
bottleneck for the assignment it returns (tests/partition check this).

Per stage j, for one micro-batch, ``evaluate`` sums its nodes (``NodeCosts``) into
``StageSums`` and prices them with the one stage cost formula (``fxpipe.partition.cost``);
what it adds is where values travel:

    comm_s                 send + receive time, by ``Problem.comm``:
        NEIGHBOUR  a value produced on stage s and read on stages C spans the stages
                   lo = min(s, C) .. hi = max(s, C); it crosses boundaries lo .. hi-1, and
                   each crossing of boundary b charges the node's comm_s to stage b and b+1.
        DIRECT     a value read on a stage other than its own charges comm_s once to its
                   own stage, and once to every other stage that reads it.
               + all-reduce of a copied tied parameter, on each stage holding a copy,
                 when more than one stage holds one.
    received   bytes of values it receives (NEIGHBOUR: also the ones it passes on)
    kept       bytes of the values its own nodes produce that a later stage reads or that
               the model returns (``Node.returned``): the runner keeps every value a stage
               sends, and the model's output, until that micro-batch's backward. A value
               stage j only passes on (NEIGHBOUR) is in received, not here.
    params     its nodes' parameters, + tied parameters (see TiedPolicy)

How each stage recomputes: given (``recompute``), or by ``Problem.recompute``
(``choose_recompute``: under AUTO, the fastest choice per stage that fits).

Replicated stage j (r_j GPUs, ``replicas``): each replica computes 1/r_j of every
micro-batch, so forward_s, backward_s, activations, received, outputs and loss are
divided by r_j (the figures are per replica); comm_s adds the ring all-reduce over r_j of the
gradients of its nodes' own parameters (``allreduce_s``); parameters, gradients and
optimizer state are whole on every replica, and so is backward (conservative: only its
activation-gradient part shrinks with the replica's share of the micro-batch). Sends and
receives are not divided (conservative: a stage of one GPU next to two replicas still
moves the whole micro-batch through its link).

Interleaved (v > 1): a GPU runs its v stage modules one after another, so the
figures that decide the step are per GPU: its time is the sum of its modules' times
and its memory the sum of their memories.

V placement (ZB-V, DualPipeV): the same per GPU, its two modules being stage j and
stage K - 1 - j (``Problem.device_of``).

Step figures (K pipeline positions: stages, or GPUs when interleaved; T the slowest
GPU's time per micro-batch, T_d each GPU's):
    iteration_s      M * T + (sum_d T_d - T) / v     (fill, steady state, drain)
    bubble_fraction  (K - 1) / (v*M + K - 1)          idle share of the whole step
    bubble_ratio     (K - 1) / (v*M)                  idle time over the ideal time
(the schedule kind's formulas, ``fxpipe.schedules.KINDS``; these are every kind's today)

Zero-bubble schedules fill the bubble with weight gradients: per the Zero Bubble paper
a GPU idles (K - 1)(T_F + T_B - T_W) (B the input gradient), so with W_d the weight
gradient seconds of GPU d and U_d = max(T_d - 2 W_d, 0) its unfilled share,
    iteration_s      M * T + (sum_d U_d - max_d U_d) / v      (v = 2 for the V schedules,
                                                               whose chunks are half a GPU)
    bubble_fraction  (iteration_s - M * T) / iteration_s
    bubble_ratio     (iteration_s - M * T) / (M * T)
DualPipeV is priced as ZB-V: its pairing hides communication behind computation only
with an overlapped forward-backward that fxpipe does not generate (torch runs the pair
one after the other).

Legend: n nodes, K stages, M micro-batches, s/t/j stages (see problem.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fxpipe.partition.cost import (
    NodeCosts,
    Option,
    StageCost,
    StageSums,
    choose_recompute,
    recompute_options,
    stage_cost,
    state_split,
)
from fxpipe.partition.problem import (
    Comm,
    Problem,
    TiedPolicy,
    stage_deferred,
    stage_flights,
)
from fxpipe.plan import Estimate, StageRecompute

__all__ = [
    "Evaluation",
    "StageCost",
    "evaluate",
    "stage_sums",
    "state_split",
    "step_estimate",
    "violations",
]


@dataclass(frozen=True)
class Evaluation:
    stage_of: tuple[int, ...]
    stages: tuple[StageCost, ...]
    estimate: Estimate

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(s.replicas for s in self.stages)

    @property
    def recompute(self) -> tuple[StageRecompute, ...]:
        """Per stage: how it recomputes its forward in the backward."""
        return tuple(s.recompute for s in self.stages)

    @property
    def options(self) -> tuple[Option, ...]:
        """Per stage: how it recomputes, with its keep level."""
        return tuple(s.option for s in self.stages)

    @property
    def bottleneck_s(self) -> float:
        return self.estimate.bottleneck_s


def consumers(problem: Problem) -> list[list[int]]:
    """For each node, the nodes reading its value (edges that move data), deduplicated."""
    readers: list[set[int]] = [set() for _ in problem.nodes]
    for e in problem.edges:
        if e.data:
            readers[e.src].add(e.dst)
    return [sorted(r) for r in readers]


def _replicas(problem: Problem, replicas: Sequence[int] | None) -> tuple[int, ...]:
    if replicas is None:
        assert not problem.replicates, "a replicated problem needs replicas per stage"
        return (1,) * problem.num_stages
    return tuple(replicas)


def violations(problem: Problem, stage_of: Sequence[int],
               replicas: Sequence[int] | None = None) -> list[str]:
    """Why ``stage_of`` (and ``replicas``) is not a valid pipeline split (empty list: it
    is). Memory is not checked."""
    K = problem.num_stages
    out: list[str] = []
    if len(stage_of) != len(problem.nodes):
        return [f"{len(stage_of)} stage indices for {len(problem.nodes)} nodes"]
    if replicas is not None:
        r = tuple(replicas)
        if len(r) != K or min(r, default=0) < 1 or sum(r) != problem.devices:
            out.append(f"replicas {r} do not give {K} stages {problem.devices} GPUs")
    for v, s in enumerate(stage_of):
        if not 0 <= s < K:
            out.append(f"node {problem.nodes[v].name} on stage {s}, outside 0..{K - 1}")
    for e in problem.edges:
        if e.ordered and stage_of[e.src] > stage_of[e.dst]:
            out.append(
                f"edge {problem.nodes[e.src].name} -> {problem.nodes[e.dst].name} goes back "
                f"from stage {stage_of[e.src]} to {stage_of[e.dst]}"
            )
    groups = list(problem.colocate)
    if problem.tied_policy is TiedPolicy.COLOCATE:
        groups += [g.nodes for g in problem.tied]
    for group in groups:
        if len({stage_of[v] for v in group}) > 1:
            out.append(f"co-located nodes {[problem.nodes[v].name for v in group]} are split")
    if not problem.allow_empty_stages:
        empty = sorted(set(range(K)) - set(stage_of))
        if empty:
            out.append(f"stages {empty} are empty")
    return out


def evaluate(problem: Problem, stage_of: Sequence[int],
             replicas: Sequence[int] | None = None,
             recompute: Sequence[Option | StageRecompute] | None = None) -> Evaluation:
    """Cost of putting node v on stage ``stage_of[v]``, stage j on ``replicas[j]`` GPUs
    (default one each) and recomputing where ``recompute[j]`` (default: as
    ``Problem.recompute`` says; see the module docstring; a bare ``StageRecompute`` is
    selective at the last keep level, all kept)."""
    K = problem.num_stages
    assert len(stage_of) == len(problem.nodes), (len(stage_of), len(problem.nodes))
    assert all(0 <= s < K for s in stage_of)
    stage_of = tuple(stage_of)
    reps = _replicas(problem, replicas)
    flight = stage_flights(problem)
    waiting = stage_deferred(problem)
    sums = stage_sums(problem, stage_of)

    def priced(choice: Sequence[Option]) -> list[StageCost]:
        return [stage_cost(problem, j, sums[j], flight=flight[j], recompute=choice[j],
                           replicas=reps[j], waiting=waiting[j]) for j in range(K)]

    if recompute is None:
        costs = {option: priced([option] * K) for option in recompute_options(problem)}
        recompute = choose_recompute(problem, costs)
        stages = [costs[recompute[j]][j] for j in range(K)]
    else:
        assert len(recompute) == K, (len(recompute), K)
        last = len(problem.keep_levels) - 1
        stages = priced([Option(r, last if r is StageRecompute.SELECTIVE else 0)
                         if isinstance(r, StageRecompute) else r for r in recompute])
    return Evaluation(stage_of=stage_of, stages=tuple(stages),
                      estimate=step_estimate(problem, stages))


def stage_sums(problem: Problem, stage_of: Sequence[int]) -> list[StageSums]:
    """Per stage, its nodes' sums for one micro-batch (``NodeCosts``), with where values
    travel (see the module docstring)."""
    K = problem.num_stages
    costs = NodeCosts.of(problem).by(stage_of, K)
    comm = [0.0] * K
    params = [int(b) for b in costs.params]
    received = [0] * K
    kept = [0] * K

    readers = consumers(problem)
    for v, node in enumerate(problem.nodes):
        s = stage_of[v]
        read_on = {stage_of[w] for w in readers[v]}
        if node.returned or max(read_on, default=s) > s:
            kept[s] += node.output_bytes
        if not readers[v]:
            continue
        if problem.comm is Comm.NEIGHBOUR:
            lo, hi = min(read_on | {s}), max(read_on | {s})
            for b in range(lo, hi):  # boundary b sits between stage b and b + 1
                comm[b] += node.comm_s
                comm[b + 1] += node.comm_s
            for j in range(lo, hi + 1):
                if j != s:
                    received[j] += node.output_bytes
        else:
            others = read_on - {s}
            if others:
                comm[s] += node.comm_s
            for j in others:
                comm[j] += node.comm_s
                received[j] += node.output_bytes

    for group in problem.tied:
        holders = {stage_of[v] for v in group.nodes}
        if problem.tied_policy is TiedPolicy.COLOCATE:
            # One copy; validity (all on one stage) is ``violations``' business.
            params[min(holders)] += group.param_bytes
            continue
        for j in holders:
            params[j] += group.param_bytes
            if len(holders) > 1:
                comm[j] += group.allreduce_s

    return [StageSums(forward_s=float(costs.forward_s[j]),
                      backward_s=float(costs.backward_s[j]), comm_s=comm[j],
                      params=params[j], own_params=int(costs.params[j]),
                      activations=int(costs.activations[j]),
                      transient=int(costs.transient[j]), received=received[j], kept=kept[j],
                      backward_weight_s=float(costs.backward_weight_s[j]),
                      deferred=int(costs.deferred[j]),
                      selective=tuple(int(b) for b in costs.selective[j]),
                      selective_again_s=tuple(float(s) for s in costs.selective_again_s[j]),
                      selective_host_s=float(costs.selective_host_s[j]),
                      forward_collective_s=float(costs.forward_collective_s[j]),
                      backward_collective_s=float(costs.backward_collective_s[j]))
            for j in range(K)]


def step_estimate(problem: Problem, stages: Sequence[StageCost]) -> Estimate:
    """The step figures of per-stage costs (see the module docstring), per pipeline
    position: a GPU's stage modules together when interleaved, each stage otherwise."""
    M, v = problem.microbatches, problem.virtual_stages
    positions = range(problem.num_stages // v)
    on = [[s for j, s in enumerate(stages) if problem.device_of(j) == d] for d in positions]
    times = [sum(s.time_s for s in held) for held in on]
    memories = [sum(s.memory.total for s in held) for held in on]
    K = len(times)
    bottleneck = max(times)
    max_memory = max(memories)
    spec = problem.schedule.spec
    if spec.splits_backward:
        weights = [sum(s.backward_weight_s for s in held) for held in on]
        unfilled = [max(t - 2 * w, 0.0) for t, w in zip(times, weights, strict=True)]
        chunks = 2 if spec.v_placed else 1
        steady = M * bottleneck
        iteration = steady + (sum(unfilled) - max(unfilled)) / chunks
        idle = iteration - steady
        return Estimate(
            bottleneck_s=bottleneck,
            iteration_s=iteration,
            bubble_fraction=idle / iteration if iteration > 0 else 0.0,
            max_memory=max_memory,
            fits=max_memory <= problem.memory_limit,
            bubble_ratio=idle / steady if steady > 0 else 0.0,
        )
    return Estimate(
        bottleneck_s=bottleneck,
        iteration_s=M * bottleneck + (sum(times) - bottleneck) / v,
        bubble_fraction=problem.schedule.spec.bubble_fraction(K, v, M),
        max_memory=max_memory,
        fits=max_memory <= problem.memory_limit,
        bubble_ratio=problem.schedule.spec.bubble_ratio(K, v, M),
    )
