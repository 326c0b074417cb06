"""An MLP whose hidden values pass through ``Tensor.renorm``, an op torch 2.13's DTensor has
no sharding rule for: a model file for the refusal of tensor parallelism under torchrun."""

from __future__ import annotations

import torch
from torch import nn


class RenormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.up(x).renorm(2, 0, 1.0))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return RenormMLP()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(4, 16),)


def example_target() -> torch.Tensor:
    return torch.randn(4, 16)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(output, target)
