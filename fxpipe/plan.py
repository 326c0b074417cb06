"""The result of partitioning: which fine-graph nodes run on which stage, and what it costs.

A ``Plan`` is plain data that round-trips through ``plan.json``. Codegen reads a
plan, never a solver, so tests can hand-write one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from fxpipe.runtime.recompute_modes import KeepRule
from fxpipe.schedules import Table, kind_of

__all__ = ["DynamicDim", "Estimate", "Layout", "LayoutRow", "Plan", "SolverReport",
           "StageMemory", "StagePlan", "StageRecompute", "StageTimes"]

PLAN_FORMAT = 1


@dataclass(frozen=True)
class StageMemory:
    """Predicted peak bytes on one device, by kind."""

    params: int = 0
    grads: int = 0
    optimizer: int = 0
    activations: int = 0  # saved for backward, times micro-batches in flight
    received: int = 0  # inputs received from other stages, times micro-batches in flight
    workspace: int = 0
    stashed: int = 0  # weight stashing: a parameter copy per micro-batch in flight
    # values it sends to later stages or returns, kept per micro-batch in flight until that
    # micro-batch's backward, plus one micro-batch of their gradients
    outputs: int = 0
    loss: int = 0  # the loss on the last stage: what it saves for backward + its gradient
    backward: int = 0  # gradients alive while its largest node runs backward (one micro-batch)
    # zero-bubble schedules: what each waiting weight gradient (W) keeps alive after its
    # micro-batch's input gradient ran, times the micro-batches whose W waits at the peak
    deferred: int = 0

    @property
    def total(self) -> int:
        return (
            self.params + self.grads + self.optimizer + self.activations + self.received
            + self.outputs + self.loss + self.backward + self.stashed + self.workspace
            + self.deferred
        )


class StageRecompute(str, Enum):
    """How a stage recomputes: what it keeps for its backward per micro-batch in flight
    (the runtime's modes, fxpipe.runtime.recompute_modes.MODES, in the order of the bytes
    kept)."""

    NONE = "none"  # everything its backward reads
    # its inputs and the outputs of its matmuls and fused attention (torch's selective
    # activation checkpointing): the other ops run again in the backward
    SELECTIVE = "selective"
    FULL = "full"  # its inputs only: its whole forward runs again in the backward


class StageTimes:
    """A stage's per-micro-batch time from its parts, one formula for the plan's stages
    (``StagePlan``) and the solver's (``partition.cost.StageCost``)."""

    forward_s: float
    backward_s: float  # input gradient (B) + weight gradient (W), a recomputed forward included
    comm_s: float  # send + receive time per micro-batch
    backward_weight_s: float  # the weight-gradient (W) part of backward_s
    recompute_s: float  # the part of backward_s that runs the forward again (recompute)

    @property
    def backward_input_s(self) -> float:
        """The input-gradient (B) part of backward_s, a recomputed forward included."""
        return self.backward_s - self.backward_weight_s

    @property
    def time_s(self) -> float:
        """Per-micro-batch time of this stage: forward + backward + communication."""
        return self.forward_s + self.backward_s + self.comm_s


