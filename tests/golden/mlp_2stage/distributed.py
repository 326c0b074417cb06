"""TinyMLP's 2 stages on torch.distributed.pipelining, generated
by fxpipe. Everything above the runtime's own code is generated from the plan;
the runtime below it is fxpipe/codegen/distributed.py, copied verbatim:

Run the generated stages one per process on torch.distributed.pipelining.

This module is copied verbatim into every generated ``distributed.py``, between
a generated header (the package's stage classes and the literal tables below)
and a footer that binds them; it imports only torch and the standard library.

# K: stages, r_j: replicas of stage j (REPLICAS), Σ r_j processes, M: micro-batches.

torch's ``PipelineStage`` passes a flat tuple of tensors from stage k to stage
k + 1 only. Each generated stage (inputs by name, a tuple of outputs) is
wrapped in a ``StageAdapter`` whose forward takes and returns flat tuples in
the order of the ``WIRES`` table: ``WIRES[k]`` names the values stage k
receives (``WIRES[0]``: the graph inputs any stage reads). A value that skips
stages (a U-Net skip, an attention mask) is in every wire between its producer
and its last reader, so the stages in between pass it along::

    stage 0 ──(x1, x2)──► stage 1 ──(x1, y)──► stage 2      x1: made by 0, read by 2

The last stage returns the model's output (``build_output``) for ``loss_fn``;
torch's schedules take only tensors from a stage, so an output with structure (a
Hugging Face model's dict) leaves the stage as its tensor leaves and ``loss_fn``
gets it rebuilt.
Values that are not tensors (``x.size(1)``, a float keyword argument) cannot
travel; they are read from the example micro-batch and baked into the
adapters as constants (micro-batch shapes are fixed by the static metadata
anyway), and ``train_step`` checks that a baked graph input keeps its value.

Tied parameters (``TIED``: one Parameter bound into several stages, a GPT
embedding reused as the LM head) live as one copy per rank; after backward
``train_step`` sums their gradients over a process group of exactly the ranks
that hold a copy, so every copy sees the gradient of the unsplit model.

Replicated stages (PipeDream's "2-2" or "1-1-2", ``REPLICAS``): stage j runs on
r_j ranks, numbered as ``DEVICE_OF`` numbers its GPUs (stage j's first rank is
r_0 + ... + r_{j-1}), and its replica i takes chunk i of the r_j equal chunks of
every micro-batch, as the single-process runner splits a replicated stage's
micro-batch. When every stage has the same r, the K·r ranks form r lanes, each a
whole ``PipelineStage`` pipeline of K ranks on its own process group (rank j·r + l
runs stage j in lane l)::

    lane 0 | rank 0 (stage 0) ──► rank 2 (stage 1)     chunk 0 of every micro-batch
    lane 1 | rank 1 (stage 0) ──► rank 3 (stage 1)     chunk 1
             └─ all-reduce ─┘     └─ all-reduce ─┘     gradients, over each stage's r ranks

After backward every gradient is averaged over its stage's r replicas (a tied
one over all its holders in all lanes, divided by r), and the last stage's loss
over the lanes: with a loss that is a mean over the batch and equal chunks, the
gradient of the whole micro-batch.

Stages with different replica counts do not fit ``PipelineStage``, whose wires
join one rank to one rank. A ``TableStage`` runs them instead: every rank walks
the runner's ``SCHEDULE`` table and does its own stage's actions, sending each
replica the rows of a value that it takes (``dist.isend``/``irecv``, the wires
and adapters above), and sending gradients back the same way::

    1-2, b = 4 rows:  stage 0 (rank 0) rows 0-3 ──┬─ rows 0-1 ─► stage 1 replica 0 (rank 1)
                                                  └─ rows 2-3 ─► stage 1 replica 1 (rank 2)

A tensor whose dim 0 is not the micro-batch's rows (a causal mask) goes whole
from the producer's replica 0 to every replica, and their gradients for it are
summed there. The last stage's replicas divide their chunk's loss by r, so the
gradients summed over each stage's replicas (and over all copies of a tied
parameter) are the whole micro-batch's. Each send matches a receive at a later
tick of the table, so no rank waits on one that waits on it.

Interleaved plans (Megatron-LM, ``VIRTUAL_STAGES`` = v > 1): the K·v stages run on
K ranks, stage j on rank j % K, as the single-process runner puts stage j on GPU
j % K. ``pipeline_stages`` gives each rank its v ``PipelineStage`` objects and
``build_schedule`` torch's ``ScheduleInterleaved1F1B`` over them; the wires are the
same (stage j sends to stage j + 1, now on the next rank). A tied parameter held by
two stages of one rank is one copy there, summed over the ranks that hold it::

    rank 0: stage 0, stage 2        stage 0 ──► stage 1 ──► stage 2 ──► stage 3
    rank 1: stage 1, stage 3        (rank 0)    (rank 1)    (rank 0)    (rank 1)

Memory: with ``checkpoint``, ``pipeline_stage`` allocates only the rank's own
stage (parameters and buffers still on ``meta`` become empty tensors on
``device``, then get their values from the checkpoint by their original key
names; a checkpoint file is memory-mapped), so no rank holds the whole model.
Build the model with ``parameters_on_meta()``: parameters land on ``meta`` and
buffers stay real (non-persistent buffers such as causal masks are not in
checkpoints).

    rank, world_size, device = init_distributed()
    with parameters_on_meta():
        model = build_model()
    stage = pipeline_stage(model, rank, world_size, device, *example_microbatch,
                           checkpoint="model.pt")
    schedule = build_schedule(stage, loss_fn)
    loss = train_step(schedule, stage, *mini_batch, target=target)   # last rank: loss

(``pipeline_stages`` instead of ``pipeline_stage`` gives a list of the rank's stages
for any plan, one unless interleaved; the other calls take the list as well.)
"""

import argparse
import contextlib
import importlib.util
import os
import resource
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)
from torch.utils import _pytree as pytree

