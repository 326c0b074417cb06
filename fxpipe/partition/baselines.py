"""The splits users can get today without fxpipe, and the interval DP used as a warm start.

Each baseline returns ``stage_of`` (a stage per fine node) and is scored by
``evaluate`` like the ILP's answer. All cut contiguous blocks of one topological
order of the co-location groups, so they are valid pipelines:

- ``uniform-layers``  DeepSpeed ``partition_method="uniform"``: the same number of
                      top-level blocks (``Node.module``) per stage; nodes when no
                      module names are given.
- ``parameters``      DeepSpeed ``"parameters"`` / PiPPy ``split_into_equal_size``:
                      parameter bytes balanced (min-max) over the order.
- ``greedy-time``     torchgpipe ``balance_by_time``: the block partition of the order
                      that minimises the slowest stage's compute time (communication
                      and memory ignored, as there).

The baselines' recompute choice is ``evaluate``'s (``Problem.recompute``; under AUTO
each stage of a baseline's cut takes the fastest choice that fits), so they are compared
with the solver on the same terms.

``interval_dp`` is DESIGN's O(K n^2) warm start (priced only where a best split can
pass, ``min_max_dp``: about n x (n/K) x a few stages on a balanced chain): the best
contiguous split of the order with cut communication and memory (the stage cost formula
of ``cost``: received and sent values, the loss, the backward transient, recompute per
stage) included (tied parameters' copies left out; ``evaluate`` has the last word).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import numpy as np

from fxpipe.partition.coarsen import Coarsening, exact_groups
from fxpipe.partition.cost import (
    NodeCosts,
    Option,
    memory_parts,
    prefix_sums,
    recompute_options,
    run_again_s,
    state_split,
)
from fxpipe.partition.problem import Problem, stage_flights
from fxpipe.plan import StageRecompute

__all__ = ["BASELINES", "Blocks", "baselines", "bisect_least", "interval_dp", "leanest_dp",
           "linear_partition", "min_max_dp"]

Found = TypeVar("Found")


def linear_partition(weights: Sequence[float], num_parts: int, *, allow_empty: bool = False
                     ) -> list[int]:
    """Part index per item: contiguous parts minimising the heaviest part's weight.

    Binary search on the threshold with greedy packing (exact for contiguous parts).
    Without ``allow_empty``, every part gets an item when there are enough items.
    """
    n, K = len(weights), num_parts
    if n == 0:
        return []

    def pack(limit: float) -> list[int] | None:
        part, load, out = 0, 0.0, []
        for w in weights:
            if load + w > limit and load > 0:
                part, load = part + 1, 0.0
            if part >= K or w > limit:
                return None
            load += w
            out.append(part)
        return out

    lo, hi = max(weights), max(sum(weights), max(weights))
    packed = pack(hi)
    assert packed is not None
    _, best = bisect_least(pack, lo, hi, packed, halvings=64, tolerance=1e-12)
    if not allow_empty and n >= K:
        # Item i must leave an item for each later part: a monotone fix that hits every part.
        best = [min(i, max(b, i - (n - K))) for i, b in enumerate(best)]
    return best


def bisect_least(fits: Callable[[float], Found | None], low: float, high: float,
                 found: Found, *, halvings: int, tolerance: float | None = None
                 ) -> tuple[float, Found]:
    """The least value in (``low``, ``high``] at which ``fits`` finds something (not None),
    to ``halvings`` halvings of the interval, and what it found there: ``fits`` found
    ``found`` at ``high``, and finds something at every value above one where it does.
    ``tolerance``: stop early once the interval is within that share of ``high`` (of 1,
    below 1). The linear partition's threshold and the re-cut rounds' time bisect so."""
    for _ in range(halvings):
        if tolerance is not None and high - low <= tolerance * max(1.0, high):
            break
        mid = (low + high) / 2
        got = fits(mid)
        if got is None:
            low = mid
        else:
            high, found = mid, got
    return high, found


def uniform_layers(problem: Problem, c: Coarsening | None = None) -> tuple[int, ...]:
    c = c or exact_groups(problem)
    K = problem.num_stages
    modules = [problem.nodes[group[0]].module for group in c.groups]
    rank: dict[str, int] = {}
    unit, running = [], 0
    for name in modules:
        rank.setdefault(name, len(rank))
        running = max(running, rank[name])
        unit.append(running)
    if all(m == "" for m in modules) or (len(rank) < K and not problem.allow_empty_stages):
        parts = linear_partition([float(len(group)) for group in c.groups], K,
                                 allow_empty=problem.allow_empty_stages)
        return c.expand(parts)
    count = len(rank)
    return c.expand([u * K // count for u in unit])


def by_parameters(problem: Problem, c: Coarsening | None = None) -> tuple[int, ...]:
    c = c or exact_groups(problem)
    w = NodeCosts.of(problem).by(c.group_of, c.num_coarse).params
    for tied in problem.tied:  # whole bytes: the same sums in any order
        w[c.group_of[min(tied.nodes)]] += tied.param_bytes
    return c.expand(linear_partition(w.tolist(), problem.num_stages,
                                     allow_empty=problem.allow_empty_stages))


def greedy_time(problem: Problem, c: Coarsening | None = None) -> tuple[int, ...]:
    c = c or exact_groups(problem)
    w = NodeCosts.of(problem).by(c.group_of, c.num_coarse).compute_s
    return c.expand(linear_partition(w.tolist(), problem.num_stages,
                                     allow_empty=problem.allow_empty_stages))


BASELINES: dict[str, Callable[[Problem, Coarsening | None], tuple[int, ...]]] = {
    "uniform-layers": uniform_layers,
    "parameters": by_parameters,
    "greedy-time": greedy_time,
}


def baselines(problem: Problem, c: Coarsening | None = None) -> dict[str, tuple[int, ...]]:
    """Every baseline's ``stage_of``."""
    c = c or exact_groups(problem)
    return {name: f(problem, c) for name, f in BASELINES.items()}


