"""Two consecutive rounds of an interleaved split re-cut together, across every GPU.

In interleaved 1F1B, GPU g runs stage g of each round of N stages, so its load is the
sum of one block per round. The search's other moves (``interleave.py``) re-cut a few
stages at a time, each cut within a few groups of where it is; on Llama-3-8B, v = 2 onto
8, they stopped at 423.9 ms where a split of 420.5 ms exists (CP-SAT found it in 600 s):
it moves the cut between the rounds by 48 groups and the other cuts by up to 47 at once.

This move re-cuts rounds r and r + 1 over the span [lo, hi) they hold, every cut free
within REACH groups of where it is and the cut s between them within MIDDLE_REACH, the
other rounds' stages fixed. Whether some such split keeps every GPU at or under a time T
is a dynamic program over the GPUs in order:

    after GPU g, for each place a of round r's cut, the furthest place b that round
    r + 1's cut can reach with every GPU so far at or under T (time and memory); GPU g
    then takes round r's block [a, a') and round r + 1's block [b, b'), for each a'
    the furthest b' that fits.

Furthest is best: a later cut leaves the later GPUs less of the round, and round r + 1's
blocks hold hundreds of groups, so taking at least one never binds. (Round r's blocks
may be a few groups, which is why they, not round r + 1's, index the table.) A block's
time and memory grow with its end but for the cut's own transfers and the values kept
past it, so the table reads them as running maxima along the end: it may miss a split,
never accept one over T.
For each s, nearest the current one first, where some split meets the best T so far, T
steps down by 3 % until none does and is then bisected; the split found is the
furthest-cut one at the least T.

Legend: N GPUs, r the first of the two rounds, s the cut between them, a and b places of
the cuts of rounds r and r + 1, T a time every GPU must meet, z a recompute choice.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from fxpipe.partition.prices import Prices

__all__ = ["recut_rounds"]

REACH = 48  # groups each cut of the two rounds may move: most of a transformer layer
MIDDLE_REACH = 24  # groups the cut between the rounds may move (per move; it repeats)
BISECTIONS = 10  # halvings of a 3 % step of the time T: to 0.003 %
MAX_STEPS_DOWN = 100  # 3 % steps down from the slowest GPU, at most: to 5 % of it
# Time (s) and memory (bytes) offsets that keep the rows of a block table apart when
# they are searched as one sorted array (larger than any block's price).
_ROW_APART = (1e3, 1e16)


def recut_rounds(prices: Prices, stage: Sequence[tuple[Any, ...]], cuts: Sequence[int],
                 gap: int, r: int, now: float) -> list[int] | None:
    """The cuts of a split whose rounds r and r + 1 are re-cut together (the module
    docstring) with every GPU faster than ``now``, the least such T found; None when
    none is, or ``now`` is not a time (inf: some GPU does not fit). ``stage``: each
    stage's prices at ``cuts`` (``Prices.block``); ``gap``: 1 where no stage may be
    empty."""
    if not 0 < now < math.inf:  # nothing to lower, or no GPU's time to start from
        return None
    rounds = _Rounds(prices, stage, cuts, gap, r)
    best: tuple[float, int, list[Any]] | None = None
    for s in rounds.middle_order():
        high = (best[0] if best is not None else now) * (1 - 1e-9)
        found = rounds.fits(high, s)
        if found is None:
            continue
        low = high
        for _ in range(MAX_STEPS_DOWN):  # down in steps of 3 % to a T that fails
            low *= 0.97
            tighter = rounds.fits(low, s)
            if tighter is None:
                break
            high, found = low, tighter
        for _ in range(BISECTIONS):
            mid = (low + high) / 2
            tighter = rounds.fits(mid, s)
            if tighter is None:
                low = mid
            else:
                high, found = mid, tighter
        best = (high, s, found)
    return None if best is None else rounds.cuts_of(best[1], best[2])


class _Rounds:
    """The places each cut of the two rounds may take, their blocks priced, and the
    dynamic program over them."""

    def __init__(self, prices: Prices, stage: Sequence[tuple[Any, ...]],
                 cuts: Sequence[int], gap: int, r: int) -> None:
        p = prices.problem
        self.N = N = p.devices
        self.cuts, self.gap, self.r = list(cuts), gap, r
        self.limit = p.memory_limit
        self.options = range(len(prices.options))
        first, second = [r * N + g for g in range(N)], [(r + 1) * N + g for g in range(N)]
        self.lo, self.hi = cuts[r * N], cuts[(r + 2) * N]
        middle = cuts[(r + 1) * N]
        self.middle = np.arange(max(self.lo + gap * N, middle - MIDDLE_REACH),
                                min(self.hi - gap * N, middle + MIDDLE_REACH) + 1)
        # places of round r's cuts after GPU g (a), and of round r + 1's (b), g = 0..N
        self.a = [np.array([self.lo]), *(self._near(j) for j in first[1:]), self.middle]
        self.b = [self.middle, *(self._near(j) for j in second[1:]), np.array([self.hi])]
        # per GPU g, per recompute choice: (time, memory) of its block of each round
        self.first = [prices.pairs(j, self.a[g], self.a[g + 1], gap)
                      for g, j in enumerate(first)]
        second_prices = [prices.pairs(j, self.b[g], self.b[g + 1], gap)
                         for g, j in enumerate(second)]
        self.rising = [[_rising(h[2 * z], h[2 * z + 1]) for z in self.options]
                       for h in second_prices[:-1]]
        last = second_prices[-1]  # its blocks all end at hi
        self.last = [(last[2 * z][:, 0], last[2 * z + 1][:, 0]) for z in self.options]
        # per GPU: the recompute choices of its two blocks worth trying, each with its
        # other stages' (time, memory) under theirs: every combination, or only none
        # recomputing (the first, the fastest) where that fits whatever the blocks
        moving = {*first, *second}
        self.choices: list[list[tuple[int, int, float, float]]] = []
        for d in range(N):
            held = [[(float(stage[j][2 * z][0]), float(stage[j][2 * z + 1][0]))
                     for z in self.options] for j in prices.on[d] if j not in moving]
            every = [(z1, z2, sum(t for t, _ in pick), sum(m for _, m in pick))
                     for z1, z2 in itertools.product(self.options, self.options)
                     for pick in itertools.product(*held)]
            z1, z2, _, m0 = every[0]
            most = (_most(self.first[d][2 * z1], self.first[d][2 * z1 + 1])
                    + _most(second_prices[d][2 * z2], second_prices[d][2 * z2 + 1]) + m0)
            self.choices.append(every[:1] if most <= self.limit else every)

    def _near(self, j: int) -> Any:
        """The places cut j (before stage j) may take."""
        return np.arange(max(self.lo + self.gap, self.cuts[j] - REACH),
                         min(self.hi - self.gap, self.cuts[j] + REACH) + 1)

    def middle_order(self) -> list[int]:
        """Indices of ``middle``, nearest the current cut first."""
        distance = np.abs(self.middle - self.cuts[(self.r + 1) * self.N])
        return [int(i) for i in np.argsort(distance, kind="stable")]

    def fits(self, T: float, s: int) -> list[Any] | None:
        """The dynamic program at time T with the rounds' cut at ``middle[s]``: per GPU,
        the table's back pointers (see ``cuts_of``); None when no split meets T."""
        N, gap, limit = self.N, self.gap, self.limit
        reach = np.array([s])  # over a[0]: the index in b[0] of round r + 1's cut
        back: list[Any] = []
        for g in range(N - 1):
            live = reach >= 0
            at = np.where(live, reach, 0)
            furthest = np.full((at.size, self.a[g + 1].size), -1)
            for z1, z2, t0, m0 in self.choices[g]:
                time, memory, first_end = self.rising[g][z2]
                t_left = T - t0 - self.first[g][2 * z1]
                m_left = limit - m0 - self.first[g][2 * z1 + 1]
                end = np.minimum(_within(time, at, t_left, _ROW_APART[0]),
                                 _within(memory, at, m_left, _ROW_APART[1])) - 1
                furthest = np.maximum(furthest, np.where(end >= first_end[at][:, None], end, -1))
            # round r's cut leaves room for a block on each GPU after g
            room = self.a[g + 1] <= self.middle[s] - gap * (N - 1 - g)
            furthest = np.where(live[:, None] & room[None, :], furthest, -1)
            came = np.argmax(furthest, axis=0)
            reach = furthest[came, np.arange(came.size)]
            back.append((came, reach))
        # the last GPU: round r's block ends at the middle cut, round r + 1's at hi
        live = reach >= 0
        at = np.where(live, reach, 0)
        ok = np.zeros(at.size, dtype=bool)
        for z1, z2, t0, m0 in self.choices[N - 1]:
            time, memory = self.last[z2]
            ok |= ((self.first[N - 1][2 * z1][:, s] + time[at] + t0 <= T)
                   & (self.first[N - 1][2 * z1 + 1][:, s] + memory[at] + m0 <= limit))
        ok &= live
        if not ok.any():
            return None
        return [*back, int(np.argmax(ok))]

    def cuts_of(self, s: int, back: list[Any]) -> list[int]:
        """The split the back pointers of ``fits`` at ``middle[s]`` lead to."""
        N, r = self.N, self.r
        cuts = list(self.cuts)
        a = back[-1]  # index in a[N - 1] of round r's last cut
        for g in range(N - 2, -1, -1):
            came, reach = back[g]
            cuts[r * N + g + 1] = int(self.a[g + 1][a])
            cuts[(r + 1) * N + g + 1] = int(self.b[g + 1][reach[a]])
            a = int(came[a])
        cuts[(r + 1) * N] = int(self.middle[s])
        return cuts


