"""Top-2 mixture-of-experts GPT: GPT blocks whose MLP is a router + E expert MLPs (Shazeer et al. 2017;
GShard, Lepikhin et al. 2021; Switch/Mixtral-style top-k gating with renormalized top-k weights).

**Dense formulation.** Routing here is written with dense, shape-static math so that the model traces with
``torch.fx.symbolic_trace`` and ``torch.export`` without data-dependent shapes: every expert is applied to every
token, and the outputs are combined with a dense [.., E] gate tensor that is zero except at each token's top-2
experts (``torch.topk`` + ``scatter``). The result equals sparse top-2 routing (with unlimited capacity), but the
traced graph performs E/2 times the expert FLOPs of a sparse dispatch; cost models that want sparse MoE cost should
scale the expert matmuls by top_k / E. Structure::

    model.wte, model.wpe, model.blocks[i].{ln1, attn(qkv, proj), ln2, mlp(router, experts[e](fc1, fc2))},
    model.ln_f, model.lm_head (tied to wte)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from autopar.zoo.gpt import MLP, CausalSelfAttention, GPTConfig

__all__ = ["MoEConfig", "MoEGPT", "MoEBlock", "MoELayer"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEConfig:
    """Size of a mixture-of-experts GPT.

    layers: number of transformer blocks.
    hidden: model width; divisible by ``heads``.
    heads: attention heads.
    seq: maximum sequence length (learned position embedding size).
    vocab: vocabulary size.
    experts: number of expert MLPs per block (E).
    top_k: experts each token is routed to (2); at most ``experts``.
    ffn_mult: expert MLP expansion factor.
    """

    layers: int
    hidden: int
    heads: int
    seq: int
    vocab: int
    experts: int
    top_k: int = 2
    ffn_mult: int = 4

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "seq", "vocab", "experts", "top_k", "ffn_mult"):
            if getattr(self, field) <= 0:
                raise ValueError(f"MoEConfig.{field} must be positive, got {getattr(self, field)}")
        if self.hidden % self.heads:
            raise ValueError(f"MoEConfig.hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.top_k > self.experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= experts ({self.experts})")

    def gpt_config(self) -> GPTConfig:
        """The dense GPT config sharing this model's attention and embedding sizes."""
        return GPTConfig(layers=self.layers, hidden=self.hidden, heads=self.heads, seq=self.seq,
                         vocab=self.vocab, ffn_mult=self.ffn_mult, tied=True)

    def param_count(self) -> int:
        """Exact ``sum(p.numel() for p in MoEGPT(self).parameters())``, computed analytically."""
        h, f, e = self.hidden, self.ffn_mult * self.hidden, self.experts
        per_layer = 4 * h * h + 4 * h + (h * e + e) + e * (2 * h * f + f + h) + 4 * h
        return self.layers * per_layer + (self.vocab + self.seq) * h + 2 * h


class MoELayer(nn.Module):
    """Router Linear(h, E) + softmax, top-k gates renormalized over the chosen experts, dense combine (module doc)."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts)
        self.experts = nn.ModuleList(MLP(cfg.hidden, cfg.ffn_mult * cfg.hidden) for _ in range(cfg.experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x), dim=-1)  # [b, s, E]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # [b, s, k]
        top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        gates = torch.zeros_like(probs).scatter(-1, top_i, top_w)  # dense [b, s, E], k nonzeros per token
        outs = torch.stack([expert(x) for expert in self.experts], dim=-2)  # [b, s, E, h]
        return (gates.unsqueeze(-1) * outs).sum(dim=-2)


class MoEBlock(nn.Module):
    """Pre-LN block: x + attn(ln1(x)), then x + moe(ln2(x))."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = CausalSelfAttention(cfg.gpt_config())
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MoELayer(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class MoEGPT(nn.Module):
    """GPT language model with top-k MoE MLPs; ``forward(idx[B, s]) -> logits[B, s, V]``; LM head tied to wte."""

    def __init__(self, cfg: MoEConfig) -> None:
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.hidden)
        self.wpe = nn.Embedding(cfg.seq, cfg.hidden)
        self.blocks = nn.ModuleList(MoEBlock(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head.weight`` the very same Parameter as ``wte.weight``."""
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))
