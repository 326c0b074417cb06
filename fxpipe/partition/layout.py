"""The cluster's layout as plain data: N GPUs, G to a host, as p pipeline stages × d
data-parallel replicas of the pipeline × t GPUs splitting each stage's ops (tensor
parallelism, inside a host), and what a layout costs beyond its cuts.

# N: GPUs, G: GPUs per host, p: pipeline degree (stages per pipeline), t: the TP degree
# (GPUs per stage, dividing G), d = N / (p t): the data-parallel degree, B: samples per
# step (the global batch), b: samples per micro-batch (the example's), M = B / (d b):
# micro-batches per pipeline per step.

Every t GPUs of a host run one pipeline rank, each op Megatron-LM's layout splits split
over them (the problem priced at t: ``partition.tensor_parallel``); the d pipelines each
take B / d samples per step, and the d copies of each stage's parameters agree after
every step. The two data-parallel modes torch runs under a pipeline:

    ddp    every copy holds the whole stage and its optimizer state; the gradients are
           all-reduced once per step (DDP, no_sync until the last micro-batch)
    fsdp   FSDP2 over the d copies: torch's PipelineStage defers the gradient
           reduce-scatter to the last micro-batch, so inside a step every rank holds its
           stage's whole parameters and gradients; only the optimizer state (Adam's two
           moments) is divided by d. After the step the updated shards are all-gathered.

What a layout adds to the pipeline's own step (``Problem``, ``evaluate``), the cost model
the layout search states in the report:

- memory: the optimizer state of every stage divided by d under fsdp (``sharded``);
- time: after the pipeline's last backward, each stage's gradient sync over its d copies:
  a ring all-reduce (ddp) or a ring reduce-scatter and all-gather (fsdp), the same bytes on
  the wire, 2 (d - 1) / d of the stage's gradient bytes, not overlapped with the pipeline's
  drain (an upper bound: the last stage's sync could start while the first drains); the
  step ends when the slowest stage's sync does (``sync_s``);
- links: ranks are laid out on a (dp, pp, tp) mesh, tensor-parallel dimension innermost
  and then the pipeline's (rank r = (i p + j) t + k is GPU k of stage j of pipeline i),
  so the t GPUs of a stage share a host (t divides G) and their all-reduces ride its
  link, a pipeline of p t <= G GPUs, G a multiple of p t, sits in one host and its sends
  ride the host's link (NVLink), while the d copies of a stage, one per pipeline, span
  hosts once N > G and sync on the hosts' link (the NIC); a pipeline longer than a host
  sends across hosts at its host boundaries, priced for every boundary (an upper bound,
  as the cuts are chosen per boundary-blind program). The other order (data-parallel
  innermost) is the same search with the links exchanged; it is not searched yet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from fxpipe.collectives import ring_allreduce_s
from fxpipe.partition.cost import NodeCosts, state_split
from fxpipe.partition.errors import InfeasibleMemoryError
from fxpipe.partition.evaluate import Evaluation, evaluate
from fxpipe.partition.problem import Problem

__all__ = [
    "COMPUTE_EFFICIENCY",
    "DEFAULT_GPUS_PER_NODE",
    "DP_MODES",
    "Cluster",
    "Link",
    "Totals",
    "Tried",
    "candidates",
    "ddp_copies",
    "fills_hosts",
    "grad_bytes",
    "layout_bound",
    "layout_step",
    "per_host",
    "pipeline_crosses_hosts",
    "search",
    "sharded",
    "slowest_sync_s",
    "split_step",
    "sync_crosses_hosts",
    "sync_link",
    "sync_s",
    "totals",
]

DP_MODES = ("fsdp", "ddp")

# The share of the cost model's speed the layout search assumes a GPU reaches: every op's
# seconds are the cost model's divided by it, communication's are not (``lower``). The
# roofline's own (1.0): measured against it, a training step on one H100 / H200 took
# 1.59x (GPT-2) and 1.85x (an 886M Llama) the predicted time, 0.63 and 0.54 of it
# (docs/benchmarks/gpu.md), which makes compute look cheaper beside the collectives than
# it is; ``ClusterOptions.compute_efficiency`` sets another, ``--calibrate`` measures it.
COMPUTE_EFFICIENCY = 1.0
# A host of this many GPUs where --gpus-per-node is not given (an HGX / DGX board), or all
# of them where fewer
DEFAULT_GPUS_PER_NODE = 8


def ddp_copies(mode: str, d: int, t: int) -> bool:
    """Whether ``mode`` can keep d copies of stages split over t GPUs: not DDP where there
    are copies of split stages, whose DTensor parameters torch's DDP does not take."""
    return not (mode == "ddp" and t > 1 and d > 1)