@dataclass(frozen=True)
class StagePlan(StageTimes):
    index: int
    nodes: tuple[str, ...]  # fine-graph node names, in graph order
    inputs: tuple[str, ...] = ()  # values it receives: producing node names, graph order
    outputs: tuple[str, ...] = ()  # values it sends on or returns, graph order
    parameters: tuple[str, ...] = ()  # qualified names of the parameters it holds
    flops_forward: int = 0
    flops_backward: int = 0
    forward_s: float = 0.0
    backward_s: float = 0.0  # input gradient (B) + weight gradient (W)
    comm_s: float = 0.0  # send + receive time per micro-batch
    memory: StageMemory = field(default_factory=StageMemory)
    recompute: StageRecompute = StageRecompute.NONE
    # GPUs running this stage data-parallel ("2-1-1": stage 0 on two GPUs, each taking half
    # of every micro-batch, gradients all-reduced). forward_s/backward_s are per replica
    # (already divided by replicas); comm_s includes the all-reduce.
    replicas: int = 1
    backward_weight_s: float = 0.0  # the weight-gradient (W) part of backward_s
    # The part of backward_s that runs the forward again, recomputed (SAC's host time on
    # that run included); plan.json has it only then.
    recompute_s: float = 0.0
    # Of forward_s and backward_s (the forward run again included), the seconds of tensor
    # parallelism's all-reduces and gathers; plan.json has them only under it.
    collective_s: tuple[float, float] = (0.0, 0.0)
    # A selective stage that keeps only some of its matmuls' and attention's outputs: the
    # (work, width) of its fxpipe.runtime.recompute_modes.KeepRule (those doing more FLOPs per
    # element than work, and of those doing work, the ones at most width wide). None:
    # it keeps them all (or it is not selective). ``skips``: the (work, width) of the
    # outputs it never keeps, which the model writes into in place. plan.json, either or
    # both set: "keeps": {"work": W, "width": N, "skip": [[W1, N1], ...]}.
    keeps: tuple[int, int] | None = None
    skips: tuple[tuple[int, int], ...] = ()

    @property
    def keep_rule(self) -> KeepRule | None:
        """A selective stage's rule (``keeps`` and ``skips``); None for another stage."""
        if self.recompute is not StageRecompute.SELECTIVE:
            return None
        return KeepRule(*(self.keeps or (0, 0)), self.skips)

    @property
    def recompute_mode(self) -> str:
        """How the runtime recomputes it (fxpipe.runtime.recompute_modes.modes):
        ``recompute``'s value, or a selective stage's rule printed (``"selective:W:N"``
        where it keeps by a rule, ``"selective:W:N:W1xN1,..."`` where it also skips
        outputs)."""
        rule = self.keep_rule
        return self.recompute.value if rule is None else str(rule)


@dataclass(frozen=True)
class SolverReport:
    # "cp-sat"; "interval-dp" where the block bound settled the best of the interval DP's
    # and the baselines' splits and no CP-SAT program ran; "uniform-layers",
    # "parameters", "greedy-time", "hand-written"
    method: str
    status: str  # "OPTIMAL", "FEASIBLE", "INFEASIBLE", "HEURISTIC"
    objective: float  # bottleneck seconds found
    bound: float  # best proved lower bound on the bottleneck
    wall_s: float = 0.0  # not in plan.json, which is reproducible: see Plan.to_dict
    solved_nodes: int = 0  # nodes of the (coarsened) graph the solver saw
    graph_nodes: int = 0  # nodes of the fine graph
    # The wall-clock safety net, not the deterministic work limit, stopped the search: the
    # answer may differ run to run (not in plan.json; the plan's notes say so instead).
    wall_clock_stopped: bool = False

    @property
    def gap(self) -> float:
        if self.objective <= 0:
            return 0.0
        return max(0.0, (self.objective - self.bound) / self.objective)


@dataclass(frozen=True)
class Estimate:
    """Predicted step figures of a partition under the plan's schedule."""

    bottleneck_s: float  # slowest stage's per-micro-batch time
    iteration_s: float  # (M - 1) * bottleneck + sum of stage times (fill + steady + drain)
    bubble_fraction: float  # (K - 1) / (v*M + K - 1): idle share of the whole step
    max_memory: int  # largest device's predicted bytes
    fits: bool  # every device within the memory limit
    bubble_ratio: float = 0.0  # (K - 1) / (v*M): idle time over the ideal (bubble-free) time


@dataclass(frozen=True)
class DynamicDim:
    """A dimension of a graph input that the stages compute with, not a traced constant.

    The plan is costed at the traced size; ``low``..``high`` is the range the tracer
    assumed (``high`` None: unbounded)."""

    input: str  # the graph input's name
    dim: int
    traced: int  # its size in the example the plan is costed at
    low: int
    high: int | None = None


