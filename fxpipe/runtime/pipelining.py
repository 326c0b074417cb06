"""Run the generated stages one per process on torch.distributed.pipelining.

# K: stages, r_j: replicas of stage j (REPLICAS), Σ r_j processes, M: micro-batches.

A ``DistributedPipeline`` holds a package's stage classes, wires (adapter.py) and tied
parameters (grads.py); the generated ``distributed.py`` makes one and exports its methods
as module functions. Which rank runs which stage is ranks.py. Each rank's stage is a
torch ``PipelineStage`` around a ``StageAdapter``, driven by torch's schedules: gpipe ->
``ScheduleGPipe``, 1f1b -> ``Schedule1F1B``, interleaved -> ``ScheduleInterleaved1F1B``
over the rank's v stages, zb1p, zbv and dualpipev as torch_zero_bubble.py says. When every
stage has the same r, each of the r lanes is a whole ``PipelineStage`` pipeline, and a
plan's layout runs d of them: on a ``DeviceMesh``, each stage's copies kept equal by
torch's DDP (or a layout's FSDP2; data_parallel.py), each stage split over t ranks of a
host (tensor_parallel.py). Stages with different replica counts run the runner's
schedule table (table.py).

Memory: with ``checkpoint`` a rank allocates only its own stage (materialize.py)::

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

import warnings
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils import _pytree as pytree

from .adapter import (
    StageAdapter,
    check_constants,
    check_feed,
    example_values,
    split_wire,
    torch_schedule_kwargs,
    wire_example,
)
from .data_parallel import check_backward_sync, check_data_parallel, make_mesh, shard
from .grads import clip_grads, make_groups, reduce_grads
from .materialize import Checkpoint, load_state, materialize
from .microbatch import batch_size, lane_share, shared_leaves
from .mixed_precision import autocast_loss, check_precision, unscaled
from .older_torch import skip_warmup_sends_to_self, step
from .own_loss import feed_target, target_or_none
from .ranks import RankLayout
from .recompute import modes
from .table import TableSchedule, TableStage
from .tensor_parallel import split_stage, tensor_mesh, tensor_step, whole_loss
from .torch_schedules import schedule_class, torch_schedule
from .torch_zero_bubble import ZERO_BUBBLE, zero_bubble_schedule

__all__ = ["DistributedPipeline"]


class DistributedPipeline(RankLayout):
    """The package's stages, wires and tied parameters on ranks laid out as
    ``RankLayout`` says; the generated ``distributed.py`` makes one and exports its
    methods as module functions."""

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
        precision: str = "32-true",
        device_of: Sequence[int] = (),
        shared_inputs: Collection[str] = (),
        recompute: Sequence[str | bool] = (),
        data_parallel: tuple[int, str] = (1, "fsdp"),
        tensor_parallel: tuple[int, Sequence[Mapping[str, int]]] = (1, ()),
    ) -> None:
        # per stage, how it recomputes (recompute.MODES)
        self.recompute = modes(tuple(recompute) or None, len(stage_classes))
        assert len(wires) == len(stage_classes) == len(self.recompute), (
            len(wires), len(stage_classes), len(self.recompute))
        self.precision = check_precision(precision)
        # the plan's layout: d pipelines side by side, each stage's d copies kept equal by
        # torch's FSDP2 or DDP (data_parallel.py)
        dp, self.dp_mode = check_data_parallel(data_parallel, replicas)
        # each stage split over tp ranks of a host as the plan says (tensor_parallel.py)
        tp, self.tp_shards = tensor_parallel[0], [dict(s) for s in tensor_parallel[1]]
        super().__init__(len(stage_classes), replicas, virtual_stages, device_of, dp, tp)
        self.dp_group: Any = None  # this rank's dp sub-mesh's process group, once built
        self.norm_group: Any = None  # the ranks gradient clipping sums over (None: the job)
        self.unsupported = unsupported  # why this plan cannot run under torchrun
        self.table = [tuple(tick) for tick in table]  # the runner's SCHEDULE (TableStage)
        self.stage_classes = list(stage_classes)
        self.wires = [tuple(w) for w in wires]
        self.tied = [dict(group) for group in tied]
        self.schedule = schedule
        self.microbatches = microbatches
        self.flatten_inputs = flatten_inputs
        self.build_output = build_output
        self.shared_inputs = frozenset(shared_inputs)  # graph inputs whole in every micro-batch
        # 16-mixed: this rank's GradScaler, made by build_schedule; every rank steps it
        self.scaler: torch.amp.GradScaler | None = None

    # -------------------------------------------------------------- building

    def stage_module(
        self, model: nn.Module, stage_index: int, device: torch.device | str,
        *example_args: Any, checkpoint: Checkpoint = None, **example_kwargs: Any,
    ) -> tuple[StageAdapter, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Stage ``stage_index`` of ``model`` as a ``StageAdapter`` on ``device``, with
        the example tensors (inputs, outputs) of one micro-batch. No process group
        needed. Parameters and buffers still on ``meta`` are materialized and
        loaded from ``checkpoint`` (a state_dict or a ``torch.save`` file of one,
        memory-mapped); nothing outside this stage is allocated."""
        k = self.check_stage(stage_index)
        device = torch.device(device)
        examples = example_values(self.stage_classes, self.flatten_inputs, self.build_output,
                                  model, example_args, example_kwargs, self.precision, device)
        receives, constants = split_wire(self.wires[k], k, examples)
        last = k == self.num_stages - 1
        sends = None if last else split_wire(self.wires[k + 1], k + 1, examples)[0]
        stage = self.stage_classes[k](model)
        materialize(stage, device, load_state(checkpoint), k)
        adapter = StageAdapter(stage, receives, sends, constants, self.build_output,
                               precision=self.precision, device=device, recompute=self.recompute[k])

        inputs = adapter.travel_in_memory_order(examples, first=k == 0, device=device)
        if last:
            adapter.flatten_output(examples["__output__"])
            leaves = [v for v in pytree.tree_leaves(examples["__output__"])
                      if isinstance(v, torch.Tensor)]
            outputs = tuple(wire_example(v, None, device) for v in leaves)
        else:
            outputs = tuple(wire_example(examples[name], order, device)
                            for name, order in zip(sends or (), adapter.send_orders,
                                                   strict=True))
        return adapter, inputs, outputs

    def pipeline_stage(
        self, model: nn.Module, rank: int, world_size: int, device: torch.device | str,
        *example_args: Any, checkpoint: Checkpoint = None, group: Any = None,
        **example_kwargs: Any,
    ) -> "PipelineStage | TableStage":
        """This rank's ``PipelineStage``, or ``TableStage`` for uneven replicas
        (collective: every rank calls it, in the same order). ``example_args`` /
        ``example_kwargs``: ONE micro-batch, as the model's forward takes it.
        ``group``: the pipeline's process group (default: the whole job), ``rank`` and
        ``world_size`` then its own: one pipeline per data-parallel rank, every rank of
        the job calling this; with replicated stages fxpipe makes one per lane. A plan
        with a data-parallel layout (``data_parallel``) makes its own ``DeviceMesh``:
        ``rank`` and ``world_size`` are the job's (d · pp)."""
        self._check_launch(world_size)
        if self.virtual_stages > 1:
            raise ValueError(
                f"this plan is interleaved: every rank runs {self.virtual_stages} stages; "
                f"call pipeline_stages for the list of them")
        (stage,) = self._rank_stages(model, rank, device, example_args, example_kwargs,
                                     checkpoint, group)
        return stage

    def pipeline_stages(
        self, model: nn.Module, rank: int, world_size: int, device: torch.device | str,
        *example_args: Any, checkpoint: Checkpoint = None, group: Any = None,
        **example_kwargs: Any,
    ) -> "list[PipelineStage | TableStage]":
        """This rank's stages as a list (collective, like ``pipeline_stage``): the one
        ``pipeline_stage`` gives, or the v ``PipelineStage`` objects of an interleaved
        plan, stage j on rank j % K."""
        self._check_launch(world_size)
        return self._rank_stages(model, rank, device, example_args, example_kwargs,
                                 checkpoint, group)

    def _rank_stages(self, model: nn.Module, rank: int, device: torch.device | str,
                     example_args: tuple[Any, ...], example_kwargs: dict[str, Any],
                     checkpoint: Checkpoint, group: Any) -> "list[PipelineStage | TableStage]":
        """The set-up behind ``pipeline_stage`` and ``pipeline_stages``: this rank's
        stages, built from its lane's share of the example micro-batch, and every
        process group, created in the same order on every rank (a collective call)."""
        if group is not None and (self.lanes > 1 or not self.uniform or self.dp > 1):
            raise ValueError("a plan with replicated stages or a data-parallel layout makes "
                             "its own process groups (one per pipeline, or the schedule "
                             "table's): call pipeline_stage without group")
        if not self.uniform:
            return [self._table_stage(model, rank, device, example_args, example_kwargs,
                                      checkpoint)]
        self.norm_group = group  # a pipeline of the user's: its gradients are its own
        # d pipelines of a layout, or r lanes (rank j·r + l: stage j of lane l), each
        # pipeline on the mesh's pp dimension, each stage's copies on its dp dimension
        mesh, mode = None, self.dp_mode if self.dp > 1 else "ddp"
        if self.dp * self.tp > 1:  # the example micro-batch is one pipeline's, as M is
            mesh = tensor_mesh(device, self.dp, self.num_ranks, self.tp)
            rank = mesh["pp"].get_local_rank()
        else:
            example_args, example_kwargs = self.lane_share(
                (example_args, example_kwargs), self.position(rank)[1], microbatches=1,
                what="the example micro-batch", inputs=True)
            if self.lanes > 1:
                mesh = make_mesh(device, self.lanes, self.num_stages, ("pp", "dp"))
        built = {k: self.stage_module(model, k, device, *example_args, checkpoint=checkpoint,
                                      **example_kwargs) for k in self.stages_of(rank)}
        modules: dict[int, Any] = {k: adapter for k, (adapter, _, _) in built.items()}
        for k in modules if self.tp > 1 else ():  # the last stage keeps its logits split
            split_stage(modules[k].stage, self.tp_shards[k], mesh["tp"],  # type: ignore[index]
                        last=k == self.num_stages - 1)
        group = group if mesh is None else mesh["pp"].get_group()
        make_groups(self.one_pipeline(), self.tied, modules, group,
                    separate=self.dp * self.lanes > 1)  # FSDP2 or DDP wraps each stage
        if mesh is not None and self.dp * self.lanes > 1:
            self.dp_group = mesh["dp"].get_group()
            modules = {k: shard(adapter, mode, mesh["dp"]) for k, adapter in modules.items()}
        return skip_warmup_sends_to_self([
            PipelineStage(modules[k], k, self.num_stages, torch.device(device),
                          input_args=inputs, output_args=outputs, group=group)
            for k, (_, inputs, outputs) in built.items()])

    def _check_launch(self, world_size: int) -> None:
        if self.unsupported:
            raise ValueError(self.unsupported)
        self.check_world_size(world_size)

    def _table_stage(self, model: nn.Module, rank: int, device: torch.device | str,
                     example_args: tuple[Any, ...], example_kwargs: dict[str, Any],
                     checkpoint: Checkpoint) -> "TableStage":
        """This rank's replica of its stage, for a plan with uneven replicas."""
        k, replica = self.position(rank)
        rows = batch_size((example_args, example_kwargs))
        if rows is None or any(rows % r for r in self.replicas):
            raise ValueError(
                f"the example micro-batch has {rows} rows along dim 0, which do not split "
                f"into equal chunks for every stage's replicas "
                f"({'-'.join(map(str, self.replicas))}); use a micro-batch size that is a "
                f"multiple of each")
        adapter, inputs, outputs = self.stage_module(
            model, k, device, *example_args, checkpoint=checkpoint, **example_kwargs)
        make_groups(self, self.tied, {k: adapter})
        return TableStage(self, adapter, k, replica, torch.device(device), inputs, outputs, rows)

    def lane_share(self, value: Any, lane: int, *, microbatches: int, what: str,
                   inputs: bool = False) -> Any:
        """Lane ``lane``'s rows of ``value`` (see ``microbatch.lane_share``), or under a
        layout pipeline ``lane``'s: rows [i·B/d, (i+1)·B/d) of B; with ``inputs``, ``value``
        is the model's (args, kwargs) and its shared graph inputs pass whole."""
        flat = self.flatten_inputs(*value[0], **value[1]) if inputs else {}
        parts, microbatches = (self.dp, 1) if self.dp > 1 else (self.lanes, microbatches)
        return lane_share(value, lane, parts, microbatches=microbatches, what=what,
                          whole=shared_leaves(flat, self.shared_inputs))

    def build_schedule(
        self,
        stage: "PipelineStage | TableStage | Sequence[PipelineStage | TableStage]",
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        *,
        microbatches: int | None = None,
        schedule: str | None = None,
    ) -> Any:
        """The plan's schedule as torch's: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B,
        interleaved -> ScheduleInterleaved1F1B over the rank's stages, zb1p, zbv and
        dualpipev: torch_zero_bubble.py. Gradients are divided by M, as in one process; the loss
        runs under the plan's autocast (16-mixed: scaled by ``scaler``; see mixed_precision.py).
        ``schedule``: another kind, refused unless it places the stages on the ranks the
        plan did (``RankLayout.check_placement``)."""
        kind = schedule or self.schedule
        m = microbatches or self.microbatches
        check_backward_sync(self.dp_mode if self.dp > 1 else None, kind)
        if kind != self.schedule:  # another kind: only if it places the stages as planned
            self.check_placement(kind, self.schedule)
        # the stages' device, read without assuming stages: the checks below come first
        device = getattr(next(iter(_as_list(stage)), None), "device", None)
        loss_fn, self.scaler = autocast_loss(whole_loss(target_or_none(loss_fn), self.tp),
                                             self.precision, device, self.scaler)
        if kind in ZERO_BUBBLE and not isinstance(_as_list(stage)[0], TableStage):
            return zero_bubble_schedule(kind, _as_list(stage), self.lane_ranks(), m, loss_fn,
                                        self.shared_inputs)
        if isinstance(stage, Sequence) and self.virtual_stages > 1:
            if torch_schedule(kind).placement != "loop" or m % self.num_ranks:
                raise ValueError(
                    f"an interleaved plan runs interleaved 1F1B with a multiple of "
                    f"{self.num_ranks} micro-batches (got {kind}, M = {m}); split again "
                    f"to change it")
            stages: list[Any] = [cast(PipelineStage, s) for s in stage]
            for s in stages:
                cast(StageAdapter, s.submod).microbatches = m
            # torch divides each stage's gradients by M; a tied copy two of this rank's
            # stages share would be divided twice, so train_step divides once instead
            return schedule_class(kind)(stages, n_microbatches=m, scale_grads=False,
                                        **torch_schedule_kwargs(stages, loss_fn,
                                                                self.shared_inputs))
        if isinstance(stage, Sequence):
            (stage,) = stage
        if isinstance(stage, TableStage):
            if m != self.microbatches or kind != self.schedule:
                raise ValueError(
                    f"a plan with unevenly replicated stages runs its own schedule table "
                    f"({self.schedule}, M = {self.microbatches}); split again to change it")
            return TableSchedule(stage, self.table, m, loss_fn)
        if torch_schedule(kind).placement != "line":
            raise ValueError(f"schedule {kind!r} runs several stages per rank; this plan has "
                             f"one: split again with --schedule {kind}")
        if kind == "1f1b" and m < self.num_stages:
            warnings.warn(f"torch's Schedule1F1B needs at least as many micro-batches ({m}) as "
                          f"stages ({self.num_stages}); running ScheduleGPipe, which gives the "
                          "same gradients", stacklevel=2)
            kind = "gpipe"
        cast(StageAdapter, stage.submod).microbatches = m
        return schedule_class(kind)(stage, n_microbatches=m,
                                    **torch_schedule_kwargs([stage], loss_fn, self.shared_inputs))

    # -------------------------------------------------------------- running

    def train_step(
        self, schedule: Any,
        stage: "PipelineStage | TableStage | Sequence[PipelineStage | TableStage]",
        *args: Any, target: Any = None, clip_grad_norm: float | None = None, **kwargs: Any,
    ) -> torch.Tensor | None:
        """Forward and backward of one mini-batch (M micro-batches; under a layout d · M, each
        pipeline its rows): the first stage feeds ``args``/``kwargs``, the last ``target``;
        then gradients are summed over tied copies, averaged over the stage's copies (a
        layout's by torch's FSDP2 or DDP) and, with ``clip_grad_norm``, clipped to that norm
        (``clip_grad_norm``). Returns the mean loss on the last stage's ranks, None elsewhere."""
        if isinstance(schedule, TableSchedule):
            (table_stage,) = _as_list(stage)
            assert isinstance(table_stage, TableStage)
            if table_stage.is_first:
                check_constants(table_stage.submod, self.flatten_inputs(*args, **kwargs))
            loss = unscaled(schedule.step(args, kwargs, target), self.scaler)
            if clip_grad_norm is not None:
                self.clip_grad_norm(stage, clip_grad_norm)
            return loss
        stages = [cast(PipelineStage, s) for s in _as_list(stage)]
        first = next((s for s in stages if s.is_first), None)
        last = next((s for s in stages if s.is_last), None)
        lane = self.copy_of(dist.get_rank()) if self.lanes * self.dp > 1 else 0
        m = cast(StageAdapter, stages[0].submod).microbatches
        feed: list[torch.Tensor] = []
        if first is not None:
            adapter = cast(StageAdapter, first.submod)
            args, kwargs = self.lane_share((args, kwargs), lane, microbatches=m,
                                           what="the mini-batch", inputs=True)
            values = self.flatten_inputs(*args, **kwargs)
            check_constants(adapter, values)
            feed = [values[name].to(first.device) for name in adapter.receives]
            check_feed(adapter.receives, adapter.input_shapes, feed, m, self.shared_inputs)
        losses: list[torch.Tensor] = []
        if last is not None:
            target = self.lane_share(target, lane, microbatches=m, what="the target")
            target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(last.device), target)
        with tensor_step(self.tp, stages[0].device):
            step(schedule, stages, *feed, **({} if last is None else {
                "target": feed_target(target, m), "losses": losses}))
        if not schedule.scale_grads:  # built unscaled, see build_schedule
            for param in {id(p): p for s in stages for p in s.submod.parameters()}.values():
                if param.grad is not None:
                    param.grad /= m
        self.reduce_grads(stages)
        if clip_grad_norm is not None:
            self.clip_grad_norm(stages, clip_grad_norm)
        if last is None:
            return None
        loss = unscaled(torch.stack([loss.detach() for loss in losses]).mean(), self.scaler)
        copies = self.dp_group or cast(StageAdapter, last.submod).replica_group
        if copies is not None:  # the mean over every copy's rows
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=copies)
            loss /= self.lanes * self.dp
        return loss

    def clip_grad_norm(self, stage: Any, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale this rank's gradients so that the whole model's (every stage, every shard,
        a tied parameter once) have at most ``max_norm`` (torch's ``clip_grads_with_norm_``);
        returns the norm before (collective: every rank calls it, after ``reduce_grads``).
        ``stage``: this rank's stage, or the list ``pipeline_stages`` gave."""
        if self.scaler is not None:
            raise ValueError("clip_grad_norm under 16-mixed would clip the GradScaler's scaled "
                             "gradients; split with --precision bf16-mixed or 32-true to clip")
        return clip_grads(self, self.tied, {s.stage_index: s.submod for s in _as_list(stage)},
                          max_norm, norm_type, self.norm_group)

    def reduce_grads(self, stage: Any) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy (once per rank);
        with replicated stages, average every gradient over its stage's replicas."""
        reduce_grads([cast(StageAdapter, s.submod) for s in _as_list(stage)])


def _as_list(stage: Any) -> list[Any]:
    """A rank's stages: ``stage`` itself when ``pipeline_stages`` gave a list, else [stage]."""
    return list(stage) if isinstance(stage, Sequence) else [stage]
