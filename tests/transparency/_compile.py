"""Compile an in-memory model with the whole fxpipe sequence (trace, annotate, plan,
generate) into an imported package, as `fxpipe split` would write it."""

from __future__ import annotations

import itertools
import sys
import types
from pathlib import Path
from typing import Any

from torch import nn

from fxpipe.codegen import generate
from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced, trace
from fxpipe.partition import Recompute
from fxpipe.runtime.loading import import_file
from fxpipe.schedules import ScheduleKind

_counter = itertools.count()


def compile_package(model: nn.Module, args: tuple[Any, ...], directory: Path, *,
                    gpus: int = 2, microbatches: int = 4, schedule: str = "1f1b",
                    recompute: bool = False,
                    kwargs: dict[str, Any] | None = None) -> tuple[Traced, types.ModuleType]:
    traced = trace(model, args, kwargs or {})
    device = get_device("h100")
    analyze(traced, device=device)
    options = SplitOptions(gpus=gpus, device=device, memory_limit=float("inf"),
                           microbatches=microbatches, schedule=ScheduleKind(schedule),
                           recompute=Recompute.ALL if recompute else Recompute.NONE,
                           time_limit_s=10)
    plan = plan_split(traced, label="case", options=options)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in generate(traced, plan).items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text, encoding="utf-8")
    name = f"fxpipe_case_{next(_counter)}"
    try:
        package = import_file(directory / "__init__.py", name, package=True)
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]
    return traced, package
