"""Blocks of an order priced per stage, and GPUs' loads from their stages' prices.

The search over splits of the exact groups' order where GPUs share stage modules
(``interleave.py``, ``rounds.py``) prices a stage on the block [start, end) of the order
as the interval DP prices it (``baselines.Blocks``: the stage cost formula with cut
communication, received and kept values, the loss, the backward transient), plus the
copies of tied parameters and their all-reduces, once per recompute choice; and a
GPU's time as the sum over its stage modules with its fastest recompute choice that fits.
Many blocks are priced at once: a row or a column (``block``), or a grid of starts and
ends (``pairs``).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np

from fxpipe.partition.baselines import Blocks
from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import NodeCosts, memory_parts, prefix_sums, recompute_options
from fxpipe.partition.problem import TiedPolicy, stage_deferred, stage_flights

__all__ = ["Prices"]


class Prices:
    """Blocks of the order priced per stage, and GPUs' loads from their stages' prices."""

    def __init__(self, c: Coarsening) -> None:
        self.problem = p = c.problem
        self.blocks = Blocks.of(c)
        self.priced = 0  # blocks priced so far (see PRICE_BUDGET)
        self.sparse: Any = None  # built by _sparse on first use
        self.flights = stage_flights(p)
        self.waiting = stage_deferred(p)
        self.options = recompute_options(p)
        self.deferred = prefix_sums(NodeCosts.of(p).by(c.group_of, c.num_coarse).deferred)
        sends = sorted((a, hi, size) for hi, a, size in self.blocks.sends)
        self.send_from = np.array([s[0] for s in sends], dtype=np.int64)
        self.send_to = np.array([s[1] for s in sends], dtype=np.int64)
        self.send_bytes = np.array([s[2] for s in sends], dtype=float)
        self.on = [[j for j in range(p.num_stages) if p.device_of(j) == d]
                   for d in range(p.devices)]
        # Replicated tied parameters: (sorted positions of their readers, bytes, all-reduce
        # seconds); ``Blocks`` counts their bytes at the first reader only.
        self.tied = [] if p.tied_policy is TiedPolicy.COLOCATE else [
            (np.array(sorted({c.group_of[v] for v in t.nodes})), t.param_bytes, t.allreduce_s)
            for t in p.tied]

    def _kept(self, starts: Any, ends: Any) -> Any:
        """Bytes produced in [start, end) and read at or after end, per pair (one end of
        the pairs fixed): each value counts for the ends after its producer up to its
        last reader."""
        a, b, size = self.send_from, self.send_to, self.send_bytes
        if np.all(ends == ends[0]):
            end = int(ends[0])
            alive = (b >= end) & (a < end)
            held = np.bincount(a[alive], weights=size[alive], minlength=end + 1)
            after = np.cumsum(held[::-1])[::-1]  # after[x]: produced in [x, end)
            return after[starts]
        assert np.all(starts == starts[0]), "one end of the blocks is fixed"
        start, last = int(starts[0]), int(ends.max())
        alive = a >= start
        change = np.zeros(last + 2)
        np.add.at(change, np.minimum(a[alive] + 1, last + 1), size[alive])
        np.add.at(change, np.minimum(b[alive] + 1, last + 1), -size[alive])
        return np.cumsum(change)[ends]

    def block(self, j: int, starts: Any, ends: Any) -> tuple[Any, ...]:
        """Stage j on [start, end), per pair: (time, memory) per recompute choice, in
        ``self.options`` order, flattened."""
        self.priced += starts.size
        return self._priced(j, starts, ends, self._kept(starts, ends), self._peak(starts, ends))

    def pairs(self, j: int, starts: Any, ends: Any, gap: int) -> tuple[Any, ...]:
        """``block`` for every start y of ``starts`` and end x of ``ends`` at once, shaped
        (starts, ends): inf in time (and no memory) where y > x - ``gap`` (no stage)."""
        ok = starts[:, None] <= ends[None, :] - gap
        self.priced += int(ok.sum())
        kept, peak = self._kept_grid(starts, ends), self._peak(starts[:, None], ends[None, :])
        grid = np.broadcast_arrays(starts[:, None], ends[None, :])
        priced = self._priced(j, grid[0], grid[1], kept, peak)
        return tuple(np.where(ok, a, np.inf if i % 2 == 0 else 0.0)
                     for i, a in enumerate(priced))

    def _kept_grid(self, starts: Any, ends: Any) -> Any:
        """``_kept`` for every start and end at once, (starts, ends) shaped: the bytes of
        the values made at a and last read at b with start <= a < end <= b. (Bytes are
        whole numbers: summed in any order, the same as ``_kept``'s. ``_kept`` stays the
        one-dimensional form: the sweeps price a row or a column at a time, where a grid
        would cost rows times columns.)"""
        lo = int(starts.min())
        hi = max(lo, int(ends.max()))
        made = (self.send_from >= lo) & (self.send_from < hi)
        a, b, size = self.send_from[made], self.send_to[made], self.send_bytes[made]
        order = np.argsort(ends, kind="stable")
        first = np.searchsorted(ends[order], a, side="right")  # the ends after a
        last = np.maximum(np.searchsorted(ends[order], b, side="right"), first)  # up to b
        change = np.zeros((hi - lo + 1, ends.size + 1))  # per a, along the ends
        np.add.at(change, (a - lo, first), size)
        np.add.at(change, (a - lo, last), -size)
        at_a = np.cumsum(change, axis=1)[:, :-1]
        from_a = np.cumsum(at_a[::-1], axis=0)[::-1]  # made at a or later
        kept = np.empty((starts.size, ends.size))
        kept[:, order] = from_a[np.clip(starts - lo, 0, hi - lo)]
        return kept

    def _peak(self, starts: Any, ends: Any) -> Any:
        """The largest backward transient in [start, end), per pair (starts and ends
        broadcast together), 0 where empty: the larger of the maxima of the two halving
        ranges (``_sparse``) that cover it."""
        table = self._sparse()
        s, e = np.broadcast_arrays(starts, ends)
        length = np.maximum(e - s, 1)
        level = np.frexp(length)[1] - 1  # floor(log2(length))
        right = np.clip(e - (1 << level), 0, table.shape[1] - 1)
        left = np.clip(s, 0, table.shape[1] - 1)
        peak = np.maximum(table[level, left], table[level, right])
        return np.where(e > s, peak, 0.0)

    def _sparse(self) -> Any:
        """table[k, i]: the largest backward transient of the blocks' groups [i, i + 2^k)
        (clipped at the end of the order)."""
        if self.sparse is None:
            grad = np.asarray(self.blocks.grad, dtype=float)
            rows = [grad]
            while (1 << len(rows)) <= grad.size:
                half = 1 << (len(rows) - 1)
                prev = rows[-1]
                rows.append(np.maximum(prev, np.append(prev[half:], np.zeros(half))))
            self.sparse = np.array(rows)
        return self.sparse

    def _priced(self, j: int, starts: Any, ends: Any, kept: Any, peak: Any
                ) -> tuple[Any, ...]:
        """``block`` with the bytes produced in each block and read after it (``_kept``)
        and its largest backward transient (``_peak``) given."""
        p, x = self.problem, self.blocks
        params = np.maximum(x.P[ends] - x.P0[starts], 0.0)
        kept = kept + x.R[ends] - x.R[starts]
        seconds = (np.maximum(x.T[ends] - x.T0[starts], 0.0)
                   + x.cut[starts] + x.cut[ends])
        for readers, size, allreduce in self.tied:  # a copy where a reader is, summed
            inside = (np.searchsorted(readers, ends, side="left")
                      - np.searchsorted(readers, starts, side="left"))
            first = (starts <= readers[0]) & (readers[0] < ends)
            params = params + size * ((inside > 0) & ~first)
            seconds = seconds + allreduce * ((inside > 0) & (inside < readers.size))
        out: list[Any] = []
        for recompute in self.options:
            parts = memory_parts(
                p, j, flight=self.flights[j], params=params,
                activations=np.maximum(x.A[ends] - x.A0[starts], 0.0),
                received=x.cut_bytes[starts], kept=kept, transient=peak,
                recompute=recompute.mode, deferred=self.deferred[ends] - self.deferred[starts],
                waiting=self.waiting[j], selective=x.selective(recompute, ends, starts))
            out += [seconds + x.run_again(recompute, ends, starts), sum(parts.values())]
        return tuple(out)

    def gpu(self, d: int, stage: list[tuple[Any, ...]], trial: dict[int, tuple[Any, ...]]
            ) -> Any:
        """GPU d's time with its fastest recompute choice that fits, inf where none fits;
        its stages priced by ``trial`` where given, else by ``stage``."""
        fixed = [[(float(stage[j][2 * z][0]), float(stage[j][2 * z + 1][0]))
                  for z in range(len(self.options))] for j in self.on[d] if j not in trial]
        moving = [trial[j] for j in self.on[d] if j in trial]
        # The fixed stages' choices as (time, memory) pairs, then the moving ones on top.
        sums = [(sum(t for t, _ in pick), sum(m for _, m in pick))
                for pick in itertools.product(*fixed)]
        limit = self.problem.memory_limit
        best: Any = np.inf
        for choice in itertools.product(range(len(self.options)), repeat=len(moving)):
            time = sum((h[2 * z] for h, z in zip(moving, choice, strict=True)), start=0.0)
            memory = sum((h[2 * z + 1] for h, z in zip(moving, choice, strict=True)), start=0.0)
            for t, m in sums:
                best = np.minimum(best, np.where(memory + m <= limit, time + t, np.inf))
        return np.atleast_1d(best)