from .runner import MICROBATCHES, REPLICAS, SCHEDULE, build_output, flatten_inputs
from .stage0 import Stage0
from .stage1 import Stage1

STAGE_CLASSES = (Stage0, Stage1)
SCHEDULE_KIND = "1f1b"
# VIRTUAL_STAGES: stages per rank (interleaved: stage k on rank k % (K / v))
VIRTUAL_STAGES = 1
# UNSUPPORTED: why this plan cannot run here (None: it can)
UNSUPPORTED = None
# WIRES[k]: the values stage k receives, in this order; a value passes through
# every stage between the one that makes it and the last one that reads it.
WIRES = (
    # into stage 0
    ("x", "scale"),
    # into stage 1
    ("scale", "relu", "relu_1"),
)
# TIED: parameters bound by several stages, stage -> name; their gradients are
# summed over exactly the ranks of those stages after backward.
TIED = ()


__all__ = [
    "DistributedPipeline",
    "StageAdapter",
    "init_distributed",
    "parameters_on_meta",
    "peak_rss_bytes",
]


# ---------------------------------------------------------------------------- launch


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun job: (rank, world size, this rank's device). gloo on the
    CPU, NCCL on GPUs (one GPU per local rank)."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"not launched under torchrun ({' and '.join(missing)} unset): run "
            "`torchrun --nproc-per-node N train_torchrun.py ...` with N the plan's GPUs"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return rank, world_size, device


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with every parameter on ``meta`` (nothing allocated) and its
    buffers real. A parameter assigned twice (a tied weight) stays one object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ---------------------------------------------------------------------------- adapter


class StageAdapter(nn.Module):
    """A generated stage as torch's pipelining wants it: a flat tuple of tensors
    in (``receives``), a flat tuple out (``sends``), or the model's output at the
    last stage. ``constants`` are the non-tensor values baked in."""

    def __init__(
        self,
        stage: nn.Module,
        receives: Sequence[str],
        sends: Sequence[str] | None,
        constants: Mapping[str, Any],
        build_output: Callable[[dict[str, Any]], Any],
    ) -> None:
        super().__init__()
        self.stage = stage
        self.receives = tuple(receives)
        self.sends = None if sends is None else tuple(sends)
        self.constants = dict(constants)
        self.build_output = build_output
        self.tied: list[tuple[Any, nn.Parameter]] = []  # (process group, this rank's copy)
        self.replica_group: Any = None  # the ranks running this stage (replicated stages)
        self.microbatches = 1  # per step, set by build_schedule
        # last stage with a structured output: its leaves (None where a tensor goes) and
        # structure; it returns only the tensors, ``rebuild_output`` puts them back
        self.output_leaves: list[Any] | None = None
        self.output_spec: Any = None

    def forward(self, *flat: torch.Tensor) -> Any:
        values: dict[str, Any] = dict(self.constants)
        values.update(zip(self.receives, flat, strict=True))
        names = cast(tuple[str, ...], self.stage.INPUTS)
        outputs = self.stage(**{name: values[name] for name in names})
        values.update(zip(cast(tuple[str, ...], self.stage.OUTPUTS), outputs, strict=True))
        if self.sends is None:
            output = self.build_output(values)
            if self.output_leaves is None:
                return output
            return tuple(x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor))
        # sends need contiguous memory (a transposed view may be one of the values)
        return tuple(values[name].contiguous() for name in self.sends)

    def flatten_output(self, example: Any) -> None:
        """From now on return the tensor leaves of an output that is more than a tensor
        or a tuple of tensors (``example``: one micro-batch's output)."""
        if isinstance(example, torch.Tensor) or (
                isinstance(example, tuple) and all(isinstance(x, torch.Tensor) for x in example)):
            return
        leaves, self.output_spec = pytree.tree_flatten(example)
        self.output_leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]

    def rebuild_output(self, tensors: Any) -> Any:
        """The model's output from what ``forward`` returned."""
        if self.output_leaves is None:
            return tensors
        given = iter(tensors if isinstance(tensors, tuple) else (tensors,))
        leaves = [next(given) if x is None else x for x in self.output_leaves]
        return pytree.tree_unflatten(leaves, self.output_spec)


# ---------------------------------------------------------------------------- pipeline


