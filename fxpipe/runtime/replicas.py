"""Replicated stages (PipeDream's "2-1-1") in one process: ``replicas[k] = r > 1``.

Stage k runs data-parallel. Each micro-batch's inputs to it are split along
dim 0 into r chunks (``torch.tensor_split``), the stage runs on every chunk and
the chunk outputs are concatenated back along dim 0, all inside autograd::

    F(0, m) | inputs ─┬─ chunk 0 ─► replica 0 (devices[0][0]) ─┬─ cat ─► F(1, m) ─► ...
            |         └─ chunk 1 ─► replica 1 (devices[0][1]) ─┘

so the backward splits the output gradient, and the r chunks' parameter
gradients are summed into the stage's parameters: the sum a data-parallel
all-reduce computes. Which values are split: an input tensor leaf whose dim 0
equals the micro-batch's batch size (dim 0 of its first graph-input tensor with
dim > 0); an output tensor leaf is concatenated when its dim 0 equals every
replica's chunk size. Anything else (0-dim tensors, non-tensors, a causal mask
of shape (1, 1, T, T)) goes whole to every replica, and as an output is taken
from replica 0 when every replica made the same one (else refused: a loss the model
computes is each replica's own). Limits: only a stage that treats samples independently is
transparent when replicated; one that mixes samples across the batch
(BatchNorm in training mode, which warns; a batch mean returned as an output)
sees chunk statistics instead of the micro-batch's; and a non-batched tensor
whose dim 0 happens to equal the batch size (an output: the chunk size, e.g.
one sample per chunk) is taken for a batched one. On the CPU the r chunks run
one after another on the same module; on CUDA ``devices[k]`` may be a sequence
of r devices: replica i runs on ``devices[k][i]`` with copies of the stage's
Parameters and buffers bound there (see placement.py; a replica on the stage's
own device runs the module itself).
"""

import warnings
from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import nn

from .microbatch import batch_size, merge_leaves

__all__ = ["batch_sizes", "check_replicas", "merge_replicas"]


def check_replicas(replicas: Sequence[int], num_stages: int) -> None:
    """One int of at least 1 per stage."""
    if len(replicas) != num_stages:
        raise ValueError(
            f"replicas has {len(replicas)} entries for {num_stages} stages: pass one "
            f"int per stage (1 for a stage that is not replicated)"
        )
    for k, r in enumerate(replicas):
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(
                f"stage {k} has replicas={r!r}: the number of replicas of a stage must "
                f"be an int of at least 1"
            )


def batch_sizes(values: list[dict[str, Any]], stages: Sequence[nn.Module],
                replicas: Sequence[int], shared: Collection[str] = ()) -> list[int | None]:
    """Each micro-batch's batch size: dim 0 of its first graph-input tensor with
    dim > 0, the ``shared`` inputs left out (None without one). Checks that every
    replicated stage can split it."""
    num_mb = len(values)
    sizes: list[int | None] = []
    for m, graph_inputs in enumerate(values):
        size = batch_size({name: v for name, v in graph_inputs.items() if name not in shared})
        for k, r in enumerate(replicas):
            if r > 1 and size is None:
                raise ValueError(
                    f"stage {k} has {r} replicas, but no graph input is a tensor with a "
                    f"batch dimension to split among them: use replicas=1 for it"
                )
            if r > 1 and size is not None and size < r:
                raise ValueError(
                    f"stage {k} has {r} replicas, more than the {size} samples of "
                    f"micro-batch {m}: pass a mini-batch of at least "
                    f"{r * num_mb} samples ({r} per micro-batch), or give the "
                    f"stage fewer replicas"
                )
        sizes.append(size)
    _warn_batch_norm(stages, replicas)
    return sizes


def _warn_batch_norm(stages: Sequence[nn.Module], replicas: Sequence[int]) -> None:
    """Warn about BatchNorm in training mode inside a replicated stage: each
    replica would normalize with its own chunk's statistics."""
    batch_norms = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    for k, (stage, r) in enumerate(zip(stages, replicas, strict=True)):
        if r == 1:
            continue
        for name, module in stage.named_modules():
            if isinstance(module, batch_norms) and module.training:
                warnings.warn(
                    f"Stage {k} runs on {r} replicas and its {name or 'module'!r} "
                    f"({type(module).__name__}) is in training mode: each replica "
                    f"normalizes with its own chunk's statistics, so outputs and gradients "
                    f"differ from the unsplit model's. Use replicas=1 for stage {k} or "
                    f"put the module in eval mode.",
                    stacklevel=4,
                )
                return


def merge_replicas(outputs: list[Any], sizes: list[int], *, whole: Collection[int] = ()) -> Any:
    """The replicas' outputs as one (the inverse of ``split_replicas``): a tensor leaf
    whose dim 0 is each replica's chunk size is concatenated along dim 0, any other
    leaf taken from replica 0, and so are the outputs at the positions ``whole`` (each
    replica's tuple of outputs: values that have no batch dimension)."""
    if whole:
        return tuple(outputs[0][i] if i in whole else merge_replicas([o[i] for o in outputs], sizes)
                     for i in range(len(outputs[0])))

    def merge(parts: list[Any]) -> Any:
        batched = all(isinstance(t, torch.Tensor) and t.dim() > 0 and t.size(0) == size
                      for t, size in zip(parts, sizes, strict=True))
        if batched:
            return torch.cat(parts, dim=0)
        _same_in_every_replica(parts)
        return parts[0]

    return merge_leaves(outputs, merge)


def _same_in_every_replica(parts: list[Any]) -> None:
    """A value with no row per sample stands for the whole micro-batch only if every
    replica made the same one (a mask, a table); one each made from its own rows (a loss
    the model computes, a sum over the rows) would be replica 0's alone, and so would
    its gradient."""
    first = parts[0]
    if not isinstance(first, torch.Tensor):
        return
    for other in parts[1:]:
        same = (isinstance(other, torch.Tensor) and other.shape == first.shape
                and torch.equal(other.detach().to(first.device), first.detach()))
        if not same:
            raise ValueError(
                f"a replicated stage returns a tensor of shape {tuple(first.shape)} that has "
                "no row per sample and differs between its replicas (a loss the model "
                "computes, a sum over its rows): each replica makes its own from its share "
                "of the micro-batch, and none stands for the whole; return per-sample values "
                "and reduce them in loss_fn, or split without --replicate")
