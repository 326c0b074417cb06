"""Whether the model file's loss is a mean over the samples, as a pipeline needs it.

A pipeline's loss is the mean of its M micro-batches' losses, and its gradients those of
that mean (the runner and train_torchrun.py alike): the whole mini-batch's loss when the
loss is a mean over the samples. A loss that sums over them (torchtitan's
``cross_entropy_loss`` with ``reduction="sum"``) gives the whole mini-batch's divided by M,
silently. ``summed_loss_note`` tells the two apart on the example micro-batch: the loss
of the whole and of its two halves (``torch.tensor_split`` of the batched inputs along
dim 0, rows n = n_1 + n_2)::

    mean:  L = (n_1 L_1 + n_2 L_2) / n
    sum:   L = L_1 + L_2
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils import _pytree as pytree

from fxpipe.frontend import ModelSource, Traced

__all__ = ["summed_loss_note"]

RTOL = 1e-3  # float32 sums in another order differ far less


def summed_loss_note(source: ModelSource, traced: Traced) -> str | None:
    """One line saying the loss sums over the samples, or None: a mean, neither, or
    nothing to tell (no loss_fn, a micro-batch of one row, a model on the meta device,
    a loss that is no scalar or that fails on half a micro-batch)."""
    batched = {id(t) for value, split in zip(traced.flat_inputs, traced.batched, strict=True)
               if split for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)}
    rows = next((t.size(0) for t in pytree.tree_leaves((source.args, source.kwargs))
                 if id(t) in batched), 0)
    if source.loss_fn is None or rows < 2 or _on_meta(source):
        return None
    halves = [_half(source, batched, rows, i) for i in range(2)]
    whole = _loss(source, source.args, source.kwargs, source.target)
    first, second = (_loss(source, *half) for half in halves)
    if whole is None or first is None or second is None:
        return None
    n_1 = -(-rows // 2)  # tensor_split gives the first half the odd row
    mean = (n_1 * first + (rows - n_1) * second) / rows
    if not _close(whole, first + second) or _close(whole, mean):
        return None
    return (f"loss_fn sums over the samples: on the example micro-batch it gives {whole:.6g}, "
            f"the sum of its halves' {first:.6g} and {second:.6g}, not their mean; a pipeline "
            f"averages its M micro-batches' losses, so the loss and gradients it gives are "
            f"the whole mini-batch's divided by M: make the loss a mean over the samples "
            f"(reduction=\"mean\"), or multiply the gradients by M")


def _half(source: ModelSource, batched: set[int], rows: int, i: int
          ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
    """Half ``i`` of the example micro-batch: its batched inputs' rows and its target's."""
    def cut(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor_split(t, 2)[i]

    args, kwargs = pytree.tree_map_only(
        torch.Tensor, lambda t: cut(t) if id(t) in batched else t, (source.args, source.kwargs))
    target = pytree.tree_map_only(
        torch.Tensor, lambda t: cut(t) if t.dim() and t.size(0) == rows else t, source.target)
    return args, kwargs, target


def _loss(source: ModelSource, args: tuple[Any, ...], kwargs: dict[str, Any], target: Any
          ) -> float | None:
    """The loss in eval mode (no dropout: the three runs must be comparable), or None."""
    model, loss_fn = source.model, source.loss_fn
    assert loss_fn is not None
    training = model.training
    try:
        with torch.no_grad():
            model.eval()
            loss = loss_fn(model(*args, **kwargs), target)
    except Exception:  # a loss that cannot take half the rows says nothing of its reduction
        return None
    finally:
        model.train(training)
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        return None
    value = float(loss)
    return value if math.isfinite(value) else None


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b))


def _on_meta(source: ModelSource) -> bool:
    tensors = [*source.model.parameters(), *source.model.buffers(),
               *(t for t in pytree.tree_leaves((source.args, source.kwargs))
                 if isinstance(t, torch.Tensor))]
    return any(t.is_meta for t in tensors)