class DistributedPipeline:
    """The package's stages, wires and tied parameters; the generated footer makes
    one and exports its methods as module functions."""

    def __init__(
        self,
        *,
        stage_classes: Sequence[Callable[[nn.Module], nn.Module]],
        wires: Sequence[Sequence[str]],
        tied: Sequence[Mapping[int, str]],
        schedule: str,
        microbatches: int,
        flatten_inputs: Callable[..., dict[str, Any]],
        build_output: Callable[[dict[str, Any]], Any],
        replicas: Sequence[int] = (),
        table: Sequence[Sequence[tuple[int, str, int]]] = (),
        unsupported: str | None = None,
        virtual_stages: int = 1,
    ) -> None:
        assert len(wires) == len(stage_classes), (len(wires), len(stage_classes))
        self.unsupported = unsupported  # why this plan cannot run under torchrun
        self.replicas = tuple(replicas) or (1,) * len(stage_classes)
        assert len(self.replicas) == len(stage_classes) and min(self.replicas) >= 1
        # interleaved: v stages per rank, stage j on rank j % num_ranks; never replicated
        self.virtual_stages = virtual_stages
        assert len(stage_classes) % virtual_stages == 0
        assert virtual_stages == 1 or max(self.replicas) == 1
        # the same r on every stage: r PipelineStage pipelines side by side, else TableStage
        self.uniform = len(set(self.replicas)) == 1
        self.lanes = self.replicas[0] if self.uniform else 1
        self.first_rank = [sum(self.replicas[:j]) for j in range(len(self.replicas))]
        self.table = [tuple(tick) for tick in table]  # the runner's SCHEDULE (TableStage)
        self.stage_classes = list(stage_classes)
        self.wires = [tuple(w) for w in wires]
        self.tied = [dict(group) for group in tied]
        self.schedule = schedule
        self.microbatches = microbatches
        self.flatten_inputs = flatten_inputs
        self.build_output = build_output

    @property
    def num_stages(self) -> int:
        return len(self.stage_classes)

    @property
    def num_ranks(self) -> int:
        return sum(self.replicas) // self.virtual_stages

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of ``rank``: stage j's replicas are ranks first_rank[j] + i
        (with the same r everywhere, rank j·r + l runs stage j in lane l). Interleaved:
        (the rank's first stage, 0)."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"rank {rank} has no stage: this package runs on ranks 0..{self.num_ranks - 1}"
            )
        if self.virtual_stages > 1:
            return rank, 0
        j = max(j for j, first in enumerate(self.first_rank) if first <= rank)
        return j, rank - self.first_rank[j]

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The stages ``rank`` runs: one, or v when interleaved (rank, rank + K, ...)."""
        first = self.position(rank)[0]
        if self.virtual_stages == 1:
            return (first,)
        return tuple(range(first, self.num_stages, self.num_ranks))

    def ranks_of(self, stage: int) -> tuple[int, ...]:
        """The ranks that run ``stage``: its replicas, or its one rank when interleaved."""
        if self.virtual_stages > 1:
            return (stage % self.num_ranks,)
        return tuple(range(self.first_rank[stage], self.first_rank[stage] + self.replicas[stage]))

    # -------------------------------------------------------------- building

    def stage_module(
        self,
        model: nn.Module,
        stage_index: int,
        device: torch.device | str,
        *example_args: Any,
        checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
        **example_kwargs: Any,
    ) -> tuple[StageAdapter, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Stage ``stage_index`` of ``model`` as a ``StageAdapter`` on ``device``, with
        the example tensors (inputs, outputs) of one micro-batch. No process group
        needed. Parameters and buffers still on ``meta`` are materialized and
        loaded from ``checkpoint`` (a state_dict or a ``torch.save`` file of one,
        memory-mapped); nothing outside this stage is allocated."""
        k = self._check_stage(stage_index)
        device = torch.device(device)
        examples = self._example_values(model, example_args, example_kwargs)
        receives, constants = self._split_wire(k, examples)
        last = k == self.num_stages - 1
        sends = None if last else self._split_wire(k + 1, examples)[0]
        stage = self.stage_classes[k](model)
        _materialize(stage, device, _load_state(checkpoint), k)
        adapter = StageAdapter(stage, receives, sends, constants, self.build_output)

        def example(value: Any) -> torch.Tensor:
            out = torch.empty(value.shape, dtype=value.dtype, device=device)
            return out.requires_grad_(value.requires_grad)

        inputs = tuple(example(examples[name]) for name in receives)
        if last:
            adapter.flatten_output(examples["__output__"])
            leaves = [v for v in pytree.tree_leaves(examples["__output__"])
                      if isinstance(v, torch.Tensor)]
            outputs = tuple(example(v) for v in leaves)
        else:
            outputs = tuple(example(examples[name]) for name in sends or ())
        return adapter, inputs, outputs

    def pipeline_stage(
        self,
        model: nn.Module,
        rank: int,
        world_size: int,
        device: torch.device | str,
        *example_args: Any,
        checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
        group: Any = None,
        **example_kwargs: Any,
    ) -> "PipelineStage | TableStage":
        """This rank's ``PipelineStage``, or ``TableStage`` for uneven replicas
        (collective: every rank calls it, in the same order). ``example_args`` /
        ``example_kwargs``: ONE micro-batch, as the model's forward takes it.
        ``group``: the pipeline's process group (default: the whole job); with
        replicated stages fxpipe makes one per lane."""
        self._check_launch(world_size)
        if self.virtual_stages > 1:
            raise ValueError(
                f"this plan is interleaved: every rank runs {self.virtual_stages} stages; "
                f"call pipeline_stages for the list of them")
        if not self.uniform:
            return self._table_stage(model, rank, device, example_args, example_kwargs,
                                     checkpoint)
        k, lane = self.position(rank)
        example_args, example_kwargs = self.lane_share(
            (example_args, example_kwargs), lane, microbatches=1, what="the example micro-batch")
        adapter, inputs, outputs = self.stage_module(
            model, k, device, *example_args, checkpoint=checkpoint, **example_kwargs
        )
        # every group, created in the same order on every rank (a collective call)
        r = self.lanes
        self._make_groups({k: adapter})
        if r > 1:
            if group is not None:
                raise ValueError("a plan with replicated stages makes its own process groups, "
                                 "one per lane: call pipeline_stage without group")
            for i in range(r):  # lane i: stage j on rank j·r + i
                lane_group = dist.new_group([j * r + i for j in range(self.num_stages)])
                if i == lane:
                    group = lane_group
        return PipelineStage(
            adapter,
            k,
            self.num_stages,
            torch.device(device),
            input_args=inputs,
            output_args=outputs,
            group=group,
        )

    def pipeline_stages(
        self,
        model: nn.Module,
        rank: int,
        world_size: int,
        device: torch.device | str,
        *example_args: Any,
        checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
        group: Any = None,
        **example_kwargs: Any,
    ) -> "list[PipelineStage | TableStage]":
        """This rank's stages as a list (collective, like ``pipeline_stage``): the one
        ``pipeline_stage`` gives, or the v ``PipelineStage`` objects of an interleaved
        plan, stage j on rank j % K."""
        if self.virtual_stages == 1:
            return [self.pipeline_stage(model, rank, world_size, device, *example_args,
                                        checkpoint=checkpoint, group=group, **example_kwargs)]
        self._check_launch(world_size)
        built = {k: self.stage_module(model, k, device, *example_args, checkpoint=checkpoint,
                                      **example_kwargs) for k in self.stages_of(rank)}
        self._make_groups({k: adapter for k, (adapter, _, _) in built.items()})
        return [PipelineStage(adapter, k, self.num_stages, torch.device(device),
                              input_args=inputs, output_args=outputs, group=group)
                for k, (adapter, inputs, outputs) in built.items()]

    def _check_launch(self, world_size: int) -> None:
        if self.unsupported:
            raise ValueError(self.unsupported)
        if world_size != self.num_ranks:
            if self.virtual_stages > 1:
                what = (f"GPUs of the plan ({self.num_ranks}, each running "
                        f"{self.virtual_stages} of its {self.num_stages} stages)")
            elif self.num_ranks == self.num_stages:
                what = f"pipeline stages ({self.num_stages})"
            else:
                what = f"GPUs of the plan ({'-'.join(map(str, self.replicas))})"
            raise ValueError(
                f"world size ({world_size}) must equal the number of {what}: launch with "
                f"torchrun --nproc-per-node {self.num_ranks}"
            )

    def _make_groups(self, adapters: Mapping[int, StageAdapter]) -> None:
        """The process groups of tied copies (all their holders' ranks) and of each
        replicated stage's ranks, created in the same order on every rank. ``adapters``:
        this rank's stages by index; a tied parameter two of them hold becomes one copy."""
        for copies in self.tied:
            tied_group = dist.new_group(sorted({rank for j in copies
                                                for rank in self.ranks_of(j)}))
            held = [k for k in sorted(adapters) if k in copies]
            if not held:
                continue
            param = adapters[held[0]].stage.get_parameter(copies[held[0]])
            for k in held:
                _rebind(adapters[k].stage, adapters[k].stage.get_parameter(copies[k]), param)
                adapters[k].tied.append((tied_group, param))
        for j in range(self.num_stages):
            if self.replicas[j] > 1:
                replica_group = dist.new_group(list(self.ranks_of(j)))
                if j in adapters:
                    adapters[j].replica_group = replica_group

    def _table_stage(self, model: nn.Module, rank: int, device: torch.device | str,
                     example_args: tuple[Any, ...], example_kwargs: dict[str, Any],
                     checkpoint: str | Path | Mapping[str, torch.Tensor] | None) -> "TableStage":
        """This rank's replica of its stage, for a plan with uneven replicas."""
        k, replica = self.position(rank)
        rows = _batch_rows((example_args, example_kwargs))
        if rows is None or any(rows % r for r in self.replicas):
            raise ValueError(
                f"the example micro-batch has {rows} rows along dim 0, which do not split "
                f"into equal chunks for every stage's replicas "
                f"({'-'.join(map(str, self.replicas))}); use a micro-batch size that is a "
                f"multiple of each"
            )
        adapter, inputs, outputs = self.stage_module(
            model, k, device, *example_args, checkpoint=checkpoint, **example_kwargs
        )
        self._make_groups({k: adapter})
        return TableStage(self, adapter, k, replica, torch.device(device), inputs, outputs, rows)

    def lane_share(self, value: Any, lane: int, *, microbatches: int, what: str) -> Any:
        """Lane ``lane``'s rows of ``value``: every tensor leaf with dim > 0 cut into
        ``microbatches`` micro-batches along dim 0, each of them into r equal chunks
        (``torch.tensor_split``, as the runner splits a replicated stage's inputs),
        and chunk ``lane`` of each, concatenated. Other leaves pass whole."""
        r = self.lanes
        if r == 1:
            return value

        def share(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return x
            if x.size(0) % (microbatches * r):
                raise ValueError(
                    f"{what} has {x.size(0)} rows along dim 0, which do not split into "
                    f"{microbatches} micro-batches of {r} equal replica chunks; use a batch "
                    f"size that is a multiple of {microbatches * r}"
                )
            return torch.cat([mb.tensor_split(r)[lane] for mb in x.tensor_split(microbatches)])

        return pytree.tree_map(share, value)

    def build_schedule(
        self,
        stage: "PipelineStage | TableStage | Sequence[PipelineStage | TableStage]",
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        *,
        microbatches: int | None = None,
        schedule: str | None = None,
    ) -> Any:
        """The plan's schedule as torch's: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B,
        interleaved -> ScheduleInterleaved1F1B over the rank's stages. Gradients are
        divided by M, as the single-process runner does."""
        kind = schedule or self.schedule
        m = microbatches or self.microbatches
        if isinstance(stage, Sequence) and self.virtual_stages > 1:
            if kind != "interleaved" or m % self.num_ranks:
                raise ValueError(
                    f"an interleaved plan runs interleaved 1F1B with a multiple of "
                    f"{self.num_ranks} micro-batches (got {kind}, M = {m}); split again "
                    f"to change it")
            stages = [cast(PipelineStage, s) for s in stage]
            for s in stages:
                cast(StageAdapter, s.submod).microbatches = m
            # torch divides each stage's gradients by M; a tied copy two of this rank's
            # stages share would be divided twice, so train_step divides once instead
            return ScheduleInterleaved1F1B(stages, n_microbatches=m,
                                           loss_fn=_on_model_output(stages, loss_fn),
                                           scale_grads=False)
        if isinstance(stage, Sequence):
            (stage,) = stage
        if isinstance(stage, TableStage):
            if m != self.microbatches or kind != self.schedule:
                raise ValueError(
                    f"a plan with unevenly replicated stages runs its own schedule table "
                    f"({self.schedule}, M = {self.microbatches}); split again to change it"
                )
            return TableSchedule(stage, self.table, m, loss_fn)
        classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        if kind not in classes:
            raise ValueError(f"unknown schedule {kind!r}; use one of {sorted(classes)}")
        if kind == "1f1b" and m < self.num_stages:
            warnings.warn(
                f"torch's Schedule1F1B needs at least as many micro-batches ({m}) as stages "
                f"({self.num_stages}); running ScheduleGPipe, which gives the same gradients",
                stacklevel=2,
            )
            kind = "gpipe"
        cast(StageAdapter, stage.submod).microbatches = m
        return classes[kind](stage, n_microbatches=m, loss_fn=_on_model_output([stage], loss_fn))

    # -------------------------------------------------------------- running

    def train_step(
        self, schedule: Any, stage: "PipelineStage | TableStage | Sequence[PipelineStage]",
        *args: Any, target: Any = None, **kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward and backward of one mini-batch (M micro-batches): the first stage
        feeds ``args``/``kwargs``, the last ``target`` (each lane its share of every
        micro-batch); then gradients are summed over tied copies and averaged over
        replicas. Returns the mean loss on the last stage's rank, None elsewhere. Zero
        grads before. ``stage``: this rank's stage, or the list ``pipeline_stages`` gave."""
        if isinstance(schedule, TableSchedule):
            (table_stage,) = _as_list(stage)
            assert isinstance(table_stage, TableStage)
            if table_stage.is_first:
                _check_constants(table_stage.submod, self.flatten_inputs(*args, **kwargs))
            return schedule.step(args, kwargs, target)
        stages = [cast(PipelineStage, s) for s in _as_list(stage)]
        first = next((s for s in stages if s.is_first), None)
        last = next((s for s in stages if s.is_last), None)
        lane = self.position(dist.get_rank())[1] if self.lanes > 1 else 0
        m = cast(StageAdapter, stages[0].submod).microbatches
        feed: list[torch.Tensor] = []
        if first is not None:
            adapter = cast(StageAdapter, first.submod)
            args, kwargs = self.lane_share((args, kwargs), lane, microbatches=m,
                                           what="the mini-batch")
            values = self.flatten_inputs(*args, **kwargs)
            _check_constants(adapter, values)
            feed = [values[name].to(first.device) for name in adapter.receives]
        losses: list[torch.Tensor] = []
        if last is not None:
            target = self.lane_share(target, lane, microbatches=m, what="the target")
            target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(last.device), target)
            schedule.step(*feed, target=target, losses=losses)
        else:
            schedule.step(*feed)
        if isinstance(schedule, ScheduleInterleaved1F1B):
            for param in {id(p): p for s in stages for p in s.submod.parameters()}.values():
                if param.grad is not None:
                    param.grad /= m
        self.reduce_grads(stages)
        if last is None:
            return None
        loss = torch.stack([loss.detach() for loss in losses]).mean()
        replica_group = cast(StageAdapter, last.submod).replica_group
        if replica_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=replica_group)
            loss /= self.lanes
        return loss

    def reduce_grads(
        self, stage: "PipelineStage | TableStage | Sequence[PipelineStage | TableStage]",
    ) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy (once per
        rank, however many of its stages use it); with replicated stages, average every
        gradient over its stage's replicas."""
        adapters = [cast(StageAdapter, s.submod) for s in _as_list(stage)]
        # lanes: each replica's loss is its chunk's mean, so the sum over replicas is
        # divided by r; TableStage divides the loss by r itself
        r = self.lanes
        tied: set[int] = set()
        for adapter in adapters:
            for tied_group, param in adapter.tied:
                if id(param) in tied:
                    continue
                tied.add(id(param))
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tied_group)
                param.grad /= r
        for adapter in adapters:
            if adapter.replica_group is None:
                continue
            for param in adapter.stage.parameters():
                if id(param) in tied or not param.requires_grad:
                    continue
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=adapter.replica_group)
                param.grad /= r

    # -------------------------------------------------------------- internals

    def _check_stage(self, k: int) -> int:
        if not 0 <= k < self.num_stages:
            raise ValueError(f"no stage {k}: this package has stages 0..{self.num_stages - 1}")
        return k

    def _example_values(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Every wire value of one micro-batch as a fake tensor (shape, dtype,
        requires_grad; nothing allocated), running all stages under FakeTensorMode."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        stages = [cls(model) for cls in self.stage_classes]
        values: dict[str, Any] = {}
        with mode, torch.enable_grad():
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            values.update(self.flatten_inputs(*fake[0], **fake[1]))
            for stage in stages:
                state = {
                    name: _fake_like(t)
                    for name, t in _named_tensors(stage)
                }
                inputs = {name: values[name] for name in cast(tuple[str, ...], stage.INPUTS)}
                outputs = torch.func.functional_call(stage, state, (), inputs)
                values.update(zip(cast(tuple[str, ...], stage.OUTPUTS), outputs, strict=True))
            values["__output__"] = self.build_output(values)
        return values

    def _split_wire(self, k: int, examples: dict[str, Any]) -> tuple[tuple[str, ...], dict]:
        """WIRES[k] as (tensor names, baked constants)."""
        tensors, constants = [], {}
        for name in self.wires[k]:
            value = examples[name]
            if isinstance(value, torch.Tensor):
                tensors.append(name)
            elif _is_constant(value):
                constants[name] = value
            else:
                raise ValueError(
                    f"{name!r} reaches stage {k} from an earlier stage but is a "
                    f"{type(value).__name__}, neither a tensor nor a constant: "
                    "torch.distributed.pipelining passes only tensors between stages; "
                    "cut the model where no such value crosses"
                )
        return tuple(tensors), constants


# ---------------------------------------------------------------------------- uneven replicas


class TableStage:
    """One rank's replica of a stage in a plan whose stages have different replica
    counts (see the module docstring): its adapter, where it sits, and the example
    tensors of one whole micro-batch (``rows`` along dim 0) that it receives and
    sends, which fix the shapes of what travels."""

    def __init__(self, pipeline: DistributedPipeline, adapter: StageAdapter, stage_index: int,
                 replica: int, device: torch.device, receives: tuple[torch.Tensor, ...],
                 sends: tuple[torch.Tensor, ...], rows: int) -> None:
        self.pipeline = pipeline
        self.submod = adapter  # named as on PipelineStage, so train scripts read both alike
        self.stage_index = stage_index
        self.replica = replica
        self.device = device
        self.receives = receives
        self.sends = sends
        self.rows = rows
        self.is_first = stage_index == 0
        self.is_last = stage_index == pipeline.num_stages - 1

    def chunk(self, j: int, i: int) -> tuple[int, int]:
        """Rows [lo, hi) of a micro-batch that replica i of stage j takes."""
        size = self.rows // self.pipeline.replicas[j]
        return i * size, (i + 1) * size

    def rank_of(self, j: int, i: int) -> int:
        return self.pipeline.first_rank[j] + i

    def batched(self, example: torch.Tensor) -> bool:
        return example.dim() > 0 and example.size(0) == self.rows

    def peers(self, j: int) -> list[tuple[int, int, int]]:
        """(replica of stage j, lo, hi): the rows this replica shares with each of
        stage j's replicas, in row order."""
        lo, hi = self.chunk(self.stage_index, self.replica)
        shared = []
        for i in range(self.pipeline.replicas[j]):
            a, b = self.chunk(j, i)
            if max(lo, a) < min(hi, b):
                shared.append((i, max(lo, a), min(hi, b)))
        return shared


class TableSchedule:
    """The runner's schedule table run on ``TableStage``s with point-to-point sends
    (see the module docstring); ``step`` is one mini-batch of M micro-batches."""

    def __init__(self, stage: TableStage, table: Sequence[Sequence[tuple[int, str, int]]],
                 microbatches: int, loss_fn: Callable[[Any, Any], torch.Tensor] | None) -> None:
        self.stage = stage
        self.actions = [(kind, m) for tick in table for j, kind, m in tick
                        if j == stage.stage_index]
        self.microbatches = microbatches
        self.loss_fn = loss_fn
        # (isend work, the tensor it sends): waited at the end of the step
        self.pending: list[tuple[Any, torch.Tensor]] = []

    def step(self, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
             ) -> torch.Tensor | None:
        stage, m_count = self.stage, self.microbatches
        lo, hi = stage.chunk(stage.stage_index, stage.replica)
        feeds: list[dict[str, Any]] = []
        if stage.is_first:
            values = stage.pipeline.flatten_inputs(*args, **kwargs)
            feeds = [_rows_of(v, lo, hi, stage.rows) for v in _micro_batches(values, m_count)]
        targets = []
        if stage.is_last:
            if self.loss_fn is None:
                raise ValueError("the last stage needs loss_fn: build_schedule(stage, loss_fn)")
            targets = [_rows_of(t, lo, hi, stage.rows) for t in _micro_batches(target, m_count)]
        saved: dict[int, tuple[list[Any], Any]] = {}
        total = torch.zeros((), device=stage.device)
        for kind, m in self.actions:
            if kind == "F":
                saved[m] = self._forward(m, feeds[m] if feeds else None,
                                         targets[m] if targets else None)
                if stage.is_last:
                    total += saved[m][1].detach()
            else:
                self._backward(m, *saved.pop(m))
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()
        stage.pipeline.reduce_grads(stage)
        if not stage.is_last:
            return None
        group = stage.submod.replica_group
        if group is not None:
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    # ---------------------------------------------------------------- one action

    def _forward(self, m: int, feed: dict[str, Any] | None, target: Any
                 ) -> tuple[list[Any], Any]:
        stage = self.stage
        adapter = stage.submod
        if feed is not None:
            flat = [feed[name].to(stage.device) for name in adapter.receives]
        else:
            flat = [self._receive(m, i, x) for i, x in enumerate(stage.receives)]
        leaves = [x.detach().requires_grad_(ex.requires_grad)
                  for x, ex in zip(flat, stage.receives, strict=True)] if feed is None else flat
        out = adapter(*leaves)
        if stage.is_last:
            target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(stage.device), target)
            assert self.loss_fn is not None
            r = stage.pipeline.replicas[stage.stage_index]
            loss = self.loss_fn(adapter.rebuild_output(out), target)
            return leaves, loss / (self.microbatches * r)
        for i, (y, ex) in enumerate(zip(out, stage.sends, strict=True)):
            self._send(m, i, y, ex)
        return leaves, out

    def _backward(self, m: int, leaves: list[Any], out: Any) -> None:
        stage = self.stage
        if stage.is_last:
            out.backward()
        else:
            grads = [self._receive_grad(m, i, ex) for i, ex in enumerate(stage.sends)]
            pairs = [(y, g) for y, g in zip(out, grads, strict=True)
                     if g is not None and y.requires_grad]
            if pairs:
                torch.autograd.backward([y for y, _ in pairs], [g for _, g in pairs])
        if stage.is_first:
            return
        for i, (x, ex) in enumerate(zip(leaves, stage.receives, strict=True)):
            if ex.requires_grad:
                grad = x.grad if x.grad is not None else torch.zeros_like(x)
                self._send_grad(m, i, grad, ex)

    # ---------------------------------------------------------------- messages
    # A message's tag: (micro-batch, value, direction), unique between two ranks.

    @staticmethod
    def _tag(m: int, i: int, count: int, backward: bool) -> int:
        return (m * count + i) * 2 + int(backward)

    def _send(self, m: int, i: int, y: torch.Tensor, example: torch.Tensor) -> None:
        """Value i of micro-batch m to the next stage's replicas: the rows each takes,
        or (not batched) all of it from replica 0 to every replica."""
        stage, j = self.stage, self.stage.stage_index + 1
        tag = self._tag(m, i, len(stage.sends), backward=False)
        lo = stage.chunk(stage.stage_index, stage.replica)[0]
        if stage.batched(example):
            for peer, a, b in stage.peers(j):
                self._isend(y[a - lo:b - lo], stage.rank_of(j, peer), tag)
        elif stage.replica == 0:
            for peer in range(stage.pipeline.replicas[j]):
                self._isend(y, stage.rank_of(j, peer), tag)

    def _receive(self, m: int, i: int, example: torch.Tensor) -> torch.Tensor:
        """Value i of micro-batch m from the previous stage's replicas (this replica's rows)."""
        stage, j = self.stage, self.stage.stage_index - 1
        tag = self._tag(m, i, len(stage.receives), backward=False)
        if not stage.batched(example):
            return self._recv(example.shape, example, stage.rank_of(j, 0), tag)
        parts = [self._recv((b - a, *example.shape[1:]), example, stage.rank_of(j, peer), tag)
                 for peer, a, b in stage.peers(j)]
        return torch.cat(parts)

    def _send_grad(self, m: int, i: int, grad: torch.Tensor, example: torch.Tensor) -> None:
        """The gradient of received value i back to the replicas it came from."""
        stage, j = self.stage, self.stage.stage_index - 1
        tag = self._tag(m, i, len(stage.receives), backward=True)
        lo = stage.chunk(stage.stage_index, stage.replica)[0]
        if not stage.batched(example):
            self._isend(grad, stage.rank_of(j, 0), tag)
            return
        for peer, a, b in stage.peers(j):
            self._isend(grad[a - lo:b - lo], stage.rank_of(j, peer), tag)

    def _receive_grad(self, m: int, i: int, example: torch.Tensor) -> torch.Tensor | None:
        """The gradient of sent value i from the next stage's replicas (None: it has
        none); a value sent whole gets the sum of every replica's gradient."""
        if not example.requires_grad:
            return None
        stage, j = self.stage, self.stage.stage_index + 1
        tag = self._tag(m, i, len(stage.sends), backward=True)
        if stage.batched(example):
            rows = stage.rows // stage.pipeline.replicas[stage.stage_index]
            parts = [self._recv((b - a, *example.shape[1:]), example, stage.rank_of(j, peer), tag)
                     for peer, a, b in stage.peers(j)]
            assert sum(p.size(0) for p in parts) == rows
            return torch.cat(parts)
        if stage.replica != 0:  # replica 0 sent it, so its gradient goes there
            return torch.zeros(example.shape, dtype=example.dtype, device=stage.device)
        replicas = range(stage.pipeline.replicas[j])
        return torch.stack([self._recv(example.shape, example, stage.rank_of(j, peer), tag)
                            for peer in replicas]).sum(0)

    def _isend(self, tensor: torch.Tensor, dst: int, tag: int) -> None:
        tensor = tensor.detach().contiguous()
        self.pending.append((dist.isend(tensor, dst=dst, tag=tag), tensor))

    def _recv(self, shape: Sequence[int], example: torch.Tensor, src: int, tag: int
              ) -> torch.Tensor:
        buffer = torch.empty(tuple(shape), dtype=example.dtype, device=self.stage.device)
        dist.recv(buffer, src=src, tag=tag)
        return buffer


