"""The chain structure of a graph of repeated layers, which the bounds (``bound.py``)
relax: separators, the segments between them, each segment's ideals and what they send.

A stage holds D_j \\ D_{j-1} for ideals (downward closed sets of exact groups) D_{j-1} of
D_j. A *separator* s is comparable (ancestor or descendant) with every group that
counts: an ideal either holds all of s's ancestors and s, or none of s's descendants.
Groups too light to count (next to no time, parameters or bytes: a source reading a few
bytes of parameters, say GPT-OSS's attention sinks, which a split may put in any stage
before its reader) get their costs zeroed, which only lowers a bound. Between
consecutive separators lie segments (``chain_segments``), and an ideal is all segments
before some k plus an ideal of segment k (``enumerate_ideals``, up to MAX_IDEALS of
them). With neighbour transport, ``segment_crossings`` tells what each ideal of a
segment sends.

Legend: G exact groups, s a separator, k a segment, D an ideal.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import NodeCosts
from fxpipe.partition.evaluate import consumers

__all__ = ["MAX_IDEALS", "Crossing", "chain_segments", "counted_reads", "enumerate_ideals",
           "group_sums", "neighbours", "predecessor_masks", "segment_crossings",
           "segment_places"]

MAX_IDEALS = 50_000  # per distinct segment; beyond, none (the enumeration's time)
LIGHT = 1e-4  # a group below this share of time, parameters and bytes


@dataclass(frozen=True)
class Crossing:
    """What an ideal of one segment sends with neighbour transport, as (comm_s, bytes):
    values from or to groups the block bound zeroes are left out, which only lowers it."""

    through: np.ndarray  # values produced before the segment and read after it: every
    #                      ideal sends them
    incoming: tuple[tuple[int, float, int], ...]  # (readers' bits, comm, bytes) of values
    #                                               from before read last in the segment
    local: tuple[tuple[int, int, bool, float, int], ...]  # (producer's bit, readers' bits,
    #                      read after the segment, comm, bytes) of the segment's own values

    def sent(self, ideal: int) -> tuple[float, int, int]:
        """What ``ideal`` (bits of the segment's groups) sends beyond ``through``: comm_s,
        bytes, and the bytes of those its own groups make."""
        crossing = [(c, b) for bits, c, b in self.incoming if bits & ~ideal]
        own = [(c, b) for bit, bits, later, c, b in self.local
               if ideal & bit and (later or bits & ~ideal)]
        return (sum(c for c, _ in crossing + own), sum(b for _, b in crossing + own),
                sum(b for _, b in own))


def counted_reads(exact: Coarsening, segments: list[list[int]]
                  ) -> list[tuple[int, int, set[int]]]:
    """Per value a counted group makes and other counted groups read (the groups in
    ``segments``): its node, the maker's group and the readers' groups."""
    segment_of, _ = segment_places(exact.num_coarse, segments)
    reads = []
    for v, readers in enumerate(consumers(exact.problem)):
        g = exact.group_of[v]
        read = {r for r in {exact.group_of[w] for w in readers} - {g} if segment_of[r] >= 0}
        if segment_of[g] >= 0 and read:
            reads.append((v, g, read))
    return reads


def segment_crossings(exact: Coarsening, segments: list[list[int]],
                      reads: list[tuple[int, int, set[int]]]) -> list[Crossing]:
    """Per segment, what its ideals send (``Crossing``); ``reads``: ``counted_reads``."""
    p = exact.problem
    segment_of, place = segment_places(exact.num_coarse, segments)
    through = np.zeros((len(segments), 2))
    incoming: list[list[tuple[int, float, int]]] = [[] for _ in segments]
    local: list[list[tuple[int, int, bool, float, int]]] = [[] for _ in segments]
    for v, g, read in reads:
        comm, size = p.nodes[v].comm_s, p.nodes[v].output_bytes
        if comm <= 0 and size <= 0:
            continue
        k0, last = int(segment_of[g]), max(int(segment_of[r]) for r in read)
        through[k0 + 1:last] += (comm, size)
        if last > k0:
            bits = sum(1 << int(place[r]) for r in read if segment_of[r] == last)
            incoming[last].append((bits, comm, size))
        bits = sum(1 << int(place[r]) for r in read if segment_of[r] == k0)
        local[k0].append((1 << int(place[g]), bits, last > k0, comm, size))
    return [Crossing(through[k], tuple(incoming[k]), tuple(local[k]))
            for k in range(len(segments))]


def neighbours(exact: Coarsening) -> tuple[list[list[int]], list[list[int]]]:
    """Per exact group, its predecessors and its successors along the ordering edges."""
    preds: list[list[int]] = [[] for _ in range(exact.num_coarse)]
    succs: list[list[int]] = [[] for _ in range(exact.num_coarse)]
    for a, b in exact.order_edges:
        preds[b].append(a)
        succs[a].append(b)
    return preds, succs


def segment_places(G: int, segments: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Per exact group, its segment (-1 for a zeroed group) and its place in it."""
    segment_of = np.full(G, -1)
    place = np.zeros(G, dtype=np.int64)
    for k, segment in enumerate(segments):
        for i, g in enumerate(segment):
            segment_of[g], place[g] = k, i
    return segment_of, place


def group_sums(exact: Coarsening) -> np.ndarray:
    """(G, sums): per exact group, its compute, forward, parameter, activation and returned
    bytes sums (what its stage keeps of the model's outputs until their backward), then
    per keep level what a selective recompute keeps, then per level what it runs again
    (``Blocks``' S and G)."""
    c = NodeCosts.of(exact.problem).by(exact.group_of, exact.num_coarse)
    return np.column_stack((c.compute_s, c.forward_s, c.params, c.activations, c.returned,
                            c.selective, c.selective_again_s))


def chain_segments(exact: Coarsening, sums: np.ndarray) -> tuple[list[list[int]], list[list[int]]]:
    """The groups that count, cut into segments at the separators, in order, and every
    group's predecessors; the light groups that some separator is not comparable with
    get their sums zeroed (in ``sums``)."""
    G = exact.num_coarse
    preds, succs = neighbours(exact)
    ancestors = [0] * G  # bit sets; groups are numbered in a topological order
    for g in range(G):
        for a in preds[g]:
            ancestors[g] |= ancestors[a] | (1 << a)
    descendants = [0] * G
    for g in range(G - 1, -1, -1):
        for b in succs[g]:
            descendants[g] |= descendants[b] | (1 << b)
    # What a group runs again selectively is left out: SAC's host time puts a share of it
    # on every node a stage dispatches, views too, which would leave no group light (and
    # the segments too long to enumerate). A light group's sums, that one among them, are
    # zeroed, which only lowers the bound.
    weighed = sums[:, :sums.shape[1] - len(exact.problem.keep_levels)]
    totals = np.maximum(weighed.sum(axis=0), 1e-300)
    light = np.all(weighed <= LIGHT * totals, axis=1)
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


def predecessor_masks(segment: list[int], preds: list[list[int]]) -> tuple[int, ...]:
    """Per group of the segment, the bits of its predecessors in it (a predecessor outside
    it is in every ideal that reaches it)."""
    local = {g: i for i, g in enumerate(segment)}
    return tuple(sum(1 << local[a] for a in preds[g] if a in local) for g in segment)


def enumerate_ideals(masks: tuple[int, ...], sums: np.ndarray
                     ) -> tuple[list[int], np.ndarray] | None:
    """(bits, sums (ideals, ``group_sums``)) of every ideal of a segment (``masks[i]``: the bits of
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
