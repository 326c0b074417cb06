"""A lower bound on the bottleneck from the graph's chain structure: the block bound.

A transformer is a chain of identical layers, and CP-SAT alone cannot prove on 5,000
nodes x 32 stages what the interval DP finds; the trivial bound (compute / N) ignores
that memory forces the early stages to recompute. This bound keeps memory and the
recompute choice, and is valid for every split the CP-SAT program allows, not only the
contiguous ones the DP tries.

The relaxation. Per stage, keep what is a sum over its nodes: compute C, forward F,
parameter bytes P (its nodes' own), saved activations A, returned bytes R; and, with
neighbour transport, the least its cuts send: the values an ideal's groups produce for
groups outside it cross the cut after it, costing their comm_s to the stages on both
sides and their bytes to the one after (``Crossing``). Of what is not a sum, keep a
part every such stage surely has (``_Cells``): the backward transient of the segments
it holds whole, and of the outputs it keeps for later stages, those crossing the cut
after it less those crossing the cut before it. Drop the rest (tied copies, deferred
weight gradients, values sent back down). The stage cost formula
(``cost.memory_parts``) on those parts under-prices every stage in time and in memory,
so the best split of the relaxation is no slower than the program's optimum.

The chain (``chain.py``). An ideal is all segments before some k plus an ideal of
segment k. The ideals of a segment are enumerated (once per distinct segment: identical
layers are one enumeration) and their sums binned by compute into cells; for each cell,
``lo`` and ``hi`` are the least and most of each sum over its ideals, and ``sent`` the
least its ideals send (``sent_most`` the most bytes). A stage from a cell a to a later
cell b then holds at least lo(b) - hi(a) of each sum, receives and sends at least
sent(a) and sent(b), and keeps at least sent(b) - sent_most(a) bytes of outputs, and at
least what b's cut sends that segments after a's made (``_Through``: a residual made in
the stage beside what its last groups make); the DP also tries pairs of cells whose
ideals do not nest, which can only lower the bound.

The bound is the min-max DP of the interval DP (``baselines.min_max_dp``) over the cells
in order, each block priced at those least sums; 1e-9 relative is taken off for the
floating-point sums.

A segment with more ideals than MAX_IDEALS (a preamble of masks and position codes
beside the embedding, as Gemma-2's) is not enumerated: its cells are the empty ideal, one
cell for all the others that holds between none and all of each sum and sends at least
nothing, and the full ideal (``_any_ideal``). That is weaker inside the segment, and the
bound stays valid.

Only for one GPU per stage (not interleaved, V-placed or replicated); None where the
bound does not apply.

Where GPUs run several stage modules (interleaved, V-placed), ``shared_gpu_bound`` is a
weaker one: the work spread evenly over the GPUs (see there).

Legend: G exact groups, s a separator, k a segment, D an ideal, a..b a block of cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fxpipe.partition.baselines import Blocks, min_max_dp
from fxpipe.partition.chain import (
    Crossing,
    chain_segments,
    counted_reads,
    enumerate_ideals,
    group_sums,
    neighbours,
    predecessor_masks,
    segment_crossings,
    segment_places,
)
from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import NodeCosts, recompute_options
from fxpipe.partition.problem import Comm, Problem, TiedPolicy, stage_flights

__all__ = ["block_bound", "relaxation", "shared_gpu_bound", "trivial_bound"]

CELL = 1e-3  # a cell spans at most this share of the mean stage's compute
RECENT = 64  # segments after its maker's in which a value crossing them counts (``_Through``)


def block_bound(exact: Coarsening, *, upper_s: float = math.inf) -> float | None:
    """A bottleneck no valid split that fits can beat (see the module docstring):
    ``upper_s`` when no split of the relaxation is faster (inf: none fits at all)."""
    p = exact.problem
    if p.virtual_stages > 1 or p.replicates or p.schedule.spec.v_placed:
        return None
    blocks = relaxation(exact)
    n = len(blocks.T) - 1  # positions 0..n: 0 is the empty ideal, n every group
    best, _ = min_max_dp(blocks, n, upper_s=upper_s, allow_empty=True)
    value = float(best[p.num_stages - 1, n])
    if value == math.inf:  # no split of the relaxation is faster than upper_s, or fits
        return upper_s
    return value * (1 - 1e-9)


def relaxation(exact: Coarsening) -> Blocks:
    """The relaxation's positions as blocks the interval DP's min-max prices (``_Cells``)."""
    p = exact.problem
    sums = group_sums(exact)
    segments, preds = chain_segments(exact, sums)
    reads = counted_reads(exact, segments)
    crossings = (segment_crossings(exact, segments, reads) if p.comm is Comm.NEIGHBOUR
                 else None)
    cells = _cells(segments, preds, sums, crossings,
                   CELL * float(sums[:, 0].sum()) / p.num_stages)
    lo, hi, sent = cells.lo, cells.hi, cells.sent
    n = lo.shape[0] - 1
    kept, again = slice(5, 5 + len(p.keep_levels)), slice(5 + len(p.keep_levels), None)
    return _Cells(p, lo[:, 0], lo[:, 1], lo[:, 2], lo[:, 3], lo[:, 4], np.zeros(n),
                  sent[:, 0], sent[:, 1], [],
                  np.array(stage_flights(p), dtype=np.int64)[:, None],
                  tuple(recompute_options(p)), hi[:, 0], hi[:, 1], hi[:, 2], hi[:, 3],
                  hi[:, 4], lo[:, kept], lo[:, again], hi[:, kept], hi[:, again],
                  table=cells, segment_peak=_segment_peaks(exact, segments),
                  through=_through(exact, segments, reads))


@dataclass(frozen=True)
class _Table:
    """Per position of the relaxation's DP (the empty ideal, then each segment's cells in
    order of compute, then every group): ``lo`` and ``hi`` (positions, sums) the least and
    most of each sum (``group_sums``) over the cell's ideals; ``sent`` (positions, 2) the
    least comm_s and bytes they send, ``sent_most`` the most bytes; ``own`` the least
    bytes of the values their groups in the segment make and send (0 without neighbour
    transport, at the empty ideal and at every group); ``segment`` the cell's segment (-1
    for the empty ideal, the number of segments for every group); ``whole`` the last
    segment every ideal of the cell holds whole (the segment itself where the cell holds
    only its full ideal, else the one before)."""

    lo: np.ndarray
    hi: np.ndarray
    sent: np.ndarray
    sent_most: np.ndarray
    own: np.ndarray
    segment: np.ndarray
    whole: np.ndarray


@dataclass(frozen=True)
class _Cells(Blocks):
    """The relaxation's blocks of cells, priced with what a stage from cell a to cell b
    surely holds beyond its sums:

    - its backward transient, the largest of the segments it holds whole: those after
      a's (its first ideal holds none of them) up to ``whole[b]``;
    - of the values it sends on, the bytes crossing the cut after it less the most
      crossing the cut before it (a value made before the stage and read after it
      crosses both, so the rest was made in it); where a lies in an earlier segment than
      b, at least the bytes b's ideal makes in its segment and sends (``own``) and those
      of the values crossing b's segment that a segment after a's made (``through``: a
      layer's residual, made in the stage beside what its last groups make); or its
      returned bytes, if more.

    ``table``: the cells (``_Table``); ``segment_peak``: per segment, the largest backward
    transient of its groups' nodes; ``through``: ``_Through``."""

    table: _Table | None = None
    segment_peak: np.ndarray = field(default_factory=lambda: np.zeros(0))
    through: _Through | None = None

    def peaks(self, end: int, starts: np.ndarray) -> np.ndarray:
        assert self.table is not None
        held = max(int(self.table.whole[end]) + 1, 0)  # segments [0, held) are held up to end
        after = np.minimum(self.table.segment[starts] + 1, held)  # the first held whole
        first = int(after.min())
        peak = np.append(np.maximum.accumulate(self.segment_peak[first:held][::-1])[::-1], 0.0)
        return peak[after - first]

    def outputs(self, end: int, starts: np.ndarray, made: np.ndarray) -> np.ndarray:
        t = self.table
        assert t is not None
        made = np.maximum(t.sent[end, 1] - t.sent_most[starts], 0.0)
        own = np.where(t.segment[starts] < t.segment[end], t.own[end], 0.0)
        if self.through is not None:
            own = own + self.through.made_after(int(t.segment[end]), t.segment[starts])
        return np.maximum(np.maximum(self.R[end] - self.R0[starts], made), own)


@dataclass(frozen=True)
class _Through:
    """Per segment k, the values made in an earlier segment and read after k, which every
    cut in k sends: the segments that make them, ascending (``made_in[at[k]:at[k + 1]]``),
    and per such entry the bytes of it and of those after it there (``after``). A value
    is listed in the RECENT segments after its maker's only (fewer only lowers the bound)."""

    at: np.ndarray
    made_in: np.ndarray
    after: np.ndarray

    def made_after(self, k: int, first: np.ndarray) -> np.ndarray:
        """Per segment in ``first``, the bytes of the values crossing segment k that a
        segment after it made (0 where k is no segment: the empty ideal, every group)."""
        if not 0 <= k < len(self.at) - 1:
            return np.zeros(len(first))
        lo, hi = int(self.at[k]), int(self.at[k + 1])
        tail = np.append(self.after[lo:hi], 0.0)
        return tail[np.searchsorted(self.made_in[lo:hi], first, side="right")]


def _through(exact: Coarsening, segments: list[list[int]],
             reads: list[tuple[int, int, set[int]]]) -> _Through:
    """What crosses each segment from an earlier one (``_Through``), from counted groups
    to counted groups (``reads``: ``counted_reads``)."""
    segment_of, _ = segment_places(exact.num_coarse, segments)
    entries: list[tuple[int, int, int]] = []  # (segment crossed, maker's segment, bytes)
    for v, g, read in reads:
        made, out = int(segment_of[g]), exact.problem.nodes[v].output_bytes
        last = max(int(segment_of[r]) for r in read)
        if out > 0:
            entries += [(k, made, out) for k in range(made + 1, min(last, made + 1 + RECENT))]
    entries.sort()
    crossed, made_in, size = (np.array([e[i] for e in entries], dtype=np.int64)
                              for i in range(3))
    at = np.searchsorted(crossed, np.arange(len(segments) + 1))
    suffix = np.append(np.cumsum(size[::-1])[::-1], 0).astype(float)
    return _Through(at, made_in, suffix[:-1] - suffix[at[crossed + 1]])


def _segment_peaks(exact: Coarsening, segments: list[list[int]]) -> np.ndarray:
    """Per segment, the largest backward transient of a node in its groups."""
    group_peak = NodeCosts.of(exact.problem).by(exact.group_of, exact.num_coarse).transient
    return np.array([group_peak[segment].max() for segment in segments])


def shared_gpu_bound(exact: Coarsening, *, upper_s: float = math.inf) -> float | None:
    """Where GPUs run several stage modules: a bottleneck no split faster than ``upper_s``
    beats. The GPUs' times add up to every node's compute plus every stage's transfers,
    and the slowest GPU takes at least the N-th part of the sum. Of the transfers it
    counts:

    - on each stage holding a copy of a tied parameter (copied), the all-reduce of its
      gradient whenever more than one stage holds one: a stage holding every reader of
      it holds all compute between them (stages are convex along the ordering edges),
      so when that alone is ``upper_s`` or more, a faster split has at least two copies;
    - with neighbour transport, what the K - 1 cuts send, charged to both sides
      (``_Sends.together``). The stages after cut b run on r_b distinct GPUs, each faster
      than ``upper_s``, so the ideal before b holds at least total - r_b * upper_s of
      compute and sends at least the least any such ideal sends; and the cuts' ideals
      are distinct, so together they send at least the K - 1 least of what distinct
      ideals can send.

    None for one GPU per stage (``block_bound``'s domain) and for replicated stages."""
    p = exact.problem
    if p.virtual_stages == 1 or p.replicates:
        return None
    compute = NodeCosts.of(p).by(exact.group_of, exact.num_coarse).compute_s
    total = float(compute.sum())
    work = total
    if p.tied_policy is TiedPolicy.COPY:
        for tied in p.tied:
            readers = {exact.group_of[v] for v in tied.nodes}
            if len(readers) > 1 and float(compute[_hull(exact, readers)].sum()) >= upper_s:
                work += 2 * tied.allreduce_s
    if p.comm is Comm.NEIGHBOUR and not p.allow_empty_stages:
        sends = _least_sends(exact)
        if sends is not None:
            K = p.num_stages
            each = [sends.least_from(total - sends.uncounted - upper_s
                                     * len({p.device_of(j) for j in range(b + 1, K)}))
                    for b in range(K - 1)]
            work += 2 * sends.together(each)
    return min(upper_s, work / p.devices) * (1 - 1e-9)


@dataclass(frozen=True)
class _Sends:
    """The least the cuts between stages send with neighbour transport (comm_s), over the
    ideals of counted groups (``_least_sends``): a cut's real ideal sends at least what
    its counted groups send to counted groups outside it.

    - ``at``, ``least``: ideals by counted compute, ascending; ``least[i]`` the least
      any ideal from ``at[i]`` on sends;
    - ``uncounted``: the compute of the groups the block bound zeroes (``chain_segments``),
      which the counted compute of an ideal may lack;
    - ``cheapest``: ascending, per number of counted groups, the least an ideal of that
      many sends; and per zeroed group z, the least an ideal that z may follow sends:
      holding every counted ancestor of z, no counted descendant.

    Why the cuts together send at least the K - 1 least of ``cheapest``: cut b follows
    stage b. Where stage b holds a counted group, cut b's counted ideal is larger than
    cut b - 1's, so these cuts' counted ideals have distinct sizes, one or more. Where it
    holds none, it holds a zeroed group z, and cut b's counted ideal is one z may follow;
    stages are disjoint, so these z are distinct."""

    at: np.ndarray
    least: np.ndarray
    uncounted: float
    cheapest: np.ndarray

    def least_from(self, x: float) -> float:
        """The least any ideal with at least ``x`` seconds of counted compute sends."""
        i = int(np.searchsorted(self.at, x * (1 - 1e-9) - 1e-15, side="left"))
        return float(self.least[i]) if i < len(self.least) else 0.0

    def together(self, each: list[float]) -> float:
        """The least all the cuts send together, given ``each`` the least cut b sends
        alone: the L largest of ``each`` and the len(each) - L least of ``cheapest``, at
        the L where that is most (the L cuts' ideals may be among those least ones)."""
        largest = np.concatenate(([0.0], np.cumsum(sorted(each, reverse=True))))
        least = np.concatenate(([0.0], np.cumsum(self.cheapest)))
        least = np.concatenate((least, np.full(len(each) + 1, least[-1])))
        return max(float(largest[L] + least[len(each) - L]) for L in range(len(each) + 1))


def _least_sends(exact: Coarsening) -> _Sends | None:
    """What ideals of counted groups send (``_Sends``). Every ideal's counted groups are
    all segments before some k plus an ideal I of segment k, other than its full one
    (that is the next segment's empty ideal; of the last segment, it holds every counted
    group, which no cut's ideal does when every zeroed group has a counted descendant: it
    must stay out with them). What it sends: ``Crossing``. None beyond MAX_IDEALS."""
    sums = group_sums(exact)
    compute = sums[:, 0].copy()
    segments, preds = chain_segments(exact, sums)
    counted = np.zeros(exact.num_coarse, dtype=bool)
    for segment in segments:
        counted[segment] = True
    if not _zeroed_lead_to_counted(exact, counted):
        return None
    at: list[float] = []
    sent: list[float] = []
    sized: dict[int, float] = {}  # number of counted groups -> the least sent
    per_segment: list[tuple[list[int], np.ndarray]] = []
    before, held = 0.0, 0
    crossings = segment_crossings(exact, segments, counted_reads(exact, segments))
    for segment, crossing in zip(segments, crossings, strict=True):
        ideals = enumerate_ideals(predecessor_masks(segment, preds), sums[segment])
        if ideals is None:
            return None
        full = (1 << len(segment)) - 1
        keep = [i for i, ideal in enumerate(ideals[0]) if ideal != full]
        bits = [ideals[0][i] for i in keep]
        sends = np.array([crossing.through[0] + crossing.sent(ideal)[0] for ideal in bits])
        per_segment.append((bits, sends))
        at += (before + ideals[1][keep, 0]).tolist()
        sent += sends.tolist()
        for ideal, value in zip(bits, sends, strict=True):
            size = held + ideal.bit_count()
            if size:  # a stage with a counted group lies before the cut
                sized[size] = min(sized.get(size, math.inf), float(value))
        before += float(compute[segment].sum())
        held += len(segment)
    if not at:
        return None
    order = np.argsort(at, kind="stable")
    least = np.minimum.accumulate(np.array(sent)[order][::-1])[::-1]
    followed = _least_followed(exact, segments, counted, per_segment)
    return _Sends(np.array(at)[order], least, float(compute[~counted].sum()),
                  np.sort(np.array(list(sized.values()) + followed)))


def _least_followed(exact: Coarsening, segments: list[list[int]], counted: np.ndarray,
                    per_segment: list[tuple[list[int], np.ndarray]]) -> list[float]:
    """Per zeroed group z, the least an ideal that z may follow sends (``_Sends``): an
    ideal in segment k holds z's counted ancestors when they lie before k, or in k within
    its bits; and none of z's counted descendants when they lie after k, or in k outside
    its bits. So every ideal of a segment strictly between the last holding an ancestor
    and the first holding a descendant will do, and of those two segments the ideals
    whose bits say so."""
    G = exact.num_coarse
    segment_of, place = segment_places(G, segments)
    preds, succs = neighbours(exact)

    def nearest(step: list[list[int]], order: range, later: bool) -> list[tuple[int, int]]:
        """Per group, the segment nearest it holding a counted group it reaches by ``step``
        (ancestors: the last; descendants: the first), and the bits of those there."""
        found = [(-1, 0) if later else (len(segments), 0)] * G
        for g in order:
            for w in step[g]:
                for k, bits in (found[w], (int(segment_of[w]), 1 << int(place[w]))
                                if counted[w] else found[w]):
                    now = found[g][0]
                    if k == now:
                        found[g] = (k, found[g][1] | bits)
                    elif (k > now) == later:
                        found[g] = (k, bits)
        return found

    above = nearest(preds, range(G), later=True)  # groups are in a topological order
    below = nearest(succs, range(G - 1, -1, -1), later=False)
    lowest = [float(sends.min()) if len(sends) else math.inf for _, sends in per_segment]
    followed: list[float] = []
    for z in np.flatnonzero(~counted):
        (ka, held), (kd, out) = above[z], below[z]
        options = lowest[ka + 1:kd]
        for k in {ka, kd} & set(range(len(segments))):
            bits, sends = per_segment[k]
            options += [float(s) for ideal, s in zip(bits, sends, strict=True)
                        if (k != ka or ideal & held == held) and (k != kd or ideal & out == 0)]
        if options:
            followed.append(min(options))
    return followed


def _zeroed_lead_to_counted(exact: Coarsening, counted: np.ndarray) -> bool:
    """Whether every group not counted has a counted group among its descendants."""
    leads = counted.copy()
    for a, b in sorted(exact.order_edges, reverse=True):  # groups in a topological order
        leads[a] |= leads[b]
    return bool(leads.all())


def _hull(exact: Coarsening, groups: set[int]) -> list[int]:
    """The groups on an ordering path between two of ``groups`` (and those): what a stage
    holding all of ``groups`` holds."""
    preds, succs = neighbours(exact)

    def reach(step: list[list[int]]) -> set[int]:
        seen, todo = set(groups), list(groups)
        while todo:
            for w in step[todo.pop()]:
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    return sorted(reach(succs) & reach(preds))


def _cells(segments: list[list[int]], preds: list[list[int]], sums: np.ndarray,
           crossings: list[Crossing] | None, width: float) -> _Table:
    """The relaxation's positions (``_Table``): the empty ideal, then per segment its
    cells in order of compute but one holding only the empty ideal (the same set as the
    previous segment's full ideal), then every group; a segment with more than MAX_IDEALS
    ideals gets ``_any_ideal``'s cells."""
    # per _Table field, its rows: the empty ideal's first
    columns = sums.shape[1]
    rows: dict[str, list[np.ndarray]] = {
        "lo": [np.zeros((1, columns))], "hi": [np.zeros((1, columns))],
        "sent": [np.zeros((1, 2))],
        "sent_most": [np.zeros(1)], "own": [np.zeros(1)], "segment": [np.array([-1])],
        "whole": [np.array([-1])]}
    before = np.zeros(columns)
    cache: dict[tuple[object, ...], tuple[np.ndarray, ...]] = {}
    for k, segment in enumerate(segments):
        masks = predecessor_masks(segment, preds)
        crossing = crossings[k] if crossings is not None else Crossing(np.zeros(2), (), ())
        # identical layers: one enumeration
        key = (masks, sums[segment].tobytes(), crossing.incoming, crossing.local)
        if key not in cache:
            ideals = enumerate_ideals(masks, sums[segment])
            full = (1 << len(segment)) - 1
            cache[key] = _any_ideal(sums[segment].sum(axis=0), crossing.sent(full)) \
                if ideals is None else _bin(
                ideals[1], np.array([crossing.sent(i) for i in ideals[0]], dtype=float),
                np.array(ideals[0]) == full, width)
        binned = cache[key]
        lo, hi, sent, most, own, only_full, only_empty = binned
        keep = ~only_empty
        for name, value in (("lo", before + lo), ("hi", before + hi),
                            ("sent", crossing.through + sent),
                            ("sent_most", crossing.through[1] + most), ("own", own),
                            ("segment", np.full(len(lo), k)),
                            ("whole", np.where(only_full, k, k - 1))):
            rows[name].append(value[keep])
        before = before + sums[segment].sum(axis=0)
    last = len(segments)  # every group: what the last segment's full ideal holds
    for name, value in (("lo", before[None, :]), ("hi", before[None, :]),
                        ("sent", np.zeros((1, 2))), ("sent_most", np.zeros(1)),
                        ("own", np.zeros(1)), ("segment", np.array([last])),
                        ("whole", np.array([last - 1]))):
        rows[name].append(value)
    return _Table(**{name: np.concatenate(row) for name, row in rows.items()})


def _any_ideal(full: np.ndarray, sent: tuple[float, int, int]) -> tuple[np.ndarray, ...]:
    """``_bin``'s cells for a segment with too many ideals to enumerate: the empty ideal,
    one cell for every other ideal but the full one, which holds between none and all of
    each sum and sends at least nothing (and, for ``_Cells.outputs``, at most unboundedly
    many bytes), and the full ideal (``full`` its sums, ``sent`` what it sends)."""
    zeros = np.zeros_like(full)
    return (np.stack([zeros, zeros, full]), np.stack([zeros, full, full]),
            np.array([[0.0, 0.0], [0.0, 0.0], sent[:2]]), np.array([0.0, np.inf, sent[1]]),
            np.array([0.0, 0.0, sent[2]]), np.array([False, False, True]),
            np.array([True, False, False]))


def _bin(ideals: np.ndarray, sent: np.ndarray, full: np.ndarray, width: float,
         ) -> tuple[np.ndarray, ...]:
    """Per cell of ``width`` seconds of compute (in order) of a segment's ideals (the empty
    one first; ``sent`` what each sends, ``Crossing.sent``; ``full`` which is the full
    one): the least and the most of each sum over the cell's ideals, the least comm_s
    and bytes they send, the most bytes, the least bytes their own groups send, whether
    the cell holds only the full ideal, and whether only the empty one."""
    cell = np.floor(ideals[:, 0] / width) if width > 0 else np.zeros(len(ideals))
    order = np.argsort(cell, kind="stable")
    ideals, cell, sent, full = ideals[order], cell[order], sent[order], full[order]
    empty = order == 0  # the empty ideal is the first
    starts = np.flatnonzero(np.concatenate(([True], cell[1:] != cell[:-1])))
    return (np.minimum.reduceat(ideals, starts, axis=0),
            np.maximum.reduceat(ideals, starts, axis=0),
            np.minimum.reduceat(sent[:, :2], starts),
            np.maximum.reduceat(sent[:, 1], starts), np.minimum.reduceat(sent[:, 2], starts),
            np.logical_and.reduceat(full, starts), np.logical_and.reduceat(empty, starts))


def trivial_bound(problem: Problem) -> float:
    """A bottleneck no split can beat: all compute spread evenly over the N GPUs, and (one
    GPU per stage) the slowest node on one GPU. Communication only adds to either."""
    N = problem.devices
    times = NodeCosts.of(problem).compute_s.tolist()
    if problem.replicates:  # a node's micro-batch may be split over up to N GPUs
        return max(sum(times), 0.0) / N
    return max(sum(times) / N, max(times, default=0.0))