def _as_list(stage: Any) -> list[Any]:
    """A rank's stages: ``stage`` itself when ``pipeline_stages`` gave a list, else [stage]."""
    return list(stage) if isinstance(stage, Sequence) else [stage]


def _on_model_output(stages: Sequence[Any], loss_fn: Callable[[Any, Any], torch.Tensor] | None
                     ) -> Callable[[Any, Any], torch.Tensor] | None:
    """``loss_fn`` for torch's schedules, which hand it the last stage's tensors: on the
    model's output rebuilt from them (``StageAdapter.rebuild_output``)."""
    last = next((cast(StageAdapter, s.submod) for s in stages if s.is_last), None)
    if loss_fn is None or last is None or last.output_leaves is None:
        return loss_fn
    return lambda output, target: loss_fn(last.rebuild_output(output), target)


def _check_constants(adapter: StageAdapter, values: Mapping[str, Any]) -> None:
    """A graph input baked into the stages must keep the value it was built with."""
    for name, baked in adapter.constants.items():
        if name in values and values[name] != baked:
            raise ValueError(
                f"graph input {name!r} is {values[name]!r} but the stages were built "
                f"with {baked!r} (non-tensor inputs are baked in at pipeline_stage)"
            )


def _batch_rows(value: Any) -> int | None:
    """Dim 0 of the first tensor leaf of ``value`` with dim > 0: its batch size."""
    for x in pytree.tree_leaves(value):
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            return int(x.size(0))
    return None


