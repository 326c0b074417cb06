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
from .distributed import build_schedule, pipeline_stage, train_step
from .runner import MICROBATCHES, RECOMPUTE, SCHEDULE, build_output, flatten_inputs
from .stage0 import Stage0
from .stage1 import Stage1

__all__ = [
    "PLAN",
    "SCHEDULE",
    "PipelineRunner",
    "build_schedule",
    "build_stages",
    "distributed",
    "pipeline_stage",
    "train_step",
]

PLAN = json.loads(Path(__file__).with_name("plan.json").read_text(encoding="utf-8"))


def build_stages(
    model: nn.Module, devices: Sequence[torch.device | str | int] | None = None
) -> list[nn.Module]:
    """One module per stage, bound to ``model``'s own parameters and buffers;
    with ``devices``, stage k is moved to ``devices[k]``."""
    stages: list[nn.Module] = [Stage0(model), Stage1(model)]
    if devices is None:
        return stages
    if len(devices) != len(stages):
        raise ValueError(
            f"got {len(devices)} devices for {len(stages)} stages; pass one per stage"
        )
    return [stage.to(device) for stage, device in zip(stages, devices, strict=True)]


class PipelineRunner(runner.PipelineRunner):
    """The runtime's PipelineRunner with this package's schedule, micro-batches,
    recompute flags and input/output mapping as defaults."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        devices: Sequence[torch.device | str | int] | None = None,
        *,
        schedule: Sequence[Sequence[tuple[int, str, int]]] = SCHEDULE,
        microbatches: int = MICROBATCHES,
        recompute: Sequence[bool] = RECOMPUTE,
    ) -> None:
        super().__init__(
            stages,
            devices,
            schedule=schedule,
            microbatches=microbatches,
            flatten_inputs=flatten_inputs,
            build_output=build_output,
            recompute=recompute,
        )
