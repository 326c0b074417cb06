"""Split a fuzz model with the whole fxpipe pipeline (trace, annotate, cost, lower,
partition, plan, generate) and check the transparency rule on the generated package.

    case = Case(spec, stages=3, schedule="1f1b", microbatches=2, recompute=(True, False, True),
                batch=2)
    check_transparency(case, tmp_dir)  # raises AssertionError (or the pipeline's error)

The oracle is the unsplit model, run on copies of the same inputs (a model may mutate
its inputs in place):

- on the whole mini-batch: outputs, the loss, every gradient;
- micro-batch by micro-batch when the model's outputs depend on how the batch is cut
  (BatchNorm in training mode, bfloat16 rounding: ``ModelSpec.per_microbatch``), the
  loss the mean of the micro-batches' losses; buffers (BatchNorm's running statistics)
  are compared too, after the forward and after the step;
- PipeDream's weight stashing (``WEIGHT_STASHING``) updates every stage after each
  micro-batch's backward, so ``step`` is compared with that update rule written out on
  the unsplit model: micro-batch m runs on stage k's weights after c(k, m) updates,
  c(k, m) the backwards stage k ran before F(k, m) in the schedule table, and each update
  is plain SGD with the gradient of micro-batch m's loss (``stashed_sgd``).
"""

from __future__ import annotations

import copy
import itertools
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe import meta
from fxpipe.compiler import SplitOptions, analyze, plan_split
from fxpipe.cost_models import get_device
from fxpipe.frontend import Traced, trace
from fxpipe.lower import lower
from fxpipe.partition import Recompute
from fxpipe.partition.coarsen import exact_groups
from fxpipe.schedules import ScheduleKind
from tests.codegen._models import grads, import_and_forget, ruff, write_package

from .models import ModelSpec, build_model, example_inputs, output_leaves

__all__ = ["Case", "Split", "check_adapters", "check_transparency", "split"]

RTOL, ATOL = 1e-9, 1e-10  # float64; micro-batching only reorders sums
LR = 0.1  # PipeDream's per-micro-batch SGD step
_counter = itertools.count()

Inputs = tuple[tuple[Any, ...], dict[str, Any]]


@dataclass(frozen=True)
class Case:
    spec: ModelSpec
    stages: int  # GPUs asked for; capped by the model's op groups
    schedule: str  # a ScheduleKind value
    microbatches: int  # asked for; raised where the schedule needs more (see ``split``)
    # per stage (the runner's: a bool or a mode), or one flag (or policy name) for the plan
    recompute: tuple[bool | str, ...] | bool | str
    batch: int  # samples per micro-batch of the traced example
    virtual_stages: int = 2  # interleaved: stage modules per GPU
    replicate: bool = False  # the solver may run a stage on several GPUs ("2-1-1")
    replicas: tuple[int, ...] | None = None  # the runner's per stage (cycled), over the plan's
    declare: bool = True  # batch_dims given to fxpipe; else it tells shared inputs itself
    # samples per micro-batch the package is checked at besides the traced ``batch`` (a
    # model traced at one row runs at any); raised to what replicas and BatchNorm need
    rows: tuple[int, ...] = ()


@dataclass(frozen=True)
class Split:
    traced: Traced
    package: types.ModuleType
    schedule: str  # what the plan runs: the case's, or 1f1b where the model is too small
    stages: int  # stage modules
    gpus: int


def loss_fn(output: Any, target: Any) -> torch.Tensor:
    """Mean of every output leaf, summed: a per-sample mean, so micro-batches add up."""
    del target
    leaves = [leaf for leaf in output_leaves(output) if leaf.is_floating_point()]
    return sum(leaf.mean() for leaf in leaves)  # type: ignore[return-value]


