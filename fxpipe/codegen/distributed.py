"""Run the generated stages one per process on torch.distributed.pipelining.

This module is copied verbatim into every generated ``distributed.py``, between
a generated header (the package's stage classes and the literal tables below)
and a footer that binds them; it imports only torch and the standard library.

# K: stages, r: replicas of every stage (LANES), K·r processes, M: micro-batches.

torch's ``PipelineStage`` passes a flat tuple of tensors from stage k to stage
k + 1 only. Each generated stage (inputs by name, a tuple of outputs) is
wrapped in a ``StageAdapter`` whose forward takes and returns flat tuples in
the order of the ``WIRES`` table: ``WIRES[k]`` names the values stage k
receives (``WIRES[0]``: the graph inputs any stage reads). A value that skips
stages (a U-Net skip, an attention mask) is in every wire between its producer
and its last reader, so the stages in between pass it along::

    stage 0 ──(x1, x2)──► stage 1 ──(x1, y)──► stage 2      x1: made by 0, read by 2

The last stage returns the model's output (``build_output``) for ``loss_fn``.
Values that are not tensors (``x.size(1)``, a float keyword argument) cannot
travel; they are read from the example micro-batch and baked into the
adapters as constants (micro-batch shapes are fixed by the static metadata
anyway), and ``train_step`` checks that a baked graph input keeps its value.

Tied parameters (``TIED``: one Parameter bound into several stages, a GPT
embedding reused as the LM head) live as one copy per rank; after backward
``train_step`` sums their gradients over a process group of exactly the ranks
that hold a copy, so every copy sees the gradient of the unsplit model.

Replicated stages (PipeDream's "2-2": ``LANES`` = r > 1 replicas of every
stage): K·r ranks form r lanes, each a whole pipeline of K ranks on its own
process group. Rank j·r + l runs stage j in lane l (the GPUs of stage j are
j·r .. j·r + r - 1, as ``DEVICE_OF`` numbers them), and lane l takes chunk l of
the r equal chunks of every micro-batch, as the single-process runner splits a
replicated stage's micro-batch::

    lane 0 | rank 0 (stage 0) ──► rank 2 (stage 1)     chunk 0 of every micro-batch
    lane 1 | rank 1 (stage 0) ──► rank 3 (stage 1)     chunk 1
             └─ all-reduce ─┘     └─ all-reduce ─┘     gradients, over each stage's r ranks

After backward every gradient is averaged over its stage's r replicas (a tied
one over all its holders in all lanes, divided by r), and the last stage's loss
over the lanes: with a loss that is a mean over the batch and equal chunks, the
gradient of the whole micro-batch. Only plans whose stages all have the same
number of replicas run here: the lanes carry whole micro-batch chunks from one
rank to the next, which a "1-1-2" plan (one rank feeding two) does not fit.

Memory: with ``checkpoint``, ``pipeline_stage`` allocates only the rank's own
stage (parameters and buffers still on ``meta`` become empty tensors on
``device``, then get their values from the checkpoint by their original key
names; a checkpoint file is memory-mapped), so no rank holds the whole model.
Build the model with ``parameters_on_meta()``: parameters land on ``meta`` and
buffers stay real (non-persistent buffers such as causal masks are not in
checkpoints).

    rank, world_size, device = init_distributed()
    with parameters_on_meta():
        model = build_model()
    stage = pipeline_stage(model, rank, world_size, device, *example_microbatch,
                           checkpoint="model.pt")
    schedule = build_schedule(stage, loss_fn)
    loss = train_step(schedule, stage, *mini_batch, target=target)   # last rank: loss
"""

import argparse
import contextlib
import importlib.util
import os
import resource
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.utils import _pytree as pytree

__all__ = [
    "DistributedPipeline",
    "StageAdapter",
    "init_distributed",
    "parameters_on_meta",
    "peak_rss_bytes",
]


