"""A lower bound on the bottleneck from the graph's chain structure: the block bound.

A transformer is a chain of identical layers, and CP-SAT alone cannot prove on 5,000
nodes x 32 stages what the interval DP finds; the trivial bound (compute / N) ignores
that memory forces the early stages to recompute. This bound keeps memory and the
recompute choice, and is valid for every split the CP-SAT program allows, not only the
contiguous ones the DP tries.

The relaxation. Per stage, keep what is a sum over its nodes: compute C, forward F,
parameter bytes P (its nodes' own), saved activations A; and, with neighbour transport,
the least its cuts send: the values an ideal's groups produce for groups outside it
cross the cut after it, costing their comm_s to the stages on both sides and their bytes
to the one after (``_Crossing``). Drop what only adds (outputs kept for later stages, the
backward transient, tied copies, deferred weight gradients, values sent back down). The
stage cost formula (``cost.memory_parts``) on those sums under-prices every stage in
time and in memory, so the best split of the relaxation is no slower than the program's
optimum.

The chain. A stage holds D_j \\ D_{j-1} for ideals (downward closed sets of exact groups)
D_{j-1} of D_j. A *separator* s is comparable (ancestor or descendant) with every group
that counts: an ideal either holds all of s's ancestors and s, or none of s's
descendants. Groups too light to count (no parameters, next to no time or bytes) get
their costs zeroed, which only lowers the bound. Between consecutive separators lie
segments, and an ideal is all segments before some k plus an ideal of segment k. The
ideals of a segment are enumerated (once per distinct segment: identical layers are one
enumeration) and their sums binned by compute into cells; for each cell, ``lo`` and
``hi`` are the least and most of each sum over its ideals, and ``sent`` the least its
ideals send. A stage from a cell a to a later cell b then holds at least lo(b) - hi(a)
of each sum and receives and sends at least sent(a) and sent(b) (the DP also tries
pairs of cells whose ideals do not nest, which can only lower the bound).

The bound is the min-max DP of the interval DP (``baselines.min_max_dp``) over the cells
in order, each block priced at those least sums; 1e-9 relative is taken off for the
floating-point sums.

Only for one GPU per stage (not interleaved, V-placed or replicated); None where the
bound does not apply or a segment has too many ideals to enumerate.

Where GPUs run several stage modules (interleaved, V-placed), ``shared_gpu_bound`` is a
weaker one: the work spread evenly over the GPUs (see there).

Legend: G exact groups, s a separator, k a segment, D an ideal, a..b a block of cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fxpipe.partition.baselines import Blocks, min_max_dp
from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import recompute_options
from fxpipe.partition.evaluate import consumers
from fxpipe.partition.problem import Comm, TiedPolicy, stage_flights

__all__ = ["block_bound", "shared_gpu_bound"]

MAX_IDEALS = 50_000  # per distinct segment; beyond, no bound (the enumeration's time)
LIGHT = 1e-4  # a group with no parameters and below this share of time and bytes
CELL = 1e-3  # a cell spans at most this share of the mean stage's compute


def block_bound(exact: Coarsening, *, upper_s: float = math.inf) -> float | None:
    """A bottleneck no valid split that fits can beat (see the module docstring):
    ``upper_s`` when no split of the relaxation is faster (inf: none fits at all)."""
    p = exact.problem
    if p.virtual_stages > 1 or p.replicates or p.schedule.spec.v_placed:
        return None
    sums = _group_sums(exact)
    segments, preds = _segments(exact, sums)
    crossings = _crossings(exact, segments) if p.comm is Comm.NEIGHBOUR else None
    cells = _cells(segments, preds, sums, crossings,
                   CELL * float(sums[:, 0].sum()) / p.num_stages)
    if cells is None:
        return None
    lo, hi, sent = cells
    n = lo.shape[0] - 1  # positions 0..n: 0 is the empty ideal, n every group
    zeros = np.zeros(n + 1)
    blocks = Blocks(p, lo[:, 0], lo[:, 1], lo[:, 2], lo[:, 3], zeros, np.zeros(n), sent[:, 0],
                     sent[:, 1], [], np.array(stage_flights(p), dtype=np.int64)[:, None],
                     tuple(recompute_options(p)), hi[:, 0], hi[:, 1], hi[:, 2], hi[:, 3])
    best, _ = min_max_dp(blocks, n, upper_s=upper_s, allow_empty=True)
    value = float(best[p.num_stages - 1, n])
    if value == math.inf:  # no split of the relaxation is faster than upper_s, or fits
        return upper_s
    return value * (1 - 1e-9)


def shared_gpu_bound(exact: Coarsening, *, upper_s: float = math.inf) -> float | None:
    """Where GPUs run several stage modules: a bottleneck no split faster than ``upper_s``
    beats. The GPUs' times add up to every node's compute plus every stage's transfers,
    and the slowest GPU takes at least the N-th part of the sum. Of the transfers it
    counts:

    - on each stage holding a copy of a replicated tied parameter, the all-reduce of its
      gradient whenever more than one stage holds one: a stage holding every reader of
      it holds all compute between them (stages are convex along the ordering edges),
      so when that alone is ``upper_s`` or more, a faster split has at least two copies;
    - with neighbour transport, each boundary b charges the values crossing it to both
      sides. The stages after b run on r_b distinct GPUs, each faster than ``upper_s``,
      so the ideal before b holds at least total - r_b * upper_s of compute; it then
      sends at least the least any such ideal sends (``_least_crossing``). The last
      round's boundaries are the ones this says something about.

    None for one GPU per stage (``block_bound``'s domain) and for replicated stages."""
    p = exact.problem
    if p.virtual_stages == 1 or p.replicates:
        return None
    compute = np.zeros(exact.num_coarse)
    for v, node in enumerate(p.nodes):
        compute[exact.group_of[v]] += node.forward_s + node.backward_s
    work = float(compute.sum())
    if p.tied_policy is TiedPolicy.REPLICATE:
        for tied in p.tied:
            readers = {exact.group_of[v] for v in tied.nodes}
            if len(readers) > 1 and float(compute[_hull(exact, readers)].sum()) >= upper_s:
                work += 2 * tied.allreduce_s
    if p.comm is Comm.NEIGHBOUR and upper_s < math.inf and not p.allow_empty_stages:
        crossing = _least_crossing(exact)
        if crossing is not None:
            least, uncounted = crossing
            K = p.num_stages
            for b in range(K - 1):
                after = len({p.device_of(j) for j in range(b + 1, K)})
                work += 2 * least(float(compute.sum()) - after * upper_s - uncounted)
    return min(upper_s, work / p.devices) * (1 - 1e-9)


def _least_crossing(exact: Coarsening) -> tuple[Callable[[float], float], float] | None:
    """(least, uncounted): least(X) is the least comm_s of the values that an ideal with
    at least X seconds of counted compute (not every group) sends to a group outside it;
    ``uncounted`` the compute of the groups the block bound zeroes (``_segments``), which
    the counted compute of an ideal may lack. Every ideal's counted groups are all segments
    before some k plus an ideal I of segment k (what it sends: ``_Crossing``). None beyond
    MAX_IDEALS."""
    sums = _group_sums(exact)
    compute = sums[:, 0].copy()
    segments, preds = _segments(exact, sums)
    counted = np.zeros(exact.num_coarse, dtype=bool)
    for segment in segments:
        counted[segment] = True
    uncounted = float(compute[~counted].sum())
    found: list[tuple[float, float]] = []
    before = 0.0
    for segment, crossing in zip(segments, _crossings(exact, segments), strict=True):
        ideals = _ideals(_masks(segment, preds), sums[segment])
        if ideals is None:
            return None
        bits, ideal_sums = ideals
        # Not the full ideal: before the last segment it is the next one's empty ideal; of
        # the last, it holds every counted group, which no other ideal does when every
        # zeroed group has a counted descendant (it must stay out with them).
        full = (1 << len(segment)) - 1
        found += [(before + float(row[0]), crossing.through[0] + crossing.sent(ideal)[0])
                  for ideal, row in zip(bits, ideal_sums, strict=True) if ideal != full]
        before += float(compute[segment].sum())
    if not found or not _zeroed_lead_to_counted(exact, counted):
        return None
    found.sort()
    at = np.array([f[0] for f in found])
    least = np.minimum.accumulate(np.array([f[1] for f in found])[::-1])[::-1]

    def least_from(x: float) -> float:
        i = int(np.searchsorted(at, x * (1 - 1e-9) - 1e-15, side="left"))
        return float(least[i]) if i < len(least) else 0.0

    return least_from, uncounted


@dataclass(frozen=True)
class _Crossing:
    """What an ideal of one segment sends with neighbour transport, as (comm_s, bytes):
    values from or to groups the block bound zeroes are left out, which only lowers it."""

    through: np.ndarray  # values produced before the segment and read after it: every
    #                      ideal sends them
    incoming: tuple[tuple[int, float, int], ...]  # (readers' bits, comm, bytes) of values
    #                                               from before read last in the segment
    local: tuple[tuple[int, int, bool, float, int], ...]  # (producer's bit, readers' bits,
    #                      read after the segment, comm, bytes) of the segment's own values

    def sent(self, ideal: int) -> tuple[float, int]:
        """What ``ideal`` (bits of the segment's groups) sends beyond ``through``."""
        crossing = [(c, b) for bits, c, b in self.incoming if bits & ~ideal]
        crossing += [(c, b) for bit, bits, later, c, b in self.local
                     if ideal & bit and (later or bits & ~ideal)]
        return sum(c for c, _ in crossing), sum(b for _, b in crossing)


def _crossings(exact: Coarsening, segments: list[list[int]]) -> list[_Crossing]:
    """Per segment, what its ideals send (``_Crossing``)."""
    p = exact.problem
    segment_of = np.full(exact.num_coarse, -1)
    place = np.zeros(exact.num_coarse, dtype=np.int64)
    for k, segment in enumerate(segments):
        for i, g in enumerate(segment):
            segment_of[g], place[g] = k, i
    through = np.zeros((len(segments), 2))
    incoming: list[list[tuple[int, float, int]]] = [[] for _ in segments]
    local: list[list[tuple[int, int, bool, float, int]]] = [[] for _ in segments]
    for v, readers in enumerate(consumers(p)):
        g = exact.group_of[v]
        read = {exact.group_of[w] for w in readers} - {g}
        read = {r for r in read if segment_of[r] >= 0}
        comm, size = p.nodes[v].comm_s, p.nodes[v].output_bytes
        if segment_of[g] < 0 or not read or (comm <= 0 and size <= 0):
            continue
        k0, last = int(segment_of[g]), max(int(segment_of[r]) for r in read)
        through[k0 + 1:last] += (comm, size)
        if last > k0:
            bits = sum(1 << int(place[r]) for r in read if segment_of[r] == last)
            incoming[last].append((bits, comm, size))
        bits = sum(1 << int(place[r]) for r in read if segment_of[r] == k0)
        local[k0].append((1 << int(place[g]), bits, last > k0, comm, size))
    return [_Crossing(through[k], tuple(incoming[k]), tuple(local[k]))
            for k in range(len(segments))]


def _zeroed_lead_to_counted(exact: Coarsening, counted: np.ndarray) -> bool:
    """Whether every group not counted has a counted group among its descendants."""
    leads = counted.copy()
    for a, b in sorted(exact.order_edges, reverse=True):  # groups in a topological order
        leads[a] |= leads[b]
    return bool(leads.all())


def _hull(exact: Coarsening, groups: set[int]) -> list[int]:
    """The groups on an ordering path between two of ``groups`` (and those): what a stage
    holding all of ``groups`` holds."""
    succs: list[list[int]] = [[] for _ in range(exact.num_coarse)]
    preds: list[list[int]] = [[] for _ in range(exact.num_coarse)]
    for a, b in exact.order_edges:
        succs[a].append(b)
        preds[b].append(a)

    def reach(step: list[list[int]]) -> set[int]:
        seen, todo = set(groups), list(groups)
        while todo:
            for w in step[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    return sorted(reach(succs) & reach(preds))


def _group_sums(exact: Coarsening) -> np.ndarray:
    """(G, 4): per exact group, its compute, forward, parameter and activation sums."""
    p = exact.problem
    sums = np.zeros((exact.num_coarse, 4))
    for v, node in enumerate(p.nodes):
        sums[exact.group_of[v]] += (node.forward_s + node.backward_s, node.forward_s,
                                    node.param_bytes, node.activation_bytes)
    return sums


def _segments(exact: Coarsening, sums: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """The groups that count, cut into segments at the separators, in order, and every
    group's predecessors; the light groups that some separator is not comparable with
    get their sums zeroed (in ``sums``)."""
    G = exact.num_coarse
    preds: list[list[int]] = [[] for _ in range(G)]
    succs: list[list[int]] = [[] for _ in range(G)]
    for a, b in exact.order_edges:
        preds[b].append(a)
        succs[a].append(b)
    ancestors = [0] * G  # bit sets; groups are numbered in a topological order
    for g in range(G):
        for a in preds[g]:
            ancestors[g] |= ancestors[a] | (1 << a)
    descendants = [0] * G
    for g in range(G - 1, -1, -1):
        for b in succs[g]:
            descendants[g] |= descendants[b] | (1 << b)
    totals = np.maximum(sums.sum(axis=0), 1e-300)
    light = (sums[:, 2] == 0) & np.all(sums <= LIGHT * totals, axis=1)
    heavy = sum(1 << g for g in range(G) if not light[g])
    separators = [s for s in range(G)
                  if heavy & ((1 << s) - 1) & ~ancestors[s] == 0
                  and (heavy >> (s + 1) << (s + 1)) & ~descendants[s] == 0]
    zeroed = 0
    for s in separators:
        zeroed |= ((1 << G) - 1) & ~(ancestors[s] | descendants[s] | (1 << s))
    assert zeroed & heavy == 0
    segments: list[list[int]] = [[]]
    cuts = set(separators)
    for g in range(G):
        if zeroed >> g & 1:
            sums[g] = 0.0
            continue
        segments[-1].append(g)
        if g in cuts:
            segments.append([])
    return [segment for segment in segments if segment], preds


def _masks(segment: list[int], preds: list[list[int]]) -> tuple[int, ...]:
    """Per group of the segment, the bits of its predecessors in it (a predecessor outside
    it is in every ideal that reaches it)."""
    local = {g: i for i, g in enumerate(segment)}
    return tuple(sum(1 << local[a] for a in preds[g] if a in local) for g in segment)


def _cells(segments: list[list[int]], preds: list[list[int]], sums: np.ndarray,
           crossings: list[_Crossing] | None, width: float,
           ) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(lo, hi, sent): lo and hi (positions, 4), sent (positions, 2): the empty ideal,
    then per segment its cells in order of compute, then every group; sent the least
    comm_s and the least bytes any of the cell's ideals sends (0 without ``crossings``,
    at the empty ideal and at every group). None when a segment has more than MAX_IDEALS
    ideals."""
    lo_rows: list[np.ndarray] = [np.zeros((1, 4))]
    hi_rows: list[np.ndarray] = [np.zeros((1, 4))]
    sent_rows: list[np.ndarray] = [np.zeros((1, 2))]
    before = np.zeros(4)
    cache: dict[tuple[object, ...], tuple[np.ndarray, np.ndarray, np.ndarray] | None] = {}
    for k, segment in enumerate(segments):
        masks = _masks(segment, preds)
        crossing = crossings[k] if crossings is not None else _Crossing(np.zeros(2), (), ())
        # identical layers: one enumeration
        key = (masks, sums[segment].tobytes(), crossing.incoming, crossing.local)
        if key not in cache:
            ideals = _ideals(masks, sums[segment])
            cache[key] = None if ideals is None else _bin(
                ideals[1], np.array([crossing.sent(i) for i in ideals[0]], dtype=float), width)
        binned = cache[key]
        if binned is None:
            return None
        lo_rows.append(before + binned[0])
        hi_rows.append(before + binned[1])
        sent_rows.append(crossing.through + binned[2])
        before = before + sums[segment].sum(axis=0)
    lo_rows.append(before[None, :])
    hi_rows.append(before[None, :])
    sent_rows.append(np.zeros((1, 2)))
    return np.concatenate(lo_rows), np.concatenate(hi_rows), np.concatenate(sent_rows)


def _ideals(masks: tuple[int, ...], sums: np.ndarray) -> tuple[list[int], np.ndarray] | None:
    """(bits, sums (ideals, 4)) of every ideal of a segment (``masks[i]``: the bits of
    group i's predecessors in it, groups in a topological order), the empty one first;
    None beyond MAX_IDEALS. Each ideal is made once, from the ideal of its groups but the
    last (in order), which is one too."""
    rows = sums.tolist()
    bits: list[int] = [0]
    found: list[list[float]] = [[0.0] * sums.shape[1]]
    stack: list[tuple[int, int, list[float]]] = [(0, 0, found[0])]  # (ideal, next group, sums)
    while stack:
        ideal, first, total = stack.pop()
        for g in range(first, len(masks)):
            if masks[g] & ~ideal == 0:
                grown = [a + b for a, b in zip(total, rows[g], strict=True)]
                bits.append(ideal | (1 << g))
                found.append(grown)
                if len(found) > MAX_IDEALS:
                    return None
                stack.append((bits[-1], g + 1, grown))
    return bits, np.array(found)


def _bin(ideals: np.ndarray, sent: np.ndarray, width: float,
         ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell of ``width`` seconds of compute (in order), the least and the most of each
    sum over the ideals whose compute falls in it, and the least of each they send."""
    cell = np.floor(ideals[:, 0] / width) if width > 0 else np.zeros(len(ideals))
    order = np.argsort(cell, kind="stable")
    ideals, cell, sent = ideals[order], cell[order], sent[order]
    starts = np.flatnonzero(np.concatenate(([True], cell[1:] != cell[:-1])))
    return (np.minimum.reduceat(ideals, starts, axis=0),
            np.maximum.reduceat(ideals, starts, axis=0), np.minimum.reduceat(sent, starts))