def split(case: Case, directory: Path) -> Split:
    """Trace, plan and generate ``case`` into ``directory``; the package imported.

    What a schedule needs is met here: interleaved and the V kinds (zbv, dualpipev) put
    v stage modules on every GPU, so the GPUs are capped by the model's op groups / v
    (1F1B on one stage when it has fewer groups than v); interleaved needs M a multiple
    of the GPUs and DualPipeV M >= 2 x GPUs, so M is raised to that."""
    spec = case.spec
    model = build_model(spec)
    args, kwargs = example_inputs(spec, batch=case.batch, seed=1)
    traced = trace(model, args, kwargs, batch_dims=_batch_dims(case, args, kwargs))
    regions = any(op.kind == "region" for op in spec.ops)
    assert (traced.tracer == "export") == (spec.untraceable or regions), traced.fallback_reason
    # Batched and shared inputs told apart (one no output depends on may be either).
    first, live = len(spec.inputs), spec.live_inputs
    assert [b for i, b in enumerate(traced.batched) if i in live] == [
        i < first for i in sorted(live)], (traced.batched, traced.batching)
    device = get_device("h100")
    analyze(traced, device=device)
    kind = ScheduleKind(case.schedule)
    v = case.virtual_stages if kind.spec.interleaved else 2 if kind.spec.v_placed else 1
    probe = lower(traced.gm, num_stages=1, device=device, memory_limit=float("inf"),
                  schedule=ScheduleKind.ONE_F_ONE_B, microbatches=1)
    gpus = min(case.stages, exact_groups(probe.problem).num_coarse // v)
    if gpus == 0:
        kind, v, gpus = ScheduleKind.ONE_F_ONE_B, 1, 1
    m = case.microbatches
    if kind.spec.interleaved:
        m = -(-m // gpus) * gpus
    if kind is ScheduleKind.DUALPIPEV:
        m = max(m, 2 * gpus)
    policy = (Recompute(case.recompute) if isinstance(case.recompute, str)
              else Recompute.FULL if case.recompute is True else Recompute.NONE)
    if policy is Recompute.SELECTIVE and probe.problem.writes_kept is not None:
        policy = Recompute.FULL  # refused in one line (tests/test_recompute_flag.py)
    options = SplitOptions(
        gpus=gpus, device=device, memory_limit=float("inf"), microbatches=m, schedule=kind,
        recompute=policy,
        time_limit_s=120, virtual_stages=v, replicate=case.replicate and v == 1)
    # The compiler's own sequence (what `fxpipe split` runs), minus the diagrams. The
    # solver stops on its work limit, the same at any load; the wall-clock limit is only a
    # safety net, loose enough for a machine shared by many.
    plan = plan_split(traced, label="fuzz", options=options)
    write_package(directory, traced, plan)
    complaints = ruff(directory)  # generated code passes the project's rule set
    assert not complaints, complaints
    return Split(traced, import_and_forget(directory), kind.value, plan.num_stages, gpus)


def _batch_dims(case: Case, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """batch_dims() as a model file would declare it: 0 per batched input, None per shared.
    Undeclared, fxpipe decides (see fxpipe/batching.py)."""
    if not case.declare:
        return None
    first = len(case.spec.inputs)
    dims = [0 if i < first else None for i in range(len(args) + len(kwargs))]
    return tuple(dims[:len(args)]), dict(zip(kwargs, dims[len(args):], strict=True))


def check_transparency(case: Case, directory: Path) -> Split:
    """Split ``case`` into ``directory`` and check it at the traced batch and every row
    count of ``case.rows``; returns what the split used."""
    done = split(case, directory)
    traced = done.traced
    # a capture that fixed the batch size runs at that size only (and says so)
    free = all(shape.dynamic[0] is not None for shape in traced.inputs
               if shape.shape and shape.name not in traced.shared_inputs)
    for rows in dict.fromkeys((case.batch, *case.rows) if free else (case.batch,)):
        try:
            _check_at(case, done, rows)
        except Exception as exc:
            exc.add_note(f"at {rows} samples per micro-batch (traced at {case.batch})")
            raise
    return done


def _check_at(case: Case, done: Split, rows: int) -> None:
    """The oracle on a mini-batch of ``rows`` samples per micro-batch (at least a sample
    per replica, and what BatchNorm needs)."""
    package, k, spec = done.package, done.stages, case.spec
    model = build_model(spec)  # a fresh copy: tracing must not have touched the weights
    reference = copy.deepcopy(model)
    stages = package.build_stages(model)
    runner_kwargs: dict[str, Any] = {}
    if isinstance(case.recompute, tuple):
        runner_kwargs["recompute"] = _cycle(_selective_if_it_can(case.recompute, done), k)
    replicas = tuple(package.REPLICAS)
    if case.replicas is not None:
        replicas = runner_kwargs["replicas"] = _cycle(case.replicas, k)
    runner = package.PipelineRunner(stages, **runner_kwargs)
    num_mb = package.MICROBATCHES
    per_mb = max(rows, *replicas, spec.min_batch)  # a replica gets a sample at least
    args, kwargs = example_inputs(spec, batch=per_mb * num_mb, seed=2)

    def fresh() -> Inputs:
        return pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))

    chunks = _microbatches(spec, fresh(), num_mb)
    with torch.no_grad():
        a, kw = fresh()
        got = runner.forward(*a, **kw)
        if spec.per_microbatch:
            want = _concat([reference(*a, **kw) for a, kw in chunks])
        else:
            a, kw = fresh()
            want = reference(*a, **kw)
    _assert_trees_close(got, want, "forward output")
    _assert_close_dicts(_buffers(model), _buffers(reference), "buffer {} after forward")

    a, kw = fresh()
    if package.WEIGHT_STASHING:
        optimizers = [torch.optim.SGD(list(stage.parameters()), lr=LR)
                      if any(p.requires_grad for p in stage.parameters()) else None
                      for stage in stages]
        loss = runner.step(kw if kw else a, None, loss_fn, optimizers=optimizers)
        chunks = _microbatches(spec, fresh(), num_mb)
        weights, want_loss = stashed_sgd(reference, _owners(model, stages), chunks,
                                         versions_used(package.SCHEDULE, k, num_mb))
        torch.testing.assert_close(torch.as_tensor(loss), want_loss, rtol=RTOL, atol=ATOL)
        _assert_close_dicts({n: p.detach() for n, p in model.named_parameters()},
                            {n: weights.get(n, p.detach())
                             for n, p in reference.named_parameters()}, "weight {}")
        assert all(p.grad is None for p in model.parameters())  # zeroed after every update
    else:
        loss = runner.step(kw if kw else a, None, loss_fn)
        if spec.per_microbatch:
            losses = [loss_fn(reference(*a, **kw), None) / num_mb
                      for a, kw in _microbatches(spec, fresh(), num_mb)]
            want_loss = sum(losses)  # type: ignore[assignment]
        else:
            a, kw = fresh()
            want_loss = loss_fn(reference(*a, **kw), None)
        if want_loss.requires_grad:  # else every parameter is frozen or detached from the loss
            want_loss.backward()
        torch.testing.assert_close(torch.as_tensor(loss), want_loss.detach(), rtol=RTOL,
                                   atol=ATOL)
        got_grads, want_grads = grads(model), grads(reference)
        assert sorted(got_grads) == sorted(want_grads), (sorted(got_grads), sorted(want_grads))
        _assert_close_dicts(got_grads, want_grads, "gradient of {}")
    _assert_close_dicts(_buffers(model), _buffers(reference), "buffer {} after step")


def check_adapters(case: Case, done: Split) -> None:
    """The torchrun path in one process: every stage as the ``StageAdapter`` that torch's
    ``PipelineStage`` runs (``distributed.stage_module``), each recomputing under
    checkpoint, chained on the traced example micro-batch (the shapes torchrun's stages
    are built for): the model's output, loss, gradients and buffers. Plans torchrun does
    not run (PipeDream's weight stashing) are skipped."""
    distributed = done.package.distributed
    if distributed.UNSUPPORTED:
        return
    spec = case.spec
    model = build_model(spec)
    reference = copy.deepcopy(model)
    args, kwargs = example_inputs(spec, batch=case.batch, seed=3)
    # each stage_module puts its copies into the modules it binds, the model's own: name
    # the model's parameters before (a tie the stages split is still one parameter)
    owner = {name: id(p) for name, p in model.named_parameters(remove_duplicate=False)}
    names = [name for name, _ in model.named_parameters()]
    adapters = []
    with warnings.catch_warnings():  # no checkpoint file: the stages bind the model's values
        warnings.simplefilter("ignore")
        for k in range(done.stages):
            adapter = distributed.stage_module(model, k, "cpu", *args, **kwargs)[0]
            adapter.recompute = "full"
            adapters.append(adapter)
    values = distributed.PIPELINE.flatten_inputs(*args, **kwargs)
    flat = tuple(values[name] for name in adapters[0].receives)
    torch.manual_seed(0)
    for adapter in adapters:
        flat = adapter(*flat)
    last = adapters[-1]
    output = flat if last.output_leaves is None else last.rebuild_output(flat)
    torch.manual_seed(0)
    a, kw = pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))
    want = reference(*a, **kw)  # on copies: a model may write its inputs in place
    _assert_trees_close(output, want, "torchrun stages' output")
    loss, want_loss = loss_fn(output, None), loss_fn(want, None)
    if want_loss.requires_grad:
        loss.backward()
        want_loss.backward()
    _assert_close_dicts(_summed_grads(adapters, owner, names), grads(reference),
                        "torchrun stages: gradient of {}")
    buffers = {**_buffers(model), **{name: b.detach().clone() for adapter in adapters
                                     for name, b in adapter.stage.named_buffers()}}
    _assert_close_dicts(buffers, _buffers(reference), "torchrun stages: buffer {}")


