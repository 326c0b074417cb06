"""Split a fuzz model with the whole fxpipe pipeline (trace, annotate, cost, lower,
partition, plan, generate) and check the transparency rule on the generated package.

    case = Case(spec, stages=3, schedule="1f1b", microbatches=2, recompute=(True, False, True),
                batch=2)
    check_transparency(case, tmp_dir)  # raises AssertionError (or the pipeline's error)
"""

from __future__ import annotations

import types
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced, trace
from fxpipe.lower import lower
from fxpipe.partition import Recompute
from fxpipe.partition.coarsen import exact_groups
from fxpipe.schedules import ScheduleKind
from tests.codegen._models import grads, import_and_forget, write_package

from .models import ModelSpec, build_model, example_inputs, output_leaves

__all__ = ["Case", "check_transparency", "split"]

RTOL, ATOL = 1e-9, 1e-10  # float64; micro-batching only reorders sums


@dataclass(frozen=True)
class Case:
    spec: ModelSpec
    stages: int  # asked for; capped by the model's op groups
    schedule: str  # "gpipe" | "1f1b"
    microbatches: int
    recompute: tuple[bool, ...] | bool  # per stage (the runner's), or one flag for the plan
    batch: int  # samples per micro-batch


def loss_fn(output: Any, target: Any) -> torch.Tensor:
    """Mean of every output leaf, summed: a per-sample mean, so micro-batches add up."""
    del target
    leaves = [leaf for leaf in output_leaves(output) if leaf.is_floating_point()]
    return sum(leaf.mean() for leaf in leaves)  # type: ignore[return-value]


def split(case: Case, directory: Path) -> tuple[Traced, types.ModuleType, int]:
    """The traced model, its generated package imported from ``directory``, the stage count."""
    model = build_model(case.spec)
    args, kwargs = example_inputs(case.spec, batch=case.batch, seed=1)
    # Every input of a fuzz model is per sample; with one sample fxpipe could not tell.
    traced = trace(model, args, kwargs,
                   batch_dims=((0,) * len(args), dict.fromkeys(kwargs, 0)))
    assert (traced.tracer == "export") == case.spec.untraceable, traced.fallback_reason
    device = get_device("h100")
    analyze(traced, device=device)
    plan_recompute = Recompute.ALL if case.recompute is True else Recompute.NONE
    options = SplitOptions(gpus=case.stages, device=device, memory_limit=float("inf"),
                           microbatches=case.microbatches, schedule=ScheduleKind(case.schedule),
                           recompute=plan_recompute, time_limit_s=10)
    # Ask for no more stages than the model has groups of ops that may be cut apart.
    probe = lower(traced.gm, num_stages=1, device=device, memory_limit=float("inf"),
                  schedule=options.schedule, microbatches=options.microbatches)
    k = min(case.stages, exact_groups(probe.problem).num_coarse)
    # The compiler's own sequence (what `fxpipe split` runs), minus the diagrams.
    plan = plan_split(traced, label="fuzz", options=replace(options, gpus=k))
    write_package(directory, traced, plan)
    return traced, import_and_forget(directory), k


def check_transparency(case: Case, directory: Path) -> int:
    """Split ``case`` into ``directory`` and check it; returns the number of stages used."""
    _traced, package, k = split(case, directory)
    model = build_model(case.spec)  # a fresh copy: tracing must not have touched the weights
    runner_kwargs: dict[str, Any] = {}
    if not isinstance(case.recompute, bool):
        runner_kwargs["recompute"] = (tuple(case.recompute) * k)[:k]
    runner = package.PipelineRunner(package.build_stages(model), **runner_kwargs)
    args, kwargs = example_inputs(case.spec, batch=case.batch * case.microbatches, seed=2)

    with torch.no_grad():
        want = model(*args, **kwargs)
        got = runner.forward(*args, **kwargs)
    _assert_trees_close(got, want, "forward output")

    model.zero_grad(set_to_none=True)
    loss = runner.step(kwargs if kwargs else args, None, loss_fn)
    pipeline_grads = grads(model)
    model.zero_grad(set_to_none=True)
    want_loss = loss_fn(model(*args, **kwargs), None)
    if want_loss.requires_grad:  # else every parameter is frozen or detached from the loss
        want_loss.backward()
    model_grads = grads(model)
    torch.testing.assert_close(torch.as_tensor(loss), want_loss.detach(), rtol=RTOL, atol=ATOL)
    assert sorted(pipeline_grads) == sorted(model_grads), (sorted(pipeline_grads),
                                                           sorted(model_grads))
    for key, value in model_grads.items():
        torch.testing.assert_close(pipeline_grads[key], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, key=key: f"gradient of {key}: {m}")
    return k


def _assert_trees_close(got: Any, want: Any, what: str) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"{what}: structure {got_spec} != {want_spec}"
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=i: f"{what} leaf {i}: {m}")

