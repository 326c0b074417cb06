"""The stage cost formula: what one stage costs per micro-batch, from its sums.

Every place that prices a stage reads it from here: ``evaluate`` (every figure fxpipe
reports), the interval DP warm start (vectorised over block starts) and the CP-SAT hint
(through ``evaluate``). The CP-SAT rows are the same formula written as linear rows;
tests/partition check them against it.

Per stage j, for one micro-batch, from ``StageSums`` (sums over its nodes):

    time        forward_s + backward_s + comm_s; a stage recomputed in full runs its
                forward again in the backward (backward_s + forward_s), one recomputed
                selectively all of it but the matmuls and attention its keep level keeps
                (backward_s + selective_again_s[level]); the host time torch's SAC adds
                to both runs, in that, is the forward's half and the backward's half
                (selective_host_s)
    memory (StageMemory)
        params      parameter bytes held (its nodes' and its tied copies)
        grads       params * clamp(state_factor - 1, 0, 1)
        optimizer   params * max(state_factor - 2, 0)
                    (so params + grads + optimizer = params * state_factor for factor >= 1)
        activations activations * keep(j): the micro-batches in flight, or 1 when the stage
                    recomputes in full (one micro-batch's activations while its backward
                    reruns the forward; the inputs it keeps per micro-batch are
                    ``received``); recomputed selectively, activations +
                    selective[level] * (flight - 1): the matmuls' and attention's outputs its
                    keep level keeps of the micro-batches in flight and all of one while
                    its backward runs
        received    received * in_flight(j)
        outputs     kept * (in_flight(j) + 1): values sent on or returned, held until their
                    micro-batch's backward, plus one micro-batch of their gradients (the same
                    with recompute: the runner keeps what it sends until the backward)
        loss        last stage only: loss_saved_bytes * keep(j) + loss_grad_bytes (the
                    loss runs outside a selective stage's region: all micro-batches'
                    kept)
        backward    the largest backward transient of its nodes (one micro-batch)
        stashed     PipeDream weight stashing: params * in_flight(j)
        deferred    zero-bubble schedules: deferred * waiting(j), what the weight gradients
                    keep from their input gradient until they run (a weight op's inputs),
                    for the micro-batches whose W waits at the peak (``stage_deferred``);
                    kept with recompute too (the recomputed inputs wait for W)
        workspace   Problem.workspace_bytes

A stage on r replicas (GPUs running it data-parallel) divides forward_s, backward_s,
activations, received, outputs and loss by r (rounded up), and adds the ring all-reduce of
its own parameters' gradients to its time.

Recompute per stage (``Problem.recompute``, an ``Option`` per stage: a ``StageRecompute``
and, selectively, the keep level, an index into ``Problem.keep_levels``, whose rule keeps
the matmuls' and attention's outputs that cost the most to run again for their bytes, from
a few of them to all): NONE, SELECTIVE (keeping all) and ALL decide it for every stage;
AUTO chooses none, selective at any level, or full per stage (per GPU, when interleaved) as
the fastest choice that fits (``choose_recompute``): for a fixed split each step from none
through the levels (from all kept to the fewest) to full only adds time and removes memory.
Schedules that split the backward (zero bubble) leave selective out, as do models that
write in place into a matmul's output: torch's SAC runs a region's backward once and hands
it what it kept as it is then.

Legend: j a stage, r its replicas, K stages (see problem.py).
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

import numpy as np

from fxpipe.partition.problem import Problem, Recompute, allreduce_s
from fxpipe.plan import StageMemory, StageRecompute, StageTimes

__all__ = [
    "NodeCosts",
    "Option",
    "StageCost",
    "StageSums",
    "added_up",
    "choose_recompute",
    "memory_parts",
    "prefix_sums",
    "recompute_options",
    "run_again_s",
    "saved_activations",
    "stage_cost",
    "state_split",
]

# A byte count: a number, or an array of them (the interval DP prices every block start at once).
Amount = float | np.ndarray


@dataclass(frozen=True)
class NodeCosts:
    """``Node``'s costs as columns: a row per node (``of``), or per part of the nodes
    (``by``: a stage, a coarse group, a group of an order), each then its nodes' sum, added
    in node order, but ``transient``, their largest. Every sum over nodes the solver makes
    is made here: ``evaluate`` per stage, ``Blocks`` (prefix sums over the order), the
    CP-SAT program's inputs per coarse group, the block bound per exact group, coarsening
    and what would fit. Tied parameters are no node's: each reader adds them its own way."""

    compute_s: np.ndarray  # forward_s + backward_s, each node's, then added up
    forward_s: np.ndarray
    backward_s: np.ndarray
    backward_weight_s: np.ndarray
    params: np.ndarray  # param_bytes
    activations: np.ndarray  # activation_bytes
    returned: np.ndarray  # output_bytes of the values the model returns
    deferred: np.ndarray  # deferred_bytes
    transient: np.ndarray  # grad_bytes: the largest
    # (rows, keep levels): recomputed selectively at each level, the bytes kept and the
    # forward seconds run again (``Node.selective``)
    selective: np.ndarray
    selective_again_s: np.ndarray
    selective_host_s: np.ndarray  # SAC's host time on both runs, in selective_again_s
    forward_collective_s: np.ndarray  # of forward_s, tensor parallelism's collectives
    backward_collective_s: np.ndarray  # of backward_s, likewise

    @classmethod
    def of(cls, problem: Problem) -> NodeCosts:
        """A row per node of ``problem``: read once per problem (``evaluate`` runs on
        many splits of one), read-only."""
        held = _COLUMNS.get(id(problem))
        if held is not None and held[0]() is problem:
            return held[1]
        costs = cls._columns(problem)
        for f in fields(costs):
            getattr(costs, f.name).setflags(write=False)
        key = id(problem)  # dropped with the problem, before its id can be another's
        _COLUMNS[key] = (weakref.ref(problem, lambda _: _COLUMNS.pop(key, None)), costs)
        return costs

    @classmethod
    def _columns(cls, problem: Problem) -> NodeCosts:
        nodes = problem.nodes
        levels = range(len(problem.keep_levels))
        chosen = [[node.selective(level) for level in levels] for node in nodes]

        def column(values: Sequence[Any]) -> np.ndarray:  # numbers, or rows of them
            return np.array(values, dtype=float)

        return cls(
            compute_s=column([n.forward_s + n.backward_s for n in nodes]),
            forward_s=column([n.forward_s for n in nodes]),
            backward_s=column([n.backward_s for n in nodes]),
            backward_weight_s=column([n.backward_weight_s for n in nodes]),
            params=column([n.param_bytes for n in nodes]),
            activations=column([n.activation_bytes for n in nodes]),
            returned=column([n.output_bytes if n.returned else 0 for n in nodes]),
            deferred=column([n.deferred_bytes for n in nodes]),
            transient=column([n.grad_bytes for n in nodes]),
            selective=column([[kept for kept, _ in row] for row in chosen]).reshape(
                len(nodes), len(levels)),
            selective_again_s=column([[again for _, again in row] for row in chosen]).reshape(
                len(nodes), len(levels)),
            selective_host_s=column([n.selective_host_s for n in nodes]),
            forward_collective_s=column([n.forward_collective_s for n in nodes]),
            backward_collective_s=column([n.backward_collective_s for n in nodes]))

    def by(self, part_of: Sequence[int] | np.ndarray, parts: int) -> NodeCosts:
        """A row per part: ``part_of[v]`` the part of row v, ``parts`` how many there are."""
        index = np.asarray(part_of, dtype=np.int64)
        summed = {f.name: added_up(index, parts, getattr(self, f.name)) for f in fields(self)
                  if f.name != "transient"}
        transient = np.zeros(parts)
        np.maximum.at(transient, index, self.transient)
        return NodeCosts(**summed, transient=transient)


