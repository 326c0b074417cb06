"""``partition``: baselines, coarsening, warm start, CP-SAT, and an honest report.

The steps, each in its own module:

    exact_groups ─► baselines ─► interval DP ─► CP-SAT (exact groups, hinted, 5% of the
                                                 work): proved? that is the answer
                                      │ not proved
                                      ▼
                     coarsen (cap total/4K) ─► CP-SAT (coarse) ─► best split
                                                                      │
                      GPUs with several stage modules: moving cuts between their loads
                                      (interleave.py) from the best splits ─► best split
                                                                      │
                              CP-SAT (exact groups, hinted, T <= best, stages fixed by it)
                                                                      │ not proved
                                 moving cuts between neighbours (repair.py) ─► the answer

On a big exact program (BOUND_FIRST) the block bound (``bound.py``) runs beside the
interval DP first, and where the DP's split is within PROVED of it (GAP on a program too
big for CP-SAT to help, LARGE_MODEL; any gap on one far too big, HUGE_MODEL) no CP-SAT
solve runs.

The last solve works on the exact groups, so the bound and gap it proves are for
the real problem, and whatever the coarse graph lost is won back there. Where it does
not prove its answer, the block bound (one GPU per stage) or the shared-GPU bound
(``bound.py``) may prove more. Where GPUs run several stage modules and the exact
program is large (SHARED_LARGE), neither exact solve runs: the search's split and the
shared-GPU bound are the answer.

With more GPUs than stages allowed (``Problem.num_devices`` > ``num_stages``, PipeDream's
replicated stages), the one-stage-per-GPU answer above comes first; then one CP-SAT
program per stage count K = N-1 .. 1 chooses the cuts and the replicas per stage
together, each asked only for splits faster than the best so far:

    N stages, one GPU each ─► K = N-1 stages, sum r = N ─► ... ─► K = 1 (data parallel)
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field, replace

from fxpipe.forked import Forked
from fxpipe.partition.baselines import baselines as run_baselines
from fxpipe.partition.baselines import interval_dp
from fxpipe.partition.bound import block_bound, shared_gpu_bound, trivial_bound
from fxpipe.partition.coarsen import Coarsening, exact_groups
from fxpipe.partition.coarsen import coarsen as coarsen_graph
from fxpipe.partition.errors import (
    InfeasibleMemoryError,
    NoSolutionError,
    ProblemTooLargeError,
    TooManyStagesError,
)
from fxpipe.partition.evaluate import Evaluation, evaluate, violations
from fxpipe.partition.ilp import IlpResult, StageModel
from fxpipe.partition.interleave import shared_gpu_warm_start
from fxpipe.partition.nothing_fits import heaviest_group, memory_floor, min_memory, unadvised
from fxpipe.partition.nothing_fits import infeasible as nothing_fits
from fxpipe.partition.problem import Problem
from fxpipe.partition.reach import largest_block
from fxpipe.partition.repair import repair
from fxpipe.partition.verdict import PROVED, exact_report, replicated_report
from fxpipe.plan import Estimate, SolverReport

__all__ = [
    "MAX_NODES",
    "InfeasibleMemoryError",
    "NoSolutionError",
    "Partition",
    "ProblemTooLargeError",
    "TooManyStagesError",
    "check_size",
    "partition",
]


DP_MAX_NODES = 1000  # exact groups up to which the interval DP warm start runs anyway
WORK_LIMIT = 10.0  # CP-SAT deterministic time for one partition (about seconds when quiet)
COARSE_SHARE = 0.25  # of the work limit, for the solve on the capped coarse graph
PROOF_SHARE = 0.05  # of the work limit, for trying to prove the interval DP's split first
PROOF_MAX_GROUPS = 4 * DP_MAX_NODES  # exact groups up to which that is tried
# Placement variables (exact groups x stages) beyond which CP-SAT finds nothing within the
# work limit (Llama-3-70B onto 32 GPUs, 5,177 x 32: both solves UNKNOWN, 50 s building
# them): there the interval DP's split stands when the block bound is within GAP of it.
LARGE_MODEL = 40_000
# Placement variables from which the block bound is tried beside the interval DP before
# any CP-SAT solve: building the exact program alone takes a second there. Transformers'
# Llama-3-8B onto 8 (1,946 x 8): CP-SAT proves the DP's split in 1.7 s; the bound, beside
# the DP, proves it within PROVED in 0.9 s.
BOUND_FIRST = 10_000
# Placement variables beyond which no CP-SAT solve runs at all where one GPU runs each
# stage: the interval DP's split stands, with the block bound's gap, however wide, and
# where the DP finds none, no split was found. Building the programs alone takes tens of
# seconds there, and they found nothing: Llama-3-405B at bf16-mixed onto 32 stages
# (6,830 x 32), 129 s of CP-SAT left the DP's split and its 1.65 % gap as they were; onto
# 128 (x 128), 773 s and 6.4 GiB left its 36.3 %; GPipe's Transformer-L at 2,975 layers
# onto 128 in 16 GiB, where the DP found no split, grew past 21.5 GB building one.
HUGE_MODEL = 200_000
SHARED_STARTS = 2  # best candidates the shared-GPU search starts from (besides its own)
# Placement variables beyond which, where GPUs run several stage modules, CP-SAT on the
# exact groups neither proves nor improves the shared-GPU search's split within the work
# limit, so the exact solves are skipped there: UNKNOWN in every run on the HF Llama-3-8B
# and GPT-2 XL shapes onto 8 GPUs, interleaved v = 2 and 4 and ZB-V (32,000-67,000; half
# of partition()'s time or more) and on bench/partition_graphs.py's synthetic graph, v = 2,
# at 12,800 and 19,200; at 1,600-6,400 they found better splits or bounds.
SHARED_LARGE = 10_000
# Placement variables up to which, where GPUs run several stage modules, the exact
# program is the only CP-SAT solve, given the whole work limit and started from the
# shared-GPU search's split. The first exact solve (5 % of the work) and the coarse one
# (25 %) proved nothing there that one solve does not: on the 48 zoo families whose ZB-V
# plans took over 5 s (536-1,830), as many proved OPTIMAL (25), 6 splits were faster and
# none slower, and partition() took 647 s instead of 798 (BENCHMARKS.md).
SHARED_SMALL = 2_000
GAP = 0.01
# The solver's memory grows with the op count (the ops' costs, their groups, the interval
# DP's and block bound's rows, CP-SAT on the coarse graph): OP_BYTES an op, about what
# GPipe's Transformer-L at 1,663 layers (36,589 ops) took, 0.8 GiB at its peak in all.
# Checked before any solving.
MAX_NODES = 200_000
OP_BYTES = 16 * 1024
# Reachability (which ops precede which, ``reach.py``) keeps a matrix per block between two
# ops no value skips (bool, then int64: 9 bytes a pair), growing with the square of the
# largest block: a transformer's are a dozen ops; a graph with a skip over all of it is one
# block, and 100,000 ops in one died allocating 74.5 GiB.
MAX_BLOCK = 20_000


def check_size(num_nodes: int) -> None:
    """Refuse a graph whose solve would exhaust memory, before any work on it."""
    if num_nodes > MAX_NODES:
        raise ProblemTooLargeError(nodes=num_nodes, most=MAX_NODES,
                                   needs_bytes=OP_BYTES * num_nodes)


def check_blocks(problem: Problem) -> None:
    """Refuse a graph whose largest block between two ops no value skips is too long for
    its reachability matrix (MAX_BLOCK), before any work on it."""
    edges = [(e.src, e.dst) for e in problem.edges if e.ordered and e.src != e.dst]
    n = len(problem.nodes)
    block = largest_block(n, edges) if all(a < b for a, b in edges) else n
    if block > MAX_BLOCK:
        raise ProblemTooLargeError(nodes=n, most=MAX_BLOCK, needs_bytes=9 * block**2,
                                   block=block)


@dataclass(frozen=True)
class Partition:
    stage_of: tuple[int, ...]  # stage per node of the problem
    problem: Problem  # the problem solved (its num_stages: the stages chosen)
    report: SolverReport
    evaluation: Evaluation
    baselines: dict[str, Estimate] = field(default_factory=dict)
    baseline_splits: dict[str, tuple[int, ...]] = field(default_factory=dict)
    coarse_nodes: int = 0  # nodes of the capped coarse graph (first solve)
    phases: tuple[IlpResult, ...] = ()  # the CP-SAT runs, in order


def _check_stage_count(problem: Problem, exact: Coarsening) -> None:
    n, K = len(problem.nodes), problem.num_stages
    if problem.allow_empty_stages:
        return
    if n < K or exact.num_coarse < K:
        raise TooManyStagesError(stages=K, nodes=n, groups=exact.num_coarse,
                                 devices=problem.devices, virtual_stages=problem.virtual_stages)


def partition(problem: Problem, *, work_limit: float = WORK_LIMIT, time_limit_s: float = 120.0,
              coarsen: bool = True, workers: int = 2, replicate: bool = False,
              advise: bool = True, quick: bool = False, bound_s: float | None = None,
              hint: tuple[int, ...] | None = None, count_gpus: bool = True) -> Partition:
    """Split ``problem`` into ``problem.num_stages`` pipeline stages, minimising the
    bottleneck stage time within the memory limit.

    ``replicate`` (implied when ``problem.num_devices`` > ``num_stages``): any number of
    stages K <= N = ``problem.devices``, the N GPUs shared among them (PipeDream's
    replicated stages); the answer's ``problem`` has the K chosen.

    ``work_limit`` bounds CP-SAT in deterministic time (about seconds, quiet), so the
    answer is the same at any load; ``time_limit_s`` of wall clock is a safety net, and
    the report says when it fired (``SolverReport.wall_clock_stopped``).

    Raises ``ProblemTooLargeError`` / ``TooManyStagesError`` / ``InfeasibleMemoryError`` /
    ``NoSolutionError`` (all ``ValueError``) with a one-sentence message for the user.
    The layout search: ``advise=False`` says only that nothing fits (``unadvised``);
    ``count_gpus=False`` advises but for the fewest GPUs (it counts layouts); ``quick``
    stops at the DP and the block bound; ``bound_s`` (a lower bound the caller proved,
    where a split of the relaxation fits: the block bound's), ``hint`` (a split that fits)
    stand in."""
    check_size(len(problem.nodes))
    check_blocks(problem)
    if replicate or problem.replicates:
        return _partition_replicated(problem, work_limit=work_limit, time_limit_s=time_limit_s,
                                     coarsen=coarsen, workers=workers)
    start = time.perf_counter()
    deadline = start + time_limit_s
    exact = exact_groups(problem)
    infeasible = functools.partial(  # the error, when no split fits
        functools.partial(nothing_fits, count_gpus=count_gpus) if advise else unadvised,
        problem, exact, work_limit=work_limit, time_limit_s=time_limit_s, workers=workers)
    _check_stage_count(problem, exact)
    if (memory_floor(problem) > problem.memory_limit
            or heaviest_group(problem, exact)[1] > problem.memory_limit):
        # Proved in no time: the full search would spend its time limit proving it again.
        raise infeasible()

    splits, scored, candidates = _baselines(problem, exact)
    bound_s, dp_first = _unbounded(problem, exact, candidates, bound_s=bound_s, hint=hint)
    if bound_s == math.inf:  # not even the block bound's relaxation fits: proved
        raise infeasible()
    lower, settled, prepared = _bound_first(problem, exact, candidates, prepare=not quick,
                                            bound_s=bound_s, hint=hint, dp_done=dp_first)
    if quick and lower is None:  # a problem too small to bound first: its DP all the same
        _add_dp_split(problem, exact, candidates)
    huge = _huge(problem, exact)  # no CP-SAT at all: the DP's split stands, or none
    settled = settled or quick or huge
    if lower == math.inf:  # not even the block bound's relaxation fits: proved
        raise infeasible()
    level = exact  # the coarse graph is not needed when the bound settles it
    if settled:  # CP-SAT would not help
        phases: list[IlpResult] = []
        result = _not_run(exact)
    else:
        level, phases, result = _search(
            problem, exact, candidates, coarsen=coarsen,
            dp_done=_bounded_first(problem, exact),
            work_limit=work_limit, deadline=deadline, workers=workers, prepared=prepared)
    best = min(candidates, key=lambda c: c[0])[1] if candidates else None
    if result.stage_of is not None:
        found = evaluate(problem, result.stage_of)
        if best is None or found.bottleneck_s <= evaluate(problem, best).bottleneck_s:
            best = result.stage_of
    if best is None:
        if result.status == "INFEASIBLE":
            raise infeasible()
        # nothing proved: what a limit that surely fits would be is still advice to act on
        leanest = min_memory(problem, exact, work_limit=work_limit,
                             time_limit_s=max(1.0, time_limit_s / 2), workers=workers)
        raise NoSolutionError(devices=problem.devices, work_limit=work_limit,
                              time_limit_s=time_limit_s, limit=problem.memory_limit,
                              wall_clock=any(p.wall_clock_stopped for p in phases),
                              leanest=leanest if leanest > problem.memory_limit else None,
                              too_big=_placements(problem, exact) if huge else None)

    evaluation = evaluate(problem, best)
    if lower is None and result.status not in ("OPTIMAL", "INFEASIBLE"):  # not yet proved
        lower = block_bound(exact, upper_s=evaluation.bottleneck_s)
        if lower is None:
            lower = shared_gpu_bound(exact, upper_s=evaluation.bottleneck_s)
    report = exact_report(problem, exact, evaluation, result, phases, start=start,
                           lower=lower)
    if report.status != "OPTIMAL":  # not proved: neighbours may still share out work
        repaired = repair(exact, best)
        if repaired is not None:
            best, evaluation = repaired.stage_of, repaired
            report = exact_report(problem, exact, evaluation, result, phases,
                                   start=start, lower=lower)
    return Partition(
        stage_of=tuple(best),
        problem=problem,
        report=replace(report, method="interval-dp") if settled else report,
        evaluation=evaluation,
        baselines={name: ev.estimate for name, ev in scored.items()},
        baseline_splits=splits,
        coarse_nodes=level.num_coarse,
        phases=tuple(phases),
    )


def _unbounded(problem: Problem, exact: Coarsening,
               candidates: list[tuple[float, tuple[int, ...]]], *, bound_s: float | None,
               hint: tuple[int, ...] | None) -> tuple[float | None, bool]:
    """Where memory binds every baseline (no ``candidates``), nothing bounds the interval
    DP nor the block bound. On a big program (BOUND_FIRST) the DP first, its split added
    to ``candidates`` to bound the bound (405B onto 128 stages in 160 GiB: 9.7 -> 5.9 s);
    where it finds none, the block bound, which may prove that no split fits (inf;
    CP-SAT: its whole limit) and stands in for _bound_first's. A bound given is one the
    caller proved, with a split of the relaxation that fits: not computed again. Returns
    the bound (``bound_s``, the one computed, or None) and whether the DP ran."""
    dp_first = (not candidates and bound_s is None and hint is None
                and _bounded_first(problem, exact))
    if dp_first:
        _add_dp_split(problem, exact, candidates)
    if bound_s is None and not candidates:
        bound_s = block_bound(exact)
    return bound_s, dp_first


def _baselines(problem: Problem, exact: Coarsening) -> tuple[
    dict[str, tuple[int, ...]], dict[str, Evaluation], list[tuple[float, tuple[int, ...]]]
]:
    """Every baseline's split, its evaluation, and (bottleneck, split) of those that fit
    and are valid: the first candidates for the warm start."""
    splits = run_baselines(problem, exact)
    scored = {name: evaluate(problem, s) for name, s in splits.items()}
    candidates = [
        (ev.bottleneck_s, s) for s, ev in zip(splits.values(), scored.values(), strict=True)
        if ev.estimate.fits and not violations(problem, s)
    ]
    return splits, scored, candidates


def _bounded_first(problem: Problem, exact: Coarsening) -> bool:
    """Whether the exact program is big enough for the block bound to run before CP-SAT
    (see BOUND_FIRST)."""
    return exact.num_coarse * problem.num_stages > BOUND_FIRST


def _large(problem: Problem, exact: Coarsening) -> bool:
    """Whether the exact model is too big for CP-SAT to help (see LARGE_MODEL)."""
    return exact.num_coarse * problem.num_stages > LARGE_MODEL


def _huge(problem: Problem, exact: Coarsening) -> bool:
    """Whether one GPU runs each stage and the exact model is too big for any CP-SAT
    solve (see HUGE_MODEL)."""
    return not _shared(problem) and _placements(problem, exact) > HUGE_MODEL


def _placements(problem: Problem, exact: Coarsening) -> int:
    """The exact program's placement variables: a group's stage, each group and stage."""
    return exact.num_coarse * problem.num_stages


def _shared_large(problem: Problem, exact: Coarsening) -> bool:
    """Whether GPUs run several stage modules and the exact model is too big for CP-SAT
    to help there (see SHARED_LARGE)."""
    return _shared(problem) and exact.num_coarse * problem.num_stages > SHARED_LARGE


def _shared_small(problem: Problem, exact: Coarsening) -> bool:
    """Whether GPUs run several stage modules on an exact program small enough for one
    CP-SAT solve to take all the work (see SHARED_SMALL)."""
    return _shared(problem) and exact.num_coarse * problem.num_stages <= SHARED_SMALL


def _shared(problem: Problem) -> bool:
    """Whether GPUs run several stage modules (interleaved, V-placed)."""
    return problem.virtual_stages > 1 and not problem.replicates


def _not_run(exact: Coarsening) -> IlpResult:
    """The exact solve's place when it is skipped: nothing found, nothing proved."""
    return IlpResult("UNKNOWN", None, None, math.inf, 0.0, 0.0, exact.num_coarse)


def _bound_first(problem: Problem, exact: Coarsening,
                 candidates: list[tuple[float, tuple[int, ...]]], *, prepare: bool = True,
                 bound_s: float | None = None, hint: tuple[int, ...] | None = None,
                 dp_done: bool = False) -> tuple[float | None, bool, StageModel | None]:
    """On a big exact program (BOUND_FIRST): the interval DP over the exact groups (its
    split added to ``candidates``) and the block bound first. Returns the bound (None
    where not tried or the relaxation gives none; inf when no split fits); whether it
    settles the search: the best split is within PROVED of it, or within GAP where
    CP-SAT cannot help (LARGE_MODEL); and, where the bound was not ready when the DP
    was, the first exact program, built meanwhile (``_search`` solves it). ``dp_done``: the
    interval DP's split is in ``candidates`` already."""
    if not _bounded_first(problem, exact):
        return None, False, None
    large = _large(problem, exact)
    # Two DPs of seconds each at 70B scale, independent given an upper bound: the bound's
    # in a forked child, pruned by the baselines' best split, while the parent runs the
    # interval DP, then builds the program CP-SAT would solve first if the bound leaves
    # a gap (the same program whenever it is built: the answer does not depend on it).
    upper = min((c[0] for c in candidates), default=math.inf)
    prepared = None
    if hint is not None:
        candidates.append((evaluate(problem, hint).bottleneck_s, hint))
    with Forked(lambda: block_bound(exact, upper_s=upper), in_child=bound_s is None) as bounding:
        if hint is None and not dp_done:
            _add_dp_split(problem, exact, candidates)
        if (prepare and bound_s is None and not (large or bounding.ready())
                and _proving(problem, exact) and candidates):
            prepared = _first_program(exact, candidates)
        # without a split: inf when none fits
        lower = bounding.result() if bound_s is None else bound_s
    if lower is None or lower == math.inf:
        return lower, lower is not None, prepared
    best = min((c[0] for c in candidates), default=math.inf)
    # the baselines' best when the relaxation has no faster split
    return min(lower, best), best <= lower * (1 + (GAP if large else PROVED)), prepared


def _proving(problem: Problem, exact: Coarsening) -> bool:
    """Whether CP-SAT first tries to prove the best split so far on the exact program
    (``_first_program``): up to PROOF_MAX_GROUPS groups, where the exact solves run."""
    return exact.num_coarse <= PROOF_MAX_GROUPS and not _shared_large(problem, exact)


def _first_program(exact: Coarsening, candidates: list[tuple[float, tuple[int, ...]]]
                   ) -> StageModel:
    """The exact program hinted with the best split so far: CP-SAT's first try."""
    best = min(candidates, key=lambda c: c[0])[1]
    return StageModel(exact, hint=exact.restrict(best))


def _search(problem: Problem, exact: Coarsening,
            candidates: list[tuple[float, tuple[int, ...]]], *, coarsen: bool,
            dp_done: bool, work_limit: float, deadline: float, workers: int,
            prepared: StageModel | None = None,
            ) -> tuple[Coarsening, list[IlpResult], IlpResult]:
    """The graph the warm start was solved on, the CP-SAT solves, and the answer for the
    exact groups (the last solve, or ``_not_run`` where it was skipped). First the exact
    program hinted with the interval DP's split on PROOF_SHARE of the work: the DP's
    split is often already the optimum, which that proves in a fraction of a second
    (proving the coarse program optimal first took 15 s on transformers' Llama-3-8B at
    bf16-mixed). When it does not, the coarse warm start, then the exact program again on
    the rest of the work; where GPUs run several stage modules, hinted with the shared-GPU
    search's split when that is the best; on a model too big there (``_shared_large``)
    neither exact solve runs, on a small one (``_shared_small``) only the last, on all of
    the work.
    ``dp_done``: the interval DP's split is in ``candidates`` already (``_bound_first``);
    ``prepared``: the first exact program, built already (``_first_program``)."""
    if _shared_small(problem, exact):
        return _search_shared_small(problem, exact, candidates, dp_done=dp_done,
                                    work_limit=work_limit, deadline=deadline, workers=workers)
    tried: list[IlpResult] = []
    skip_exact = _shared_large(problem, exact)
    proving = _proving(problem, exact)
    if proving and not dp_done:
        _add_dp_split(problem, exact, candidates)
        dp_done = True
    if proving and candidates:
        first = (prepared or _first_program(exact, candidates)).solve(
            work_limit=work_limit * PROOF_SHARE, time_limit_s=_left(deadline),
            workers=workers)
        if first.status in ("OPTIMAL", "INFEASIBLE"):
            return exact, [first], first
        tried.append(first)
        if first.stage_of is not None:  # often the optimum already: the rest proves it
            candidates.append((evaluate(problem, first.stage_of).bottleneck_s,
                               first.stage_of))
    level = _coarse_level(problem, exact) if coarsen else exact
    phases = _warm_starts(problem, exact, level, candidates, work_limit=work_limit,
                          deadline=deadline, workers=workers, dp_done=dp_done)
    _shared_gpu_start(problem, exact, candidates)
    if skip_exact:
        return level, [*tried, *phases], _not_run(exact)
    result = _solve_from_best(exact, candidates, work_limit=work_limit * (
        1 - COARSE_SHARE if phases else 1), deadline=deadline, workers=workers)
    return level, [*tried, *phases, result], result


def _search_shared_small(problem: Problem, exact: Coarsening,
                         candidates: list[tuple[float, tuple[int, ...]]], *, dp_done: bool,
                         work_limit: float, deadline: float, workers: int,
                         ) -> tuple[Coarsening, list[IlpResult], IlpResult]:
    """``_search`` where GPUs run several stage modules on a small exact program
    (SHARED_SMALL): the interval DP's split and the shared-GPU search's from the best
    candidates, then the exact program on the whole work limit, hinted with the best."""
    if not dp_done:
        _add_dp_split(problem, exact, candidates)
    _shared_gpu_start(problem, exact, candidates)
    result = _solve_from_best(exact, candidates, work_limit=work_limit, deadline=deadline,
                              workers=workers)
    return exact, [result], result


def _solve_from_best(exact: Coarsening, candidates: list[tuple[float, tuple[int, ...]]], *,
                     work_limit: float, deadline: float, workers: int) -> IlpResult:
    """The exact program on ``work_limit``, hinted with the best of ``candidates``."""
    best = min(candidates, key=lambda c: c[0])[1] if candidates else None
    hint = exact.restrict(best) if best is not None else None
    return StageModel(exact, hint=hint).solve(work_limit=work_limit,
                                              time_limit_s=_left(deadline), workers=workers)


def _add_dp_split(problem: Problem, exact: Coarsening,
                  candidates: list[tuple[float, tuple[int, ...]]]) -> None:
    """Add to ``candidates`` the interval DP's split over the exact groups' order, when it
    fits and is valid; the best candidate so far bounds the blocks it tries."""
    upper = min((c[0] for c in candidates), default=math.inf)
    dp = interval_dp(exact, upper_s=upper)
    if dp is None:
        return
    split = exact.expand(dp)
    if violations(problem, split):
        return
    ev = evaluate(problem, split)
    if ev.estimate.fits:
        candidates.append((ev.bottleneck_s, split))


def _warm_starts(problem: Problem, exact: Coarsening, level: Coarsening,
                 candidates: list[tuple[float, tuple[int, ...]]], *, work_limit: float,
                 deadline: float, workers: int, dp_done: bool = False) -> list[IlpResult]:
    """Add to ``candidates`` (bottleneck, split) the splits that may hint the exact solve:
    CP-SAT's on the capped coarse graph ``level`` when it is coarser than the exact
    groups, and the interval DP's over the exact groups' order. Returns the CP-SAT runs."""
    # The best baseline bounds every block the interval DP needs to try (see interval_dp).
    upper = min((c[0] for c in candidates), default=float("inf"))
    phases: list[IlpResult] = []
    if level.num_coarse < exact.num_coarse:
        hint = interval_dp(level, upper_s=upper)
        result = StageModel(level, hint=hint).solve(
            work_limit=work_limit * COARSE_SHARE, time_limit_s=_left(deadline),
            workers=workers)
        phases.append(result)
        if result.stage_of is not None:  # fits and is valid by construction
            candidates.append((evaluate(problem, result.stage_of).bottleneck_s,
                               result.stage_of))
    upper = min((c[0] for c in candidates), default=float("inf"))
    if not dp_done and (not phases or phases[-1].stage_of is None
                        or exact.num_coarse <= DP_MAX_NODES or upper < float("inf")):
        # The DP over the exact groups' order: often a better warm start than the coarse
        # answer (ResNet-50: 264.8 vs 312.7). O(K n^2) with nothing to bound its blocks,
        # so then skipped on big graphs that already have a coarse answer; O(n^2) or
        # less with an upper bound (see interval_dp).
        _add_dp_split(problem, exact, candidates)
    return phases


def _shared_gpu_start(problem: Problem, exact: Coarsening,
                      candidates: list[tuple[float, tuple[int, ...]]]) -> None:
    """Where GPUs run several stage modules (interleaved, V-placed): add to ``candidates``
    the split that moving cuts between GPUs' loads reaches from each of them
    (``interleave.py``); CP-SAT alone finds little there within its work limit."""
    if not _shared(problem):
        return
    starts = [exact.restrict(split) for _, split in sorted(candidates)[:SHARED_STARTS]]
    split = shared_gpu_warm_start(exact, starts)
    if split is not None:
        candidates.append((evaluate(problem, split).bottleneck_s, split))


def _left(deadline: float) -> float:
    """Wall-clock seconds left before ``deadline`` (the safety net), at least a little."""
    return max(0.05, deadline - time.perf_counter())


def _coarse_level(problem: Problem, exact: Coarsening) -> Coarsening:
    return coarsen_graph(problem, base=exact)


def _partition_replicated(problem: Problem, *, work_limit: float, time_limit_s: float,
                          coarsen: bool, workers: int) -> Partition:
    """The best of: one stage per GPU, and K = N-1 .. 1 stages with replicas (see the
    module docstring). The bound is the smallest any stage count could still reach."""
    start = time.perf_counter()
    deadline = start + time_limit_s
    N = problem.devices
    one_each = replace(problem, num_stages=N, num_devices=0)
    best: Partition | None = None
    failure: ValueError | None = None
    try:
        best = partition(one_each, work_limit=work_limit / 2, time_limit_s=time_limit_s / 2,
                         coarsen=coarsen, workers=workers)
    except ValueError as exc:  # too few nodes or too little memory for N stages
        failure = exc
    # proved: every stage count so far is settled (its optimum found, or none exists)
    if best is not None:
        proved = best.report.status == "OPTIMAL"
    else:
        proved = isinstance(failure, TooManyStagesError | InfeasibleMemoryError)
    bounds = [best.report.bound] if best is not None else []
    wall_clock = best is not None and best.report.wall_clock_stopped
    counts = range(N - 1, 0, -1)
    for K in counts:
        sub = replace(problem, num_stages=K, num_devices=N)
        exact = exact_groups(sub)
        if exact.num_coarse < K and not sub.allow_empty_stages:
            continue
        upper = best.evaluation.bottleneck_s if best is not None else None
        result = StageModel(exact, upper_s=upper).solve(
            work_limit=work_limit / 2 / len(counts), time_limit_s=_left(deadline),
            workers=workers)
        wall_clock |= result.wall_clock_stopped
        if result.status == "INFEASIBLE":
            continue  # nothing with K stages beats the best so far (or fits)
        proved &= result.status == "OPTIMAL"
        bounds.append(result.bound)
        if result.stage_of is None or result.replicas is None:
            continue
        found = evaluate(sub, result.stage_of, result.replicas)
        if best is None or found.bottleneck_s < best.evaluation.bottleneck_s:
            best = Partition(
                stage_of=result.stage_of,
                problem=sub,
                report=replicated_report(result, found, graph_nodes=len(problem.nodes)),
                evaluation=found,
                baselines=best.baselines if best is not None else {},
                baseline_splits=best.baseline_splits if best is not None else {},
                coarse_nodes=exact.num_coarse,
                phases=(*best.phases, result) if best is not None else (result,),
            )
    if best is None:
        raise failure or NoSolutionError(devices=N, work_limit=work_limit,
                                         time_limit_s=time_limit_s, wall_clock=wall_clock,
                                         limit=None)
    objective = best.evaluation.bottleneck_s
    bound = min([objective, *bounds])
    bound = min(objective, max(bound, trivial_bound(replace(problem, num_stages=1,
                                                            num_devices=N))))
    report = replace(best.report, status="OPTIMAL" if proved else "FEASIBLE",
                     objective=objective, bound=objective if proved else bound,
                     wall_s=time.perf_counter() - start, wall_clock_stopped=wall_clock)
    return replace(best, report=report)
