"""Two rounds of an interleaved split, or the two arms of a V, re-cut at once on every GPU.

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

A V (ZB-V, DualPipeV: stage j and K - 1 - j on GPU j) is the same with the second arm
walked from its end (``_Vee``): the table keeps the least place of that arm's cut, and
the two arms meet on the last GPU, which tries every middle cut itself, so there is no
loop over it.

Legend: N GPUs, r the first of the two rounds, s the cut between them, a and b places of
the cuts of rounds r and r + 1, T a time every GPU must meet, z a recompute choice.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fxpipe.partition.baselines import bisect_least
from fxpipe.partition.prices import Prices

__all__ = ["recut_rounds", "recut_vee"]

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
        least = _least(functools.partial(rounds.fits, s=s),
                       (best[0] if best is not None else now) * (1 - 1e-9))
        if least is not None:
            best = (least[0], s, least[1])
    return None if best is None else rounds.cuts_of(best[1], best[2])


def recut_vee(prices: Prices, stage: Sequence[tuple[Any, ...]], cuts: Sequence[int],
              gap: int, now: float) -> list[int] | None:
    """``recut_rounds`` for a V (ZB-V, DualPipeV: stage j and K - 1 - j on GPU j): the
    two rounds walked from both ends at once (``_Vee``)."""
    if not 0 < now < math.inf:
        return None
    vee = _Vee(prices, stage, cuts, gap)
    least = _least(vee.fits, now * (1 - 1e-9))
    return None if least is None else vee.cuts_of(least[1])


def _least(fits: Callable[[float], Any], high: float) -> tuple[float, Any] | None:
    """The least time T, to BISECTIONS halvings of a 3 % step below ``high``, at which
    ``fits`` finds a split, and what it returned there; None when it finds none at
    ``high``."""
    found = fits(high)
    if found is None:
        return None
    low = high
    for _ in range(MAX_STEPS_DOWN):  # down in steps of 3 % to a T that fails
        low *= 0.97
        tighter = fits(low)
        if tighter is None:
            break
        high, found = low, tighter
    return bisect_least(fits, low, high, found, halvings=BISECTIONS)


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
        lo, hi = cuts[r * N], cuts[(r + 2) * N]
        self.middle = _places(cuts[(r + 1) * N], MIDDLE_REACH, lo + gap * N, hi - gap * N)
        near = [_places(cut, REACH, lo + gap, hi - gap) for cut in cuts]
        # places of round r's cuts after GPU g (a), and of round r + 1's (b), g = 0..N
        self.a = [np.array([lo]), *(near[j] for j in first[1:]), self.middle]
        self.b = [self.middle, *(near[j] for j in second[1:]), np.array([hi])]
        # per GPU g, per recompute choice: (time, memory) of its block of each round
        self.first = [prices.pairs(j, self.a[g], self.a[g + 1], gap)
                      for g, j in enumerate(first)]
        second_prices = [prices.pairs(j, self.b[g], self.b[g + 1], gap)
                         for g, j in enumerate(second)]
        self.rising = [[_rising(h[2 * z], h[2 * z + 1]) for z in self.options]
                       for h in second_prices[:-1]]
        last = second_prices[-1]  # its blocks all end at hi
        self.last = [(last[2 * z][:, 0], last[2 * z + 1][:, 0]) for z in self.options]
        moving = {*first, *second}
        self.choices = [_choices(prices, stage, moving, d, _most(self.first[d])
                                 + _most(second_prices[d])) for d in range(N)]

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
                end = _fitting(time, memory, at, t_left, m_left) - 1
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


class _Vee:
    """``_Rounds`` for a V: GPU g runs stage g, on [a_g, a_g+1), and stage K - 1 - g, on
    [b_g+1, b_g), b the cuts from the end (b_0 = hi); the last GPU runs the two stages
    that meet at the middle cut m. The table keeps, per place of a after GPU g, the
    least b reachable: furthest from the end. No loop over the middle cut: the last GPU
    tries every m between its a and b."""

    def __init__(self, prices: Prices, stage: Sequence[tuple[Any, ...]],
                 cuts: Sequence[int], gap: int) -> None:
        p = prices.problem
        self.N = N = p.devices
        self.K = K = p.num_stages
        self.cuts, self.gap, self.limit = list(cuts), gap, p.memory_limit
        options = range(len(prices.options))
        lo, hi = cuts[0], cuts[K]
        near = [_places(cut, REACH, lo + gap, hi - gap) for cut in cuts]
        self.a = [np.array([lo]), *(near[g] for g in range(1, N))]
        self.b = [np.array([hi]), *(near[K - g] for g in range(1, N))]
        self.middle = near[N]
        # GPU g < N - 1: stage g on (a[g], a[g + 1]); stage K - 1 - g on (b[g + 1], b[g]),
        # read per end b[g] with its starts from the last down (furthest first)
        self.first = [prices.pairs(g, self.a[g], self.a[g + 1], gap) for g in range(N - 1)]
        second = [prices.pairs(K - 1 - g, self.b[g + 1], self.b[g], gap)
                  for g in range(N - 1)]
        self.rising = [[_rising(h[2 * z].T[:, ::-1], h[2 * z + 1].T[:, ::-1])
                        for z in options] for h in second]
        # the last GPU: stage N - 1 on (a[N - 1], middle), stage N on (middle, b[N - 1])
        self.left = prices.pairs(N - 1, self.a[N - 1], self.middle, gap)
        self.right = prices.pairs(N, self.middle, self.b[N - 1], gap)
        tables = [*zip(self.first, second, strict=True), (self.left, self.right)]
        self.choices = [_choices(prices, stage, {d, K - 1 - d}, d,
                                 _most(tables[d][0]) + _most(tables[d][1]))
                        for d in range(N)]

    def fits(self, T: float) -> list[Any] | None:
        """The dynamic program at time T: per GPU, the table's back pointers (see
        ``cuts_of``); None when no split meets T."""
        N, gap, limit = self.N, self.gap, self.limit
        reach = np.array([0])  # over a[0]: the index in b[0] of the cut from the end
        back: list[Any] = []
        for g in range(N - 1):
            live = reach >= 0
            at = np.where(live, reach, 0)
            size = self.b[g + 1].size
            least = np.full((at.size, self.a[g + 1].size), size)  # size: none fits
            for z1, z2, t0, m0 in self.choices[g]:
                time, memory, first_valid = self.rising[g][z2]
                t_left = T - t0 - self.first[g][2 * z1]
                m_left = limit - m0 - self.first[g][2 * z1 + 1]
                count = _fitting(time, memory, at, t_left, m_left)
                start = np.where(count - 1 >= first_valid[at][:, None], size - count, size)
                least = np.minimum(least, start)
            # the two cuts must not cross: the stages between them need room
            place = self.b[g + 1][np.minimum(least, size - 1)]
            place = np.maximum(place, self.a[g + 1][None, :] + gap * 2 * (N - 1 - g))
            ends = self.b[g][at][:, None]
            ok = live[:, None] & (least < size) & (place <= ends - gap) & (
                place <= self.b[g + 1][-1])
            index = np.where(ok, place - self.b[g + 1][0], size)
            came = np.argmin(index, axis=0)
            best = index[came, np.arange(came.size)]
            reach = np.where(best < size, best, -1)
            back.append((came, reach))
        # the last GPU: its two stages meet at some middle cut between its a and b
        live = reach >= 0
        at = np.where(live, reach, 0)
        ok = np.zeros((at.size, self.middle.size), dtype=bool)
        for z1, z2, t0, m0 in self.choices[N - 1]:
            ok |= ((self.left[2 * z1] + self.right[2 * z2][:, at].T + t0 <= T)
                   & (self.left[2 * z1 + 1] + self.right[2 * z2 + 1][:, at].T + m0 <= limit))
        ok &= live[:, None]
        if not ok.any():
            return None
        a, m = np.unravel_index(int(np.argmax(ok)), ok.shape)
        return [*back, (int(a), int(m))]

    def cuts_of(self, back: list[Any]) -> list[int]:
        """The split the back pointers of ``fits`` lead to."""
        N, K = self.N, self.K
        cuts = list(self.cuts)
        a, m = back[-1]
        cuts[N] = int(self.middle[m])
        for g in range(N - 2, -1, -1):
            came, reach = back[g]
            cuts[g + 1] = int(self.a[g + 1][a])
            cuts[K - g - 1] = int(self.b[g + 1][reach[a]])
            a = int(came[a])
        return cuts


def _choices(prices: Prices, stage: Sequence[tuple[Any, ...]], moving: set[int], d: int,
             most: float) -> list[tuple[int, int, float, float]]:
    """GPU d's recompute choices (z1, z2) of its two moving blocks worth trying, each with
    its other stages' (time, memory) under theirs: every combination, or only the first
    (none recomputing where the policy allows: the fastest) where that fits whatever the
    blocks (``most``: the largest memory the two blocks can have under it)."""
    options = range(len(prices.options))
    held = [[(float(stage[j][2 * z][0]), float(stage[j][2 * z + 1][0])) for z in options]
            for j in prices.on[d] if j not in moving]
    every = [(z1, z2, sum(t for t, _ in pick), sum(m for _, m in pick))
             for z1, z2 in itertools.product(options, options)
             for pick in itertools.product(*held)]
    return every[:1] if most + every[0][3] <= prices.problem.memory_limit else every


def _most(table: tuple[Any, ...]) -> float:
    """The largest memory of a table's valid blocks (finite time) under its first
    recompute choice; -inf where none is valid."""
    time, memory = table[0], table[1]
    valid = np.isfinite(time)
    return float(memory[valid].max()) if valid.any() else -math.inf


def _rising(time: Any, memory: Any) -> tuple[Any, Any, Any]:
    """A table of blocks (starts, ends) as running maxima along the end over its valid
    blocks (finite time), -inf before them, and each start's first valid end."""
    valid = np.isfinite(time)
    rising = [np.maximum.accumulate(np.where(valid, a, -np.inf), axis=1) for a in (time, memory)]
    first = np.where(valid.any(axis=1), np.argmax(valid, axis=1), time.shape[1])
    return rising[0], rising[1], first


