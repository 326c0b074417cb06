"""The partitioning problem as plain data: no torch, no graph library.

A ``Problem`` is a DAG of nodes with costs, K pipeline stages on identical
devices with a memory limit, and the schedule that decides how many
micro-batches each stage keeps in flight. Units are seconds and bytes; the
lowering from an annotated FX graph (``fxpipe.lower``) and the benchmark
adapters fill them in.

Legend used throughout ``fxpipe.partition``:
    n: number of nodes, K: number of stages, M: micro-batches per step,
    v: a node, j: a stage, b: a boundary between stage b and stage b + 1,
    N: GPUs, r: replicas of one stage (GPUs running it data-parallel).

Three ways stages map onto GPUs:

    one stage per GPU          N = K        stage j on GPU j
    replicated ("2-1-1")       N > K        stage j on r_j GPUs, sum r_j = N; each replica
                                            takes 1/r_j of every micro-batch, gradients
                                            all-reduced over the r_j replicas (ring)
    interleaved (Megatron-LM)  N = K / v    K = N * v stage modules, stage j on GPU j % N
    V (ZB-V, DualPipeV)        N = K / 2    stage j and stage K - 1 - j on GPU j: down the
                                            GPUs and back up
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from fxpipe.collectives import ring_allreduce_s
from fxpipe.schedules import ScheduleKind

__all__ = [
    "Comm",
    "Edge",
    "Node",
    "Problem",
    "Recompute",
    "TiedGroup",
    "TiedPolicy",
    "allreduce_s",
    "allreduce_terms",
    "stage_deferred",
    "stage_flights",
]


class Comm(str, Enum):
    NEIGHBOUR = "neighbour"  # torch.distributed.pipelining: bytes cross every boundary between
    DIRECT = "direct"  # one send from the producer to every stage that reads it


class Recompute(str, Enum):
    """Which stages keep less than their backward reads per micro-batch and run (part of)
    their forward again in the backward (activation re-materialization; per stage, a
    ``StageRecompute``, whose words these are, and ``auto``). ``"all"``, the command
    line's word for full before, is read as ``FULL``."""

    AUTO = "auto"  # the solver chooses per stage: the fastest split that fits
    FULL = "full"  # every stage recomputes its whole forward (StageRecompute.FULL)
    SELECTIVE = "selective"  # every stage keeps its matmuls' outputs (StageRecompute.SELECTIVE)
    NONE = "none"  # every stage keeps its activations for every micro-batch in flight

    @classmethod
    def _missing_(cls, value: object) -> Recompute | None:
        return cls.FULL if value == "all" else None


class TiedPolicy(str, Enum):
    COLOCATE = "colocate"  # every user of a tied parameter on one stage
    COPY = "copy"  # a copy on each stage that uses it, gradients summed (all-reduce)


@dataclass(frozen=True)
class Node:
    """One (possibly coarsened) vertex of the DAG, costs for one micro-batch."""

    name: str
    forward_s: float
    backward_s: float  # input gradient (B) + weight gradient (W)
    param_bytes: int = 0  # parameters owned (tied parameters: see TiedGroup, not here)
    activation_bytes: int = 0  # saved for backward per micro-batch in flight
    # Gradients its backward allocates for one micro-batch: its output's (unless the model
    # returns it: the loss's backward makes that one), its inputs' and its parameters'.
    # Transient: a stage holds the largest of its nodes' at once (``StageMemory.backward``).
    grad_bytes: int = 0
    output_bytes: int = 0  # bytes of the value it produces (received by later stages)
    comm_s: float = 0.0  # time to move its output across one boundary (bytes/bw + latency)
    module: str = ""  # top-level block it belongs to, for the layer-count baseline and display
    members: tuple[str, ...] = ()  # fine-graph node names merged into it (empty: just `name`)
    # Its value is (part of) the model's output: the runner keeps it until the micro-batch's
    # backward and the loss reads it. A coarse node is returned if any member is.
    returned: bool = False
    # The weight-gradient (W) part of ``backward_s``: a zero-bubble schedule runs it apart
    # from the input gradient (B), later, in the bubbles.
    backward_weight_s: float = 0.0
    # Bytes W keeps alive from its micro-batch's B until it runs: the saved inputs of the
    # ops that have weight gradients (a linear's X, for dW = dY^T X).
    deferred_bytes: int = 0
    # Recomputed selectively at keep level l (``Problem.keep_levels``), a stage keeps
    # selective_bytes[l] of it per micro-batch in flight (the outputs of its matmuls and fused
    # attention that the level's rule keeps) and does not run selective_kept_s[l] of its
    # forward seconds again (at a level without an entry: kept nothing, runs it all again,
    # as recomputed in full).
    selective_bytes: tuple[int, ...] = ()
    selective_kept_s: tuple[float, ...] = ()
    # Recomputed selectively at any level, the seconds torch's SAC adds to its first run
    # and its run again, the host's that its device time does not hide (``lower``).
    selective_host_s: float = 0.0
    # Of forward_s and backward_s, the seconds of tensor parallelism's all-reduces and
    # gathers (``partition.tensor_parallel``): communication, which calibration leaves.
    forward_collective_s: float = 0.0
    backward_collective_s: float = 0.0
    # It writes in place into what selective recompute keeps (a matmul's output), which
    # SAC would hand the backward written, and no keep level is left that skips all such
    # outputs (fxpipe.lower.keep_levels): no stage recomputes selectively.
    writes_kept: bool = False

    @property
    def backward_input_s(self) -> float:
        return self.backward_s - self.backward_weight_s

    def selective(self, level: int) -> tuple[int, float]:
        """(bytes kept, forward seconds run again) recomputed selectively at ``level``: all
        of its forward but what it keeps, and what SAC adds to both runs."""
        if level >= len(self.selective_bytes):
            return 0, self.forward_s + self.selective_host_s
        return (self.selective_bytes[level],
                self.forward_s - self.selective_kept_s[level] + self.selective_host_s)


