"""When no split fits: what the best split needs, and what would fit instead.

``infeasible`` words the error ``partition`` raises. Every figure in it is one a user can
act on: the memory of the leanest split found (``min_memory``), the fewest GPUs on which
the interval DP finds a split that fits (``fewest_gpus``), recompute where it is off; each
checked by a search that, when it finds a split, finds one that really fits, after lower
bounds (``heaviest_group``, the parameters' state) have ruled out what cannot fit at all.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import replace

from fxpipe.partition.baselines import baselines as run_baselines
from fxpipe.partition.baselines import interval_dp, leanest_dp
from fxpipe.partition.coarsen import Coarsening, exact_groups
from fxpipe.partition.coarsen import coarsen as coarsen_graph
from fxpipe.partition.cost import NodeCosts, memory_parts
from fxpipe.partition.errors import InfeasibleMemoryError
from fxpipe.partition.evaluate import evaluate, violations
from fxpipe.partition.grain import block_grain
from fxpipe.partition.ilp import StageModel
from fxpipe.partition.problem import Problem, Recompute
from fxpipe.plan import StageRecompute

__all__ = ["dp_fits", "fewest_gpus", "heaviest_group", "infeasible", "memory_floor", "min_memory",
           "unadvised"]

# Placement variables up to which CP-SAT's memory program looks for a leaner split than the
# interval DP's when nothing fits (see min_memory).
MEMORY_SOLVE_MAX = 4_000
# How far the fewest-GPUs search looks: up to this many times the GPUs it starts from (at
# least 8). Beyond, the answer is no advice a user takes, and the interval DP grows with
# the stage count (Llama-3-70B without recompute: 1 s at 256 stages, 150 s at 4,096).
SEARCH_FACTOR = 8


def min_memory(problem: Problem, exact: Coarsening, *, work_limit: float, time_limit_s: float,
               workers: int) -> float:
    """The per-device memory of the leanest valid split found, so that "allow that much
    memory" is always advice that works: the leanest contiguous split of the exact groups'
    order (``leanest_dp``, bounded by the baselines' leanest) and, on a problem small
    enough (MEMORY_SOLVE_MAX), CP-SAT's memory program hinted with it, which also finds
    splits no one order holds. Beyond that size the program takes seconds to build and
    did worse than the DP in its work limit (Llama-3-8B onto 8 GPUs: 14 s, 31.5 GiB
    against the DP's 25.3 GiB in 0.6 s)."""
    found = [split for split in run_baselines(problem, exact).values()
             if not violations(problem, split)]
    upper = min((float(evaluate(problem, split).estimate.max_memory) for split in found),
                default=math.inf)
    lean = _leanest_over_blocks(problem, exact, upper)
    if lean is not None:  # a real split: the leanest over the exact groups is no fatter
        found.append(lean)
        # (the DP's sums are not rounded to whole bytes per part as evaluate's are)
        upper = min(upper, float(evaluate(problem, lean).estimate.max_memory) * (1 + 1e-9))
    bounded = replace(problem, memory_limit=upper)  # no block beyond the leanest so far
    lean = leanest_dp(Coarsening(bounded, exact.group_of, exact.groups, exact.order_edges))
    if lean is not None:
        found.append(exact.expand(lean))
    if exact.num_coarse * problem.num_stages <= MEMORY_SOLVE_MAX:
        model = StageModel(exact, objective="memory", hint=lean)
        result = model.solve(work_limit=work_limit, time_limit_s=time_limit_s, workers=workers)
        if result.stage_of is not None:
            found.append(result.stage_of)
        elif not found:
            return result.bound
    assert found, "a contiguous split of the order always exists"
    return min(float(evaluate(problem, split).estimate.max_memory) for split in found)


def _leanest_over_blocks(problem: Problem, exact: Coarsening, upper: float
                         ) -> tuple[int, ...] | None:
    """The leanest contiguous split whose cuts fall at block ends (``grain.py``), a stage
    per node, within ``upper`` bytes: its memory bounds the exact groups' leanest, whose
    DP it prunes (405B onto 128: 177 GiB against the baselines' 223, a third of the
    DP's work saved; the same split found). None without a block grain."""
    grain = block_grain(exact)
    if grain is None:
        return None
    bounded = replace(problem, memory_limit=upper)
    lean = leanest_dp(Coarsening(bounded, grain.group_of, grain.groups, grain.order_edges))
    split = grain.expand(lean) if lean is not None else None
    return split if split is not None and not violations(problem, split) else None


def infeasible(problem: Problem, exact: Coarsening, *, work_limit: float,
               time_limit_s: float, workers: int, count_gpus: bool = True
               ) -> InfeasibleMemoryError:
    """The error for a problem no split of fits: what the best split needs, and what would
    fit instead (more GPUs, recompute), each checked by the interval DP (fast, and a split
    it finds fits for sure) after the lower bounds (``heaviest_group``, ``memory_floor``,
    the block bound) have ruled out what cannot fit without any search. ``count_gpus``:
    whether to search the fewest GPUs one pipeline fits on (not where the caller counts
    them its own way: the layout search, as the job runs)."""
    needed = min_memory(problem, exact, work_limit=work_limit,
                        time_limit_s=max(1.0, time_limit_s / 2), workers=workers)
    recompute = None
    if problem.recompute in (Recompute.NONE, Recompute.SELECTIVE) and dp_fits(
            replace(problem, recompute=Recompute.AUTO)):
        recompute = Recompute.AUTO.value
    name, alone = heaviest_group(problem, exact)
    if alone > problem.memory_limit:  # no stage can hold it, whatever the GPU count
        return InfeasibleMemoryError(devices=problem.devices, limit=problem.memory_limit,
                                     needed=needed, recompute=recompute, alone=(name, alone))
    fits_on, at_least, searched = (_fewest_gpus(problem, needed) if count_gpus
                                   else (None, None, None))
    return InfeasibleMemoryError(devices=problem.devices, limit=problem.memory_limit,
                                 needed=needed, fits_on=fits_on, at_least=at_least,
                                 recompute=recompute, searched=searched,
                                 microbatches=problem.microbatches)


def dp_fits(problem: Problem) -> bool:
    """Whether the interval DP finds a split of ``problem`` within its memory limit: fast
    (no CP-SAT), and a split it finds fits for sure, so a fix it confirms is real. First
    over the model's blocks (``grain.py``: a few hundred for a transformer of thousands
    of groups), then, where none of those splits fits, over the capped coarse graph."""
    exact = exact_groups(problem)
    if exact.num_coarse < problem.num_stages:
        return False
    grain = block_grain(exact)
    if grain is not None and interval_dp(grain) is not None:
        return True
    return interval_dp(coarsen_graph(problem, base=exact)) is not None


def heaviest_group(problem: Problem, exact: Coarsening) -> tuple[str, float]:
    """The exact group (named by its largest node, and that node's block) that needs the
    most memory on a stage of its own, and those bytes: its parameters with their state,
    its saved activations and returned values for one micro-batch, its backward transient
    and the workspace, and the loss for a group every other one leads to (it ends the
    last stage, which cannot be empty). Every stage that holds it needs at least that,
    whatever the split and the number of GPUs (every sum of the stage cost formula only
    grows with more nodes and more micro-batches in flight)."""
    best = ("", 0.0)
    sink = _sink(exact)
    costs = NodeCosts.of(problem).by(exact.group_of, exact.num_coarse)
    for g, group in enumerate(exact.groups):
        parts = memory_parts(
            problem, problem.num_stages - 1 if g == sink else -1, flight=1,
            recompute=StageRecompute.NONE, params=int(costs.params[g]),
            activations=int(costs.activations[g]), received=0,
            kept=int(costs.returned[g]), transient=int(costs.transient[g]))
        needs = float(sum(parts.values()))
        if needs > best[1]:
            nodes = [problem.nodes[v] for v in group]
            top = max(nodes, key=lambda n: (n.param_bytes, n.activation_bytes))
            best = (f"op {top.name} of {top.module}" if top.module else f"op {top.name}",
                    needs)
    return best


def _sink(exact: Coarsening) -> int | None:
    """The group every other group leads to, which the last stage holds whatever the split
    when no stage may be empty; None when there is none (or stages may be empty)."""
    G = exact.num_coarse
    if G == 0 or exact.problem.allow_empty_stages:
        return None
    preds: list[list[int]] = [[] for _ in range(G)]
    for a, b in exact.order_edges:
        preds[b].append(a)
    seen, stack = {G - 1}, [G - 1]  # the groups are in a topological order
    while stack:
        for a in preds[stack.pop()]:
            if a not in seen:
                seen.add(a)
                stack.append(a)
    return G - 1 if len(seen) == G else None


def fewest_gpus(problem: Problem) -> int | None:
    """The fewest GPUs on which the interval DP finds a split of ``problem`` that fits, more
    than ``problem.devices`` (which must not fit); None when no count is found (up to
    ``SEARCH_FACTOR`` times more), at once when ``heaviest_group`` proves that none can."""
    if heaviest_group(problem, exact_groups(problem))[1] > problem.memory_limit:
        return None
    return _fewest_gpus(problem)[0]


def _fewest_gpus(problem: Problem, needed: float | None = None
                 ) -> tuple[int | None, int | None, int | None]:
    """(fits_on, at_least, searched): the fewest GPUs (one stage each) on which the
    interval DP finds a split that fits, searched from what the parameters alone need
    (``memory_floor``, which also proves that fewer than ``at_least`` GPUs cannot fit), up
    to ``SEARCH_FACTOR`` times that, by doubling, then bisecting. Given ``needed``, the
    memory the best split onto ``problem.devices`` GPUs needs, the search starts from the
    count that spreads it within the limit (``_from_guess``: Llama-3-70B onto 16 takes 2
    DP runs of 0.7 s instead of 6). (The block bound is no shortcut here: without a
    bottleneck to prune its blocks, it takes longer than the DP on counts where memory
    does not bind.) fits_on is None when no count up to ``searched`` fits (``searched``
    None: up to one GPU per exact group, the most there can be), at_least None when the
    parameters rule out no count (and all three for interleaved or replicated plans,
    where the stage count is not the GPU count)."""
    if problem.virtual_stages > 1 or problem.replicates:
        return None, None, None
    limit = problem.memory_limit - problem.workspace_bytes
    if limit <= 0:
        return None, None, None
    groups = exact_groups(problem).num_coarse

    @functools.cache
    def fits(n: int) -> bool:
        return dp_fits(replace(problem, num_stages=n, num_devices=0))

    state = max(1.0, problem.state_factor) * problem.param_bytes
    floor = math.ceil(state / limit) - 1  # n GPUs hold state / n each: n <= floor cannot fit
    at_least = floor + 1 if floor >= problem.devices else None
    lo = max(problem.devices, floor)  # lo does not fit (or is asked)
    most = min(groups, SEARCH_FACTOR * max(lo, 8))
    searched = most if most < groups else None
    if lo >= most:
        return None, at_least, searched
    if needed is not None and math.isfinite(needed):
        guess = math.ceil(problem.devices * needed / problem.memory_limit)
        found = _from_guess(fits, lo, min(max(lo + 1, guess), most), most)
        if found is not None:
            return found, at_least, None
    hi = min(max(lo + 1, 2 * lo), most)
    while not fits(hi):
        if hi == most:
            return None, at_least, searched
        lo, hi = hi, min(2 * hi, most)
    return _bisect(fits, lo, hi), at_least, None


def _from_guess(fits: Callable[[int], bool], lo: int, guess: int, most: int) -> int | None:
    """The fewest count that fits, found by stepping 1, 2, 4, ... away from ``guess``
    (down while counts fit, else up) until one count fits and the one below does not;
    None when none fits from ``guess`` up to ``most``. The counts that fit need not reach
    ``most`` (in 1F1B the first stage keeps as many micro-batches as there are stages),
    so a guess above them all finds none, and the caller searches up from ``lo``."""
    hi, step = guess, 1
    if fits(hi):
        while hi - step > lo:
            if not fits(hi - step):
                lo = hi - step
                break
            hi, step = hi - step, 2 * step
    else:
        while True:
            if hi == most:
                return None
            lo, hi, step = hi, min(hi + step, most), 2 * step
            if fits(hi):
                break
    return _bisect(fits, lo, hi)


def _bisect(fits: Callable[[int], bool], lo: int, hi: int) -> int:
    """The fewest count in (lo, hi] that fits, given that hi fits and lo does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def memory_floor(problem: Problem) -> float:
    """Memory some GPU needs whatever the split: the parameters with their gradients and
    optimizer state (``cost.py``: params x max(1, state_factor)), spread evenly over the
    N GPUs or the largest node's alone, plus the workspace. Activations only add."""
    per_byte = max(1.0, problem.state_factor)
    largest = max((n.param_bytes for n in problem.nodes), default=0)
    return problem.workspace_bytes + per_byte * max(problem.param_bytes / problem.devices,
                                                    largest)


def unadvised(problem: Problem, exact: Coarsening, *, work_limit: float,
              time_limit_s: float, workers: int) -> InfeasibleMemoryError:
    """``infeasible`` without working out what would fit: the memory the bounds prove
    some GPU needs, for a caller that asks many problems (the layout search)."""
    return InfeasibleMemoryError(devices=problem.devices, limit=problem.memory_limit,
                                 needed=max(memory_floor(problem),
                                            heaviest_group(problem, exact)[1]))
