"""Vision Transformer (Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words: Transformers for Image Recognition at
Scale", ICLR 2021): an image cut into ``patch x patch`` patches, each linearly embedded, a learned class token and
learned position embeddings, a pre-LayerNorm transformer encoder (bidirectional attention), and a linear classifier on
the final class token.  NCHW input.

Structure (names the planner relies on)::

    model.patch      Conv2d(C, h, patch, stride=patch)     the patch embedding (a linear map of each flattened patch)
    model.cls        Parameter [1, 1, h]                   the class token, prepended to the patch sequence
    model.pos        Parameter [1, 1 + (image/patch)^2, h] learned position embedding
    model.blocks     ModuleList[EncoderBlock] x l          each: ln1, attn(qkv, proj), ln2, mlp(fc1, fc2)
    model.ln_f       LayerNorm(h)
    model.head       Linear(h, classes)                    on the class token

Parameter count: per layer 4h^2 + 2hf + 9h + f (qkv 3h^2+3h, proj h^2+h, fc1 hf+f, fc2 fh+h, two LayerNorms 4h);
patch embedding C p^2 h + h, class token h, positions (1 + n)h, final LayerNorm 2h, head (h + 1) classes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.gpt import MLP

__all__ = ["ViT", "ViTConfig", "EncoderBlock", "SelfAttention"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ViTConfig:
    """Size of a Vision Transformer.

    layers: encoder blocks (l).
    hidden: model width (h); divisible by ``heads``.
    heads: attention heads.
    ffn: MLP width (f; 4h in the paper's models).
    patch: patch side in pixels; ``image`` must be a multiple of it.
    image: input height and width.
    channels: input channels.
    classes: output classes.
    """

    layers: int
    hidden: int
    heads: int
    ffn: int
    patch: int = 16
    image: int = 224
    channels: int = 3
    classes: int = 1000

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "ffn", "patch", "image", "channels", "classes"):
            if getattr(self, field) <= 0:
                raise ValueError(f"ViTConfig.{field} must be positive, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(f"ViTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.image % self.patch:
            raise ValueError(f"ViTConfig.image ({self.image}) must be a multiple of patch ({self.patch})")

    @property
    def tokens(self) -> int:
        """Sequence length: the patches plus the class token."""
        return (self.image // self.patch) ** 2 + 1

    def param_count(self) -> int:
        """Exact ``sum(p.numel() for p in ViT(self).parameters())``, computed analytically."""
        h, f = self.hidden, self.ffn
        per_layer = 4 * h * h + 2 * h * f + 9 * h + f
        embed = self.channels * self.patch**2 * h + h + h + self.tokens * h
        return self.layers * per_layer + embed + 2 * h + (h + 1) * self.classes


class SelfAttention(nn.Module):
    """Bidirectional multi-head self-attention with a fused qkv projection (``scaled_dot_product_attention``)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_head, self.hidden = cfg.heads, cfg.hidden
        self.head_dim = cfg.hidden // cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        qkv = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])
        return self.proj(y.transpose(1, 2).reshape(b, s, self.hidden))


class EncoderBlock(nn.Module):
    """Pre-LN encoder block: x + attn(ln1(x)), then x + mlp(ln2(x)) (the paper's Eq. 2-3)."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ViT(nn.Module):
    """Vision Transformer classifier; ``forward(x[B, C, H, W]) -> logits[B, classes]``."""

    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.patch = nn.Conv2d(cfg.channels, cfg.hidden, cfg.patch, stride=cfg.patch)
        self.cls = nn.Parameter(torch.zeros(1, 1, cfg.hidden))
        self.pos = nn.Parameter(torch.zeros(1, cfg.tokens, cfg.hidden))
        self.blocks = nn.ModuleList(EncoderBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch(x).flatten(2).transpose(1, 2)  # [B, n, h]
        x = torch.cat((self.cls.expand(x.size(0), -1, -1), x), dim=1) + self.pos
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)[:, 0])
