"""A 6-layer MLP: Linear + GELU blocks with a LayerNorm in the middle.

The smallest example of the model-file contract: ``build_model``,
``example_inputs`` (one micro-batch), ``loss_fn`` and ``example_target``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 8
IN_FEATURES = 64
HIDDEN = 256
OUT_FEATURES = 10
DEPTH = 6


class MLP(nn.Module):
    def __init__(
        self,
        in_features: int = IN_FEATURES,
        hidden: int = HIDDEN,
        out_features: int = OUT_FEATURES,
        depth: int = DEPTH,
    ) -> None:
        super().__init__()
        dims = [in_features] + [hidden] * (depth - 1) + [out_features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(hidden)
        self.norm_after = depth // 2 - 1  # LayerNorm after this hidden layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i != last:
                x = self.act(x)
            if i == self.norm_after:
                x = self.norm(x)
        return x


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return MLP()


def example_inputs() -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, IN_FEATURES, generator=g),)


def example_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, OUT_FEATURES, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
