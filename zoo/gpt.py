"""GPT: decoder-only, pre-LayerNorm transformer with learned position embeddings (GPT-2/GPT-3/Megatron-LM).

Structure (names the planner relies on)::

    model.wte      Embedding(V, h)              word embedding
    model.wpe      Embedding(s, h)              learned position embedding
    model.blocks   ModuleList[Block] x l        each: ln1, attn(qkv, proj), ln2, mlp(fc1, fc2)
    model.ln_f     LayerNorm(h)
    model.lm_head  Linear(h, V, bias=False)     weight IS wte.weight when tied (the default, as in Megatron-LM)

Parameter count (tied): per layer 12h^2 + 13h -- qkv 3h^2+3h, proj h^2+h, fc1 4h^2+4h, fc2 4h^2+h, two LayerNorms
4h -- plus embeddings (V + s)h plus the final LayerNorm 2h. Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, Eq. (2) gives P = 12 l h^2 (1 + 13/(12h) + (V + s)/(12 l h)),
which is the same sum without the final LayerNorm; ``GPTConfig.sc21_param_count()`` returns Eq. (2) and
``GPTConfig.param_count()`` returns the exact count of this module (Eq. (2) + 2h).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP"]


@dataclass(frozen=True, kw_only=True, slots=True)
class GPTConfig:
    """Size of a GPT model.

    layers: number of transformer blocks (l).
    hidden: model width (h).
    heads: attention heads; ``hidden`` must be divisible by ``heads``.
    seq: maximum sequence length (s), the size of the position embedding.
    vocab: vocabulary size (V).
    ffn_mult: MLP expansion factor (4 in GPT-2/GPT-3/Megatron).
    tied: tie ``lm_head.weight`` to ``wte.weight``.
    dropout: hidden and attention-probability dropout (Megatron-LM trains GPT with 0.1); 0 builds no dropout ops.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    ffn_mult: int = 4
    tied: bool = True
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "seq", "vocab", "ffn_mult"):
            if getattr(self, field) <= 0:
                raise ValueError(f"GPTConfig.{field} must be positive, got {getattr(self, field)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.hidden % self.heads:
            raise ValueError(f"GPTConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.heads

    def sc21_param_count(self) -> int:
        """Narayanan et al. SC'21 Eq. (2): 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h)) = 12lh^2 + 13lh + (V+s)h.

        Assumes ffn_mult 4 and a tied LM head; excludes the final LayerNorm.
        """
        l, h = self.layers, self.hidden
        return 12 * l * h * h + 13 * l * h + (self.vocab + self.seq) * h

    def param_count(self) -> int:
        """Exact ``sum(p.numel() for p in GPT(self).parameters())``, computed analytically."""
        l, h, f = self.layers, self.hidden, self.ffn_mult * self.hidden
        per_layer = (3 * h * h + 3 * h) + (h * h + h) + (h * f + f) + (f * h + h) + 4 * h
        head = 0 if self.tied else self.vocab * h
        return l * per_layer + (self.vocab + self.seq) * h + 2 * h + head


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused qkv projection, via ``scaled_dot_product_attention``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.heads
        self.head_dim = cfg.head_dim
        self.hidden = cfg.hidden
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.size(0), x.size(1)
        qkv = self.qkv(x).view(b, s, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each [b, n_head, s, head_dim]
        if self.dropout > 0:  # a config choice, fixed at trace time
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(b, s, self.hidden)
        return self.proj(y)


class MLP(nn.Module):
    """fc1 -> GELU -> fc2."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN transformer block: x + drop(attn(ln1(x))), then x + drop(mlp(ln2(x)))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg.hidden, cfg.ffn_mult * cfg.hidden)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.dropout > 0:  # a config choice, fixed at trace time: no dropout op at all when it is 0
            x = x + F.dropout(self.attn(self.ln1(x)), self.dropout, self.training)
            return x + F.dropout(self.mlp(self.ln2(x)), self.dropout, self.training)
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Decoder-only GPT language model; ``forward(idx[B, s]) -> logits[B, s, V]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``wte.weight`` when the config says tied."""
        if self.config.tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
