"""The cluster search: which layout of N GPUs (G to a host) trains the model fastest
within each GPU's memory, as pipeline stages times data-parallel pipelines times the GPUs
of a host that split each stage (tensor parallelism).

``choose`` enumerates the layouts (``partition.layout.candidates``: every TP degree t
asked for that divides G and the model's heads, every pipeline degree p dividing N / t,
each data-parallel mode, M = the step's micro-batches over d), orders them
by a bound no split of theirs can beat, and plans each with the driver's exact program
until the next bound is no better than the best step found (``partition.layout.search``).
The chosen one's options then plan as any split does; its ``Layout`` (and every layout
considered) goes into the plan. The cost model it assumes is stated in
``partition/layout.py``: the optimizer state divided by d under FSDP, one gradient sync
per step after the pipeline's last backward, ring collectives, and the host boundary
priced where the (dp, pp, tp) mesh puts it; and for t > 1, Megatron-LM's split of each
stage's ops (``passes/tensor_parallel.py`` finds them, ``partition/tensor_parallel.py``
prices them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from fxpipe.forked import Forked
from fxpipe.frontend import Traced
from fxpipe.options import ClusterOptions, SplitOptions
from fxpipe.partition.baselines import interval_dp
from fxpipe.partition.bound import block_bound
from fxpipe.partition.coarsen import Coarsening, exact_groups
from fxpipe.partition.errors import Figures, InfeasibleMemoryError, NoSolutionError
from fxpipe.partition.evaluate import evaluate, violations
from fxpipe.partition.layout import (
    COMPUTE_EFFICIENCY,
    Cluster,
    Link,
    Tried,
    candidates,
    fills_hosts,
    layout_step,
    per_host,
    pipeline_crosses_hosts,
    search,
    split_step,
    sync_crosses_hosts,
    sync_link,
    totals,
)
from fxpipe.partition.nothing_fits import dp_fits, memory_floor
from fxpipe.partition.problem import Problem
from fxpipe.partition.solve import Partition
from fxpipe.passes.sequence_parallel import sequence_gaps
from fxpipe.passes.tensor_parallel import TensorParallel, annotate_tensor_parallel
from fxpipe.plan import Layout, LayoutRow
from fxpipe.precision import Precision
from fxpipe.request import MAX_MICROBATCHES
from fxpipe.units import format_bytes

__all__ = ["NoLayoutFits", "choose", "cluster_of", "example_batch"]

# When no layout fits, clusters up to this many times the GPUs asked are searched for the
# fewest a layout fits on (most layouts are ruled out by their memory floor alone)
LARGER = 16
# ... checking at most this many ops' worth of layouts (each check is the memory floor and
# an interval DP, about 0.5 s on the 7,000 groups of a 400B model; without a cap, --gpus
# 128 of Llama-3-405B took 7 minutes to refuse), and at least FEWEST_CHECKS layouts: the
# search is advice, deterministic, and says how far it went
FEWEST_WORK = 200_000
FEWEST_CHECKS = 16


def cluster_of(options: SplitOptions) -> Cluster:
    n, device = options.gpus, options.device
    g = per_host(n, options.cluster.gpus_per_node if options.cluster is not None else None)
    return Cluster(n, g, Link(device.intra_node_bandwidth, device.intra_node_latency),
                   Link(device.inter_node_bandwidth, device.inter_node_latency))


def example_batch(traced: Traced) -> int:
    """b: the samples of the example micro-batch (dim 0 of its first batched input)."""
    return next((shape.shape[0] for shape in traced.inputs
                 if shape.shape and shape.name not in traced.shared_inputs), 1)


def choose(traced: Traced, options: SplitOptions, *,
           problem: Callable[[SplitOptions], Problem],
           solve: Callable[..., Partition], calibrated: bool = False
           ) -> tuple[SplitOptions, Layout]:
    """The options of the fastest layout that fits, and its ``Layout``. ``problem(options)``
    is the driver's lowering of the model for one layout, ``solve(options, advise=...)``
    its plan (``partition``), raising a ``ValueError`` where no split of it is valid or
    fits (with ``advise``, saying what would fit). When no layout fits: one ``ValueError``
    naming the leanest layout, what it needs and what would fit it. ``calibrated``: the
    costs were measured (``--calibrate``), which the layout says."""
    wanted = options.cluster
    assert wanted is not None
    cluster = cluster_of(options)
    b = example_batch(traced)
    steps_microbatches, efficiency = _asked(options, b)
    split = annotate_tensor_parallel(traced.gm) if wanted.tp != 1 else None
    degrees = [1] if split is None else _tp_degrees(cluster, wanted.tp, split)
    kind = options.schedule
    if wanted.dp_mode == "ddp" and kind.spec.splits_backward:
        raise ValueError(
            f"torch's DDP does not average the gradients {kind.value}'s weight pass computes "
            f"apart from the backward: use --dp-mode fsdp with --schedule {kind.value}, or "
            f"another --schedule (1f1b) with ddp")
    layouts = candidates(cluster, steps_microbatches, pp=wanted.pp, dp_mode=wanted.dp_mode,
                         tp=degrees)
    runnable = [lay for lay in layouts if lay[3] <= MAX_MICROBATCHES]
    if layouts and not runnable:
        fewest = min(lay[3] for lay in layouts)
        raise ValueError(
            f"the step's {steps_microbatches} micro-batches leave at least {fewest} to each "
            f"pipeline, more than {MAX_MICROBATCHES}: runner.py lists every forward and "
            f"backward of every micro-batch; use a smaller --global-batch or --microbatches "
            f"(bigger micro-batches)")
    layouts = runnable
    if not layouts:
        raise ValueError(
            f"no pipeline degree of {options.gpus} GPUs splits the step's "
            f"{steps_microbatches} micro-batches evenly over its pipelines: use a "
            f"--global-batch that is a multiple of {options.gpus * b} samples")

    def of(p: int, d: int, mode: str, m: int, t: int, on: Cluster = cluster) -> SplitOptions:
        return replace(options, gpus=p, microbatches=m, data_parallel=(d, mode),
                       across_hosts=pipeline_crosses_hosts(on, p, t),
                       schedule=options.schedule, tensor_parallel=t,
                       compute_efficiency=efficiency)

    # the model's totals at each TP degree, for the layouts' bounds
    base = {t: totals(problem(of(*next(lay for lay in layouts if lay[4] == t))))
            for t in dict.fromkeys(lay[4] for lay in layouts)}
    # every layout planned quickly (the interval DP and the block bound, no CP-SAT), the
    # chosen one again in full
    tried = search(cluster, layouts, base, lambda p, d, mode, m, t, slowest, split: _quickly(
        solve, of(p, d, mode, m, t), slowest, split),
        lambda p, d, mode, m, t, upper_s: _slowest_stage(problem(of(p, d, mode, m, t)),
                                                         upper_s))
    chosen = next((t for t in tried if t.status == "chosen"), None)
    if chosen is None:
        # the leanest layout advised, but for one pipeline's fewest GPUs: NoLayoutFits
        # counts the layouts on more, as the job runs
        raise _nothing_fits(cluster, tried, lambda t: solve(of(t.p, t.d, t.mode, t.m, t.t),
                                                            count_gpus=False),
                            lambda precision: _fewest_fitting(
                                cluster, steps_microbatches, b, wanted, degrees,
                                lambda on, lay: problem(replace(
                                    of(*lay, on=on), precision=precision or options.precision))),
                            lambda t: of(t.p, t.d, t.mode, t.m, t.t))
    planned = of(chosen.p, chosen.d, chosen.mode, chosen.m, chosen.t)
    link = sync_link(cluster, chosen.p, chosen.t)
    final = solve(planned, bound_s=chosen.result.report.bound,  # from its quick answer
                  hint=chosen.result.stage_of)
    best_step, sync = layout_step(final, chosen.d, link)
    tried = [replace(t, step_s=best_step, sync_s=sync, result=final,
                     max_memory=final.evaluation.estimate.max_memory) if t is chosen else t
             for t in tried]
    rows = tuple(LayoutRow(pp=t.p, dp=t.d, dp_mode=t.mode, microbatches=t.m, status=t.status,
                           step_s=t.step_s, bound_s=t.bound_s, max_memory=t.max_memory,
                           why=t.why, tp=t.t) for t in tried)
    # pure FSDP as a person would run it, whether or not the search had it (--pp pinned)
    pure = ((1, cluster.gpus, "fsdp", steps_microbatches // cluster.gpus, 1)
            if steps_microbatches % cluster.gpus == 0 else None)
    rows += _by_hand(cluster, final, chosen, pure, lambda lay: problem(of(*lay)))
    # proved best under the cost model: its own split is, and every other layout that
    # fits is bounded (by its bound or its solver's) at no better a step
    proved = final.report.status == "OPTIMAL" and all(
        t.bound_s >= best_step for t in tried
        if t.status in ("solved", "pruned") and t.result is not final)
    tensor = split if chosen.t > 1 else None  # what the chosen layout splits, if anything
    layout = Layout(
        gpus=cluster.gpus, gpus_per_node=cluster.gpus_per_node, pp=chosen.p, dp=chosen.d,
        dp_mode=chosen.mode, global_batch=steps_microbatches * b, microbatch_size=b,
        microbatches=chosen.m,
        pipeline_link="inter" if planned.across_hosts else "intra",
        sync_link="inter" if sync_crosses_hosts(cluster, chosen.p, chosen.t) else "intra",
        sync_s=sync, step_s=best_step, proved=proved, considered=rows,
        mesh=("dp", "pp", "tp") if tensor else ("dp", "pp"), tp=chosen.t,
        **_tensor_fields(traced, tensor, chosen.t), compute_efficiency=efficiency,
        calibrated=calibrated)
    return planned, layout


def _tensor_fields(traced: Traced, tensor: TensorParallel | None, t: int) -> dict[str, Any]:
    """The layout's tensor-parallel fields: what splits at t, and what runs on 1/t of the
    tokens between the pairs (``passes/sequence_parallel.py``); none where t is 1."""
    if tensor is None:
        return {}
    sequence = sequence_gaps(traced.gm)
    return {"tp_pairs": len(tensor.pairs), "tp_replicated": tensor.replicated,
            "tp_vocab": tensor.vocab, "sp_ops": sum(len(g.ops) for g in sequence.at(t)),
            "sp_kept": sequence.kept_at(traced.gm, t)}


def _asked(options: SplitOptions, b: int) -> tuple[int, float]:
    """The step's micro-batches of the example's b samples and the compute efficiency the
    search assumes; one line where the options asked cannot be."""
    wanted = options.cluster
    assert wanted is not None
    efficiency = (COMPUTE_EFFICIENCY if wanted.compute_efficiency is None
                  else wanted.compute_efficiency)
    if not efficiency > 0:
        raise ValueError(f"a compute efficiency of {efficiency} is no share of the cost "
                         f"model's speed: use one above 0 ({COMPUTE_EFFICIENCY}: the roofline)")
    if wanted.global_batch is not None:
        if wanted.global_batch < 1 or wanted.global_batch % b:
            raise ValueError(
                f"--global-batch {wanted.global_batch} is not a whole number of micro-batches "
                f"of the example's {b} samples: use a multiple of {b}")
        steps_microbatches = wanted.global_batch // b
        if wanted.microbatches not in (None, steps_microbatches):
            raise ValueError(
                f"--global-batch {wanted.global_batch} is {steps_microbatches} micro-batches of "
                f"the example's {b} samples, not the --microbatches {wanted.microbatches} "
                f"given: leave out one of them, or use --microbatches {steps_microbatches}")
    else:
        steps_microbatches = options.microbatches
    return steps_microbatches, efficiency


def _slowest_stage(problem: Problem, upper_s: float
                   ) -> tuple[float | None, tuple[int, ...] | None]:
    """The block bound on ``problem``'s slowest stage, ``upper_s`` where no split that fits
    has a faster one, None where it has none to give, or where the memory floor proves
    that no split fits, or the problem is invalid (its solve says so in no time); and,
    worked out meanwhile in a forked child (on the second core), the interval DP's split
    where its slowest stage is faster than ``upper_s`` (None: it is not, or the bound
    pruned the layout first and the child was stopped)."""
    if memory_floor(problem) > problem.memory_limit:
        return None, None
    try:
        exact = exact_groups(problem)
    except ValueError:
        return None, None
    with Forked(lambda: _dp_split(problem, exact, upper_s)) as splitting:
        slowest = block_bound(exact, upper_s=upper_s)
        if slowest is not None and slowest >= upper_s:
            return slowest, None
        return slowest, splitting.result()


def _dp_split(problem: Problem, exact: Coarsening, upper_s: float
              ) -> tuple[int, ...] | None:
    """The interval DP's split of ``problem`` where its slowest stage is faster than
    ``upper_s`` and it is valid and fits (as ``partition`` takes it), else None."""
    found = interval_dp(exact, upper_s=upper_s)
    split = exact.expand(found) if found is not None else None
    if split is None or violations(problem, split) or not evaluate(problem, split).estimate.fits:
        return None
    return split


def _tp_degrees(cluster: Cluster, asked: int | None, split: TensorParallel) -> list[int]:
    """The TP degrees to search: the one asked (None: every one) that divides the GPUs per
    host, so that a stage's GPUs share a host, and splits every pair of the model (its
    attention heads and KV heads, its MLPs' hidden widths); one line where it does not."""
    g = cluster.gpus_per_node
    usable = [t for t in split.degrees(g) if g % t == 0]
    if asked is None:
        return usable
    assert g % asked == 0, "request.split_options refuses a --tp that does not divide a host"
    why = split.refusal(asked)
    if why is not None:
        raise ValueError(f"--tp {asked} does not divide {why}: use one of "
                         f"{', '.join(map(str, usable))}")
    return [asked]


