"""A U-Net: three down levels, a bottleneck, three up levels that concatenate
the matching skip connection. The long skips make it a good stress test for
pipeline cuts: an activation produced in an early stage is read in a late one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH = 2
CHANNELS = 1
IMAGE_SIZE = 64
BASE_WIDTH = 16
GROUPS = 8


class DoubleConv(nn.Module):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.norm1 = nn.GroupNorm(GROUPS, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.norm2 = nn.GroupNorm(GROUPS, out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.norm1(self.conv1(x)))
        return F.relu(self.norm2(self.conv2(x)))


class Down(nn.Module):
    def __init__(self, in_ch: int, out_ch: int) -> None:
        super().__init__()
        self.pool = nn.MaxPool2d(2)
        self.conv = DoubleConv(in_ch, out_ch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(self.pool(x))


class Up(nn.Module):
    def __init__(self, in_ch: int, skip_ch: int, out_ch: int) -> None:
        super().__init__()
        self.up = nn.ConvTranspose2d(in_ch, in_ch // 2, 2, stride=2)
        self.conv = DoubleConv(in_ch // 2 + skip_ch, out_ch)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        return self.conv(torch.cat([skip, x], dim=1))


class UNet(nn.Module):
    def __init__(self, channels: int = CHANNELS, base: int = BASE_WIDTH) -> None:
        super().__init__()
        c1, c2, c3, c4 = base, base * 2, base * 4, base * 8
        self.inc = DoubleConv(channels, c1)  # 64x64
        self.down1 = Down(c1, c2)  # 32x32
        self.down2 = Down(c2, c3)  # 16x16
        self.down3 = Down(c3, c4)  # 8x8
        self.bottleneck = DoubleConv(c4, c4)
        self.up1 = Up(c4, c3, c3)  # 16x16
        self.up2 = Up(c3, c2, c2)  # 32x32
        self.up3 = Up(c2, c1, c1)  # 64x64
        self.outc = nn.Conv2d(c1, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        b = self.bottleneck(x4)
        y = self.up1(b, x3)
        y = self.up2(y, x2)
        y = self.up3(y, x1)
        return self.outc(y)


def build_model() -> nn.Module:
    torch.manual_seed(0)
    return UNet()


def example_inputs() -> tuple[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=g),)


def example_target() -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.randn(BATCH, CHANNELS, IMAGE_SIZE, IMAGE_SIZE, generator=g)


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
