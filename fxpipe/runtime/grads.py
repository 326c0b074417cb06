"""Gradients across ranks after a torchrun step.

Tied parameters (``TIED``: one Parameter bound into several stages, a GPT
embedding reused as the LM head) live as one copy per rank; after backward their
gradients are summed over a process group of exactly the ranks that hold a copy,
so every copy sees the gradient of the unsplit model. A tied parameter held by
two stages of one rank (interleaved, a V) is one copy there, summed once; under a
layout's FSDP2 or DDP, which shard or sync each stage's module on its own (FSDP2 would
split one Parameter of two modules into two, each with half the gradient), each stage
keeps its own equal copy, and the rank adds its copies' gradients before the sum::

    V, 2 x 2 ranks | rank 0: stage 0 (embedding) + stage 3 (head) ─ added on the rank

Unevenly replicated stages (PipeDream's "2-1-1", the schedule table, table.py) then sum
every gradient over their stage's r replicas, each replica having divided its chunk's
loss by r: with a loss that is a mean over the batch and equal chunks, the gradient of
the whole micro-batch. The tied copies are summed over all their holders at once::

    stage 0 | rank 0 (replica 0) ─┐
            | rank 1 (replica 1) ─┴─ all-reduce ──► rank 2 (stage 1, one replica)

Whole pipelines side by side (the same r on every stage: lanes; or a plan's layout of
d pipelines) are data_parallel.py's: each pipeline sums its tied copies over its own
ranks (``group``), and torch's DDP or FSDP2 averages every gradient over the copies.
A pipeline the user runs as one of several (``group``, its gradients averaged by the
user or DDP/FSDP) does the same: the holders' ranks in its group mapped to the job's.

Clipping (``clip_grads``) takes the norm of the whole model's gradients: each rank adds
the p-th powers of what it alone counts (a tied parameter on its first stage's ranks, a
replicated gradient on copy 0, a sharded one's local shard on every rank, a tensor-parallel
one's replicated on the first of its tp ranks), one
all-reduce sums them, and torch's ``clip_grads_with_norm_`` scales every rank's.
"""

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .adapter import StageAdapter
from .data_parallel import total_norm
from .materialize import rebind
from .ranks import RankLayout
from .tensor_parallel import counted_here, settle_grads

__all__ = ["clip_grads", "make_groups", "reduce_grads"]


def make_groups(layout: RankLayout, tied: Sequence[Mapping[int, str]],
                adapters: Mapping[int, StageAdapter], group: Any = None, *,
                separate: bool = False) -> None:
    """The process groups of ``tied`` copies (their holders' ranks) and of each replicated
    stage's ranks, created in the same order on every rank of the job (``dist.new_group``
    is collective over it). ``adapters``: this rank's stages by index; a tied parameter two
    of them hold becomes one copy, or with ``separate`` (stages FSDP2 or DDP will wrap one
    by one) one equal copy each. ``group``: this pipeline's process group, None for the
    whole job; every pipeline's tied groups are then made, on every rank, from the job's
    ranks of each pipeline (gathered from all ranks)."""
    mine = tuple(range(layout.num_ranks))
    pipelines = [mine]
    if group is not None:
        mine = tuple(dist.get_global_rank(group, r) for r in range(layout.num_ranks))
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        pipelines = sorted(set(everyone))
        if sum(map(len, pipelines)) != dist.get_world_size():
            raise ValueError(
                f"the pipelines' process groups overlap (job ranks {pipelines}): give each "
                f"rank the group of the one pipeline it runs, every group of {layout.num_ranks} "
                "ranks and no rank in two")
    for copies in tied:
        holders = sorted({rank for j in copies for rank in layout.ranks_of(j)})
        groups = [dist.new_group([ranks[r] for r in holders]) for ranks in pipelines]
        held = [k for k in sorted(adapters) if k in copies]
        if not held:
            continue
        param = adapters[held[0]].stage.get_parameter(copies[held[0]])
        for k in held:
            copy = param if not separate or k == held[0] else nn.Parameter(
                param.detach().clone(), requires_grad=param.requires_grad)
            rebind(adapters[k].stage, adapters[k].stage.get_parameter(copies[k]), copy)
            adapters[k].tied.append((groups[pipelines.index(mine)], copy))
    for j in range(layout.num_stages):
        if layout.replicas[j] > 1:  # only on the whole job (pipeline_stages refuses a group)
            replica_group = dist.new_group(list(layout.ranks_of(j)))
            if j in adapters:
                adapters[j].replica_group = replica_group


def reduce_grads(adapters: Sequence[StageAdapter]) -> None:
    """Sum each tied parameter's gradient over the ranks holding a copy (once per
    rank, however many of ``adapters`` use it), and every other gradient of an
    unevenly replicated stage over its replicas (each divides its loss by r itself). A
    stage split over a host's ranks has its gradients placed as its parameters first."""
    settle_grads(p for adapter in adapters for p in adapter.parameters())
    copies: dict[int, tuple[Any, dict[int, torch.Tensor]]] = {}  # by group: its copies here
    for adapter in adapters:
        for tied_group, param in adapter.tied:
            copies.setdefault(id(tied_group), (tied_group, {}))[1][id(param)] = param
    tied = {id(param) for _, held in copies.values() for param in held.values()}
    for tied_group, held in copies.values():
        grads = []
        for copy in held.values():
            if copy.grad is None:
                copy.grad = torch.zeros_like(copy)
            # sharded over a layout's dp sub-mesh: every holder's shard i is the same rows
            grads.append(copy.grad.to_local() if isinstance(copy.grad, DTensor) else copy.grad)
        for grad in grads[1:]:  # a layout's stages' own copies, one rank: added here
            grads[0] += grad
        dist.all_reduce(grads[0], op=dist.ReduceOp.SUM, group=tied_group)
        for grad in grads[1:]:
            grad.copy_(grads[0])
    for adapter in adapters:
        if adapter.replica_group is None:
            continue
        for param in adapter.stage.parameters():
            if id(param) in tied or not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=adapter.replica_group)


def clip_grads(layout: RankLayout, tied: Sequence[Mapping[int, str]],
               adapters: Mapping[int, StageAdapter], max_norm: float, norm_type: float,
               group: Any) -> torch.Tensor:
    """Scale the gradients of ``adapters`` (this rank's stages, by index) so that the
    whole model's norm is at most ``max_norm``; returns the norm before. ``group``: the
    ranks of the model (None: the job). Collective: every rank calls it."""
    # a user's pipeline (``group``) is one copy; else copy 0 of every stage counts for all
    first_copy = group is not None or layout.copy_of(dist.get_rank()) == 0
    elsewhere = set()  # a tied parameter counts on its first stage's copy, once
    for copies in tied:
        first = min(copies)
        kept = (id(adapters[first].stage.get_parameter(copies[first]))
                if first in adapters else None)
        elsewhere |= {id(adapters[k].stage.get_parameter(copies[k]))
                      for k in copies if k in adapters} - {kept}
    params = list({id(p): p for a in adapters.values() for p in a.parameters()
                   if p.grad is not None}.values())
    counted = [p.grad for p in params if p.grad is not None and id(p) not in elsewhere
               and (first_copy or isinstance(p.grad, DTensor)) and counted_here(p.grad)]
    device = next(iter(adapters.values())).device or torch.device("cpu")
    norm = total_norm(counted, norm_type, group, torch.device(device))
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
