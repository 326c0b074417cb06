"""TinyMLP cut into 2 pipeline stages by fxpipe.

    stages = build_stages(model)              # the model's own parameters, by name
    runner = PipelineRunner(stages)           # this plan's schedule and micro-batches
    loss = runner.step(inputs, target, loss_fn)

PLAN is plan.json as a dict. Under torchrun: train_torchrun.py, or pipeline_stage (or
pipeline_stages), build_schedule and train_step in your own script; they are imported,
with torch.distributed.pipelining, on first use.
"""

import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from torch import nn

from . import runtime
from .runner import (
    DEVICE_OF,
    MICROBATCHES,
    NUM_GPUS,
    PRECISION,
    RECOMPUTE,
    REPLICAS,
    SCHEDULE,
    WEIGHT_STASHING,
    PipelineRunner,
    stage_devices,
)
from .runtime.placement import DeviceSpec
from .stage0 import Stage0
from .stage1 import Stage1

__all__ = [
    "DEVICE_OF",
    "MICROBATCHES",
    "NUM_GPUS",
    "PLAN",
    "PRECISION",
    "RECOMPUTE",
    "REPLICAS",
    "SCHEDULE",
    "WEIGHT_STASHING",
    "PipelineRunner",
    "build_schedule",
    "build_stages",
    "pipeline_stage",
    "pipeline_stages",
    "stage_devices",
    "train_step",
]

# The torchrun entry points, in distributed.py, imported on first use: a run in one
# process never needs torch.distributed.pipelining.
_DISTRIBUTED = ("build_schedule", "pipeline_stage", "pipeline_stages", "train_step")


def __getattr__(name: str) -> Any:
    if name != "distributed" and name not in _DISTRIBUTED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    distributed = importlib.import_module(".distributed", __name__)
    return distributed if name == "distributed" else getattr(distributed, name)


PLAN = json.loads(Path(__file__).with_name("plan.json").read_text(encoding="utf-8"))
STAGE_CLASSES = (Stage0, Stage1)


def build_stages(
    model: nn.Module, devices: Sequence[DeviceSpec] | None = None
) -> list[nn.Module]:
    """One module per stage, bound to ``model``'s own parameters and buffers;
    with ``devices`` (one per stage, or one per GPU), stage k is moved to its
    device (see ``stage_devices``)."""
    stages = [stage(model) for stage in STAGE_CLASSES]
    return stages if devices is None else runtime.place_stages(stages, stage_devices(devices))
