"""Marks ``stochastic_depth`` with ``torch.fx.wrap``, as torchvision.ops.stochastic_depth
does: the tracer records a call of the function, not its body."""

from __future__ import annotations

import torch
from torch import nn


def stochastic_depth(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    if not training or p == 0.0:  # a Python branch on arguments: why it is wrapped
        return x
    keep = torch.ones(x.shape[0], 1, dtype=x.dtype, device=x.device)  # deterministic here
    return x * keep / (1.0 - p)


torch.fx.wrap("stochastic_depth")


class StochasticDepth(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return stochastic_depth(x, self.p, self.training)
