"""The stages of a package on the ranks of a torchrun job, as torch's pipelining takes them.

``RankStages`` holds a package's stage classes, wires (adapter.py) and tied parameters
(grads.py), and builds the stages one rank runs: each a torch ``PipelineStage`` around a
``StageAdapter``, made from one micro-batch of examples, on the process groups of its plan
(ranks.py): r lanes of a replicated plan, a layout's d pipelines on a ``DeviceMesh`` with
each stage's copies kept equal by FSDP2 or DDP (data_parallel.py) and split over t ranks of
a host (tensor_parallel.py), or the schedule table's ``TableStage`` for uneven replicas
(table.py). ``DistributedPipeline`` (pipelining.py) adds the schedule and the step.
"""

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.utils import _pytree as pytree

from .adapter import StageAdapter, example_values, split_wire, wire_example
from .data_parallel import check_data_parallel, make_mesh, shard
from .grads import make_groups, reduce_grads
from .materialize import Checkpoint, load_state, materialize
from .microbatch import batch_size, lane_share, shared_leaves
from .mixed_precision import check_precision
from .older_torch import skip_warmup_sends_to_self
from .ranks import RankLayout
from .recompute import modes
from .table import TableStage
from .tensor_parallel import split_stage, tensor_mesh

__all__ = ["RankStages", "stage_list"]


class RankStages(RankLayout):
    """The package's stages, wires and tied parameters on ranks laid out as
    ``RankLayout`` says, and the stages each rank builds of them."""

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

    def reduce_grads(self, stage: Any) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy (once per rank);
        with replicated stages, average every gradient over its stage's replicas."""
        reduce_grads([cast(StageAdapter, s.submod) for s in stage_list(stage)])


def stage_list(stage: Any) -> list[Any]:
    """A rank's stages: ``stage`` itself when ``pipeline_stages`` gave a list, else [stage]."""
    return list(stage) if isinstance(stage, Sequence) else [stage]
