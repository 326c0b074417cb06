"""A residual MLP block with three dropouts: one on its input, before the
column-parallel linear (whole on every rank under tensor parallelism), one between its
column- and row-parallel linears (on each rank's share of the hidden width), and one
after the row, on the residual stream (on each rank's share of the tokens, sequence
parallelism): a model file for the random draws of a split stage."""

from __future__ import annotations

import torch
from torch import nn


class DropoutMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Dropout(0.5)  # whole on every rank
        self.up = nn.Linear(32, 64)
        self.inner = nn.Dropout(0.5)  # on the hidden width: split over the ranks
        self.down = nn.Linear(64, 32)
        self.outer = nn.Dropout(0.5)  # on the residual stream: split by tokens

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return h + self.outer(self.down(self.inner(torch.tanh(self.up(h)))))


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return DropoutMLP().double()


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 16, 32, dtype=torch.float64),)