def interval_dp(c: Coarsening, *, upper_s: float = float("inf")) -> tuple[int, ...] | None:
    """Coarse assignment: best contiguous split of ``c``'s order, None if none fits.

    ``upper_s``: a bottleneck some split reaches (a baseline's). A block whose compute alone
    exceeds it is in no better split, so each block's start is searched only back to where
    the compute passes it: O(K n * n/K) rather than O(K n^2) when the stages balance,
    and the same answer whenever the best split is at most ``upper_s`` (None otherwise).

    Legend: n coarse nodes in order, a..c a block [a, c), cut[i] the cost of cutting
    before item i (values whose producer and readers lie on both sides), sent[a] the
    bytes of values produced in [a, end) and read at or after ``end`` (the block's
    outputs), R the returned bytes, peak[a] the largest backward transient in [a, end),
    F the forward time a recomputing stage pays again. Each block takes the fastest
    recompute choice the policy allows that fits.
    """
    p = c.problem
    n, K = c.num_coarse, p.num_stages
    best, back = min_max_dp(Blocks.of(c), n, upper_s=upper_s,
                            allow_empty=p.allow_empty_stages)
    if best[K - 1][n] == float("inf"):
        return None
    return _walk_back(back, n, K)


def min_max_dp(blocks: Blocks, n: int, *, upper_s: float, allow_empty: bool
               ) -> tuple[Any, Any]:
    """best[j, end]: the least bottleneck of positions [0, end) cut into stages 0..j, and
    back[j, end] the start of stage j there, blocks priced by ``blocks`` (see interval_dp).

    Only what a best split can pass through is priced: for each ``end``, the starts from
    the first block that fits (``_first_starts``), and the stages j from the first whose
    stage j - 1 ends at one of those starts (between the first and the last end it was
    seen to, ``ended`` and ``last``) to the last after which the stages left can still
    cover [end, n) (``_blocks_needed``). Every other cell stays inf: it is on no split of
    [0, n) whose blocks all fit, so best[K - 1, n] and the walk back from it are the
    same as pricing every cell. With blocks balanced near ``upper_s``, that is a few
    stages at each end rather than K."""
    K = blocks.problem.num_stages
    alive = np.zeros(n + 1)  # alive[a]: bytes produced in a and read at or after ``end``
    for _, a, size in blocks.sends:
        alive[a] += size

    inf = float("inf")
    best = np.full((K, n + 1), inf)
    back = np.zeros((K, n + 1), dtype=np.int64)
    gap = 0 if allow_empty else 1
    firsts = _first_starts(blocks, n, upper_s=upper_s, gap=gap)
    needed = _blocks_needed(firsts, n, gap=gap)
    ended = np.full(K, n + 1)  # ended[j]: the first end at which best[j] is finite
    last = np.full(K, -1)  # last[j]: the last end so far at which it is
    released = 0
    for end in range(n + 1):
        while released < len(blocks.sends) and blocks.sends[released][0] < end:
            _, a, size = blocks.sends[released]
            alive[a] -= size
            released += 1
        if end < gap:
            continue
        first = int(firsts[end])
        starts = np.arange(first, end - gap + 1)
        # stages 1..K-1 that can end here: after a stage that ended at a start (or, with
        # empty stages, after stage 0 starting at 0) and before too few are left
        live = np.flatnonzero((ended[:-1] <= end - gap) & (last[:-1] >= first))
        low = 1 if gap == 0 and first == 0 else (int(live[0]) + 1 if live.size else K)
        high = K - 1 - needed[end]
        stages = np.concatenate(([0], np.arange(low, max(high + 1, low))))
        if stages.size == 1:  # only stage 0 can end here, and it starts at 0
            if first > 0:
                if not live.size:  # no stage ended at or after ``first``: none will
                    break
                continue
            starts = starts[:1]
        # bytes made in [start, end) and read at or after it (whole bytes: exact sums)
        made = np.append(np.cumsum(alive[first:end][::-1])[::-1], 0.0)[:starts.size]
        sent = blocks.outputs(end, starts, made)
        load = blocks.loads(end, starts, stages, sent=sent, peak=blocks.peaks(end, starts),
                            allow_empty=allow_empty)
        # stage 0 starts at 0; stage j > 0 after the best split of [0, start) into j stages
        best[0, end], back[0, end] = (load[0, 0] if first == 0 else inf), 0
        if stages.size > 1:
            rows = stages[1:]
            empty = load[1:, -1] if gap == 0 else None  # each stage's load as [end, end)
            tried = np.maximum(load[1:], best[low - 1:rows[-1], first:end - gap + 1])
            i = np.argmin(tried, axis=1)
            best[rows, end], back[rows, end] = tried[np.arange(rows.size), i], starts[i]
            if empty is not None:
                # an empty stage j after stages 0..j-1 ending at ``end``: that column's
                # best[j - 1, end] is only known now, row by row
                for j, alone in zip(rows.tolist(), empty.tolist(), strict=True):
                    tried_empty = max(alone, best[j - 1, end])
                    if tried_empty < best[j, end]:
                        best[j, end], back[j, end] = tried_empty, end
        finite = np.isfinite(best[:, end])
        ended = np.where(finite & (ended > end), end, ended)
        last = np.where(finite, end, last)
    return best, back


