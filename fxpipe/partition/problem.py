"""The partitioning problem as plain data: no torch, no graph library.

A ``Problem`` is a DAG of nodes with costs, K pipeline stages on identical
devices with a memory limit, and the schedule that decides how many
micro-batches each stage keeps in flight. Units are seconds and bytes; the
lowering from an annotated FX graph (``fxpipe.lower``) and the benchmark
adapters fill them in.

Legend used throughout ``fxpipe.partition``:
    n: number of nodes, K: number of stages, M: micro-batches per step,
    v: a node, j: a stage, b: a boundary between stage b and stage b + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

__all__ = [
    "Comm",
    "Edge",
    "Node",
    "Problem",
    "Schedule",
    "TiedGroup",
    "TiedPolicy",
    "in_flight",
]


class Schedule(str, Enum):
    GPIPE = "gpipe"  # fill-drain: all M forwards, then all M backwards
    ONE_F_ONE_B = "1f1b"  # PipeDream-flush: at most K - j micro-batches in flight at stage j


class Comm(str, Enum):
    NEIGHBOUR = "neighbour"  # torch.distributed.pipelining: bytes cross every boundary between
    DIRECT = "direct"  # one send from the producer to every stage that reads it


class TiedPolicy(str, Enum):
    COLOCATE = "colocate"  # every user of a tied parameter on one stage
    REPLICATE = "replicate"  # a copy on each stage that uses it, gradients summed (all-reduce)


@dataclass(frozen=True)
class Node:
    """One (possibly coarsened) vertex of the DAG, costs for one micro-batch."""

    name: str
    forward_s: float
    backward_s: float
    param_bytes: int = 0  # parameters owned (tied parameters: see TiedGroup, not here)
    activation_bytes: int = 0  # saved for backward per micro-batch in flight
    output_bytes: int = 0  # bytes of the value it produces (received by later stages)
    comm_s: float = 0.0  # time to move its output across one boundary (bytes/bw + latency)
    module: str = ""  # top-level block it belongs to, for the layer-count baseline and display
    members: tuple[str, ...] = ()  # fine-graph node names merged into it (empty: just `name`)


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
    schedule: Schedule = Schedule.ONE_F_ONE_B
    microbatches: int = 1
    # Bytes of parameter state per byte of parameter: 1 (weights) + gradients + optimizer
    # state (fp32 Adam: 1 + 1 + 2 = 4; SGD with momentum: 3; plain SGD: 2; inference: 1).
    state_factor: float = 4.0
    recompute: bool = False  # keep only stage inputs per micro-batch, recompute in backward
    workspace_bytes: int = 0  # reserved per device (CUDA context, allocator slack)
    comm: Comm = Comm.NEIGHBOUR
    tied: tuple[TiedGroup, ...] = ()
    tied_policy: TiedPolicy = TiedPolicy.REPLICATE
    # Nodes whose index sets must share one stage (a layer's forward and backward).
    colocate: tuple[tuple[int, ...], ...] = field(default=())
    # False: every stage holds at least one node (K devices, K stage modules). True: a stage
    # may stay empty, i.e. "at most K devices", the model of the partitioning literature.
    allow_empty_stages: bool = False

    def __post_init__(self) -> None:
        if self.num_stages < 1:
            raise ValueError(f"Number of stages ({self.num_stages}) must be at least 1.")
        if self.microbatches < 1:
            raise ValueError(f"Number of micro-batches ({self.microbatches}) must be at least 1.")
        n = len(self.nodes)
        for e in self.edges:
            assert 0 <= e.src < n and 0 <= e.dst < n and e.src != e.dst, e


def in_flight(schedule: Schedule, microbatches: int, num_stages: int, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at its peak."""
    if schedule is Schedule.GPIPE:
        return microbatches
    return min(microbatches, num_stages - stage)