def _micro_batches(value: Any, m: int) -> list[Any]:
    """``value`` cut into m micro-batches: tensor leaves with dim > 0 along dim 0."""
    leaves, spec = pytree.tree_flatten(value)
    columns = [x.tensor_split(m) if isinstance(x, torch.Tensor) and x.dim() > 0 else [x] * m
               for x in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(m)]


def _rows_of(value: Any, lo: int, hi: int, rows: int) -> Any:
    """Rows [lo, hi) of every tensor leaf whose dim 0 is the micro-batch's ``rows``."""
    def cut(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.dim() > 0 and x.size(0) == rows:
            return x[lo:hi]
        return x

    return pytree.tree_map(cut, value)


def _is_constant(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_constant(v) for v in value)
    return False


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(module.named_parameters(remove_duplicate=False))
    return named + list(module.named_buffers(remove_duplicate=False))


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    # called inside FakeTensorMode: a fake CPU tensor of t's shape, whatever t's device;
    # a Parameter stays one (exported stages read theirs with get_parameter)
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    if isinstance(t, nn.Parameter):
        return nn.Parameter(out, requires_grad=t.requires_grad)
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def _load_state(
    checkpoint: str | Path | Mapping[str, torch.Tensor] | None,
) -> Mapping[str, torch.Tensor] | None:
    if checkpoint is None or isinstance(checkpoint, Mapping):
        return checkpoint
    return torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)