def _first_starts(blocks: Blocks, n: int, *, upper_s: float, gap: int) -> Any:
    """firsts[end]: the first start a block [start, end) is tried from: none whose compute
    alone, with the forward every recompute choice allowed runs again (``least_again``),
    exceeds ``upper_s``, nor any whose parameters alone (with their gradients and
    optimizer state, and the workspace) exceed the memory limit (the most a start holds,
    a running maximum for the bound's cells, is within reach); the one-item block (the
    empty one with empty stages) at least. Nondecreasing in end."""
    p = blocks.problem
    ends = np.arange(n + 1)
    again, again0 = blocks.least_again()
    # under full recompute a block's seconds are its compute and its forward once more:
    # pruned by compute alone, GPipe's 1,663 layers onto 128 priced 33 stages at each end
    # where a stage of at most upper_s can end at only a few (0.4 s instead of 5.5)
    seconds, seconds0 = blocks.T + again, np.maximum.accumulate(blocks.T0 + again0)
    firsts = np.searchsorted(seconds0, seconds[:n + 1] - upper_s * (1 + 1e-9), side="left")
    grad_factor, optimizer_factor = state_split(p.state_factor)
    state = 1.0 + grad_factor + optimizer_factor
    reach = (p.memory_limit - p.workspace_bytes) / state * (1 + 1e-9)
    if reach < float("inf"):
        held = np.maximum.accumulate(blocks.P0)
        firsts = np.maximum(firsts, np.searchsorted(held, blocks.P[:n + 1] - reach,
                                                    side="left"))
    # The least of those from each end on: the bound's cells hold parameters that need
    # not grow with their compute (a later cell's ideal may lack an earlier one's groups),
    # and the DP stops where no stage can start from a later end's first start.
    firsts = np.minimum.accumulate(firsts[::-1])[::-1]
    return np.minimum(firsts, ends - gap)


