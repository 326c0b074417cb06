"""Gradients across ranks after a torchrun step.

Tied parameters (``TIED``: one Parameter bound into several stages, a GPT
embedding reused as the LM head) live as one copy per rank; after backward their
gradients are summed over a process group of exactly the ranks that hold a copy,
so every copy sees the gradient of the unsplit model. A tied parameter held by
two stages of one rank (interleaved) is one copy there, summed once.

With replicated stages every gradient is then averaged over its stage's r
replicas (a tied one over all its holders in all lanes, divided by r): with a
loss that is a mean over the batch and equal chunks, the gradient of the whole
micro-batch::

    lane 0 | rank 0 (stage 0) ──► rank 2 (stage 1)
    lane 1 | rank 1 (stage 0) ──► rank 3 (stage 1)
             └─ all-reduce ─┘     └─ all-reduce ─┘     gradients, over each stage's r ranks
"""

from collections.abc import Sequence

import torch
import torch.distributed as dist

from .adapter import StageAdapter

__all__ = ["reduce_grads"]


def reduce_grads(adapters: Sequence[StageAdapter], lanes: int) -> None:
    """Sum each tied parameter's gradient over the ranks holding a copy (once per
    rank, however many of ``adapters`` use it); divide by ``lanes``, and average
    every other gradient of a replicated stage over its replicas. Each lane's loss
    is its chunk's mean, so the sum over replicas is divided by r (an uneven-replica
    stage divides its loss by r itself and passes ``lanes`` = 1)."""
    tied: set[int] = set()
    for adapter in adapters:
        for tied_group, param in adapter.tied:
            if id(param) in tied:
                continue
            tied.add(id(param))
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=tied_group)
            param.grad /= lanes
    for adapter in adapters:
        if adapter.replica_group is None:
            continue
        for param in adapter.stage.parameters():
            if id(param) in tied or not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, group=adapter.replica_group)
            param.grad /= lanes
