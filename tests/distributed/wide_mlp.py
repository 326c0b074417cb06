"""A deep, wide MLP for the per-rank memory measurement: DEPTH Linear(WIDTH, WIDTH)
layers with ReLUs; cut into 4 stages, the whole is 4x one stage.

- ``build_model``: 16 x 2048 (256 MiB of float32 weights), for the test
- ``build_large``: 16 x 4096 (1 GiB), for BENCHMARKS.md
"""

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 4


def _mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers)


def build_model() -> nn.Module:
    return _mlp(2048, 16)


def build_large() -> nn.Module:
    return _mlp(4096, 16)


def example_inputs() -> tuple[torch.Tensor]:
    return (torch.randn(BATCH, 2048, generator=torch.Generator().manual_seed(1)),)


def example_target() -> torch.Tensor:
    return torch.randn(BATCH, 2048, generator=torch.Generator().manual_seed(2))


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)


build_large.example_inputs = lambda: (  # type: ignore[attr-defined]
    torch.randn(BATCH, 4096, generator=torch.Generator().manual_seed(1)),
)
build_large.example_target = lambda: torch.randn(  # type: ignore[attr-defined]
    BATCH, 4096, generator=torch.Generator().manual_seed(2)
)