@dataclass(frozen=True)
class LayoutRow:
    """One layout the cluster search considered (``Layout.considered``)."""

    pp: int  # GPUs per pipeline
    dp: int  # pipelines, data-parallel
    dp_mode: str  # "fsdp" or "ddp" (torch's FSDP2 or DDP over the d copies of a stage)
    microbatches: int  # per pipeline per step
    # "chosen", "solved", "pruned" (its bound is no better), "no fit", "invalid"; "by hand":
    # a layout people pick, planned as it runs (``why`` says which; its bound is its step)
    status: str
    step_s: float | None = None  # predicted step (None: not solved)
    bound_s: float = 0.0  # a step no split of it can beat
    max_memory: int | None = None  # the largest GPU's bytes (None: not solved)
    why: str = ""  # for "no fit" and "invalid": the solver's sentence
    tp: int = 1  # GPUs of a host splitting each stage's ops (plan.json: only when > 1)


@dataclass(frozen=True)
class Layout:
    """How N GPUs, G to a host, run the plan: ``pp`` GPUs per pipeline (the plan's stages
    on them) times ``dp`` pipelines, each taking ``microbatches`` micro-batches of
    ``microbatch_size`` samples per step (``global_batch`` samples in all), the d copies of
    every stage kept equal by torch's FSDP2 or DDP (``dp_mode``). Ranks sit on a
    ``mesh`` of those dimensions, outermost first (rank = i * pp + j: stage j of pipeline
    i). With ``tp`` > 1 each stage runs on tp GPUs of a host as Megatron-LM splits it
    (``tp_pairs`` pairs, ``tp_vocab`` modules by vocabulary, ``tp_replicated`` whole;
    ``sp_ops`` ops between the pairs on 1/tp of the tokens, sequence parallelism, whose
    rows ``sp_kept`` keep their all-reduce), on a (dp, pp, tp) mesh (rank = (i * pp + j)
    * tp + k); plan.json has them only then.
    ``pipeline_link`` and ``sync_link`` ("intra" or "inter") say which link the
    stage sends and the gradient syncs ride. ``step_s`` = the pipeline's step plus
    ``sync_s``, the slowest stage's sync (``fxpipe.partition.layout``). ``proved``: every
    other layout considered was solved or bounded at no better a step. Every op ran at
    ``compute_efficiency`` of the cost model's speed in the search and the plan
    (``calibrated``: the costs were measured, ``--calibrate``)."""

    gpus: int
    gpus_per_node: int
    pp: int
    dp: int
    dp_mode: str
    global_batch: int
    microbatch_size: int
    microbatches: int
    pipeline_link: str
    sync_link: str
    sync_s: float
    step_s: float
    proved: bool
    mesh: tuple[str, ...] = ("dp", "pp")
    considered: tuple[LayoutRow, ...] = ()
    tp: int = 1
    tp_pairs: int = 0
    tp_replicated: tuple[str, ...] = ()
    tp_vocab: tuple[str, ...] = ()
    # sequence parallelism between the pairs: the ops per token run on 1/t of the tokens
    # (0: none), and the modules of the rows that keep their all-reduce
    sp_ops: int = 0
    sp_kept: tuple[str, ...] = ()
    compute_efficiency: float = 1.0
    calibrated: bool = False