def _blocks_needed(firsts: Any, n: int, *, gap: int) -> list[int]:
    """needed[end]: the fewest blocks (each from ``firsts``) that cover [end, n), more
    than n if none do. Going to the farthest end a block from ``end`` reaches is best:
    fewer are never needed from later on (a block from a start also fits from a later one)."""
    needed = [2 * n + 1] * (n + 1)
    needed[n] = 0
    farthest = np.full(n + 1, -1)  # farthest[start]: the last end a block from it reaches
    np.maximum.at(farthest, firsts[gap:], np.arange(gap, n + 1))
    farthest = np.maximum.accumulate(farthest)
    for end in range(n - 1, -1, -1):
        far = int(farthest[end])
        if far > end:
            needed[end] = 1 + needed[far]
    return needed


@dataclass(frozen=True)
class Blocks:
    """What the cost of a block [a, end) of the coarse order is made of (the legend of
    ``interval_dp``), as prefix sums: X[a] totals items [0, a)."""

    problem: Problem
    T: Any  # forward + backward time
    F: Any  # forward time
    P: Any  # parameter bytes (a tied group's at its first reader)
    A: Any  # activation bytes
    R: Any  # returned bytes
    grad: Any  # per item, not summed: its largest backward transient
    cut: Any  # cut[i]: seconds of the values a cut before item i sends
    cut_bytes: Any  # cut_bytes[i]: their bytes (received by the stage starting at i)
    # (last reader, producer, bytes) of each value kept for a later stage, by last
    # reader: returned values are in R wherever their readers are
    sends: list[tuple[int, int, int]]
    flights: Any  # (K, 1): micro-batches in flight per stage
    options: tuple[Option, ...]  # the recompute choices the policy allows
    # What a block starting at a position has not got of T, F, P, A, R, S, G: the same
    # prefix sums for the DP; for the lower bound of ``fxpipe.partition.bound``, the most
    # any ideal at that position may hold (a block's sums are then at least
    # X[end] - X0[start]).
    T0: Any = None
    F0: Any = None
    P0: Any = None
    A0: Any = None
    R0: Any = None
    # (positions, keep levels): bytes kept per micro-batch when recomputed selectively, and
    # forward time run again
    S: Any = None
    G: Any = None
    S0: Any = None
    G0: Any = None

    @classmethod
    def of(cls, c: Coarsening) -> Blocks:
        p = c.problem
        costs = NodeCosts.of(p).by(c.group_of, c.num_coarse)
        params = costs.params.copy()
        for tied in p.tied:
            params[min(c.group_of[v] for v in tied.nodes)] += tied.param_bytes
        T, F, P, A, R, S, G = (prefix_sums(x) for x in (
            costs.compute_s, costs.forward_s, params, costs.activations, costs.returned,
            costs.selective, costs.selective_again_s))
        span = _spans(c)
        cut, cut_bytes = _cut_costs(c, span)
        sends = sorted((hi, c.group_of[v], p.nodes[v].output_bytes)
                       for v, (_, hi) in span.items()
                       if hi > c.group_of[v] and not p.nodes[v].returned)
        flights = np.array(stage_flights(p), dtype=np.int64)[:, None]
        return cls(p, T, F, P, A, R, costs.transient, cut, cut_bytes, sends, flights,
                   tuple(recompute_options(p)), T, F, P, A, R, S, G, S, G)

    def least_again(self) -> tuple[Any, Any]:
        """(X, X0) as the prefix sums (the legend above): the forward seconds a block runs
        again in its backward under every recompute choice the policy allows, at least.
        A single choice's own (full: F; selective: its keep level's G); zero where the
        policy allows more than one (under auto, none runs nothing again)."""
        if len(self.options) == 1:
            mode, level = self.options[0]
            if mode is StageRecompute.FULL:
                return self.F, self.F0
            if mode is StageRecompute.SELECTIVE:
                return self.G[:, level], self.G0[:, level]
        return 0.0 * self.T, 0.0 * self.T0

    def outputs(self, end: int, starts: Any, made: Any) -> Any:
        """sent[a] for each of ``starts`` (consecutive): the bytes a block [a, end) keeps
        of the values it sends on or returns (``made``: those it makes and a position at
        or after end reads, per start)."""
        return made + self.R[end] - self.R0[starts]

    def peaks(self, end: int, starts: Any) -> Any:
        """peak[a] for each of ``starts`` (consecutive, up to end): the largest backward
        transient of a block [a, end)."""
        first = int(starts[0])
        window = np.maximum.accumulate(self.grad[first:end][::-1])[::-1]
        return np.append(window, 0.0)[:starts.size]

    def loads(self, end: int, starts: Any, stages: Any, *, sent: Any, peak: Any,
              allow_empty: bool) -> Any:
        """(stages, starts): the seconds of stage j's block [start, end) on j's row, inf
        where it fits no memory with any recompute choice: those of the fastest choice that
        fits (not always the first: SAC's host time can make a selective one slower than
        full recompute). Many stages at once, a mode's keep levels together; the loss is
        the last stage's alone."""
        plain = np.maximum(self.T[end] - self.T0[starts], 0.0) + self.cut[starts] + self.cut[end]
        rows, seconds = [], []
        for mode, options in itertools.groupby(self.options, key=lambda option: option.mode):
            levels = [option.level for option in options]
            rows.append(self.levels_memory(end, starts, stages, sent=sent, peak=peak, mode=mode,
                                           levels=levels))
            seconds.append(plain + self.levels_run_again(mode, levels, end, starts))
        fits = np.concatenate(rows) <= self.problem.memory_limit  # (choices, stages, starts)
        load = np.where(fits, np.concatenate(seconds)[:, None, :], float("inf")).min(axis=0)
        if end == 0 and not allow_empty:
            load[stages == 0] = float("inf")
        return load

    def run_again(self, recompute: Option, end: Any, starts: Any) -> Any:
        """The forward seconds a block [start, end) runs again in its backward."""
        mode, level = recompute
        return run_again_s(mode, np.maximum(self.F[end] - self.F0[starts], 0.0),
                           np.maximum(self.G[end, level] - self.G0[starts, level], 0.0))

    def levels_run_again(self, mode: StageRecompute, levels: Sequence[int], end: int,
                         starts: Any) -> Any:
        """(levels, starts): ``run_again`` for each of ``mode``'s keep ``levels``."""
        again = np.maximum(self.G[end, levels][:, None] - self.G0[starts][:, levels].T, 0.0)
        return np.broadcast_to(
            run_again_s(mode, np.maximum(self.F[end] - self.F0[starts], 0.0), again),
            (len(levels), starts.size))

    def selective(self, recompute: Option, end: Any, starts: Any) -> Any:
        """The bytes a block [start, end) keeps per micro-batch recomputed selectively at
        ``recompute``'s keep level."""
        return np.maximum(self.S[end, recompute.level] - self.S0[starts, recompute.level], 0.0)

    def memory(self, end: int, starts: Any, stages: Any, *, sent: Any, peak: Any,
               recompute: Option) -> Any:
        """(stages, starts): the bytes of stage j's block [start, end) on j's row with the
        given recompute choice; the loss is the last stage's alone."""
        return self.levels_memory(end, starts, stages, sent=sent, peak=peak,
                                  mode=recompute.mode, levels=[recompute.level])[0]

    def levels_memory(self, end: int, starts: Any, stages: Any, *, sent: Any, peak: Any,
                      mode: StageRecompute, levels: Sequence[int]) -> Any:
        """(levels, stages, starts): ``memory`` for each of ``mode``'s keep ``levels``,
        the parts no level changes made once."""
        p = self.problem
        selective = np.maximum(self.S[end, levels][:, None] - self.S0[starts][:, levels].T, 0.0)
        block: dict[str, Any] = {
            "params": np.maximum(self.P[end] - self.P0[starts], 0.0),
            "activations": np.maximum(self.A[end] - self.A0[starts], 0.0),
            "received": self.cut_bytes[starts], "kept": sent, "transient": peak,
            "selective": selective[:, None, :],
        }
        parts = memory_parts(p, stages[:, None], flight=self.flights[stages], recompute=mode,
                             **block)
        # the parts of a block alone first, then those of each stage's row, the levels'
        # among them where a row's would be (whole bytes: the order of the sum does not
        # change it; the order kept all the same)
        total = sum(sorted(parts.values(), key=lambda part: min(np.ndim(part), 2)))
        return np.broadcast_to(total, (len(levels), stages.size, starts.size))


