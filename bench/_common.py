"""Shared by the benchmarks: the bundled GPT example, a model split by fxpipe into
a generated package loaded from a temporary folder, example models analysed once and
planned under several options, and timing contenders in alternating rounds."""

from __future__ import annotations

import importlib.util
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from fxpipe.codegen import load_package
from fxpipe.compiler import SplitOptions, analyze, analyze_file, output_files, plan_split
from fxpipe.cost_models import Device, get_device
from fxpipe.frontend import Traced, trace
from fxpipe.output import write_folder
from fxpipe.plan import Plan
from fxpipe.schedules import ScheduleKind
from fxpipe.units import format_bytes

ROOT = Path(__file__).resolve().parent.parent


def load_gpt_example() -> types.ModuleType:
    """examples/gpt.py as a module (its configs, ``GPT``, ``loss_fn``)."""
    spec = importlib.util.spec_from_file_location("fxpipe_example_gpt", ROOT / "examples/gpt.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@dataclass
class Generated:
    traced: Traced
    plan: Plan
    package: types.ModuleType  # the generated package: build_stages, PipelineRunner, PLAN
    folder: Path


def split_and_load(model: nn.Module, micro: tuple[Any, ...], *, stages: int, microbatches: int,
                   schedule: str = "1f1b", device: str = "h100",
                   memory_limit: float = float("inf"), measure: bool = False) -> Generated:
    """Trace ``model`` on one micro-batch, plan it with the roofline of ``device`` (with
    ``measure``: every node timed where the model and ``micro`` are), write the output
    folder and import its package."""
    traced = trace(model, micro)
    target = get_device(device)
    analyze(traced, device=target, measure=measure)
    options = SplitOptions(gpus=stages, device=target, memory_limit=memory_limit,
                           microbatches=microbatches, schedule=ScheduleKind(schedule))
    plan = plan_split(traced, label=type(model).__name__, options=options)
    folder = Path(tempfile.mkdtemp(prefix="fxpipe-bench-")) / "pipe"
    write_folder(folder, output_files(traced, plan, label=type(model).__name__))
    package = load_package(folder)
    return Generated(traced, plan, package, folder)


def analysed_models(models: dict[str, str], only: list[str] | None,
                    device: Device) -> Iterator[tuple[str, Traced]]:
    """Each of ``models`` (label -> a spec under the repository, ``examples/gpt.py:FACTORY``)
    that ``only`` names (every one when None), traced and analysed on ``device`` once."""
    for label, spec in models.items():
        if only and label not in only:
            continue
        yield label, analyze_file(str(ROOT / spec), device=device)[1]


def timed_plan(traced: Traced, label: str,
               options: SplitOptions) -> tuple[Plan | ValueError, float]:
    """``plan_split`` and its wall seconds; where no split can be had (none fits, say) the
    error instead of a plan, for a benchmark's table to say so."""
    start = time.perf_counter()
    try:
        plan: Plan | ValueError = plan_split(traced, label=label, options=options)
    except ValueError as error:
        plan = error
    return plan, time.perf_counter() - start


def plan_cells(plan: Plan, wall_s: float) -> str:
    """The last cells of a planning benchmark's row: the largest GPU's memory, whether
    every GPU fits, the solver's status and gap, and the wall time of the planning."""
    return (f"{format_bytes(plan.estimate.max_memory)} | "
            f"{'yes' if plan.estimate.fits else 'NO'} | {plan.solver.status} "
            f"{plan.solver.gap:.2%} | {wall_s:.1f} s |")


def token_batch(vocab: int, batch: int, seq: int, seed: int = 0,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids (batch, seq) and their next-token targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].to(device), ids[:, 1:].to(device)


def time_alternately(contenders: list[tuple[str, Callable[[], object]]], rounds: int, *,
                     before: Callable[[], object] = lambda: None,
                     sync: Callable[[], object] = lambda: None,
                     log: bool = False) -> dict[str, list[float]]:
    """Wall seconds of each contender over ``rounds`` rounds after one warm-up round.

    The contenders take turns, and the order flips every round, so drift on the
    machine hits all alike. ``before`` runs untimed before each call (zero the
    gradients, say) and ``sync`` inside the timing after it (wait for the GPU).
    """
    times: dict[str, list[float]] = {name: [] for name, _ in contenders}
    for i in range(rounds + 1):  # round 0 warms up and is not counted
        for name, fn in contenders if i % 2 else contenders[::-1]:
            before()
            sync()
            start = time.perf_counter()
            result = fn()
            sync()
            elapsed = time.perf_counter() - start
            if i:
                times[name].append(elapsed)
            if log:
                print(f"round {i} {name:10s} {elapsed:8.4f} s  {result}", flush=True)
    return times


def paired_ratio(times: dict[str, list[float]], ours: str, base: str) -> float:
    """The median over rounds of ``ours / base`` measured in the same round."""
    return statistics.median(a / b for a, b in zip(times[ours], times[base], strict=True))