def _summed_grads(adapters: Sequence[Any], owner: dict[str, int], names: Sequence[str]
                  ) -> dict[str, torch.Tensor]:
    """Each stage holds copies of the model's parameters it uses (materialize.py): per
    parameter (``owner``: name -> the model's parameter, before the copies), its copies'
    gradients summed over the stages, as torchrun sums a tied one's over its ranks."""
    summed: dict[int, torch.Tensor] = {}
    copies = {id(p): (name, p) for adapter in adapters  # stages may bind one module
              for name, p in adapter.stage.named_parameters()}
    for name, p in copies.values():
        if p.grad is not None:
            ident = owner[name]
            summed[ident] = summed[ident] + p.grad if ident in summed else p.grad
    return {name: summed[owner[name]].detach().clone() for name in names
            if owner[name] in summed}


def versions_used(schedule: Sequence[Sequence[tuple[int, str, int]]], num_stages: int,
                  num_mb: int) -> list[list[int]]:
    """c[k][m]: how many backwards stage k ran before F(k, m) (its weights' version)."""
    c = [[-1] * num_mb for _ in range(num_stages)]
    backwards = [0] * num_stages
    for tick in schedule:
        for k, kind, m in tick:
            if kind == "F":
                c[k][m] = backwards[k]
            else:
                backwards[k] += 1
    return c