@dataclass(frozen=True)
class _LeanBlocks(Blocks):
    """Blocks priced by their bytes with the leanest recompute choice the policy allows
    (the min-max DP then finds the split that needs the least memory), inf beyond the
    problem's memory limit."""

    def loads(self, end: int, starts: Any, stages: Any, *, sent: Any, peak: Any,
              allow_empty: bool) -> Any:
        # Full recompute keeps one micro-batch's activations and loss where the others keep
        # more, every other part the same: where the policy allows it, it is the leanest
        # of every block (and float sums are monotone), so it alone is priced (a ninth of
        # the work under auto; 405B onto 128 stages spent a quarter of its refusal here).
        leanest = self.options[-1:] if self.options[-1].mode is StageRecompute.FULL \
            else self.options
        rows = np.min([self.memory(end, starts, stages, sent=sent, peak=peak,
                                   recompute=recompute)
                       for recompute in leanest], axis=0)
        load = np.where(rows <= self.problem.memory_limit, rows, float("inf"))
        if end == 0 and not allow_empty:
            load[stages == 0] = float("inf")
        return load


def leanest_dp(c: Coarsening) -> tuple[int, ...] | None:
    """Coarse assignment: the contiguous split of ``c``'s order whose largest stage needs
    the least memory (the interval DP with bytes for seconds); None when every split
    needs more than the problem's memory limit. A finite limit (the memory of a split
    known to exist) keeps it fast: no block is tried whose parameters alone exceed it."""
    p = c.problem
    n, K = c.num_coarse, p.num_stages
    blocks = Blocks.of(c)
    lean = _LeanBlocks(*(getattr(blocks, f.name) for f in fields(blocks)))
    best, back = min_max_dp(lean, n, upper_s=float("inf"), allow_empty=p.allow_empty_stages)
    if best[K - 1][n] == float("inf"):
        return None
    return _walk_back(back, n, K)


