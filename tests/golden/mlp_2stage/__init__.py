"""TinyMLP cut into 2 pipeline stages by fxpipe.

    stages = build_stages(model)              # the model's own parameters, by name
    runner = PipelineRunner(stages)           # this plan's schedule and micro-batches
    loss = runner.step(inputs, target, loss_fn)

PLAN is plan.json as a dict.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

from . import distributed, runner
from .distributed import build_schedule, pipeline_stage, pipeline_stages, train_step
from .runner import (
    DEVICE_OF,
    MICROBATCHES,
    NUM_GPUS,
    RECOMPUTE,
    REPLICAS,
    SCHEDULE,
    WEIGHT_STASHING,
    build_output,
    flatten_inputs,
)
from .stage0 import Stage0
from .stage1 import Stage1

__all__ = [
    "DEVICE_OF",
    "PLAN",
    "SCHEDULE",
    "PipelineRunner",
    "build_schedule",
    "build_stages",
    "distributed",
    "pipeline_stage",
    "pipeline_stages",
    "stage_devices",
    "train_step",
]

PLAN = json.loads(Path(__file__).with_name("plan.json").read_text(encoding="utf-8"))


def build_stages(
    model: nn.Module, devices: Sequence[torch.device | str | int] | None = None
) -> list[nn.Module]:
    """One module per stage, bound to ``model``'s own parameters and buffers;
    with ``devices`` (one per stage, or one per GPU), stage k is moved to its
    device (see ``stage_devices``)."""
    stages: list[nn.Module] = [Stage0(model), Stage1(model)]
    if devices is None:
        return stages
    placed = stage_devices(devices)
    return [
        stage.to(device[0] if isinstance(device, list) else device)  # replicas: first
        for stage, device in zip(stages, placed, strict=True)
    ]


def stage_devices(
    devices: Sequence[torch.device | str | int],
) -> list[torch.device | str | int | list[torch.device | str | int]]:
    """One device per stage: ``devices`` as given when there is one per stage;
    when there is one per GPU (NUM_GPUS), stage k's is ``devices[DEVICE_OF[k]]``,
    or the list of its REPLICAS[k] GPUs from there for a replicated stage."""
    if len(devices) == len(DEVICE_OF):
        return list(devices)
    if len(devices) == NUM_GPUS:
        return [
            devices[gpu] if count == 1 else list(devices[gpu : gpu + count])
            for gpu, count in zip(DEVICE_OF, REPLICAS, strict=True)
        ]
    raise ValueError(
        f"got {len(devices)} devices for {len(DEVICE_OF)} stages on {NUM_GPUS} GPUs; "
        "pass one per stage or one per GPU"
    )


class PipelineRunner(runner.PipelineRunner):
    """The runtime's PipelineRunner with this package's schedule, micro-batches,
    recompute flags, replicas, weight stashing and input/output mapping as
    defaults; ``devices`` as for ``build_stages``: one per stage, or one per GPU."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int] | None = None,
        *,
        schedule: Sequence[Sequence[tuple[int, str, int]]] = SCHEDULE,
        microbatches: int = MICROBATCHES,
        recompute: Sequence[bool] = RECOMPUTE,
        replicas: Sequence[int] = REPLICAS,
        weight_stashing: bool = WEIGHT_STASHING,
    ) -> None:
        super().__init__(
            stages,
            None if devices is None else stage_devices(devices),
            schedule=schedule,
            microbatches=microbatches,
            flatten_inputs=flatten_inputs,
            build_output=build_output,
            recompute=recompute,
            replicas=replicas,
            weight_stashing=weight_stashing,
        )
