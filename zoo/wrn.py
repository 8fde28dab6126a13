"""Wide-ResNet with bottleneck blocks (Zagoruyko & Komodakis 2016, "Wide Residual Networks"; the WRN-50-2 variant
of He et al. 2016's ResNet-50 with the bottleneck 3x3 width doubled, as used for ImageNet). NCHW input.

Structure::

    model.stem     conv 7x7/2 -> BatchNorm -> ReLU -> maxpool 3x3/2
    model.stages   ModuleList of nn.Sequential[Bottleneck]; stage i has ``blocks[i]`` blocks, planes 2^i * base
    model.pool     global average pool, then flatten
    model.fc       Linear(4 * 2^3 * base, classes)

Bottleneck: 1x1 (in -> w) -> 3x3 stride (w -> w) -> 1x1 (w -> 4 planes), BatchNorm + ReLU after each, projection
shortcut (1x1 stride + BatchNorm) when the shape changes; w = planes * width_mult. WRN-50-2 has 68,883,240 params.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["WRNConfig", "WideResNet", "Bottleneck"]

_EXPANSION = 4


@dataclass(frozen=True, kw_only=True, slots=True)
class WRNConfig:
    """Size of a bottleneck Wide-ResNet.

    blocks: bottleneck blocks per stage ((3, 4, 6, 3) for the 50-layer net).
    base: planes of the first stage (64); stage i has base * 2^i planes and 4x that many output channels.
    width_mult: widening factor of the bottleneck 3x3 convolution (2 for WRN-50-2).
    classes: output classes.
    image: input height and width (the default example input size).
    channels: input channels.
    """

    blocks: tuple[int, ...]
    base: int = 64
    width_mult: int = 2
    classes: int = 1000
    image: int = 224
    channels: int = 3

    def __post_init__(self) -> None:
        if not self.blocks or any(b <= 0 for b in self.blocks):
            raise ValueError(f"WRNConfig.blocks must be a non-empty tuple of positive ints, got {self.blocks}")
        for field in ("base", "width_mult", "classes", "image", "channels"):
            if getattr(self, field) <= 0:
                raise ValueError(f"WRNConfig.{field} must be positive, got {getattr(self, field)}")


class Bottleneck(nn.Module):
    """1x1 -> 3x3 (stride) -> 1x1 bottleneck with a residual connection."""

    def __init__(self, in_ch: int, planes: int, width_mult: int, stride: int) -> None:
        super().__init__()
        width, out_ch = planes * width_mult, planes * _EXPANSION
        self.conv1 = nn.Conv2d(in_ch, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_ch, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_ch)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_ch != out_ch:
            self.shortcut = nn.Sequential(nn.Conv2d(in_ch, out_ch, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(out_ch))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + self.shortcut(x))


class WideResNet(nn.Module):
    """Bottleneck Wide-ResNet classifier; ``forward(x[B, C, H, W]) -> logits[B, classes]``."""

    def __init__(self, cfg: WRNConfig) -> None:
        super().__init__()
        self.config = cfg
        self.stem = nn.Sequential(
            nn.Conv2d(cfg.channels, cfg.base, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(cfg.base),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages: list[nn.Module] = []
        in_ch = cfg.base
        for i, n in enumerate(cfg.blocks):
            planes = cfg.base * 2**i
            blocks = [Bottleneck(in_ch if j == 0 else planes * _EXPANSION, planes, cfg.width_mult,
                                 stride=(1 if i == 0 or j > 0 else 2)) for j in range(n)]
            stages.append(nn.Sequential(*blocks))
            in_ch = planes * _EXPANSION
        self.stages = nn.ModuleList(stages)
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(in_ch, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        return self.fc(self.pool(x))
