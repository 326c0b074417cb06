"""Repairing a split the search did not prove: moving cuts between neighbouring stages.

A search stopped by its work or time limit (CP-SAT FEASIBLE, or the interval DP's split
standing within GAP of the bound) answers with the first split it found at its best
bottleneck, and may leave a GPU with next to nothing beside GPUs with twice its share.
GPT-2 XL onto 32 GPUs: the LM head alone (8.13 ms) is the bottleneck no split lowers,
stage 0 holds the token embedding (1.06 ms, no FLOPs) and 18 stages two layers each
(7.91 ms).

``repair`` works on the split's contiguous form along the exact groups' order
(``interleave.cuts_of``: the split itself when it is contiguous), with two moves, each
at most SWEEPS sweeps over the cuts:

    balance   the pair move of ``interleave.py``: each cut where the slower of its two
              GPUs is fastest, so work flows from loaded stages to idle ones; often
              through the middle of a layer, where wider values cross
    settle    from the balanced split, each cut where its two GPUs together take the
              least time (the cheapest cut, so the fewest bytes sent), neither past the
              slowest GPU's time; among cuts within TOLERANCE of that, where the slower
              of the two is fastest (``settle``, ``cheapest_cut``)

The first of the two ``evaluate`` calls better (``better``) is the answer:

    valid     no ordering edge goes back, co-located nodes together (``violations``)
    fits      every GPU within the memory limit
    faster    its slowest GPU faster (beyond TOLERANCE); or as fast, a step
              (``Estimate.iteration_s``) no longer, and the GPU times, sorted from the
              slowest, lexicographically smaller (beyond TOLERANCE)

GPT-2 XL onto 32: balancing alone gives every GPU 4.1 ms or more but sends more per
step (1233.8 ms against 1231.5); settled, stage 0 holds the embedding and the first
layer (5.0 ms), six stages two layers, the step 1231.501 ms (was 1231.511), the peak
memory 11.1 GiB instead of 12.9; in 0.9 s. Llama-3-70B onto 32 (the interval DP's split
within GAP): the step 0.06 % shorter, one stage no longer recomputed in full; 1.8 s.

``partition`` runs it only on a split not proved optimal; a split proved OPTIMAL is
never touched. Its work is 2 x SWEEPS x the exact groups blocks priced per recompute
choice, numpy-vectorised per cut. Deterministic: no clock, no randomness.

Legend: K stages, N GPUs (see problem.py); xs the positions a cut may take.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fxpipe.partition.coarsen import Coarsening
from fxpipe.partition.evaluate import Evaluation, evaluate, violations
from fxpipe.partition.interleave import cuts_of, pair_sweeps
from fxpipe.partition.problem import Problem

__all__ = ["SWEEPS", "TOLERANCE", "better", "cheapest_cut", "gpu_times", "repair", "settle"]

# Sweeps of the pair move over every cut: GPT-2 XL onto 32 GPUs settles after 5.
SWEEPS = 8
# Relative to the slowest GPU: a time this close to another is the same time (sums in
# another order differ in their last bits; a move that wins nothing is not taken).
TOLERANCE = 1e-9


def repair(exact: Coarsening, stage_of: Sequence[int], *, sweeps: int = SWEEPS
           ) -> Evaluation | None:
    """A better split than ``stage_of`` (a stage per fine node of ``exact.problem``) some
    pair moves away, by ``better``, with its evaluation; None when the moves find none.
    Replicated stages are left as they are: the moves price one GPU a stage."""
    p = exact.problem
    if p.replicates:
        return None
    before = evaluate(p, stage_of)
    balanced = pair_sweeps(exact, cuts_of(exact, exact.restrict(stage_of)), sweeps=sweeps)
    settled = None if balanced is None else settle(exact, balanced, sweeps=sweeps)
    for found in (balanced, settled):
        if found is None:
            continue
        split = exact.expand(found)
        if split == tuple(stage_of) or violations(p, split):
            continue
        after = evaluate(p, split)
        if better(p, after, before):
            return after
    return None


def settle(c: Coarsening, start: Sequence[int], *, sweeps: int) -> tuple[int, ...] | None:
    """From the contiguous split ``start``, each cut in turn moved to its cheapest place
    (``cheapest_cut``), at most ``sweeps`` sweeps over the cuts; None when it ends in a
    split that does not fit."""
    return pair_sweeps(c, start, sweeps=sweeps, rule=cheapest_cut)


def cheapest_cut(loads: list[Any], xs: Any, here: int, slowest: float) -> int | None:
    """``settle``'s rule (an ``interleave.Rule``): where the cut's GPUs together take the
    least time, neither past the slowest GPU's load as the sweeps began; among places
    within TOLERANCE of that, where the slower of the two is fastest, then the earliest;
    when that saves time, or as much with the slower faster."""
    slower = np.maximum.reduce(loads)
    total = np.where(slower <= slowest, np.add.reduce(loads), np.inf)
    tolerance = TOLERANCE * slowest
    cheap = total <= total.min() + tolerance
    best = int(np.lexsort((xs, np.where(cheap, slower, np.inf)))[0])
    if total[best] < total[here] - tolerance or (total[best] <= total[here] + tolerance
                                                 and slower[best] < slower[here] - tolerance):
        return best
    return None


def better(problem: Problem, after: Evaluation, before: Evaluation) -> bool:
    """Whether ``after`` fits and either has the faster slowest GPU (beyond TOLERANCE),
    or one no slower, a step no longer, and GPU times that, sorted from the slowest, are
    lexicographically smaller (beyond TOLERANCE)."""
    if not after.estimate.fits or after.bottleneck_s > before.bottleneck_s:
        return False
    tolerance = TOLERANCE * before.bottleneck_s
    if after.bottleneck_s < before.bottleneck_s - tolerance:
        return True
    step, was = after.estimate.iteration_s, before.estimate.iteration_s
    if step > was + TOLERANCE * was:
        return False
    for new, old in zip(sorted(gpu_times(problem, after), reverse=True),
                        sorted(gpu_times(problem, before), reverse=True), strict=True):
        if abs(new - old) > tolerance:
            return new < old
    return False


def gpu_times(problem: Problem, evaluation: Evaluation) -> list[float]:
    """Per GPU, the time of its stage modules per micro-batch (``step_estimate``'s)."""
    times = [0.0] * (problem.num_stages // problem.virtual_stages)
    for j, stage in enumerate(evaluation.stages):
        times[problem.device_of(j)] += stage.time_s
    return times