def per_host(gpus: int, asked: int | None) -> int:
    """The GPUs of a host: as asked (``--gpus-per-node``), else DEFAULT_GPUS_PER_NODE, or
    all ``gpus`` where fewer."""
    return asked if asked is not None else min(gpus, DEFAULT_GPUS_PER_NODE)


def fills_hosts(gpus: int, per_host: int) -> bool:
    """Whether ``gpus`` sit in whole hosts of ``per_host`` (or in part of one)."""
    return gpus <= per_host or gpus % per_host == 0


@dataclass(frozen=True)
class Link:
    """A link's bandwidth (bytes / s, one direction) and per-message latency (s)."""

    bandwidth: float
    latency_s: float


@dataclass(frozen=True)
class Cluster:
    """N GPUs, G to a host: the links inside a host and between hosts."""

    gpus: int
    gpus_per_node: int
    intra: Link
    inter: Link

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError(f"a cluster needs at least one GPU and one per host, got "
                             f"{self.gpus} GPUs, {self.gpus_per_node} per host")
        if not fills_hosts(self.gpus, self.gpus_per_node):
            raise ValueError(
                f"{self.gpus} GPUs do not fill hosts of {self.gpus_per_node}: use a multiple "
                f"of --gpus-per-node {self.gpus_per_node}, or set --gpus-per-node")


