"""A model that computes its own loss, under torch's schedules.

nanoGPT's ``model(X, Y)`` returns ``(logits, loss)``: the targets are an input, the
model file has no ``example_target()``, and its ``loss_fn = lambda out, _: out[1]``
takes no target (``train_step(..., target=None)``). torch's schedules index a target
per micro-batch whenever there is a loss, so ``feed_target`` hands them a placeholder
that splits into M views of one element, and ``target_or_none`` hands the loss None in
its place, as the single-process runner does. (The loss is also a 0-dim output, which
torch cannot concatenate into a mini-batch's output: ``older_torch.step`` asks for none.)
"""

from collections.abc import Callable
from typing import Any

import torch

__all__ = ["feed_target", "target_or_none"]

# never read: its views (expanded, then split by torch) stand for "no target"
_NO_TARGET = torch.zeros(1)


def feed_target(target: Any, microbatches: int) -> Any:
    """``target``, or where there is none a placeholder of ``microbatches`` rows for
    torch's schedule to split (it shares ``_NO_TARGET``'s one element)."""
    return _NO_TARGET.expand(microbatches) if target is None else target


def target_or_none(loss_fn: Callable[[Any, Any], torch.Tensor] | None
                   ) -> Callable[[Any, Any], torch.Tensor] | None:
    """``loss_fn`` given None where torch hands it a piece of ``feed_target``'s
    placeholder."""
    if loss_fn is None:
        return None

    def loss(output: Any, target: Any) -> torch.Tensor:
        placeholder = isinstance(target, torch.Tensor) and target._base is _NO_TARGET
        return loss_fn(output, None if placeholder else target)

    return loss