# ---------------------------------------------------------------------------- launch


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the torchrun job: (rank, world size, this rank's device). gloo on the
    CPU, NCCL on GPUs (one GPU per local rank)."""
    missing = [name for name in ("RANK", "WORLD_SIZE") if name not in os.environ]
    if missing:
        raise RuntimeError(
            f"not launched under torchrun ({' and '.join(missing)} unset): run "
            "`torchrun --nproc-per-node N train_torchrun.py ...` with N the plan's GPUs"
        )
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(backend or ("nccl" if device.type == "cuda" else "gloo"))
    return rank, world_size, device


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build a model with every parameter on ``meta`` (nothing allocated) and its
    buffers real. A parameter assigned twice (a tied weight) stays one object."""
    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = type(param)(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


# ---------------------------------------------------------------------------- adapter


class StageAdapter(nn.Module):
    """A generated stage as torch's pipelining wants it: a flat tuple of tensors
    in (``receives``), a flat tuple out (``sends``), or the model's output at the
    last stage. ``constants`` are the non-tensor values baked in."""

    def __init__(
        self,
        stage: nn.Module,
        receives: Sequence[str],
        sends: Sequence[str] | None,
        constants: Mapping[str, Any],
        build_output: Callable[[dict[str, Any]], Any],
    ) -> None:
        super().__init__()
        self.stage = stage
        self.receives = tuple(receives)
        self.sends = None if sends is None else tuple(sends)
        self.constants = dict(constants)
        self.build_output = build_output
        self.tied: list[tuple[Any, nn.Parameter]] = []  # (process group, this rank's copy)
        self.replica_group: Any = None  # the ranks running this stage (replicated stages)
        self.microbatches = 1  # per step, set by build_schedule

    def forward(self, *flat: torch.Tensor) -> Any:
        values: dict[str, Any] = dict(self.constants)
        values.update(zip(self.receives, flat, strict=True))
        names = cast(tuple[str, ...], self.stage.INPUTS)
        outputs = self.stage(**{name: values[name] for name in names})
        values.update(zip(cast(tuple[str, ...], self.stage.OUTPUTS), outputs, strict=True))
        if self.sends is None:
            return self.build_output(values)
        return tuple(values[name] for name in self.sends)


# ---------------------------------------------------------------------------- pipeline


class DistributedPipeline:
    """The package's stages, wires and tied parameters; the generated footer makes
    one and exports its methods as module functions."""

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
        lanes: int = 1,
        unsupported: str | None = None,
    ) -> None:
        assert len(wires) == len(stage_classes), (len(wires), len(stage_classes))
        assert lanes >= 1, lanes
        self.unsupported = unsupported  # why this plan cannot run under torchrun
        self.lanes = lanes  # replicas of every stage: r pipelines side by side
        self.stage_classes = list(stage_classes)
        self.wires = [tuple(w) for w in wires]
        self.tied = [dict(group) for group in tied]
        self.schedule = schedule
        self.microbatches = microbatches
        self.flatten_inputs = flatten_inputs
        self.build_output = build_output

    @property
    def num_stages(self) -> int:
        return len(self.stage_classes)

    @property
    def num_ranks(self) -> int:
        return self.num_stages * self.lanes

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, lane) of ``rank``: rank j·r + l runs stage j in lane l."""
        if not 0 <= rank < self.num_ranks:
            raise ValueError(
                f"rank {rank} has no stage: this package runs on ranks 0..{self.num_ranks - 1}"
            )
        return divmod(rank, self.lanes)

    # -------------------------------------------------------------- building

    def stage_module(
        self,
        model: nn.Module,
        stage_index: int,
        device: torch.device | str,
        *example_args: Any,
        checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
        **example_kwargs: Any,
    ) -> tuple[StageAdapter, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Stage ``stage_index`` of ``model`` as a ``StageAdapter`` on ``device``, with
        the example tensors (inputs, outputs) of one micro-batch. No process group
        needed. Parameters and buffers still on ``meta`` are materialized and
        loaded from ``checkpoint`` (a state_dict or a ``torch.save`` file of one,
        memory-mapped); nothing outside this stage is allocated."""
        k = self._check_stage(stage_index)
        device = torch.device(device)
        examples = self._example_values(model, example_args, example_kwargs)
        receives, constants = self._split_wire(k, examples)
        last = k == self.num_stages - 1
        sends = None if last else self._split_wire(k + 1, examples)[0]
        stage = self.stage_classes[k](model)
        _materialize(stage, device, _load_state(checkpoint), k)
        adapter = StageAdapter(stage, receives, sends, constants, self.build_output)

        def example(value: Any) -> torch.Tensor:
            out = torch.empty(value.shape, dtype=value.dtype, device=device)
            return out.requires_grad_(value.requires_grad)

        inputs = tuple(example(examples[name]) for name in receives)
        if last:
            leaves = [v for v in pytree.tree_leaves(examples["__output__"])
                      if isinstance(v, torch.Tensor)]
            outputs = tuple(example(v) for v in leaves)
        else:
            outputs = tuple(example(examples[name]) for name in sends or ())
        return adapter, inputs, outputs

    def pipeline_stage(
        self,
        model: nn.Module,
        rank: int,
        world_size: int,
        device: torch.device | str,
        *example_args: Any,
        checkpoint: str | Path | Mapping[str, torch.Tensor] | None = None,
        group: Any = None,
        **example_kwargs: Any,
    ) -> PipelineStage:
        """This rank's ``PipelineStage`` (collective: every rank calls it, in the
        same order). ``example_args``/``example_kwargs``: ONE micro-batch, as the
        model's forward takes it. ``group``: the pipeline's process group (default:
        the whole job); with replicated stages fxpipe makes one per lane."""
        if self.unsupported:
            raise ValueError(self.unsupported)
        if world_size != self.num_ranks:
            what = (f"pipeline stages ({self.num_stages})" if self.lanes == 1 else
                    f"GPUs of the plan ({self.num_stages} stages × {self.lanes} replicas)")
            raise ValueError(
                f"world size ({world_size}) must equal the number of {what}: launch with "
                f"torchrun --nproc-per-node {self.num_ranks}"
            )
        k, lane = self.position(rank)
        example_args, example_kwargs = self.lane_share(
            (example_args, example_kwargs), lane, microbatches=1, what="the example micro-batch")
        adapter, inputs, outputs = self.stage_module(
            model, k, device, *example_args, checkpoint=checkpoint, **example_kwargs
        )
        # every group, created in the same order on every rank (a collective call)
        r = self.lanes
        for copies in self.tied:  # one per tied parameter: its holders in every lane
            tied_group = dist.new_group([j * r + i for j in sorted(copies) for i in range(r)])
            if k in copies:
                adapter.tied.append((tied_group, adapter.stage.get_parameter(copies[k])))
        if r > 1:
            if group is not None:
                raise ValueError("a plan with replicated stages makes its own process groups, "
                                 "one per lane: call pipeline_stage without group")
            for i in range(r):  # lane i: stage j on rank j·r + i
                lane_group = dist.new_group([j * r + i for j in range(self.num_stages)])
                if i == lane:
                    group = lane_group
            for j in range(self.num_stages):  # stage j's replicas
                replica_group = dist.new_group([j * r + i for i in range(r)])
                if j == k:
                    adapter.replica_group = replica_group
        return PipelineStage(
            adapter,
            k,
            self.num_stages,
            torch.device(device),
            input_args=inputs,
            output_args=outputs,
            group=group,
        )

    def lane_share(self, value: Any, lane: int, *, microbatches: int, what: str) -> Any:
        """Lane ``lane``'s rows of ``value``: every tensor leaf with dim > 0 cut into
        ``microbatches`` micro-batches along dim 0, each of them into r equal chunks
        (``torch.tensor_split``, as the runner splits a replicated stage's inputs),
        and chunk ``lane`` of each, concatenated. Other leaves pass whole."""
        r = self.lanes
        if r == 1:
            return value

        def share(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or x.dim() == 0:
                return x
            if x.size(0) % (microbatches * r):
                raise ValueError(
                    f"{what} has {x.size(0)} rows along dim 0, which do not split into "
                    f"{microbatches} micro-batches of {r} equal replica chunks; use a batch "
                    f"size that is a multiple of {microbatches * r}"
                )
            return torch.cat([mb.tensor_split(r)[lane] for mb in x.tensor_split(microbatches)])

        return pytree.tree_map(share, value)

    def build_schedule(
        self,
        stage: PipelineStage,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None,
        *,
        microbatches: int | None = None,
        schedule: str | None = None,
    ) -> Any:
        """The plan's schedule as torch's: gpipe -> ScheduleGPipe, 1f1b -> Schedule1F1B.
        Gradients are divided by M, as the single-process runner does."""
        kind = schedule or self.schedule
        m = microbatches or self.microbatches
        classes = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        if kind not in classes:
            raise ValueError(f"unknown schedule {kind!r}; use one of {sorted(classes)}")
        if kind == "1f1b" and m < self.num_stages:
            warnings.warn(
                f"torch's Schedule1F1B needs at least as many micro-batches ({m}) as stages "
                f"({self.num_stages}); running ScheduleGPipe, which gives the same gradients",
                stacklevel=2,
            )
            kind = "gpipe"
        cast(StageAdapter, stage.submod).microbatches = m
        return classes[kind](stage, n_microbatches=m, loss_fn=loss_fn)

    # -------------------------------------------------------------- running

    def train_step(
        self, schedule: Any, stage: PipelineStage, *args: Any, target: Any = None, **kwargs: Any
    ) -> torch.Tensor | None:
        """Forward and backward of one mini-batch (M micro-batches): the first stage
        feeds ``args``/``kwargs``, the last ``target`` (each lane its share of every
        micro-batch); then gradients are summed over tied copies and averaged over
        replicas. Returns the mean loss on the last stage, None elsewhere. Zero
        grads before."""
        adapter = stage.submod
        assert isinstance(adapter, StageAdapter)
        lane = self.position(dist.get_rank())[1] if self.lanes > 1 else 0
        m = adapter.microbatches
        feed: list[torch.Tensor] = []
        if stage.is_first:
            args, kwargs = self.lane_share((args, kwargs), lane, microbatches=m,
                                           what="the mini-batch")
            values = self.flatten_inputs(*args, **kwargs)
            for name, baked in adapter.constants.items():
                if name in values and values[name] != baked:
                    raise ValueError(
                        f"graph input {name!r} is {values[name]!r} but the stages were built "
                        f"with {baked!r} (non-tensor inputs are baked in at pipeline_stage)"
                    )
            feed = [values[name].to(stage.device) for name in adapter.receives]
        losses: list[torch.Tensor] = []
        if stage.is_last:
            target = self.lane_share(target, lane, microbatches=m, what="the target")
            target = pytree.tree_map_only(torch.Tensor, lambda t: t.to(stage.device), target)
            schedule.step(*feed, target=target, losses=losses)
        else:
            schedule.step(*feed)
        self.reduce_grads(stage)
        if not stage.is_last:
            return None
        loss = torch.stack([loss.detach() for loss in losses]).mean()
        if adapter.replica_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.SUM, group=adapter.replica_group)
            loss /= self.lanes
        return loss

    def reduce_grads(self, stage: PipelineStage) -> None:
        """Sum each tied parameter's gradient over the ranks holding a copy; with
        replicated stages, average every gradient over its stage's replicas."""
        adapter = stage.submod
        assert isinstance(adapter, StageAdapter)
        tied = {id(param) for _, param in adapter.tied}
        for tied_group, param in adapter.tied:
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tied_group)
            param.grad /= self.lanes
        if adapter.replica_group is None:
            return
        for param in adapter.stage.parameters():
            if id(param) in tied or not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=adapter.replica_group)
            param.grad /= self.lanes

    # -------------------------------------------------------------- internals

    def _check_stage(self, k: int) -> int:
        if not 0 <= k < self.num_stages:
            raise ValueError(f"no stage {k}: this package has stages 0..{self.num_stages - 1}")
        return k

    def _example_values(
        self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        """Every wire value of one micro-batch as a fake tensor (shape, dtype,
        requires_grad; nothing allocated), running all stages under FakeTensorMode."""
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        stages = [cls(model) for cls in self.stage_classes]
        values: dict[str, Any] = {}
        with mode, torch.enable_grad():
            fake = pytree.tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
            values.update(self.flatten_inputs(*fake[0], **fake[1]))
            for stage in stages:
                state = {
                    name: _fake_like(t)
                    for name, t in _named_tensors(stage)
                }
                inputs = {name: values[name] for name in cast(tuple[str, ...], stage.INPUTS)}
                outputs = torch.func.functional_call(stage, state, (), inputs)
                values.update(zip(cast(tuple[str, ...], stage.OUTPUTS), outputs, strict=True))
            values["__output__"] = self.build_output(values)
        return values

    def _split_wire(self, k: int, examples: dict[str, Any]) -> tuple[tuple[str, ...], dict]:
        """WIRES[k] as (tensor names, baked constants)."""
        tensors, constants = [], {}
        for name in self.wires[k]:
            value = examples[name]
            if isinstance(value, torch.Tensor):
                tensors.append(name)
            elif _is_constant(value):
                constants[name] = value
            else:
                raise ValueError(
                    f"{name!r} reaches stage {k} from an earlier stage but is a "
                    f"{type(value).__name__}, neither a tensor nor a constant: "
                    "torch.distributed.pipelining passes only tensors between stages; "
                    "cut the model where no such value crosses"
                )
        return tuple(tensors), constants


def _is_constant(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return True
    if isinstance(value, (tuple, list)):
        return all(_is_constant(v) for v in value)
    return False


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    named = list(module.named_parameters(remove_duplicate=False))
    return named + list(module.named_buffers(remove_duplicate=False))


def _fake_like(t: torch.Tensor) -> torch.Tensor:
    # called inside FakeTensorMode: a fake CPU tensor of t's shape, whatever t's device
    out = torch.empty(t.shape, dtype=t.dtype, device="cpu")
    return out.requires_grad_(t.requires_grad) if t.is_floating_point() else out


def _load_state(
    checkpoint: str | Path | Mapping[str, torch.Tensor] | None,
) -> Mapping[str, torch.Tensor] | None:
    if checkpoint is None or isinstance(checkpoint, Mapping):
        return checkpoint
    return torch.load(checkpoint, map_location="cpu", mmap=True, weights_only=True)


def _materialize(
    stage: nn.Module,
    device: torch.device,
    state: Mapping[str, torch.Tensor] | None,
    k: int,
) -> None:
    """Give every parameter and buffer of ``stage`` a tensor on ``device``: from
    ``state`` by its original name where it has one, else its own value; one new
    tensor per original object, so ties inside the stage stay ties."""
    owners: dict[int, list[tuple[nn.Module, str, str, bool]]] = {}
    originals: dict[int, torch.Tensor] = {}
    for prefix, module in stage.named_modules(remove_duplicate=False):
        for is_param, table in ((True, module._parameters), (False, module._buffers)):
            for key, tensor in table.items():
                if tensor is None:
                    continue
                name = f"{prefix}.{key}" if prefix else key
                owners.setdefault(id(tensor), []).append((module, key, name, is_param))
                originals[id(tensor)] = tensor
    missing: list[str] = []
    sources: dict[int, torch.Tensor] = {}
    for ident, places in owners.items():
        names = [name for _, _, name, _ in places]
        found = next((n for n in names if state is not None and n in state), None)
        if found is not None:
            source = state[found]  # type: ignore[index]
            if tuple(source.shape) != tuple(originals[ident].shape):
                raise ValueError(
                    f"checkpoint key {found!r} has shape {tuple(source.shape)}, stage {k} "
                    f"needs {tuple(originals[ident].shape)}"
                )
            sources[ident] = source
        elif originals[ident].is_meta:
            missing.append(names[0])
        else:
            sources[ident] = originals[ident]
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} keys stage {k} needs: {', '.join(missing)}"
        )
    if state is None and any(t.device != device for t in originals.values()):
        warnings.warn(
            f"stage {k}: no checkpoint given; using the model's own values", stacklevel=3
        )
    for ident, places in owners.items():
        old = originals[ident]
        with torch.no_grad():
            new = torch.empty(old.shape, dtype=old.dtype, device=device)
            new.copy_(sources[ident])
        if isinstance(old, nn.Parameter):
            new = nn.Parameter(new, requires_grad=old.requires_grad)
        for module, key, _, is_param in places:
            if is_param:
                module._parameters[key] = cast(nn.Parameter, new)
            else:
                module._buffers[key] = new