def candidates(cluster: Cluster, global_microbatches: int, *, pp: int | None = None,
               dp_mode: str | None = None, tp: Sequence[int] = (1,)
               ) -> list[tuple[int, int, str, int, int]]:
    """The layouts to consider, as (p, d, mode, M, t): every TP degree t of ``tp`` (each
    dividing G; the caller's to check) and every pipeline degree p dividing N / t (or the
    one pinned), and M = the step's micro-batches over d, where d divides them. The mode
    is the one pinned, else fsdp where there are copies to shard (d > 1): under this cost
    model ddp moves the same bytes and holds more, so it is never faster, and is planned
    only when asked for, and never for copies of stages split over GPUs (t > 1, d > 1),
    whose DTensor parameters torch's DDP does not take. Smallest p first, then smallest t
    (ties go to the shorter pipeline, then to fewer GPUs per stage)."""
    n = cluster.gpus
    found: list[tuple[int, int, str, int, int]] = []
    for p in [pp] if pp is not None else range(1, n + 1):
        for t in tp:
            if n % (p * t):
                continue
            d = n // (p * t)
            if global_microbatches % d:
                continue
            mode = dp_mode if dp_mode is not None else ("fsdp" if d > 1 else "ddp")
            if not ddp_copies(mode, d, t):
                continue
            found.append((p, d, mode, global_microbatches // d, t))
    return found


def sharded(problem: Problem, d: int, mode: str) -> Problem:
    """``problem`` with each stage's optimizer state divided over the d copies (fsdp), as
    ``Problem.state_factor`` holds it: weights 1, gradients up to 1, optimizer the rest."""
    if mode == "ddp" or d == 1:
        return problem
    grads, optimizer = state_split(problem.state_factor)
    return replace(problem, state_factor=1.0 + grads + optimizer / d)


def pipeline_crosses_hosts(cluster: Cluster, p: int, t: int = 1) -> bool:
    """Whether a pipeline of p stages of t GPUs each, laid out inside the data-parallel
    dimension, has a stage boundary between hosts."""
    g, gpus = cluster.gpus_per_node, p * t
    return p > 1 and (gpus > g or g % gpus != 0)


def sync_crosses_hosts(cluster: Cluster, p: int, t: int = 1) -> bool:
    """Whether the d copies of a stage's GPU (ranks p t apart) span hosts: whenever there
    are several copies on more than one host."""
    return cluster.gpus > cluster.gpus_per_node and cluster.gpus // (p * t) > 1


def sync_link(cluster: Cluster, p: int, t: int = 1) -> Link:
    """The link the d copies of a stage sync over (``sync_crosses_hosts``)."""
    return cluster.inter if sync_crosses_hosts(cluster, p, t) else cluster.intra


def sync_s(grad_bytes: float, d: int, link: Link) -> float:
    """One stage's gradient sync over its d copies per step: a ring all-reduce, or a ring
    reduce-scatter plus all-gather, 2 (d - 1) / d of ``grad_bytes`` on the wire each way
    and 2 (d - 1) messages (``ring_allreduce_s``); none for a stage without gradients."""
    if grad_bytes <= 0:
        return 0.0
    return ring_allreduce_s(grad_bytes, d, link.bandwidth, link.latency_s)


def slowest_sync_s(stage_grad_bytes: Iterable[float], d: int, link: Link) -> float:
    """The step's sync time: every stage syncs at once, the slowest one last."""
    return max((sync_s(b, d, link) for b in stage_grad_bytes), default=0.0)


def grad_bytes(params: Sequence[int], state_factor: float) -> list[float]:
    """Each stage's gradient bytes from its parameter bytes (``state_split``)."""
    grads, _ = state_split(state_factor)
    return [b * grads for b in params]


@dataclass(frozen=True)
class Totals:
    """What every layout's bound reads of the model, per micro-batch of b samples: its
    compute seconds, its gradient bytes (all of its parameters') and the compute seconds
    of its slowest op, which some stage holds whole."""

    compute_s: float
    grad_bytes: float
    largest_s: float = 0.0


def totals(problem: Problem) -> Totals:
    grads, _ = state_split(problem.state_factor)
    compute = NodeCosts.of(problem).compute_s.tolist()
    return Totals(sum(compute), problem.param_bytes * grads, max(compute, default=0.0))


def layout_bound(totals: Totals, p: int, d: int, m: int, link: Link,
                 bottleneck_s: float | None = None) -> float:
    """A step no split of a (p, d) layout with M = m can beat: m - 1 micro-batches through
    its slowest stage, at least ``bottleneck_s`` (a bound on it: the block bound's or the
    solver's), the compute spread evenly over the p stages and the slowest op, plus the
    fill and drain of one micro-batch through all of it, plus the sync of an even share
    of the gradients (``totals`` of the problem at the layout's TP degree: per GPU of a
    stage)."""
    compute = totals.compute_s
    slowest = max(compute / p, totals.largest_s, bottleneck_s or 0.0)
    return (m - 1) * slowest + compute + sync_s(totals.grad_bytes / p, d, link)


@dataclass(frozen=True)
class Tried:
    """One layout's outcome in ``search``: its solved step (None where it was not solved:
    pruned by its bound, no split fits, or the problem is invalid for it) and why."""

    p: int
    d: int
    mode: str
    m: int
    bound_s: float
    step_s: float | None = None
    sync_s: float = 0.0
    max_memory: int | None = None
    why: str = ""
    status: str = "pruned"
    result: Any = None  # the solver's Partition, where solved
    error: ValueError | None = None  # why it has no split, where it has none
    t: int = 1  # GPUs of a host splitting each stage (the TP degree)


def layout_step(result: Any, d: int, link: Link) -> tuple[float, float]:
    """(step, sync) of a solved layout: the pipeline's iteration, then the slowest
    stage's gradient sync over its d copies (``result``: the solver's Partition)."""
    return _step(result.evaluation, result.problem, d, link)


def split_step(problem: Problem, stage_of: Sequence[int], d: int, link: Link
               ) -> tuple[float, float, Evaluation]:
    """(step, sync, its evaluation) of the layout whose pipelines are cut as ``stage_of``
    (a split a person would pick, priced as the solver's answer is)."""
    evaluation = evaluate(problem, stage_of)
    return (*_step(evaluation, problem, d, link), evaluation)


def _step(evaluation: Evaluation, problem: Problem, d: int, link: Link
          ) -> tuple[float, float]:
    stage_grads = grad_bytes([s.memory.params for s in evaluation.stages],
                             problem.state_factor)
    sync = slowest_sync_s(stage_grads, d, link)
    return evaluation.estimate.iteration_s + sync, sync


def search(cluster: Cluster, layouts: Sequence[tuple[int, int, str, int, int]],
           totals: Mapping[int, Totals],
           solve: Callable[[int, int, str, int, int, float | None, Any], Any],
           bottleneck: Callable[[int, int, str, int, int, float], tuple[float | None, Any]]
           | None = None) -> list[Tried]:
    """Solve the layouts (p, d, mode, M, t) in the order of their bounds (the cheapest
    first, ties to the shorter pipeline, then the smaller t), each by
    ``solve(p, d, mode, M, t, slowest, split)`` (the driver lowers the model for it and
    runs ``partition``, given the bound on its slowest stage and a split where they were
    found; a ``ValueError`` says it has no valid split), and stop when the next
    bound is no better than the best step found: every layout left is pruned, proved no
    better under the cost model. ``totals``: the model's at each TP degree.

    ``bottleneck(p, d, mode, M, t, upper_s)``: a bound on the layout's slowest stage
    (the block bound), ``upper_s`` where no split that fits has a faster one, None where
    it has none to give, and a split the driver found meanwhile (None: none); once a
    layout is solved, each one after it is bounded so before it is solved, and pruned
    where it cannot beat the best step. The best one's status is "chosen"."""
    order = sorted((layout_bound(totals[t], p, d, m, sync_link(cluster, p, t)), i)
                   for i, (p, d, _, m, t) in enumerate(layouts))
    tried: dict[int, Tried] = {}
    best: Tried | None = None
    best_step = math.inf  # best's step
    for bound, i in order:
        p, d, mode, m, t = layouts[i]
        link = sync_link(cluster, p, t)
        slowest, split = None, None
        if bottleneck is not None and bound < best_step < math.inf and m > 1:
            # the slowest stage of a split that beats the best step is faster than this
            sync = sync_s(totals[t].grad_bytes / p, d, link)
            upper = (best_step - totals[t].compute_s - sync) / (m - 1)
            slowest, split = bottleneck(p, d, mode, m, t, upper)
            if slowest is not None:
                bound = max(bound, best_step if slowest >= upper else
                            layout_bound(totals[t], p, d, m, link, slowest))
        if bound >= best_step:
            tried[i] = Tried(p, d, mode, m, bound, t=t)
            continue
        try:
            result = solve(p, d, mode, m, t, slowest, split)
        except ValueError as exc:
            status = "no fit" if isinstance(exc, InfeasibleMemoryError) else "invalid"
            tried[i] = Tried(p, d, mode, m, bound, why=str(exc), status=status, error=exc,
                             t=t)
            continue
        step, sync = layout_step(result, d, link)
        # the solver's own bound on the bottleneck bounds this layout's step from below
        proved = layout_bound(totals[t], p, d, m, link, result.report.bound)
        found = Tried(p, d, mode, m, max(bound, proved), step, sync,
                      result.evaluation.estimate.max_memory, status="solved", result=result,
                      t=t)
        tried[i] = found
        if best is None or (step, found.max_memory) < (best_step, best.max_memory):
            best, best_step = found, step  # of equal steps, the one needing the least memory
    rows = [tried[i] for i in range(len(layouts))]
    return [replace(row, status="chosen") if row is best else row for row in rows]