def _spans(c: Coarsening) -> dict[int, list[int]]:
    """Per fine node with a data edge out: [first, last] coarse position of it and its readers."""
    span: dict[int, list[int]] = {}
    for e in c.problem.edges:
        if e.data:
            a, b = c.group_of[e.src], c.group_of[e.dst]
            lo_hi = span.setdefault(e.src, [a, a])
            lo_hi[0], lo_hi[1] = min(lo_hi[0], b), max(lo_hi[1], b)
    return span


def _cut_costs(c: Coarsening, span: dict[int, list[int]]) -> tuple[Any, Any]:
    """cut[i], cut_bytes[i]: seconds and bytes of the values a cut before item i separates
    from a reader (0 at both ends of the order)."""
    p, n = c.problem, c.num_coarse
    cut_time = np.zeros(n + 2)
    cut_bytes = np.zeros(n + 2)
    for v, (lo, hi) in span.items():
        if lo < hi:  # cuts lo+1 .. hi separate the value from a reader
            cut_time[lo + 1] += p.nodes[v].comm_s
            cut_time[hi + 1] -= p.nodes[v].comm_s
            cut_bytes[lo + 1] += p.nodes[v].output_bytes
            cut_bytes[hi + 1] -= p.nodes[v].output_bytes
    cut = np.cumsum(cut_time)[: n + 1]
    cut_b = np.cumsum(cut_bytes)[: n + 1]
    cut[0] = cut[n] = 0.0
    cut_b[0] = cut_b[n] = 0.0
    return cut, cut_b


def _walk_back(back: Any, n: int, K: int) -> tuple[int, ...]:
    """The stage of each coarse node, from the DP's choice of each stage's start."""
    stage = [0] * n
    end = n
    for j in range(K - 1, -1, -1):
        start = int(back[j][end])
        for g in range(start, end):
            stage[g] = j
        end = start
    return tuple(stage)
