"""A zero-bubble table's split backward (the I and W actions of schedule.py).

B(k, m) runs as I(k, m), the gradients of the values stage k received (what stage
k - 1 waits for), its graph kept, and W(k, m), later, the gradients of its
parameters: the same ``.grad`` as B (a tied parameter's copies each add theirs).
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from .recompute import refuse_split_backward
from .values import Wiring, received_leaves

__all__ = ["check_split", "input_backward", "weight_backward"]


def check_split(schedule: Sequence[Sequence[tuple[int, str, int]]], replicas: Sequence[int],
                weight_stashing: bool, recompute: Sequence[str] = ()) -> None:
    if not any(a[1] == "W" for t in schedule for a in t):
        return
    if weight_stashing or max(replicas) > 1:
        raise ValueError("a schedule with I and W actions needs replicas=None and "
                         "weight_stashing=False")
    refuse_split_backward(recompute, "A schedule with I and W actions",
                          'recompute those stages "full" or "none", or use a schedule '
                          "without W actions.")


def input_backward(wiring: Wiring, k: int, named: list[tuple[str, Any]],
                   tensors: list[torch.Tensor], grads: list[torch.Tensor | None],
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """I: the gradients of the values stage k received (``named``: its inputs and those
    the loss read), into their ``.grad``; returns what W differentiates later."""
    received = received_leaves(wiring, k, named)
    if tensors and received:
        torch.autograd.backward(tensors, grads, inputs=received, retain_graph=True)
    return tensors, grads


def weight_backward(stage: nn.Module, tensors: list[torch.Tensor],
                    grads: list[torch.Tensor | None]) -> None:
    """W: the gradients of ``stage``'s parameters from the graph its I kept, accumulated
    into ``.grad``."""
    weights = [p for p in stage.parameters() if p.requires_grad]
    if tensors and weights:
        torch.autograd.backward(tensors, grads, inputs=weights)
