"""A small residual CNN: stem conv, four residual blocks, global pool, linear head.

GroupNorm instead of BatchNorm, so training-mode forward passes do not mutate
running statistics and a pipelined run matches the unsplit model exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 4
IMAGE_SIZE = 32
NUM_CLASSES = 10
GROUPS = 8


class ResidualBlock(nn.Module):
    def __init__(self, in_ch: int, out_ch: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)
        self.norm1 = nn.GroupNorm(GROUPS, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(GROUPS, out_ch)
        self.shortcut: nn.Module
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                nn.GroupNorm(GROUPS, out_ch),
            )
        else:
            self.shortcut = nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.norm1(self.conv1(x)))
        out = self.norm2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    def __init__(self, num_classes: int = NUM_CLASSES, widths: tuple[int, ...] = (32, 64, 64, 128)):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, widths[0], 3, padding=1, bias=False),
            nn.GroupNorm(GROUPS, widths[0]),
            nn.ReLU(),
        )
        blocks = []
        in_ch = widths[0]
        for i, w in enumerate(widths):
            blocks.append(ResidualBlock(in_ch, w, stride=1 if i == 0 else 2))
            in_ch = w
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(in_ch, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        x = self.blocks(x)
        x = torch.flatten(self.pool(x), 1)
        return self.head(x)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return ResNet()


def example_inputs() -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def example_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randint(0, NUM_CLASSES, (BATCH,), generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output, target)
