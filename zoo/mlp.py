"""A plain multi-layer perceptron: ``model.layers`` (Linear + GELU blocks) followed by a Linear ``model.head``.

The simplest model the planner handles: pure matmuls, a natural test bed for data and tensor (column/row) parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPConfig", "MLPModel", "MLPBlock"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MLPConfig:
    """Size of an MLP.

    layers: number of Linear + GELU blocks.
    hidden: width of every hidden block.
    in_features: input width.
    out_features: output width of the final Linear head.
    """

    layers: int
    hidden: int
    in_features: int
    out_features: int

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "in_features", "out_features"):
            if getattr(self, field) <= 0:
                raise ValueError(f"MLPConfig.{field} must be positive, got {getattr(self, field)}")

    def param_count(self) -> int:
        """Exact ``sum(p.numel() for p in MLPModel(self).parameters())``."""
        h = self.hidden
        return (self.in_features * h + h) + (self.layers - 1) * (h * h + h) + (h * self.out_features
                                                                              + self.out_features)


class MLPBlock(nn.Module):
    """GELU(Linear(x))."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.fc(x))


class MLPModel(nn.Module):
    """``forward(x[B, in_features]) -> y[B, out_features]``."""

    def __init__(self, cfg: MLPConfig) -> None:
        super().__init__()
        self.config = cfg
        dims = [cfg.in_features] + [cfg.hidden] * cfg.layers
        self.layers = nn.ModuleList(MLPBlock(a, b) for a, b in zip(dims[:-1], dims[1:]))
        self.head = nn.Linear(cfg.hidden, cfg.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)
