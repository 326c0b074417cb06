"""The plain numbers the CP-SAT program (ilp.py) is written over: the tick scale, per
coarse node g the sums of its fine nodes' costs, per value class k its transfer time and
bytes, and the stages each coarse node may take under an upper bound. No solver here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import NodeCosts, added_up, state_split
from fxpipe.partition.problem import Recompute, TiedGroup, TiedPolicy, allreduce_s
from fxpipe.partition.reach import ancestor_sums

__all__ = [
    "TARGET_TICKS",
    "GroupCosts",
    "ValueClass",
    "group_costs",
    "stage_ranges",
    "ticks_per_second",
    "value_classes",
]

# At most ~1e9 ticks in all, so a coefficient squared stays below 2^63: with coefficients
# of ~1e11 CP-SAT 9.15's presolve (probing, inclusion) proved a 15 ms split "OPTIMAL"
# where a 14 ms one fits, and proved a feasible replicated model INFEASIBLE; both
# solve right at 1e9 (tests/partition/test_bruteforce.py keeps those cases).
TARGET_TICKS = 1e9


def ticks_per_second(coarsening: Coarsening) -> int:
    """A power of ten that makes the graph's total time at most TARGET_TICKS ticks."""
    p = coarsening.problem
    again = p.recompute is not Recompute.NONE  # a recomputed forward runs twice
    each = NodeCosts.of(p)
    comm = np.array([n.comm_s for n in p.nodes])
    total_s = sum((each.forward_s * (2 if again else 1) + each.backward_s + 4 * comm).tolist())
    total_s += sum(t.allreduce_s for t in p.tied) * p.num_stages
    if p.replicates:  # the largest all-reduce a replicated stage could pay
        total_s += allreduce_s(p, float(each.params.sum()), p.devices)
    if total_s <= 0:
        return 10**9
    return 10 ** min(15, max(0, math.floor(math.log10(TARGET_TICKS / total_s))))


@dataclass(frozen=True)
class GroupCosts:
    """Per coarse node g (each list indexed by g): what its fine nodes add up to."""

    state: float  # bytes of parameter state per parameter byte (weights, grads, optimizer)
    secs: list[float]  # forward + backward seconds
    ticks: list[int]  # t[g]: forward + backward seconds in ticks (``ticks_per_second``)
    fwd: list[float]  # forward seconds: run again by a recomputing stage
    state_bytes: list[int]  # parameter-state bytes, colocated tied parameters included
    params: list[int]  # own parameter bytes (all-reduced when the stage is replicated)
    held: list[int]  # parameter bytes held, colocated tied ones included (stashed copies)
    act: list[int]  # activation bytes saved for the backward, per micro-batch
    returned: list[int]  # bytes of the model's output it produces
    grad: list[int]  # the largest backward transient of its nodes (Node.grad_bytes)
    deferred: list[int]  # what its weight gradients keep until they run, per micro-batch
    # per keep level: bytes a selective recompute keeps of it per micro-batch, and forward
    # seconds it runs again
    selective: list[tuple[int, ...]]
    selective_fwd: list[tuple[float, ...]]
    # tied groups copied onto several coarse nodes: (group, holders)
    copied: list[tuple[TiedGroup, list[int]]]


def group_costs(coarsening: Coarsening, scale: int) -> GroupCosts:
    """``scale``: ticks per second (``ticks_per_second``)."""
    p = coarsening.problem
    G = coarsening.num_coarse
    grad_f, opt_f = state_split(p.state_factor)
    state = 1.0 + grad_f + opt_f
    nodes = NodeCosts.of(p)
    costs = nodes.by(coarsening.group_of, G)
    param_state = added_up(np.asarray(coarsening.group_of), G, nodes.params * state).tolist()
    params = [int(b) for b in costs.params]
    held = [0] * G
    copied = []
    for tied in p.tied:
        holders = sorted({coarsening.group_of[v] for v in tied.nodes})
        if len(holders) == 1 or p.tied_policy is TiedPolicy.COLOCATE:
            param_state[holders[0]] += tied.param_bytes * state
            held[holders[0]] += tied.param_bytes
        else:
            copied.append((tied, holders))
    held = [h + b for h, b in zip(held, params, strict=True)]
    secs = costs.compute_s.tolist()

    def whole(column: np.ndarray) -> list[int]:
        return [int(b) for b in column]

    return GroupCosts(state=state, secs=secs, ticks=[round(s * scale) for s in secs],
                      fwd=costs.forward_s.tolist(),
                      state_bytes=[round(b) for b in param_state], params=params, held=held,
                      act=whole(costs.activations), returned=whole(costs.returned),
                      grad=whole(costs.transient), deferred=whole(costs.deferred),
                      selective=[tuple(whole(row)) for row in costs.selective],
                      selective_fwd=[tuple(row) for row in costs.selective_again_s.tolist()],
                      copied=copied)


@dataclass(frozen=True)
class ValueClass:
    """The values produced in coarse node ``producer`` and read by the same other coarse
    nodes ``readers``: they cross the same boundaries, so they share indicators."""

    producer: int  # g
    readers: tuple[int, ...]  # W
    unordered: tuple[int, ...]  # the readers that read them only by unordered edges (Wu)
    comm_s: float  # their transfer time across one boundary
    out_bytes: float  # their bytes
    # their bytes but the model's outputs' (which their producer keeps wherever their
    # readers are: GroupCosts.returned)
    sent_bytes: float


def value_classes(coarsening: Coarsening) -> list[ValueClass]:
    """The value classes, in the order of their first value."""
    p = coarsening.problem
    group_of = coarsening.group_of
    readers: list[dict[int, bool]] = [{} for _ in p.nodes]  # per value: reader -> unordered
    for e in p.edges:
        if e.data and group_of[e.dst] != group_of[e.src]:
            wg = group_of[e.dst]
            readers[e.src][wg] = readers[e.src].get(wg, True) and e.ordered
    classes: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[float]] = {}
    for v, node in enumerate(p.nodes):
        if not readers[v]:
            continue
        W = tuple(sorted(readers[v]))
        Wu = tuple(w for w in W if not readers[v][w])
        acc = classes.setdefault((group_of[v], W, Wu), [0.0, 0.0, 0.0])
        acc[0] += node.comm_s
        acc[1] += node.output_bytes
        acc[2] += 0 if node.returned else node.output_bytes
    return [ValueClass(g, W, Wu, comm_s, out_bytes, sent_bytes)
            for (g, W, Wu), (comm_s, out_bytes, sent_bytes) in classes.items()]


def stage_ranges(coarsening: Coarsening, ticks: Sequence[int], upper_ticks: int, extra: int,
                 ) -> tuple[list[int], list[int]]:
    """Per coarse node, the first and last stage it may take when every GPU's time is at
    most ``upper_ticks``: a node whose ancestors cost more than (j+1)*UB cannot sit on
    stages <= j; one whose descendants cost more than (K-j)*UB cannot sit on stages >= j.
    ``extra``: GPUs beyond one per stage (replicas), which stages 0..j may also use."""
    K = coarsening.problem.num_stages
    G = coarsening.num_coarse
    up, down = ancestor_sums(G, coarsening.order_edges, np.array(ticks, dtype=np.int64))
    lo = [max(0, -(-int(up[g]) // upper_ticks) - 1 - extra) for g in range(G)]
    hi = [min(K - 1, K - (-(-int(down[g]) // upper_ticks)) + extra) for g in range(G)]
    return lo, hi
