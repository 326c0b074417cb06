"""A library module that marks one of its functions with ``torch.fx.wrap``, the way
torchvision marks ``stochastic_depth``: the tracer records a call, not its body."""

from __future__ import annotations

import torch
from torch import nn


def scaled_residual(x: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    if scale == 0.0:  # a Python branch on an argument: why it is wrapped
        return x
    return x + scale * y


torch.fx.wrap("scaled_residual")


class Residual(nn.Module):
    def __init__(self, width: int, scale: float) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scaled_residual(x, self.inner(x), self.scale)