def _rebind(module: nn.Module, old: nn.Parameter, new: nn.Parameter) -> None:
    """Every place ``module`` holds the parameter ``old`` holds ``new`` instead."""
    for submodule in module.modules():
        for key, param in submodule._parameters.items():
            if param is old:
                submodule._parameters[key] = new


def _materialize(
    stage: nn.Module,
    device: torch.device,
    state: Mapping[str, torch.Tensor] | None,
    k: int,
) -> None:
    """Give every parameter and buffer of ``stage`` a tensor on ``device``: from
    ``state`` by its original name where it has one, else its own value; one new
    tensor per original object, so ties inside the stage stay ties."""
    owners: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
    originals: dict[int, torch.Tensor] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{key}" if prefix else key
                owners.setdefault(id(tensor), []).append((module, key, name, is_param))
                originals[id(tensor)] = tensor
    missing: list[str] = []
    sources: dict[int, torch.Tensor] = {}
    for ident, places in owners.items():
        names = [name for _, _, name, _ in places]
        found = next((n for n in names if state is not None and n in state), None)
        if found is not None:
            source = state[found]  # type: ignore[index]
            if tuple(source.shape) != tuple(originals[ident].shape):
                raise ValueError(
                    f"checkpoint key {found!r} has shape {tuple(source.shape)}, stage {k} "
                    f"needs {tuple(originals[ident].shape)}"
                )
            sources[ident] = source
        elif originals[ident].is_meta:
            missing.append(names[0])
        else:
            sources[ident] = originals[ident]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} keys stage {k} needs: {', '.join(missing)}"
        )
    if state is None and any(t.device != device for t in originals.values()):
        warnings.warn(
            f"stage {k}: no checkpoint given; using the model's own values", stacklevel=3
        )
    for ident, places in owners.items():
        old = originals[ident]
        with torch.no_grad():
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
            new.copy_(sources[ident])
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for module, key, _, is_param in places:
            if is_param:
                module._parameters[key] = cast(nn.Parameter, new)
            else:
                module._buffers[key] = new


