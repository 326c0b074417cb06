"""Compile an in-memory model with the whole fxpipe sequence (trace, annotate, plan,
generate) into an imported package, as `fxpipe split` would write it."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

from torch import nn

from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced, trace
from fxpipe.partition import Recompute
from fxpipe.schedules import ScheduleKind
from tests.codegen._models import import_and_forget, write_package


def compile_package(model: nn.Module, args: tuple[Any, ...], directory: Path, *,
                    gpus: int = 2, microbatches: int = 4, schedule: str = "1f1b",
                    recompute: bool | str = False,
                    kwargs: dict[str, Any] | None = None) -> tuple[Traced, types.ModuleType]:
    traced = trace(model, args, kwargs or {})
    device = get_device("h100")
    analyze(traced, device=device)
    options = SplitOptions(gpus=gpus, device=device, memory_limit=float("inf"),
                           microbatches=microbatches, schedule=ScheduleKind(schedule),
                           recompute=_policy(recompute),
                           time_limit_s=10)
    plan = plan_split(traced, label="case", options=options)
    write_package(directory, traced, plan)
    return traced, import_and_forget(directory)


def _policy(recompute: bool | str) -> Recompute:
    """The policy of ``recompute``: a bool (full or none), or a policy's name."""
    if isinstance(recompute, str):
        return Recompute(recompute)
    return Recompute.FULL if recompute else Recompute.NONE