# ---------------------------------------------------------------------------- main


def _load_model_file(spec: str) -> tuple[Any, Callable[[], nn.Module]]:
    path, _, factory = spec.partition(":")
    file = Path(path).resolve()
    if not file.is_file():
        raise FileNotFoundError(f"model file {path} not found")
    sys.path.insert(0, str(file.parent))
    module_spec = importlib.util.spec_from_file_location(f"_model_{file.stem}", file)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    build = getattr(module, factory or "build_model", None)
    if build is None:
        raise ValueError(f"{path} has no factory {factory or 'build_model'}()")
    return module, build


def main(pipeline: DistributedPipeline, argv: Sequence[str] | None = None) -> int:
    """The launch script: N training steps of the model file's loss_fn under torchrun."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--model", required=True, help="model.py or model.py:factory")
    parser.add_argument("--checkpoint", help="torch.save'd state_dict of the whole model; "
                        "without it every rank builds the model for real")
    parser.add_argument("--batch", help="torch.save'd {'args', 'kwargs', 'target'} mini-batch; "
                        "default: the example micro-batch repeated M times")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", help="directory for rank{k}.pt: loss, grads, peak RSS")
    opts = parser.parse_args(argv)

    try:
        rank, world_size, device = init_distributed()
    except RuntimeError as error:
        print(f"train_torchrun: error: {error}", file=sys.stderr)
        return 2
    try:
        _train(pipeline, opts, rank, world_size, device)
    except (ValueError, FileNotFoundError) as error:
        print(f"train_torchrun: error: rank {rank}: {error}", file=sys.stderr)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _train(
    pipeline: DistributedPipeline,
    opts: argparse.Namespace,
    rank: int,
    world_size: int,
    device: torch.device,
) -> None:
    module, build = _load_model_file(opts.model)
    example = getattr(build, "example_inputs", module.example_inputs)()
    args, kwargs = (((), example) if isinstance(example, Mapping)
                    else (tuple(example), {}))
    loss_fn = getattr(module, "loss_fn", None)
    if loss_fn is None:
        raise ValueError(f"{opts.model} defines no loss_fn(output, target)")
    rss = {"start": peak_rss_bytes()}
    if opts.checkpoint:
        with parameters_on_meta():
            model = build()
    else:
        model = build()
    rss["built"] = peak_rss_bytes()
    stage = pipeline.pipeline_stage(
        model, rank, world_size, device, *args, checkpoint=opts.checkpoint, **kwargs
    )
    rss["loaded"] = peak_rss_bytes()
    schedule = pipeline.build_schedule(stage, loss_fn)
    if opts.batch:
        batch = torch.load(opts.batch, weights_only=False)
        args, kwargs, target = batch["args"], batch["kwargs"], batch["target"]
    else:
        m = pipeline.microbatches
        repeat = lambda t: torch.cat([t] * m) if t.dim() else t  # noqa: E731
        args, kwargs = pytree.tree_map_only(torch.Tensor, repeat, (args, kwargs))
        example_target = getattr(build, "example_target", module.example_target)
        target = pytree.tree_map_only(torch.Tensor, repeat, example_target())
    optimizer = torch.optim.SGD(stage.submod.parameters(), lr=opts.lr)
    for step in range(opts.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = pipeline.train_step(schedule, stage, *args, target=target, **kwargs)
        if loss is not None and rank % pipeline.lanes == 0:  # lane 0 speaks for all
            print(f"step {step}: loss {loss.item():.6f}", flush=True)
        if step == opts.steps - 1 and opts.save:
            rss["step"] = peak_rss_bytes()
            grads = {name: p.grad.detach().cpu().clone()
                     for name, p in cast(nn.Module, stage.submod.stage).named_parameters(
                         remove_duplicate=False) if p.grad is not None}
            Path(opts.save).mkdir(parents=True, exist_ok=True)
            torch.save({"loss": loss, "grads": grads, "rss": rss},
                       Path(opts.save) / f"rank{rank}.pt")
        optimizer.step()
    print(f"rank {rank}: peak RSS {peak_rss_bytes() / 2**20:.0f} MiB", flush=True)
