"""A library module that marks one of its functions with ``torch.fx.wrap``, the way
torchvision marks ``stochastic_depth``: the tracer records a call, not its body. And one
with a ``torch.autograd.Function``, which the tracer records as one call too."""

from __future__ import annotations

from typing import Any

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


class StraightThrough(torch.autograd.Function):
    """Rounding whose gradient passes straight through (quantization-aware training): a
    backward that is not the forward's derivative (rounding's is zero)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.round()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class Quantized(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(StraightThrough.apply(4 * self.a(x)))