def _by_hand(cluster: Cluster, final: Partition, chosen: Tried,
             pure: tuple[int, int, str, int, int] | None,
             problem: Callable[[tuple[int, int, str, int, int]], Problem]
             ) -> tuple[LayoutRow, ...]:
    """The layouts a person would pick by hand, planned as they would run, beside the
    chosen one: its degrees with torchtitan's layer-count cuts (the pipeline's
    uniform-layers baseline), and pure FSDP (one stage, the whole model on every GPU),
    where the chosen layout is neither."""
    rows = []
    cuts = final.baseline_splits.get("uniform-layers")
    if chosen.p > 1 and cuts is not None:
        link = sync_link(cluster, chosen.p, chosen.t)
        step, _, evaluation = split_step(final.problem, cuts, chosen.d, link)
        rows.append(LayoutRow(
            pp=chosen.p, dp=chosen.d, dp_mode=chosen.mode, microbatches=chosen.m,
            status="by hand", step_s=step, bound_s=step,
            max_memory=evaluation.estimate.max_memory, tp=chosen.t,
            why="torchtitan's layer-count cuts" + _unfit(evaluation.estimate.fits)))
    if pure is not None and (chosen.p, chosen.mode, chosen.t) != (1, "fsdp", 1):
        whole = problem(pure)
        if whole.num_stages == 1:  # (not where each GPU holds v stage modules)
            step, _, evaluation = split_step(whole, (0,) * len(whole.nodes), pure[1],
                                             sync_link(cluster, 1))
            rows.append(LayoutRow(
                pp=1, dp=pure[1], dp_mode="fsdp", microbatches=pure[3], status="by hand",
                step_s=step, bound_s=step, max_memory=evaluation.estimate.max_memory,
                why="pure FSDP" + _unfit(evaluation.estimate.fits)))
    return tuple(rows)