@dataclass(frozen=True)
class Plan:
    num_stages: int  # stage modules (K * v for an interleaved schedule)
    schedule: str  # a ScheduleKind's value (fxpipe.schedules.KINDS): gpipe, 1f1b, zbv, ...
    microbatches: int
    stages: tuple[StagePlan, ...]
    solver: SolverReport
    estimate: Estimate
    model: str = ""
    tracer: str = ""
    device: str = ""
    memory_limit: float = float("inf")
    optimizer: str = "adam"
    precision: str = "32-true"  # Lightning's name: 32-true, bf16-mixed, bf16-true, 16-mixed
    # a tied parameter -> "colocated" (its readers on one stage) or "copied" (a copy on each
    # stage that reads it, their gradients summed)
    tied: dict[str, str] = field(default_factory=dict)
    # The keys the stages' state_dict()s hold between them, grouped by tensor: a tied
    # parameter's names share a group (("emb.weight", "head.weight")). fxpipe merge --plan
    # checks stage checkpoints against it; empty in plans written before it. It may list
    # a non-persistent buffer the graph reads by name (planning.state_keys), never less.
    state_keys: tuple[tuple[str, ...], ...] = ()
    baselines: dict[str, Estimate] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    # Interleaved 1F1B: each GPU runs v stage modules; stage j runs on GPU j % (K / v).
    virtual_stages: int = 1
    # the graph inputs' dimensions that may differ from the example's (every other one is
    # fixed at its traced size)
    dynamic_dims: tuple[DynamicDim, ...] = ()
    # Graph inputs without a batch dimension: handed whole to every micro-batch, not split
    shared_inputs: tuple[str, ...] = ()
    # The cluster's layout, where the plan was searched for one (``fxpipe.cluster``); None:
    # one pipeline on all the plan's GPUs (--replicate, and not in plan.json)
    layout: Layout | None = None

    @property
    def num_devices(self) -> int:
        """GPUs the plan uses: one per stage times its replicas, or K / v when interleaved
        or V-placed."""
        if self.virtual_stages > 1:
            return self.num_stages // self.virtual_stages
        return sum(stage.replicas for stage in self.stages)

    @property
    def tp(self) -> int:
        """GPUs of a host splitting each stage's ops (the layout's; 1 without one)."""
        return 1 if self.layout is None else self.layout.tp

    @property
    def compute_efficiency(self) -> float:
        """The share of the cost model's speed every op ran at (the layout's; 1 without
        one)."""
        return 1.0 if self.layout is None else self.layout.compute_efficiency

    @property
    def v_placed(self) -> bool:
        """Stage j and stage K - 1 - j on GPU j, as the schedule kind says (``KindSpec``)."""
        return kind_of(self.schedule).spec.v_placed

    def schedule_table(self) -> Table:
        """The plan's schedule as a clock-tick table over its stage modules."""
        k, v = self.num_stages, self.virtual_stages
        spec = kind_of(self.schedule).spec
        if spec.interleaved and self.num_devices * v != k:
            raise ValueError(
                f"an interleaved plan on {self.num_devices} GPUs with {v} virtual stages each "
                f"has {self.num_devices * v} stages, not {k}"
            )
        return spec.table(k, v, self.microbatches)

    @property
    def configuration(self) -> str:
        """PipeDream's notation: replicas per stage, e.g. "2-1-1"."""
        return "-".join(str(stage.replicas) for stage in self.stages)

    def devices_of(self, stage: int) -> tuple[int, ...]:
        """GPU indices (0 .. num_devices - 1) that run stage module ``stage``."""
        if self.v_placed:
            return (stage if stage < self.num_devices else self.num_stages - 1 - stage,)
        if self.virtual_stages > 1:
            return (stage % self.num_devices,)
        first = sum(s.replicas for s in self.stages[:stage])
        return tuple(range(first, first + self.stages[stage].replicas))

    def stage_of(self) -> dict[str, int]:
        """Fine-graph node name -> stage index."""
        return {name: stage.index for stage in self.stages for name in stage.nodes}

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = PLAN_FORMAT
        data["solver"]["gap"] = self.solver.gap
        # The same model and flags give a byte-identical plan.json; wall time differs from
        # run to run, so the CLI writes it to timing.json instead.
        del data["solver"]["wall_s"]
        del data["solver"]["wall_clock_stopped"]
        for stage, raw in zip(self.stages, data["stages"], strict=True):
            raw["time_s"] = stage.time_s
            raw["backward_input_s"] = stage.backward_input_s
            raw["memory"]["total"] = stage.memory.total
            del raw["skips"]
            if not stage.recompute_s:
                del raw["recompute_s"]
            if not any(stage.collective_s):
                del raw["collective_s"]
            if stage.keeps is None and not stage.skips:
                del raw["keeps"]
            else:
                work, width = stage.keeps or (0, 0)
                raw["keeps"] = {"work": work, "width": width,
                                **({"skip": [list(s) for s in stage.skips]} if stage.skips else {})}
        if self.memory_limit == float("inf"):
            data["memory_limit"] = None
        if not self.state_keys:
            del data["state_keys"]
        if self.layout is None:
            del data["layout"]
        else:  # a layout (or row) without tensor parallelism as before it
            for raw in (data["layout"], *data["layout"]["considered"]):
                if raw.get("tp") == 1:
                    for key in ("tp", "tp_pairs", "tp_replicated", "tp_vocab", "sp_ops",
                                "sp_kept"):
                        raw.pop(key, None)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        def stage(raw: dict[str, Any]) -> StagePlan:
            raw = dict(raw)
            raw.pop("time_s", None)
            raw.pop("backward_input_s", None)
            memory = dict(raw.pop("memory", {}))
            memory.pop("total", None)
            tuples: dict[str, tuple[Any, ...]] = {
                k: tuple(raw[k]) for k in ("nodes", "inputs", "outputs", "parameters") if k in raw
            }
            fields: dict[str, Any] = {**raw, **tuples}
            if "collective_s" in raw:
                fields["collective_s"] = tuple(raw["collective_s"])
            if "keeps" in raw:
                rule = (raw["keeps"]["work"], raw["keeps"]["width"])
                fields["skips"] = tuple(tuple(s) for s in raw["keeps"].get("skip", ()))
                fields["keeps"] = None if rule == (0, 0) else rule
            if "recompute" in raw:  # a bool in plans written before selective recompute
                was = raw["recompute"]
                fields["recompute"] = StageRecompute(
                    {True: "full", False: "none"}.get(was, was))
            return StagePlan(**fields, memory=StageMemory(**memory))

        solver = dict(data["solver"])
        solver.pop("gap", None)
        limit = data.get("memory_limit")
        return cls(
            num_stages=data["num_stages"],
            schedule=data["schedule"],
            microbatches=data["microbatches"],
            stages=tuple(stage(s) for s in data["stages"]),
            solver=SolverReport(**solver),
            estimate=Estimate(**data["estimate"]),
            model=data.get("model", ""),
            tracer=data.get("tracer", ""),
            device=data.get("device", ""),
            memory_limit=float("inf") if limit is None else float(limit),
            optimizer=data.get("optimizer", "adam"),
            precision=data.get("precision", "32-true"),
            tied={str(k): str(v) for k, v in data.get("tied", {}).items()},
            state_keys=tuple(tuple(map(str, group)) for group in data.get("state_keys", ())),
            baselines={k: Estimate(**v) for k, v in data.get("baselines", {}).items()},
            notes=tuple(data.get("notes", ())),
            virtual_stages=int(data.get("virtual_stages", 1)),
            dynamic_dims=tuple(DynamicDim(**d) for d in data.get("dynamic_dims", ())),
            shared_inputs=tuple(data.get("shared_inputs", ())),
            layout=_layout(data.get("layout")),
        )

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))


def _layout(raw: dict[str, Any] | None) -> Layout | None:
    if raw is None:
        return None
    fields = dict(raw)
    fields["mesh"] = tuple(fields.get("mesh", ("dp", "pp")))
    fields["considered"] = tuple(LayoutRow(**row) for row in fields.get("considered", ()))
    fields.update({k: tuple(fields.get(k, ())) for k in ("tp_replicated", "tp_vocab",
                                                         "sp_kept")})
    return Layout(**fields)