# ---------------------------------------------------------------------------- main


def _load_model_file(spec: str) -> tuple[Any, Callable[[], nn.Module]]:
    path, _, factory = spec.partition(":")
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"model file {path} not found")
    sys.path.insert(0, str(file.parent))
    module_spec = importlib.util.spec_from_file_location(f"_model_{file.stem}", file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    build = getattr(module, factory or "build_model", None)
    if build is None:
        raise ValueError(f"{path} has no factory {factory or 'build_model'}()")
    return module, build


def main(pipeline: DistributedPipeline, argv: Sequence[str] | None = None) -> int:
    """The launch script: N training steps of the model file's loss_fn under torchrun."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True, help="model.py or model.py:factory")
    parser.add_argument("--checkpoint", help="torch.save'd state_dict of the whole model; "
                        "without it every rank builds the model for real")
    parser.add_argument("--batch", help="torch.save'd {'args', 'kwargs', 'target'} mini-batch; "
                        "default: the example micro-batch repeated M times")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", help="directory for rank{k}.pt: loss, grads, peak RSS")
    opts = parser.parse_args(argv)

    try:
        rank, world_size, device = init_distributed()
    except RuntimeError as error:
        print(f"train_torchrun: error: {error}", file=sys.stderr)
        return 2
    try:
        _train(pipeline, opts, rank, world_size, device)
    except (ValueError, FileNotFoundError) as error:
        print(f"train_torchrun: error: rank {rank}: {error}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _train(
    pipeline: DistributedPipeline,
    opts: argparse.Namespace,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    module, build = _load_model_file(opts.model)
    example = getattr(build, "example_inputs", module.example_inputs)()
    args, kwargs = (((), example) if isinstance(example, Mapping)
                    else (tuple(example), {}))
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is None:
        raise ValueError(f"{opts.model} defines no loss_fn(output, target)")
    rss = {"start": peak_rss_bytes()}
    if opts.checkpoint:
        with parameters_on_meta():
            model = build()
    else:
        model = build()
    rss["built"] = peak_rss_bytes()
    stages = pipeline.pipeline_stages(
        model, rank, world_size, device, *args, checkpoint=opts.checkpoint, **kwargs
    )
    rss["loaded"] = peak_rss_bytes()
    schedule = pipeline.build_schedule(stages, loss_fn)
    if opts.batch:
        batch = torch.load(opts.batch, weights_only=False)
        args, kwargs, target = batch["args"], batch["kwargs"], batch["target"]
    else:
        m = pipeline.microbatches
        repeat = lambda t: torch.cat([t] * m) if t.dim() else t  # noqa: E731
        args, kwargs = pytree.tree_map_only(torch.Tensor, repeat, (args, kwargs))
        example_target = getattr(build, "example_target", module.example_target)
        target = pytree.tree_map_only(torch.Tensor, repeat, example_target())
    trained = list({id(p): p for stage in stages for p in stage.submod.parameters()
                    if p.requires_grad}.values())
    # a stage of parameter-free ops (a softmax mixing layer) has nothing to update
    optimizer = torch.optim.SGD(trained, lr=opts.lr) if trained else None
    for step in range(opts.steps):
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        loss = pipeline.train_step(schedule, stages, *args, target=target, **kwargs)
        if loss is not None and pipeline.position(rank)[1] == 0:  # replica 0 speaks
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
        if step == opts.steps - 1 and opts.save:
            rss["step"] = peak_rss_bytes()
            grads = {name: p.grad.detach().cpu().clone()
                     for stage in stages
                     for name, p in cast(nn.Module, stage.submod.stage).named_parameters(
                         remove_duplicate=False) if p.grad is not None}
            Path(opts.save).mkdir(parents=True, exist_ok=True)
            torch.save({"loss": loss, "grads": grads, "rss": rss},
                       Path(opts.save) / f"rank{rank}.pt")
        if optimizer is not None:
            optimizer.step()
    print(f"rank {rank}: peak RSS {peak_rss_bytes() / 2**20:.0f} MiB", flush=True)


PIPELINE = DistributedPipeline(
    stage_classes=STAGE_CLASSES,
    wires=WIRES,
    tied=TIED,
    schedule=SCHEDULE_KIND,
    microbatches=MICROBATCHES,
    flatten_inputs=flatten_inputs,
    build_output=build_output,
    replicas=REPLICAS,
    table=SCHEDULE,
    unsupported=UNSUPPORTED,
    virtual_stages=VIRTUAL_STAGES,
)
stage_module = PIPELINE.stage_module
pipeline_stage = PIPELINE.pipeline_stage
pipeline_stages = PIPELINE.pipeline_stages
build_schedule = PIPELINE.build_schedule
train_step = PIPELINE.train_step
reduce_grads = PIPELINE.reduce_grads