def _most(time: Any, memory: Any) -> float:
    """The largest memory of a table's valid blocks (finite time); -inf where none is."""
    valid = np.isfinite(time)
    return float(memory[valid].max()) if valid.any() else -math.inf


def _rising(time: Any, memory: Any) -> tuple[Any, Any, Any]:
    """A table of blocks (starts, ends) as running maxima along the end over its valid
    blocks (finite time), -inf before them, and each start's first valid end."""
    valid = np.isfinite(time)
    rising = [np.maximum.accumulate(np.where(valid, a, -np.inf), axis=1) for a in (time, memory)]
    first = np.where(valid.any(axis=1), np.argmax(valid, axis=1), time.shape[1])
    return rising[0], rising[1], first


def _within(rows: Any, at: Any, budget: Any, apart: float) -> Any:
    """Per (i, k): how many entries of the non-decreasing row ``rows[at[i]]`` are at most
    ``budget[i, k]``: one sorted search over the rows laid end to end, each shifted by
    ``apart`` from the one before (values clipped within a quarter of it)."""
    row = np.arange(at.size)[:, None]
    bound = apart / 4
    laid = (np.clip(rows[at], -bound, bound) + row * apart).ravel()
    asked = np.clip(budget, -bound, bound) + row * apart
    return np.searchsorted(laid, asked, side="right") - row * rows.shape[1]