def _places(cut: int, reach: int, lo: int, hi: int) -> Any:
    """The places a cut at ``cut`` may take: within ``reach`` of it, in [lo, hi]."""
    return np.arange(max(lo, cut - reach), min(hi, cut + reach) + 1)


def _fitting(time: Any, memory: Any, at: Any, t_left: Any, m_left: Any) -> Any:
    """Per (i, k): how many entries of the rising rows ``time[at[i]]`` and
    ``memory[at[i]]`` (``_rising``) are within ``t_left[i, k]`` and ``m_left[i, k]``
    both."""
    return np.minimum(_within(time, at, t_left, _ROW_APART[0]),
                      _within(memory, at, m_left, _ROW_APART[1]))


def _within(rows: Any, at: Any, budget: Any, apart: float) -> Any:
    """Per (i, k): how many entries of the non-decreasing row ``rows[at[i]]`` are at most
    ``budget[i, k]``: one sorted search over the rows laid end to end, each shifted by
    ``apart`` from the one before (values clipped within a quarter of it)."""
    row = np.arange(at.size)[:, None]
    bound = apart / 4
    laid = (np.clip(rows[at], -bound, bound) + row * apart).ravel()
    asked = np.clip(budget, -bound, bound) + row * apart
    return np.searchsorted(laid, asked, side="right") - row * rows.shape[1]
