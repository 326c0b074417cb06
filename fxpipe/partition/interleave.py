"""A warm start for stage modules that share GPUs: moving cuts between two GPUs' loads.

When a GPU runs several stage modules (interleaved: stage j on GPU j % N; V-placed:
stage j and K - 1 - j on one GPU), its time and memory are the sums over its modules,
so the interval DP's min-max over stages is not the problem's, and CP-SAT on thousands
of exact groups x stages finds little within its work limit (Llama-3-8B, 16 modules on
8 GPUs: 0.503 s against about 0.42 s possible).

The search works on contiguous splits of the exact groups' order (valid pipelines by
construction): a split is its cuts c_0 = 0 < c_1 < ... < c_K = n, stage j the block
[c_j, c_j+1). Four moves, each taken only when it lowers the slowest GPU it touches, so
the GPU times, sorted from the slowest, decrease lexicographically and the search ends:

    pair    moving cut c_j+1 only changes stage j and j + 1, so only their two GPUs'
            loads: put it where the slower of the two is fastest (ties: the smaller
            difference, then the earlier position). Sweeping the cuts in order, work
            flows from a slow GPU along the chain to where there is slack, within a
            round of stages and across rounds.
    window  where pair moves stall on big ops (a 21.5 ms matmul moved from GPU 5 to 6
            makes 6 the slower), re-cut up to N consecutive stages (on distinct GPUs)
            around the slowest GPU at once: the min-max DP over the window's GPUs, their
            other stages fixed, each inner cut within REACH groups of where it is.
    rounds  where windows stall too (every GPU within a small op of the slowest, the
            stages outside the window fixed), re-cut the same w < N consecutive GPUs
            in two consecutive rounds at once (interleaved only: stages s..s+w-1 and
            s+N..s+N+w-1): the min-max DP over the GPUs in order, its state the pair of
            cuts after a GPU, one per round, each within ROUNDS_REACH groups of where
            it is. Work then moves between rounds on each GPU while it moves along the
            chain of GPUs, which balances what single-round moves leave uneven.
    whole   where those stall too, and only from the best split of all the starts:
    rounds  re-cut two consecutive rounds (the two arms of a V) across every GPU at
            once, every cut free within about a layer's groups (``rounds.py``).
            Seconds per move where the others take milliseconds; on Llama-3-8B,
            v = 2, it reaches 420.9 ms where they stop at 423.9.

Each GPU takes its fastest recompute choice that fits (``cost.choose_recompute``'s
rule). Blocks are priced like the interval DP prices them (``baselines.Blocks``: the
stage cost formula with cut communication, received and kept values, the loss, the
backward transient) plus the copies of tied parameters and their all-reduces;
``evaluate`` has the last word on the split found. Deterministic: no clock, no
randomness. ``repair.py`` moves single cuts too (``pair_sweeps``), on any split.

Legend: n exact groups in order, K stages, N GPUs, c the cuts, x a candidate position
for one cut, z a recompute choice.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.cost import NodeCosts
from fxpipe.partition.evaluate import evaluate, violations
from fxpipe.partition.prices import Prices
from fxpipe.partition.rounds import recut_rounds, recut_vee

__all__ = ["Rule", "cuts_of", "pair_sweeps", "round_profiles", "shared_gpu_search",
           "shared_gpu_warm_start", "slower_fastest"]

MAX_SWEEPS = 400  # sweeps over every cut; each strictly improves or the search stops
MAX_ROUNDS = 200  # rounds of sweeps then one window DP (one round or two) that improves
# Blocks priced per search, at most: a deterministic bound on its work on big graphs (the
# HF Llama-3-8B and GPT-2 XL shapes, v = 4 onto 8, take 0.3-0.8 million, 1-3 s).
PRICE_BUDGET = 1_500_000
WINDOW = 8  # consecutive stages (at most N) re-cut together by the window DP
REACH = 48  # groups each cut of the window may move: about a transformer layer's
# Groups each cut of the two-round window may move: its DP has (2 x ROUNDS_REACH + 1)^4
# transitions per GPU; 12 is a quarter to a third of a transformer layer's groups.
ROUNDS_REACH = 12
# Starts besides the candidates': round r of N stages gets a share of the compute in
# proportion to RATIO ** r. Memory favours light early rounds, whose modules keep the most
# micro-batches (Llama-3-8B on 8 GPUs, v = 2: 0.4269 s from 256, 0.474 s from 1); the rest
# are for models where time rather than memory binds.
RATIOS = (1 / 4, 1.0, 4.0, 16.0, 64.0, 256.0)


def shared_gpu_warm_start(c: Coarsening, starts: Sequence[Sequence[int]]
                          ) -> tuple[int, ...] | None:
    """The best split, by ``evaluate``, that ``shared_gpu_search`` reaches from the coarse
    assignments ``starts`` (made contiguous by ``cuts_of``) and from ``round_profiles``,
    then from the best of those with whole rounds re-cut too (``rounds.py``: seconds a
    time, so once); a stage per fine node, None when no search ends in a split that fits."""
    p = c.problem
    best: tuple[float, tuple[int, ...]] | None = None

    def keep(found: tuple[int, ...] | None) -> None:
        nonlocal best
        if found is None:
            return
        split = c.expand(found)
        ev = evaluate(p, split)
        if ev.estimate.fits and not violations(p, split) and (
                best is None or ev.bottleneck_s < best[0]):
            best = (ev.bottleneck_s, split)

    tried: set[tuple[int, ...]] = set()
    for start in [*(cuts_of(c, s) for s in starts), *round_profiles(c)]:
        if start not in tried:
            tried.add(start)
            keep(shared_gpu_search(c, start))
    if best is not None and (p.schedule.spec.interleaved or p.schedule.spec.v_placed):
        keep(shared_gpu_search(c, c.restrict(best[1]), whole_rounds=True))
    return None if best is None else best[1]


def round_profiles(c: Coarsening) -> list[tuple[int, ...]]:
    """Contiguous splits of the order, one per ``RATIOS`` entry: stage j (round j // N)
    takes compute in proportion to RATIO ** (j // N)."""
    p = c.problem
    K, N, n = p.num_stages, p.devices, c.num_coarse
    before = _compute_before(c)
    out = []
    for ratio in RATIOS:
        weight = np.array([ratio ** (j // N) for j in range(K)])
        targets = np.cumsum(weight / weight.sum() * before[-1])[:-1]
        out.append(_contiguous(np.searchsorted(before, targets, side="left"), K, n))
    return out


def shared_gpu_search(c: Coarsening, start: Sequence[int], *, whole_rounds: bool = False
                      ) -> tuple[int, ...] | None:
    """A coarse assignment at least as good, under the DP's pricing, as the contiguous
    split ``start`` (a stage per exact group), found by moving cuts (module docstring),
    whole rounds too when ``whole_rounds``; None when it does not fit and no move does."""
    search = _Search.of(c, start)
    for _ in range(MAX_ROUNDS):
        search.sweep_pairs()
        if search.spent() or not (search.window_around_slowest()
                                  or search.rounds_around_slowest()
                                  or (whole_rounds and search.recut_rounds())):
            break
    return search.assignment()


# Where a cut goes, from its GPUs' loads per position (an array per GPU), the positions,
# its own (an index) and the slowest GPU's load as the sweeps began; None: it stays.
Rule = Callable[[list[Any], Any, int, float], int | None]


def slower_fastest(loads: list[Any], xs: Any, here: int, slowest: float) -> int | None:
    """The pair move's rule: where the slower of the two GPUs is fastest (ties: the
    smaller difference, then the earlier position), when that lowers it."""
    slower = np.maximum.reduce(loads)
    with np.errstate(invalid="ignore"):  # inf - inf where nothing fits
        spread = np.max(loads, axis=0) - np.min(loads, axis=0)
    best = int(np.lexsort((xs, spread, slower))[0])
    return best if slower[best] < slower[here] * (1 - 1e-12) else None


def pair_sweeps(c: Coarsening, start: Sequence[int], *, sweeps: int,
                rule: Rule | None = None) -> tuple[int, ...] | None:
    """Single cuts moved by ``rule`` (default the pair move's) from the contiguous split
    ``start``, at most ``sweeps`` sweeps; None when it ends in a split that does not fit."""
    search = _Search.of(c, start)
    search.sweep_pairs(sweeps, rule)
    return search.assignment()


class _Search:
    """The cuts of a split of the order and its stages' prices, improved in place."""

    @classmethod
    def of(cls, c: Coarsening, start: Sequence[int]) -> _Search:
        """The search from the contiguous split ``start`` (a stage per exact group)."""
        K, n = c.problem.num_stages, c.num_coarse
        assert len(start) == n and all(a <= b for a, b in itertools.pairwise(start))
        return cls(c, [0, *(int(np.searchsorted(np.asarray(start), j, side="left"))
                            for j in range(1, K)), n])

    def __init__(self, c: Coarsening, cuts: list[int]) -> None:
        self.problem = p = c.problem
        self.prices = Prices(c)
        self.cuts = cuts
        self.gap = 0 if p.allow_empty_stages else 1
        # per stage: (time, memory) under each recompute choice, arrays of one position
        self.stage: list[tuple[Any, ...]] = [() for _ in range(p.num_stages)]
        self._price(range(p.num_stages))

    def _price(self, stages: Iterable[int]) -> None:
        """Price ``stages`` afresh at the current cuts."""
        for j in stages:
            self.stage[j] = self.prices.block(j, np.array([self.cuts[j]]),
                                              np.array([self.cuts[j + 1]]))

    def spent(self) -> bool:
        return self.prices.priced > PRICE_BUDGET

    def loads(self) -> list[float]:
        return [float(self.prices.gpu(d, self.stage, {})[0])
                for d in range(self.problem.devices)]

    def assignment(self) -> tuple[int, ...] | None:
        """The coarse assignment of the cuts; None when some GPU's load does not fit."""
        if not np.all(np.isfinite(self.loads())):
            return None
        cuts = self.cuts
        return tuple(j for j in range(self.problem.num_stages)
                     for _ in range(cuts[j], cuts[j + 1]))

    def _set(self, j: int, prices: tuple[Any, ...], at: int) -> None:
        self.stage[j] = tuple(a[at:at + 1] for a in prices)

    def sweep_pairs(self, sweeps: int = MAX_SWEEPS, rule: Rule | None = None) -> None:
        """Move single cuts, each where ``rule`` says (default ``slower_fastest``), until
        it moves none, at most ``sweeps`` times over the cuts."""
        p, cuts, gap = self.problem, self.cuts, self.gap
        rule = rule or slower_fastest
        slowest = max(self.loads())
        for _ in range(sweeps):
            moved = False
            for b in range(1, p.num_stages):
                if self.spent():
                    return
                xs = np.arange(cuts[b - 1] + gap, cuts[b + 1] - gap + 1)
                if xs.size <= 1:
                    continue
                left = self.prices.block(b - 1, np.full(xs.size, cuts[b - 1]), xs)
                right = self.prices.block(b, xs, np.full(xs.size, cuts[b + 1]))
                trial = {b - 1: left, b: right}
                gpus = sorted({p.device_of(b - 1), p.device_of(b)})
                loads = [self.prices.gpu(d, self.stage, trial) for d in gpus]
                best = rule(loads, xs, int(np.flatnonzero(xs == cuts[b])[0]), slowest)
                if best is not None:
                    cuts[b] = int(xs[best])
                    self._set(b - 1, left, best)
                    self._set(b, right, best)
                    moved = True
            if not moved:
                return

    def window_around_slowest(self) -> bool:
        """The window move (module docstring) on windows holding a stage of the slowest
        GPU, until one lowers it: True then."""
        p, K = self.problem, self.problem.num_stages
        loads = self.loads()
        slowest = int(np.argmax(loads))
        w = min(WINDOW, K, p.devices)
        for j in (j for j in range(K) if p.device_of(j) == slowest):
            # the windows ending at, centred on and starting at stage j
            for first in sorted({min(max(0, f), K - w) for f in (j - w + 1, j - w // 2, j)}):
                stages = range(first, first + w)
                gpus = [p.device_of(i) for i in stages]
                if len(set(gpus)) < w or self.spent():
                    continue
                if self._window(stages, max(loads[d] for d in gpus)):
                    return True
        return False

    def _window(self, stages: range, now: float) -> bool:
        """The min-max DP over ``stages``' inner cuts, each within REACH groups of where
        it is; applied when it beats ``now``."""
        p, prices, gap, cuts = self.problem, self.prices, self.gap, self.cuts
        lo, hi = cuts[stages.start], cuts[stages.stop]
        # per inner cut k (after stage k of the window): the positions it may take
        spots = [np.arange(max(lo + gap, cuts[j + 1] - REACH),
                           min(hi - gap, cuts[j + 1] + REACH) + 1) for j in stages[:-1]]
        spots = [np.array([lo]), *spots, np.array([hi])]
        best = [np.zeros(1)]  # best[k][i]: the slowest GPU of stages ..k-1 ending at spots[k][i]
        back: list[Any] = [None]
        for k, j in enumerate(stages, start=1):
            # over (y, x): the GPU's time with stage j on [y, x), inf where none fits
            load = prices.gpu(p.device_of(j), self.stage,
                              {j: prices.pairs(j, spots[k - 1], spots[k], gap)})
            load = np.maximum(load, best[k - 1][:, None])
            came = np.argmin(load, axis=0)
            best.append(load[came, np.arange(spots[k].size)])
            back.append(came)
        if not best[-1][0] < now * (1 - 1e-12):
            return False
        i = 0
        for k in range(len(stages), 1, -1):
            i = int(back[k][i])
            cuts[stages.start + k - 1] = int(spots[k - 1][i])
        self._price(stages)
        return True

    def rounds_around_slowest(self) -> bool:
        """The two-round window move (module docstring) on windows holding a stage of
        the slowest GPU, until one lowers it: True then."""
        p, K, N = self.problem, self.problem.num_stages, self.problem.devices
        if not p.schedule.spec.interleaved or K < 2 * N or N < 3:
            return False
        loads = self.loads()
        slowest = int(np.argmax(loads))
        w = min(WINDOW, N - 1)
        for j in (j for j in range(K - N) if p.device_of(j) == slowest):
            # the windows ending at, centred on and starting at stage j, in its round
            # and the next
            for first in sorted({min(max(0, f), K - N - w) for f in (j - w + 1, j - w // 2, j)}):
                gpus = [p.device_of(i) for i in range(first, first + w)]
                if self.spent():
                    return False
                if self._two_rounds(first, w, max(loads[d] for d in gpus)):
                    return True
        return False

    def _two_rounds(self, first: int, w: int, now: float) -> bool:
        """The min-max DP over the inner cuts of stages first..first+w-1 and of the same
        GPUs' stages a round later, each within ROUNDS_REACH groups of where it is;
        applied when it beats ``now``."""
        p, prices, cuts, N = self.problem, self.prices, self.cuts, self.problem.devices
        # per round: per cut k of the window (k = 0 and w fixed), the positions it may take
        spots = [self._spots(first + r * N, w) for r in (0, 1)]
        best = np.zeros((1, 1))  # best[x0, x1]: the slowest GPU so far, cuts at x0, x1
        back: list[Any] = []
        for k in range(1, w + 1):
            j0, j1 = first + k - 1, first + N + k - 1
            here = [prices.pairs(j, spots[r][k - 1], spots[r][k], self.gap)
                    for r, j in enumerate((j0, j1))]
            # time and memory over (y0, y1, x0, x1): round 0's block on axes 0, 2
            trial = {j0: tuple(a[:, None, :, None] for a in here[0]),
                     j1: tuple(a[None, :, None, :] for a in here[1])}
            load = prices.gpu(p.device_of(j0), self.stage, trial)
            load = np.maximum(load, best[:, :, None, None])
            flat = load.reshape(best.size, -1)
            came = np.argmin(flat, axis=0)
            best = flat[came, np.arange(flat.shape[1])].reshape(load.shape[2:])
            back.append(came.reshape(load.shape[2:]))
        if not best[0, 0] < now * (1 - 1e-12):
            return False
        at = (0, 0)  # (x0, x1) at cut k of the window, from the last
        for k in range(w, 1, -1):
            y0, y1 = divmod(int(back[k - 1][at]), spots[1][k - 1].size)
            at = (y0, y1)
            for r in (0, 1):
                cuts[first + r * N + k - 1] = int(spots[r][k - 1][at[r]])
        self._price((*range(first, first + w), *range(first + N, first + N + w)))
        return True

    def recut_rounds(self) -> bool:
        """The move of ``rounds.py`` on each two consecutive rounds (the two arms of a
        V), until one lowers the slowest GPU: True then."""
        p, N, K = self.problem, self.problem.devices, self.problem.num_stages
        now = max(self.loads())
        if p.schedule.spec.v_placed and K == 2 * N:
            tries = [functools.partial(recut_vee, self.prices, self.stage, self.cuts,
                                       self.gap, now)]
        elif p.schedule.spec.interleaved and K >= 2 * N:
            tries = [functools.partial(recut_rounds, self.prices, self.stage, self.cuts,
                                       self.gap, r, now) for r in range(K // N - 1)]
        else:
            return False
        for recut in tries:
            if self.spent():
                return False
            cuts = recut()
            if cuts is None:
                continue
            kept, self.cuts[:] = list(self.cuts), cuts
            self._price(range(K))
            if max(self.loads()) < now:
                return True
            self.cuts[:] = kept  # not expected: the table keeps every GPU within T < now
            self._price(range(K))
        return False

    def _spots(self, first: int, w: int) -> list[Any]:
        """The positions of cuts first..first+w of the two-round window: its end cuts
        where they are, the inner ones within ROUNDS_REACH groups of where they are."""
        cuts, gap = self.cuts, self.gap
        lo, hi = cuts[first], cuts[first + w]
        inner = [np.arange(max(lo + gap, cuts[i] - ROUNDS_REACH),
                           min(hi - gap, cuts[i] + ROUNDS_REACH) + 1)
                 for i in range(first + 1, first + w)]
        return [np.array([lo]), *inner, np.array([hi])]


def cuts_of(c: Coarsening, coarse: Sequence[int]) -> tuple[int, ...]:
    """A contiguous split of ``c``'s order close to the coarse assignment ``coarse``: stage
    j starts where the order's compute reaches that of the groups ``coarse`` puts before
    j (``coarse`` itself when it is already contiguous)."""
    K, n = c.problem.num_stages, c.num_coarse
    if all(a <= b for a, b in itertools.pairwise(coarse)):
        return tuple(coarse)
    before = _compute_before(c)
    per_stage = np.bincount(np.asarray(coarse), weights=np.diff(before), minlength=K)
    return _contiguous(np.searchsorted(before, np.cumsum(per_stage)[:-1], side="left"), K, n)


def _compute_before(c: Coarsening) -> Any:
    """before[i]: the compute of the order's groups [0, i)."""
    compute = NodeCosts.of(c.problem).by(c.group_of, c.num_coarse).compute_s
    return np.concatenate(([0.0], np.cumsum(compute)))


def _contiguous(starts: Any, K: int, n: int) -> tuple[int, ...]:
    """The coarse assignment whose stage j >= 1 starts near ``starts[j - 1]``, every stage
    holding a group when there are enough (K <= n)."""
    bounds = [0]
    for j, start in enumerate(starts.tolist(), start=1):
        bounds.append(min(max(start, bounds[-1] + 1), n - (K - j)) if n >= K
                      else min(max(start, bounds[-1]), n))  # (a sum's rounding can pass n)
    bounds.append(n)
    return tuple(j for j in range(K) for _ in range(bounds[j], bounds[j + 1]))