@dataclass(frozen=True)
class Edge:
    """Data flows from node ``src`` to node ``dst`` (indices into ``Problem.nodes``)."""

    src: int
    dst: int
    ordered: bool = True  # stage(src) <= stage(dst) must hold; False: only costs communication
    data: bool = True  # False: an ordering constraint only, no value moves (costs nothing)


@dataclass(frozen=True)
class TiedGroup:
    """A parameter read by several nodes (a GPT embedding reused by the LM head)."""

    name: str
    nodes: tuple[int, ...]
    param_bytes: int
    allreduce_s: float = 0.0  # summing its gradient between two copies, per step


@dataclass(frozen=True)
class Problem:
    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...]
    num_stages: int
    memory_limit: float = float("inf")  # bytes per device
    schedule: ScheduleKind = ScheduleKind.ONE_F_ONE_B
    microbatches: int = 1
    # Bytes of parameter state per byte of parameter: 1 (weights) + gradients + optimizer
    # state (fp32 Adam: 1 + 1 + 2 = 4; SGD with momentum: 3; plain SGD: 2; inference: 1).
    state_factor: float = 4.0
    # Keep only stage inputs per micro-batch and recompute in backward: on no stage, on
    # every stage, or on the stages the solver chooses (see ``fxpipe.partition.cost``).
    recompute: Recompute = Recompute.NONE
    # The rules a selective stage may keep by, from the fewest bytes kept to all
    # (fxpipe.runtime.recompute.KeepRule's (work, width)); a node's ``selective_bytes`` has
    # one entry per level. Under SELECTIVE every stage keeps by the last, (0, 0): all.
    keep_levels: tuple[tuple[int, int], ...] = ((0, 0),)
    # The (work, width) of the outputs no level keeps, which the model writes into in place
    # (every level's rule skips them: fxpipe.lower.keep_levels).
    unkept: tuple[tuple[int, int], ...] = ()
    workspace_bytes: int = 0  # reserved per device (CUDA context, allocator slack)
    # The loss, computed on the last stage for every micro-batch: bytes it saves for backward
    # (kept per micro-batch in flight there) and bytes its backward allocates for one
    # micro-batch (the gradient of its input). See ``fxpipe.lower`` for the default.
    loss_saved_bytes: int = 0
    loss_grad_bytes: int = 0
    comm: Comm = Comm.NEIGHBOUR
    tied: tuple[TiedGroup, ...] = ()
    tied_policy: TiedPolicy = TiedPolicy.COPY
    # Nodes whose index sets must share one stage (a layer's forward and backward).
    colocate: tuple[tuple[int, ...], ...] = field(default=())
    # False: every stage holds at least one node (K devices, K stage modules). True: a stage
    # may stay empty, i.e. "at most K devices", the model of the partitioning literature.
    allow_empty_stages: bool = False
    # Interleaved schedule: stage modules per GPU (v); num_stages = N * v.
    virtual_stages: int = 1
    # GPUs (N). 0: one per stage (num_stages / v when interleaved). More GPUs than stages:
    # the solver chooses how many replicas r_j each stage gets, sum r_j = N.
    num_devices: int = 0
    # Ring all-reduce of a replicated stage's gradients (see ``allreduce_s``).
    allreduce_bandwidth: float = float("inf")  # bytes / s
    allreduce_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"number of stages ({self.num_stages}) must be at least 1")
        if self.microbatches < 1:
            raise ValueError(f"number of micro-batches ({self.microbatches}) must be at least 1")
        v = self.virtual_stages
        if v < 1 or self.num_stages % v:
            raise ValueError(
                f"number of stages ({self.num_stages}) must be a multiple of the virtual "
                f"stages per GPU ({v})")
        spec = self.schedule.spec
        if spec.v_placed:
            if v != 2:
                raise ValueError(
                    f"the {self.schedule.value} schedule places two stage modules per GPU "
                    f"(got {v} virtual stages): use 2")
            if self.num_devices not in (0, self.num_stages // 2):
                raise ValueError(f"{self.schedule.value} stages cannot also be replicated")
            if self.schedule is ScheduleKind.DUALPIPEV and self.microbatches < self.num_stages:
                raise ValueError(
                    f"DualPipeV needs at least as many micro-batches ({self.microbatches}) "
                    f"as stages ({self.num_stages}): use {self.num_stages} micro-batches")
        elif (v > 1) != spec.interleaved:
            raise ValueError(
                f"virtual stages ({v}) need the interleaved schedule and the interleaved "
                f"schedule needs virtual stages (got {self.schedule.value})")
        interleaved = spec.interleaved
        if interleaved and self.num_devices not in (0, self.num_stages // v):
            raise ValueError("interleaved stages cannot also be replicated")
        if interleaved and self.microbatches % (self.num_stages // v):
            n = self.num_stages // v
            raise ValueError(
                f"interleaved 1F1B needs the micro-batches ({self.microbatches}) to be a "
                f"multiple of the GPUs ({n}): use {-(-self.microbatches // n) * n} micro-batches")
        if self.num_devices and self.num_devices < self.num_stages // v:
            raise ValueError(
                f"{self.num_devices} GPUs cannot run {self.num_stages // v} stages")
        assert isinstance(self.recompute, Recompute), self.recompute
        if self.recompute is Recompute.SELECTIVE and spec.splits_backward:
            raise ValueError(
                f"the {self.schedule.value} schedule runs each stage's backward in two "
                f"passes, which selective recompute cannot: use --recompute full, auto or "
                f"none with it, or another --schedule")
        writer = self.writes_kept
        if self.recompute is Recompute.SELECTIVE and writer is not None:
            raise ValueError(
                f"{writer} writes in place into the output of a matmul or attention, which "
                f"selective recompute would keep and hand the backward written: use "
                f"--recompute full, auto or none with this model")
        n = len(self.nodes)
        for e in self.edges:
            assert 0 <= e.src < n and 0 <= e.dst < n and e.src != e.dst, e

    @property
    def writes_kept(self) -> str | None:
        """The first node that writes in place into what selective recompute keeps (no
        stage of this model recomputes selectively); None when none does."""
        return next((n.name for n in self.nodes if n.writes_kept), None)

    @property
    def param_bytes(self) -> int:
        """Every parameter's bytes: the nodes' own, and each tied one once."""
        return sum(n.param_bytes for n in self.nodes) + sum(g.param_bytes for g in self.tied)

    @property
    def devices(self) -> int:
        """N: the GPUs the pipeline runs on."""
        return self.num_devices or self.num_stages // self.virtual_stages

    @property
    def replicates(self) -> bool:
        """More GPUs than stages: some stage runs on several (data-parallel)."""
        return self.virtual_stages == 1 and self.devices > self.num_stages

    def device_of(self, stage: int) -> int:
        """The GPU a stage module runs on (its first replica's, when replicated)."""
        if self.schedule.spec.v_placed:
            return stage if stage < self.devices else self.num_stages - 1 - stage
        return stage % self.devices if self.virtual_stages > 1 else stage


def allreduce_terms(problem: Problem, replicas: int) -> tuple[float, float]:
    """(seconds per byte, fixed seconds) of a ring all-reduce over ``replicas`` GPUs, the
    slope and the intercept of ``ring_allreduce_s`` (linear in its bytes; the CP-SAT rows
    take it so): 2(r - 1)/r / bandwidth and 2(r - 1) * latency; nothing for one replica.
    The fixed part is paid even with no parameters: the replicas still synchronise every
    step."""
    bandwidth, latency_s = problem.allreduce_bandwidth, problem.allreduce_latency_s
    return (ring_allreduce_s(1.0, replicas, bandwidth, 0.0),
            ring_allreduce_s(0.0, replicas, bandwidth, latency_s))


def allreduce_s(problem: Problem, nbytes: float, replicas: int) -> float:
    """Ring all-reduce of ``nbytes`` over ``replicas`` GPUs (see ``allreduce_terms``)."""
    per_byte, fixed = allreduce_terms(problem, replicas)
    return per_byte * nbytes + fixed


def stage_flights(problem: Problem) -> tuple[int, ...]:
    """Per stage module, the micro-batches whose activations it holds at its peak: the
    schedule kind's in-flight rule (``fxpipe.schedules.KINDS``)."""
    return problem.schedule.spec.flights(
        problem.num_stages, problem.virtual_stages, problem.microbatches)


def stage_deferred(problem: Problem) -> tuple[int, ...]:
    """Per stage module, the micro-batches whose weight gradient (W) waits at its peak,
    each keeping ``Node.deferred_bytes``: the schedule kind's rule (ZB-H1's stage j holds
    j + 1); none for a kind that does not split its backwards."""
    return problem.schedule.spec.deferred(
        problem.num_stages, problem.virtual_stages, problem.microbatches)
