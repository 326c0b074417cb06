"""Pipelines side by side: d copies of every stage on torch's DeviceMesh, kept equal by
torch's FSDP2 (``fully_shard``) or DDP.

# K: stages, pp: ranks per pipeline, d: pipelines (the data-parallel degree).

The job's d · pp ranks sit on a 2-D ``DeviceMesh`` named ("dp", "pp"), rank i · pp + j
running the stage(s) of rank j of pipeline i (the plan's ``layout``). A pipeline's
stages send to each other on its ``pp`` sub-mesh's process group, and its tied
parameters are summed there; each stage is sharded (fsdp) or replicated (ddp) over its
``dp`` sub-mesh, whose gradient sync is torch's own::

    pipeline 0 | rank 0 (stage 0) ──► rank 1 (stage 1)     rows 0 .. B/d - 1
    pipeline 1 | rank 2 (stage 0) ──► rank 3 (stage 1)     rows B/d .. 2B/d - 1
                 └─ dp sub-mesh ─┘     └─ dp sub-mesh ─┘    FSDP2 / DDP: gradients averaged

Uniformly replicated stages (PipeDream's "2-2": r lanes of whole pipelines, ranks.py) are
the same idea on a mesh named ("pp", "dp"), rank j · r + l, always DDP.

The FSDP unit is the ``StageAdapter``, the module torch's ``PipelineStage`` calls, so its
deferral of the gradient reduce-scatter to the last micro-batch applies; parameters stay
unsharded between micro-batches (``reshard_after_forward=False``, as torchtitan runs FSDP
under a pipeline), so a rank holds its stage's whole parameters and gradients in the step
and 1/d of them, and of the optimizer state, between steps.
"""

import functools
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from .adapter import StageAdapter
from .torch_schedules import TORCH_SCHEDULES

__all__ = ["DP_MODES", "DataParallelStage", "check_backward_sync", "check_data_parallel",
           "held_bytes", "make_mesh", "shard", "total_norm", "watch_step", "whole"]

DP_MODES = ("fsdp", "ddp")


def check_data_parallel(data_parallel: tuple[int, str], replicas: Sequence[int]
                        ) -> tuple[int, str]:
    """(d, mode) of a ``DistributedPipeline``'s ``data_parallel``, refused in one line
    when it is no such pair or comes with replicated stages."""
    dp, mode = data_parallel
    if mode not in DP_MODES or dp < 1 or (dp > 1 and max(replicas or (1,)) > 1):
        raise ValueError(f"data_parallel={tuple(data_parallel)!r} with replicas "
                         f"{tuple(replicas)!r}: give (d >= 1, one of {DP_MODES}), and "
                         "replicate stages by the layout or by replicas, not both")
    return dp, mode


def check_backward_sync(mode: str | None, schedule: str) -> None:
    """Refuse DDP under a schedule that splits the backward (zb1p, zbv, dualpipev): its
    weight pass fills ``.grad`` outside autograd's accumulation, which DDP's reducer
    hooks, so DDP would never average those gradients (FSDP2's sync runs after it)."""
    how = TORCH_SCHEDULES.get(schedule)
    if mode == "ddp" and how is not None and how.splits_backward:
        raise ValueError(f"torch's DDP does not average the gradients that {schedule}'s "
                         f"weight pass computes apart from the backward; split again with "
                         f"--dp-mode fsdp, or run schedule 1f1b or gpipe")


def make_mesh(device: torch.device | str, dp: int, pp: int, dims: Sequence[str] = ("dp", "pp")
              ) -> DeviceMesh:
    """The job's ranks as a ``DeviceMesh`` of ``dims`` (outermost first), each ``dp`` or
    ``pp`` long (collective: every rank calls it)."""
    assert sorted(dims) == ["dp", "pp"], dims
    sizes = {"dp": dp, "pp": pp}
    return init_device_mesh(torch.device(device).type, tuple(sizes[d] for d in dims),
                            mesh_dim_names=tuple(dims))


def shard(adapter: StageAdapter, mode: str, mesh: DeviceMesh) -> nn.Module:
    """``adapter`` (a ``StageAdapter``) kept equal over the 1-D ``mesh`` of its copies:
    sharded by ``fully_shard`` (fsdp, in place) or wrapped in DDP (``DataParallelStage``).
    Its tied copies (``adapter.tied``) are looked up again: FSDP2 swaps every parameter
    for a sharded one."""
    assert mode in DP_MODES, mode
    if not any(p.requires_grad for p in adapter.parameters()):
        return adapter  # parameter-free ops (a softmax mixing layer): nothing to keep equal
    names = {id(p): name for name, p in adapter.named_parameters(remove_duplicate=False)}
    tied = [(group, names[id(param)]) for group, param in adapter.tied]
    if mode == "ddp":
        return DataParallelStage(adapter, process_group=mesh.get_group(),
                                 device_ids=None if adapter.device is None
                                 or adapter.device.type == "cpu" else [adapter.device])
    # torch's PipelineStage sends a stage's outputs and runs their backward, never writing
    # them in place, which is what FSDP2 warns of when a unit returns a view
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(FSDPStageAdapter\) "
                            "returned a view tensor")
    fully_shard(adapter, mesh=mesh, reshard_after_forward=False)
    adapter.tied = [(group, adapter.get_parameter(name)) for group, name in tied]
    return adapter