def _unfit(fits: bool) -> str:
    return "" if fits else ", over the memory limit"


def _quickly(solve: Callable[..., Partition], options: SplitOptions, slowest: float | None,
             split: tuple[int, ...] | None) -> Partition:
    """A layout planned quickly (the interval DP and the block bound), or in full where
    neither the DP nor a baseline found a split: CP-SAT may yet, at a tight memory."""
    try:
        return solve(options, advise=False, quick=True, bound_s=slowest, hint=split)
    except NoSolutionError:
        return solve(options, advise=False, bound_s=slowest, hint=split)


def _fits(problem: Problem) -> bool:
    """Whether a split of ``problem`` surely fits: within the memory floor, and the interval
    DP finds one (``dp_fits``: fast, no CP-SAT)."""
    return memory_floor(problem) <= problem.memory_limit and dp_fits(problem)


def _fewest_fitting(cluster: Cluster, steps_microbatches: int, b: int,
                    wanted: ClusterOptions, degrees: list[int],
                    problem_of: Callable[[Cluster, tuple[int, int, str, int, int]], Problem]
                    ) -> tuple[tuple[Cluster, tuple[int, int, str, int, int], int] | None, int]:
    """The fewest GPUs, in whole hosts and up to LARGER times those asked, on which a
    layout fits (``_fits`` of its ``problem_of``) with the step's micro-batches of b
    samples, the layout (the fewest pipeline stages of those that fit; the ``--pp`` and
    ``--dp-mode`` asked kept) and the global batch, or None where none does; and the most
    GPUs whose every layout was checked, within FEWEST_WORK ops' worth of checks. A
    cluster as ``--gpus`` would make it: G to a host as asked, else 8 or all of them."""
    searched, checks = cluster.gpus, None
    for n in range(cluster.gpus + 1, LARGER * cluster.gpus + 1):
        g = per_host(n, wanted.gpus_per_node)
        if not fills_hosts(n, g):
            continue
        larger = replace(cluster, gpus=n, gpus_per_node=g)
        usable = [t for t in degrees if g % t == 0]
        for lay in candidates(larger, steps_microbatches, pp=wanted.pp,
                              dp_mode=wanted.dp_mode, tp=usable):
            problem = problem_of(larger, lay)
            if checks is None:  # every layout's problem has the model's ops
                checks = max(FEWEST_CHECKS, FEWEST_WORK // max(1, len(problem.nodes)))
            checks -= 1
            if checks < 0:
                return None, searched
            if _fits(problem):
                return (larger, lay, steps_microbatches * b), n
        searched = n
    return None, searched


# a layout that fits on more GPUs: (GPUs, the layout's words, its --pp, --dp-mode or None,
# --tp, the global batch)
FitsOn = tuple[int, str, int, str | None, int, int]
# the fewest GPUs a layout fits on, with the graph's bytes as they are costed at the time
# of the call, at a precision (None: the one planned): the layout, and the most GPUs
# whose every layout was checked
Fewest = Callable[[Precision | None], tuple[FitsOn | None, int]]


class NoLayoutFits(Figures):
    """No layout of ``gpus`` GPUs (``per_host`` to a host) fits: the leanest, ``leanest``
    (its words, as ``_described`` writes them), planned with ``options``, does not fit by
    ``raw`` (the solver's error for one of its ``dp`` pipelines, naming what would fit
    it); ``error`` is ``raw`` counted over the step (its micro-batches are the step's, as
    ``--microbatches`` counts them). ``fits_on``: the layout that fits on the fewest more
    GPUs, else None; ``fewest`` searches it again at a leaner precision (None once the
    error crossed processes: it plans with the graph), and ``leaner_on`` is what it found
    for ``raw.precision`` where that needs more GPUs (``advice.advised_layout``). The
    command line words the fixes with its flags (``cli._worded``); ``str`` is the
    sentence for the Python API."""

    def __init__(self, gpus: int, per_host: int, leanest: str, raw: InfeasibleMemoryError,
                 fits_on: FitsOn | None, options: SplitOptions, dp: int, searched: int,
                 fewest: Fewest | None, leaner_on: FitsOn | None = None) -> None:
        self.gpus, self.per_host, self.leanest = gpus, per_host, leanest
        self.raw, self.fits_on, self.options, self.dp = raw, fits_on, options, dp
        self.searched = searched  # the most GPUs a layout was looked for on
        self.fewest, self.leaner_on = fewest, leaner_on
        # The solver's "fits on N GPUs", at this precision or a leaner one, counts one
        # pipeline's stages at its d and M, not the job's GPUs: said as --gpus N it was
        # wrong ("--gpus 4" for a job of 64; "--gpus 9" beside --pp 8 or hosts of 8). The
        # layouts on more GPUs are ``fits_on``'s and ``leaner_on``'s, searched as the job
        # would run; a leaner precision that needs more GPUs and has no such layout, or
        # one on no fewer GPUs than ``fits_on``'s, is no fix.
        leaner = raw.precision if raw.precision_gpus is None or (
            leaner_on is not None and (fits_on is None or leaner_on[0] < fits_on[0])) else None
        self.error = raw.but(
            samples=None if raw.samples is None else (*raw.samples[:2], raw.samples[2] * dp),
            microbatches=None if raw.microbatches is None else raw.microbatches * dp,
            precision=leaner,
            precision_gpus=None if leaner is None or leaner_on is None else leaner_on[0],
            fits_on=None)
        fixes = str(self.error).split("; to fit, ", 1)[-1]
        if fits_on is None:
            super().__init__(f"{self.head()}{self.none_larger()}; to fit it, {fixes}")
        else:
            super().__init__(f"{self.head()}; it fits on {fits_on[0]} GPUs as {fits_on[1]}: "
                             f"use {self.flags(fits_on)}; or, to fit the leanest, {fixes}")

    def _figures(self) -> dict[str, Any]:
        # ``fewest`` plans with the graph, which stays in this process
        return {**vars(self), "fewest": None}

    def but(self, raw: InfeasibleMemoryError, leaner_on: FitsOn | None = None
            ) -> NoLayoutFits:
        """The same error, the leanest layout's own naming more fixes (``advice.advised``
        costs the graph again for them), and the layout its leaner precision fits on."""
        return NoLayoutFits(self.gpus, self.per_host, self.leanest, raw, self.fits_on,
                            self.options, self.dp, self.searched, self.fewest, leaner_on)

    def none_larger(self) -> str:
        """Where no layout on more GPUs fits, how far the search went (nothing where it
        could check none of them)."""
        return ("" if self.searched <= self.gpus
                else f", and no layout fits on up to {self.searched} GPUs")

    def head(self) -> str:
        return (f"no layout of {self.gpus} GPUs ({self.per_host} per host) fits in "
                f"{format_bytes(self.error.limit)} per GPU; the leanest, {self.leanest}, "
                f"needs {format_bytes(self.error.needed)} per GPU")

    def flags(self, layout: FitsOn) -> str:
        """The command line that plans ``layout`` (``fits_on`` or ``leaner_on``)."""
        gpus, _, p, mode, t, global_batch = layout
        return (f"--gpus {gpus} --pp {p}" + f" --dp-mode {mode}" * (mode is not None)
                + f" --tp {t}" * (t > 1) + f" --global-batch {global_batch}")


def _nothing_fits(cluster: Cluster, tried: list[Tried],
                  advised: Callable[[Tried], Partition],
                  fewest: Callable[[Precision | None], tuple[
                      tuple[Cluster, tuple[int, int, str, int, int], int] | None, int]],
                  options_of: Callable[[Tried], SplitOptions]) -> ValueError:
    """The error when no layout has a split: ``NoLayoutFits``, naming the leanest layout
    that does not fit (by the memory its bounds prove it needs), what it needs, the fewest
    GPUs a layout fits on (``fewest``, at a precision) and what would fit the leanest
    (``advised`` solves it again, working that out); or, where none is about memory, the
    first layout's own error (the solver's, which the command line words with its
    flags)."""
    short = [t for t in tried if isinstance(t.error, InfeasibleMemoryError)]
    if not short:
        first = tried[0]
        return first.error if first.error is not None else ValueError(
            f"no layout of {cluster.gpus} GPUs has a valid split: {first.why}")
    leanest = min(short, key=lambda t: (t.error.needed, t.p))  # type: ignore[union-attr]
    try:
        advised(leanest)
    except InfeasibleMemoryError as exc:
        error = exc
    else:  # pragma: no cover - a layout proved not to fit fits when solved again
        raise AssertionError(f"layout pp {leanest.p} x dp {leanest.d} fits after all")
    described = _described(leanest.p, leanest.d, leanest.mode, leanest.t)

    def fits_on(precision: Precision | None) -> tuple[FitsOn | None, int]:
        larger, searched = fewest(precision)
        if larger is None:
            return None, searched
        on, (p, d, mode, _, t), global_batch = larger
        return (on.gpus, _described(p, d, mode, t), p, mode if d > 1 else None, t,
                global_batch), searched

    found, searched = fits_on(None)
    return NoLayoutFits(cluster.gpus, cluster.gpus_per_node, described, error, found,
                        options_of(leanest), leanest.d, searched, fits_on)


def _described(p: int, d: int, mode: str, t: int) -> str:
    """"8 pipeline stages x 8 data-parallel (fsdp)", and " x 2 tensor-parallel"."""
    return (f"{p} pipeline stage{'s' * (p > 1)} x {d} data-parallel ({mode})"
            + f" x {t} tensor-parallel" * (t > 1))
