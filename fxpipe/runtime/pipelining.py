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
from collections.abc import Callable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage
from torch.utils import _pytree as pytree

from .adapter import StageAdapter, check_constants, check_feed, torch_schedule_kwargs
from .data_parallel import check_backward_sync
from .grads import clip_grads
from .mixed_precision import autocast_loss, unscaled
from .older_torch import step
from .own_loss import feed_target, target_or_none
from .rank_stages import RankStages, stage_list
from .table import TableSchedule, TableStage
from .tensor_parallel import tensor_step, whole_loss
from .torch_schedules import schedule_class, torch_schedule
from .torch_zero_bubble import ZERO_BUBBLE, zero_bubble_schedule

__all__ = ["DistributedPipeline"]


class DistributedPipeline(RankStages):
    """The package's stages on ranks (``RankStages``), run by torch's schedules; the
    generated ``distributed.py`` makes one and exports its methods as module functions."""

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
        device = getattr(next(iter(stage_list(stage)), None), "device", None)
        loss_fn, self.scaler = autocast_loss(whole_loss(target_or_none(loss_fn), self.tp),
                                             self.precision, device, self.scaler)
        if kind in ZERO_BUBBLE and not isinstance(stage_list(stage)[0], TableStage):
            return zero_bubble_schedule(kind, stage_list(stage), self.lane_ranks(), m, loss_fn,
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
            (table_stage,) = stage_list(stage)
            assert isinstance(table_stage, TableStage)
            if table_stage.is_first:
                check_constants(table_stage.submod, self.flatten_inputs(*args, **kwargs))
            loss = unscaled(schedule.step(args, kwargs, target), self.scaler)
            if clip_grad_norm is not None:
                self.clip_grad_norm(stage, clip_grad_norm)
            return loss
        stages = [cast(PipelineStage, s) for s in stage_list(stage)]
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
        return clip_grads(self, self.tied, {s.stage_index: s.submod for s in stage_list(stage)},
                          max_norm, norm_type, self.norm_group)