class DataParallelStage(DistributedDataParallel):
    """DDP around a ``StageAdapter`` whose attributes (``receives``, ``microbatches``, ...)
    read and write through to the adapter, so what knows a ``PipelineStage``'s submod as
    a ``StageAdapter`` works unchanged; torch's ``PipelineStage`` sees a DDP module and
    syncs the gradients once, in the last micro-batch's backward."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__(module, **kwargs)
        self._through = True  # from here on, the adapter's own attributes are written there

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def __setattr__(self, name: str, value: Any) -> None:
        state = self.__dict__
        if state.get("_through") and name not in state and name in vars(self.module):
            setattr(self.module, name, value)
        else:
            super().__setattr__(name, value)


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` whole: a DTensor gathered over its mesh (collective), else itself."""
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _size(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def watch_step(stages: Iterable[Any]) -> dict[int, dict[str, int]]:
    """Watch ``stages`` (torch's ``PipelineStage`` objects, or the schedule table's) keeping,
    per stage module (inside its adapter), the most bytes of parameters and of gradients
    it held at the start of a forward and just before torch's ``perform_reduce_grad`` (the
    end of its last micro-batch's backward): inside a step FSDP2's unsharded parameters,
    and the gradients they accumulate whole until that reduce-scatter (``held_bytes``
    reads them). Under a V (zbv) a stage's every forward may come before its first
    backward, so the forwards alone would not see its gradients."""
    seen: dict[int, dict[str, int]] = {}

    def record(module: nn.Module) -> None:
        params = list({id(p): p for p in module.parameters()}.values())
        held = seen.setdefault(id(module), {"params": 0, "grads": 0})
        held["params"] = max(held["params"], _size(params))
        held["grads"] = max(held["grads"], _size(p.grad for p in params if p.grad is not None))

    for stage in stages:
        module = stage.submod.stage
        module.register_forward_pre_hook(lambda module, args: record(module))
        reduce = getattr(stage, "perform_reduce_grad", None)
        if reduce is not None:
            stage.perform_reduce_grad = _before(reduce, functools.partial(record, module))
    return seen


def _before(method: Callable[..., Any], first: Callable[[], None]) -> Callable[..., Any]:
    """``method``, calling ``first`` before it."""
    def call(*args: Any, **kwargs: Any) -> Any:
        first()
        return method(*args, **kwargs)
    return call


def held_bytes(modules: Iterable[nn.Module], optimizer: torch.optim.Optimizer | None,
               step: dict[int, dict[str, int]]) -> dict[str, int]:
    """What a rank holds for ``modules``, in bytes: ``params`` and ``grads`` inside the
    step (``step``, from ``watch_step``), ``params_local`` and ``grads_local`` between
    steps (this rank's shards, each parameter once), and ``optimizer``: the optimizer's
    state of those parameters (local shards; a 0-dim step count is not counted, as the
    plan does not count it)."""
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    grads = [_local(p.grad) for p in params if p.grad is not None]
    state = optimizer.state if optimizer is not None else {}
    moments = [_local(v) for p in params for v in state.get(p, {}).values()
               if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"params": sum(held["params"] for held in step.values()),
            "grads": sum(held["grads"] for held in step.values()),
            "params_local": _size(map(_local, params)), "grads_local": _size(grads),
            "optimizer": _size(moments)}


def total_norm(grads: Sequence[torch.Tensor], norm_type: float, group: Any,
               device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of the gradients of the whole model, from ``grads``: this
    rank's share of them (every gradient counted on exactly one rank of ``group``, a
    DTensor's local shard on each of its ranks), summed over ``group`` (collective)."""
    local = [_local(g).detach() for g in grads]
    norm = (torch.nn.utils.get_total_norm(local, norm_type).to(torch.float64) if local
            else torch.zeros((), dtype=torch.float64, device=device))
    if norm_type == float("inf"):
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    norm = norm ** norm_type
    dist.all_reduce(norm, op=dist.ReduceOp.SUM, group=group)
    return norm ** (1.0 / norm_type)
