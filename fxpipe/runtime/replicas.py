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
from replica 0. Limits: only a stage that treats samples independently is
transparent when replicated; one that mixes samples across the batch
(BatchNorm in training mode, which warns; a batch mean returned as an output)
sees chunk statistics instead of the micro-batch's; and a non-batched tensor
whose dim 0 happens to equal the batch size (an output: the chunk size, e.g.
one sample per chunk) is taken for a batched one. On the CPU the r chunks run
one after another on the same module; on CUDA ``devices[k]`` may be a sequence
of r devices: replica i runs on ``devices[k][i]`` with copies of the stage's
Parameters and buffers bound there (see devices.py; a replica on the stage's
own device runs the module itself).
"""

import warnings
from collections.abc import Collection, Sequence
from typing import Any

from torch import nn

from .microbatch import batch_size

__all__ = ["batch_sizes", "check_replicas"]


def check_replicas(replicas: Sequence[int], num_stages: int) -> None:
    """One int of at least 1 per stage."""
    if len(replicas) != num_stages:
        raise ValueError(
            f"replicas has {len(replicas)} entries for {num_stages} stages: pass one "
            f"int per stage (1 for a stage that is not replicated)."
        )
    for k, r in enumerate(replicas):
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise ValueError(
                f"Stage {k} has replicas={r!r}: the number of replicas of a stage must "
                f"be an int of at least 1."
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
                    f"Stage {k} has {r} replicas, but no graph input is a tensor with a "
                    f"batch dimension to split among them: use replicas=1 for it."
                )
            if r > 1 and size is not None and size < r:
                raise ValueError(
                    f"Stage {k} has {r} replicas, more than the {size} samples of "
                    f"micro-batch {m}: pass a mini-batch of at least "
                    f"{r * num_mb} samples ({r} per micro-batch), or give the "
                    f"stage fewer replicas."
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