# id(problem) -> (a weak reference to it, its ``NodeCosts.of``)
_COLUMNS: dict[int, tuple[weakref.ref[Problem], NodeCosts]] = {}


def added_up(part_of: np.ndarray, parts: int, values: np.ndarray) -> np.ndarray:
    """Per part, the sum of ``values`` (a row per node, or rows of columns) over its nodes,
    added one node after the other in node order: the same float as a running total."""
    if values.ndim == 2:
        out = np.zeros((parts, values.shape[1]))
        for k in range(values.shape[1]):
            out[:, k] = np.bincount(part_of, weights=values[:, k], minlength=parts)
        return out
    return np.bincount(part_of, weights=values, minlength=parts)


def prefix_sums(values: np.ndarray) -> np.ndarray:
    """X[a]: the total of rows [0, a) of ``values`` (parts in order), X[0] = 0."""
    return np.cumsum(np.concatenate((np.zeros((1, *values.shape[1:])), values)), axis=0)


@dataclass(frozen=True)
class StageSums:
    """One stage's sums over its nodes for one micro-batch (before replicas divide them)."""

    forward_s: float = 0.0
    backward_s: float = 0.0
    comm_s: float = 0.0  # sends, receives, and all-reduces of tied parameters' copies
    params: int = 0  # parameter bytes held: its nodes' and its copies of tied ones
    own_params: int = 0  # its nodes' own parameters: all-reduced when the stage is replicated
    activations: int = 0  # saved for backward
    transient: int = 0  # the largest gradients one of its nodes' backward has alive
    received: int = 0  # values it receives (NEIGHBOUR: also the ones it passes on)
    kept: int = 0  # values its nodes produce that a later stage reads or the model returns
    backward_weight_s: float = 0.0  # the weight-gradient (W) part of backward_s
    deferred: int = 0  # bytes W keeps from its micro-batch's B until it runs
    # per keep level: bytes kept per micro-batch when recomputed selectively, and the forward
    # seconds it runs again (``Node.selective``)
    selective: tuple[int, ...] = ()
    selective_again_s: tuple[float, ...] = ()
    selective_host_s: float = 0.0  # of those seconds, SAC's host time on both runs
    forward_collective_s: float = 0.0  # of forward_s, tensor parallelism's collectives
    backward_collective_s: float = 0.0  # of backward_s, likewise


