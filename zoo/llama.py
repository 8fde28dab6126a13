"""Llama-style decoder: RMSNorm, SwiGLU MLP, rotary position embedding (RoPE), grouped-query attention, no biases.

Follows Touvron et al. 2023 ("LLaMA") and the Llama 3 report (Grattafiori et al. 2024, "The Llama 3 Herd of
Models", Table 3 for the 8B/70B/405B sizes). Structure::

    model.embed    Embedding(V, h)
    model.layers   ModuleList[LlamaBlock] x l
                   each: attn_norm, attn(wq, wk, wv, wo), mlp_norm, mlp(w_gate, w_up, w_down)
    model.norm     RMSNorm(h)
    model.lm_head  Linear(h, V, bias=False)     untied

Parameter count: per layer 2h^2 + 2 h kv d (q/o and k/v projections, d = h / heads) + 3 h f (SwiGLU) + 2h (norms),
plus 2 V h (embedding and head) plus h (final norm); see ``LlamaConfig.param_count()``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "Llama", "LlamaBlock", "GQAttention", "SwiGLU", "RMSNorm", "rope_tables"]


@dataclass(frozen=True, kw_only=True, slots=True)
class LlamaConfig:
    """Size of a Llama-style model.

    layers: number of transformer blocks (l).
    hidden: model width (h); divisible by ``heads``.
    heads: query heads; divisible by ``kv_heads``.
    kv_heads: key/value heads (grouped-query attention; equal to ``heads`` for plain multi-head attention).
    ffn: SwiGLU inner width (f).
    vocab: vocabulary size (V).
    seq: sequence length the RoPE tables are precomputed for (the default example input length).
    rope_theta: RoPE base frequency (500000 in Llama 3).
    norm_eps: RMSNorm epsilon.
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    seq: int
    rope_theta: float = 500_000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq"):
            if getattr(self, field) <= 0:
                raise ValueError(f"LlamaConfig.{field} must be positive, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(f"LlamaConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.kv_heads:
            raise ValueError(f"LlamaConfig.heads ({self.heads}) must be divisible by kv_heads ({self.kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig head_dim ({self.head_dim}) must be even for RoPE")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def param_count(self) -> int:
        """Exact ``sum(p.numel() for p in Llama(self).parameters())``, computed analytically."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.ffn + 2 * h
        return self.layers * per_layer + 2 * self.vocab * h + h


def rope_tables(seq: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [seq, head_dim // 2] in float32 (Su et al. 2021, RoFormer)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


class RMSNorm(nn.Module):
    """Root-mean-square LayerNorm (Zhang & Sennrich 2019) with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., :d/2], x[..., d/2:]) of x [b, heads, s, d] by the angles in cos/sin [s, d/2]."""
    half = x.size(-1) // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class GQAttention(nn.Module):
    """Causal grouped-query attention with RoPE on q and k; k/v heads are repeated to match the query heads."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_head = cfg.heads
        self.n_kv_head = cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.hidden = cfg.hidden
        self.wq = nn.Linear(cfg.hidden, cfg.heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.head_dim, cfg.hidden, bias=False)

    def _repeat_kv(self, t: torch.Tensor, b: int, s: int) -> torch.Tensor:
        rep = self.n_head // self.n_kv_head
        t = t[:, :, None].expand(b, self.n_kv_head, rep, s, self.head_dim)
        return t.reshape(b, self.n_head, s, self.head_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        q = self.wq(x).view(b, s, self.n_head, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, self.n_kv_head, self.head_dim).transpose(1, 2)
        q, k = _apply_rope(q, cos, sin), _apply_rope(k, cos, sin)
        k, v = self._repeat_kv(k, b, s), self._repeat_kv(v, b, s)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, s, self.hidden))


class SwiGLU(nn.Module):
    """w_down(silu(w_gate(x)) * w_up(x)) (Shazeer 2020, "GLU Variants Improve Transformer")."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(hidden, ffn, bias=False)
        self.w_up = nn.Linear(hidden, ffn, bias=False)
        self.w_down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = GQAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    """Llama-style language model; ``forward(idx[B, s]) -> logits[B, s, V]`` for s <= ``config.seq``.

    The RoPE cos/sin tables are non-persistent buffers (not in the state dict, not parameters), sliced to the input
    length in forward.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if torch.empty(0).is_meta:  # built on meta (zoo.materialize): shapes only, reset_buffers fills them later
            cos, sin = (torch.empty(cfg.seq, cfg.head_dim // 2) for _ in range(2))
        else:
            cos, sin = rope_tables(cfg.seq, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` moved the model off the meta device)."""
        cos, sin = rope_tables(self.config.seq, self.config.head_dim, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.size(1)
        x = self.embed(idx)
        # narrow (not [:s]) so that torch.fx can trace the slice length as a proxy.
        cos = torch.narrow(self.rope_cos, 0, 0, s).to(x.dtype)
        sin = torch.narrow(self.rope_sin, 0, 0, s).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