def stashed_sgd(model: torch.nn.Module, owned: list[list[str]], chunks: list[Inputs],
                c: list[list[int]]) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """PipeDream's rule (see the module docstring) on the unsplit ``model``: the trainable
    weights after the step, by name, and the mean loss over the micro-batches."""
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    # versions[k][v]: stage k's weights after v updates
    versions = [[{n: start[n] for n in names if n in start}] for names in owned]
    losses = []
    for m, (a, kw) in enumerate(chunks):
        params = {n: w.clone().requires_grad_()
                  for k, stage in enumerate(versions) for n, w in stage[c[k][m]].items()}
        loss = loss_fn(torch.func.functional_call(model, params, a, kw), None)
        grads: dict[str, torch.Tensor | None] = dict.fromkeys(params)
        if loss.requires_grad:
            found = torch.autograd.grad(loss, list(params.values()), allow_unused=True)
            grads = dict(zip(params, found, strict=True))
        for stage in versions:
            stage.append({n: w if grads[n] is None else w - LR * grads[n]
                          for n, w in stage[m].items()})
        losses.append(loss.detach())
    final = {n: w for stage in versions for n, w in stage[len(chunks)].items()}
    return final, torch.stack(losses).mean()


def _owners(model: torch.nn.Module, stages: Sequence[torch.nn.Module]) -> list[list[str]]:
    """owners[k]: the model's names of the parameters bound into stage k."""
    name_of = {id(p): n for n, p in model.named_parameters()}
    return [[name_of[id(p)] for p in stage.parameters()] for stage in stages]


def _microbatches(spec: ModelSpec, inputs: Inputs, num_mb: int) -> list[Inputs]:
    """The mini-batch cut as the runner cuts it: batched inputs along dim 0 into equal
    parts, shared inputs whole in each. Each part is a tensor of its own, not a view: the
    views of one tensor share its version counter, so an in-place op of the model on one
    micro-batch's input would look to autograd like a write to another's saved input."""
    args, kwargs = inputs
    first = len(spec.inputs)
    names = list(kwargs)

    def parts(i: int, x: torch.Tensor) -> Sequence[torch.Tensor]:
        return [p.clone() for p in x.tensor_split(num_mb)] if i < first else [x] * num_mb

    arg_parts = [parts(i, x) for i, x in enumerate(args)]
    kw_parts = [parts(len(args) + i, kwargs[n]) for i, n in enumerate(names)]
    return [(tuple(p[m] for p in arg_parts), {n: p[m] for n, p in zip(names, kw_parts,
                                                                       strict=True)})
            for m in range(num_mb)]


def _concat(outputs: list[Any]) -> Any:
    flat = [pytree.tree_flatten(out) for out in outputs]
    columns = zip(*(leaves for leaves, _ in flat), strict=True)
    return pytree.tree_unflatten([torch.cat(list(c)) for c in columns], flat[0][1])


def _selective_if_it_can(modes: Sequence[bool | str], done: Split) -> tuple[bool | str, ...]:
    """The runner's modes, "full" for "selective" where the model writes in place into a
    matmul's output (which SAC would keep written; the runtime refuses it, the planner
    leaves selective out: tests/runtime/test_adapter.py, tests/partition)."""
    writes = any(info.writes_kept for node in done.traced.gm.graph.nodes
                 if (info := meta.BYTES.get(node)) is not None)
    return tuple("full" if writes and str(mode).startswith("selective") else mode
                 for mode in modes)


def _cycle(values: Sequence[Any], k: int) -> tuple[Any, ...]:
    return tuple(values[j % len(values)] for j in range(k))


def _assert_trees_close(got: Any, want: Any, what: str) -> None:
    got_leaves, got_spec = pytree.tree_flatten(got)
    want_leaves, want_spec = pytree.tree_flatten(want)
    assert got_spec == want_spec, f"{what}: structure {got_spec} != {want_spec}"
    for i, (a, b) in enumerate(zip(got_leaves, want_leaves, strict=True)):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, i=i: f"{what} leaf {i}: {m}")


def _assert_close_dicts(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
                        what: str) -> None:
    assert got.keys() == want.keys(), (sorted(got), sorted(want))
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=RTOL, atol=ATOL,
                                   msg=lambda m, key=key: f"{what.format(key)}: {m}")


def _buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