class Option(NamedTuple):
    """One way a stage may recompute: a mode and, selective, its keep level (an index into
    ``Problem.keep_levels``)."""

    mode: StageRecompute
    level: int = 0


@dataclass(frozen=True)
class StageCost(StageTimes):
    forward_s: float
    backward_s: float  # includes the forward run again when it recomputes
    comm_s: float
    memory: StageMemory
    replicas: int = 1
    recompute: StageRecompute = StageRecompute.NONE
    backward_weight_s: float = 0.0  # the W part of backward_s (a recomputed forward is B's)
    keep_level: int = 0  # selective: its ``Problem.keep_levels`` index
    recompute_s: float = 0.0  # the part of backward_s that runs the forward again
    # of forward_s and backward_s (the forward run again included), the seconds of
    # tensor parallelism's collectives
    collective_s: tuple[float, float] = (0.0, 0.0)

    @property
    def option(self) -> Option:
        return Option(self.recompute, self.keep_level)


def state_split(state_factor: float) -> tuple[float, float]:
    """(gradient, optimizer) bytes per parameter byte for ``Problem.state_factor``."""
    return min(1.0, max(0.0, state_factor - 1.0)), max(0.0, state_factor - 2.0)


def _up(amount: Amount, replicas: int) -> Amount:
    """``amount`` / ``replicas``, rounded up (a replica holds its share, whole bytes)."""
    if replicas == 1:
        # The same value (whole bytes, or their ceiling), without numpy's slow floor
        # division of float arrays: most of the interval DP's time on a 70B graph.
        if isinstance(amount, np.ndarray) and amount.dtype.kind == "f":
            return np.ceil(amount)
        return -(-amount // 1)
    return -(-amount // replicas)


def saved_activations(recompute: StageRecompute, activations: Amount, selective: Amount,
                      flight: int | np.ndarray) -> Amount:
    """What a stage keeps for its backward (``activations`` and ``selective``: one
    micro-batch's; see the module docstring)."""
    if recompute is StageRecompute.FULL:
        return activations
    if recompute is StageRecompute.SELECTIVE:
        return activations + selective * (flight - 1)
    return activations * flight


def memory_parts(problem: Problem, j: int | np.ndarray, *, flight: int | np.ndarray,
                 params: Amount, activations: Amount, received: Amount, kept: Amount,
                 transient: Amount, recompute: StageRecompute, replicas: int = 1,
                 deferred: Amount = 0, waiting: int = 0, selective: Amount = 0
                 ) -> dict[str, Amount]:
    """Stage j's bytes by ``StageMemory`` field (grads and optimizer not yet rounded);
    ``flight``: its micro-batches in flight (``stage_flights``); ``waiting``: those whose
    weight gradient waits (``stage_deferred``). The interval DP prices every stage at
    once: ``j`` and ``flight`` are then a column of stages, the amounts a row of blocks."""
    keep = 1 if recompute is StageRecompute.FULL else flight
    loss = problem.loss_saved_bytes * keep + problem.loss_grad_bytes
    grad_factor, optimizer_factor = state_split(problem.state_factor)
    if isinstance(j, np.ndarray) and j.ndim:  # a column of stages: the loss on the last row
        loss_bytes = np.where(j == problem.num_stages - 1, _up(loss, replicas), 0) + 0 * params
    else:
        loss_bytes = _up(loss, replicas) if j == problem.num_stages - 1 else 0 * params
    return {
        "params": params,
        "grads": params * grad_factor,
        "optimizer": params * optimizer_factor,
        "activations": _up(saved_activations(recompute, activations, selective, flight),
                           replicas),
        "received": _up(received * flight, replicas),
        "outputs": _up(kept * (flight + 1), replicas),
        "loss": loss_bytes,
        "backward": transient,
        "stashed": params * flight if problem.schedule.spec.stashes_weights else 0 * params,
        "workspace": problem.workspace_bytes + 0 * params,
        "deferred": _up(deferred * waiting, replicas) + 0 * params,
    }


def run_again_s(recompute: StageRecompute, forward_s: Amount, selective_s: Amount) -> Amount:
    """The forward seconds a stage runs again in its backward: all of ``forward_s`` in
    full, ``selective_s`` (all but its matmuls and attention) selectively."""
    if recompute is StageRecompute.FULL:
        return forward_s
    if recompute is StageRecompute.SELECTIVE:
        return selective_s
    return 0.0 * forward_s


def stage_cost(problem: Problem, j: int, sums: StageSums, *, flight: int,
               recompute: Option, replicas: int = 1, waiting: int = 0) -> StageCost:
    """Stage j's time and memory (see the module docstring)."""
    mode, level = recompute
    parts = memory_parts(problem, j, flight=flight, params=sums.params,
                         activations=sums.activations, received=sums.received,
                         kept=sums.kept, transient=sums.transient, recompute=mode,
                         replicas=replicas, deferred=sums.deferred, waiting=waiting,
                         selective=sums.selective[level])
    memory = StageMemory(**{name: round(float(value)) for name, value in parts.items()})
    forward_s = sums.forward_s
    again_s = float(run_again_s(mode, sums.forward_s, sums.selective_again_s[level]))
    if mode is StageRecompute.SELECTIVE:  # SAC's host time: half on the first run
        forward_s += sums.selective_host_s / 2
        again_s -= sums.selective_host_s / 2
    collectives = (sums.forward_collective_s, sums.backward_collective_s
                   + (sums.forward_collective_s if mode is not StageRecompute.NONE else 0.0))
    return StageCost(forward_s / replicas, (sums.backward_s + again_s) / replicas,
                     sums.comm_s + allreduce_s(problem, sums.own_params, replicas), memory,
                     replicas, mode, sums.backward_weight_s / replicas, level,
                     again_s / replicas, (collectives[0] / replicas, collectives[1] / replicas))


def recompute_options(problem: Problem) -> tuple[Option, ...]:
    """The per-stage recompute choices ``problem.recompute`` allows, from the most bytes
    kept (and least time) to the fewest: none, selective from the last keep level (all
    kept) to the first, full."""
    none, full = Option(StageRecompute.NONE), Option(StageRecompute.FULL)
    levels = range(len(problem.keep_levels) - 1, -1, -1)
    selective = tuple(Option(StageRecompute.SELECTIVE, level) for level in levels)
    if problem.recompute is Recompute.AUTO:
        # SAC runs a region's backward once, and keeps a matmul's output as it is
        without = problem.schedule.spec.splits_backward or problem.writes_kept is not None
        return (none, full) if without else (none, *selective, full)
    return {Recompute.NONE: (none,), Recompute.SELECTIVE: selective[:1],
            Recompute.FULL: (full,)}[problem.recompute]


def choose_recompute(problem: Problem, costs: Mapping[Option, Sequence[StageCost]]
                     ) -> tuple[Option, ...]:
    """Per stage, how it recomputes: given by the policy but for AUTO, where it is the
    fastest choice that fits, per GPU (a GPU holds v stage modules when interleaved, which
    share its memory and its time); where nothing fits, the fewest bytes on that GPU (full
    recompute everywhere).
    ``costs``: per option of ``recompute_options``, every stage's cost."""
    K = problem.num_stages
    options = recompute_options(problem)
    if len(options) == 1:
        return options * K
    chosen = [options[0]] * K
    for d in range(K // problem.virtual_stages):
        held = [j for j in range(K) if problem.device_of(j) == d]
        best: tuple[bool, float, int, int, tuple[int, ...]] | None = None
        for choice in itertools.product(range(len(options)), repeat=len(held)):
            picked = [costs[options[c]][j] for j, c in zip(held, choice, strict=True)]
            fits = sum(c.memory.total for c in picked) <= problem.memory_limit
            taken = [options[c].mode for c in choice]
            # on a tie in time (a selective stage that keeps nothing is a full one), the
            # fewest recomputing stages, then the fewest selective ones, then the most kept
            key = (not fits, sum(c.time_s for c in picked),
                   sum(o is not StageRecompute.NONE for o in taken),
                   taken.count(StageRecompute.SELECTIVE), choice)
            if best is None or key < best:
                best = key
        assert best is not None
        fits_nowhere = best[0]
        for j, c in zip(held, best[-1], strict=True):
            chosen[j] = options[-1] if fits_nowhere else options[c]
    return tuple(chosen)
