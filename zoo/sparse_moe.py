"""Sparse top-k mixture-of-experts decoder (family ``sparse_moe``): Llama backbone (RMSNorm, RoPE, grouped-query
attention) whose MLPs are routed experts, dispatched and combined by index, dropless.

Routing (Shazeer et al. 2017; Mixtral, Jiang et al. 2024; DeepSeekMoE, Dai et al. 2024): a bias-free router
``Linear(h, E)``, softmax over the E experts, the top-k experts per token, gate weights renormalized over the k
(Mixtral) or not (DeepSeekMoE, ``norm_topk=False``).  Dispatch: the T*k (token, expert) pairs are sorted by expert,
the tokens gathered in that order, each expert's SwiGLU applied to its contiguous rows by one grouped matmul per
weight (:func:`expert_mm`, ``autopar_zoo::expert_mm``), and the results weighted and summed back onto their tokens
(``index_add``).  No token is dropped and no expert computes on a token not routed to it, so the traced FLOPs are the
top-k count: ``2 * T * k * 3 * h * f`` forward per layer, whatever the routing; every shape is static (the per-expert
counts are a tensor, not a shape), so fx and torch.export trace it.  Optional shared experts (DeepSeekMoE's
"shared expert isolation") are one dense SwiGLU every token passes through; the first ``dense_layers`` blocks may
use a dense SwiGLU MLP instead (DeepSeekMoE 16B's first layer).

The expert module :class:`Experts` has the calling convention of Hugging Face's ``MixtralExperts``
(``experts(x[T, h], top_k_index[T, k], top_k_weights[T, k]) -> [T, h]``, weights stored ``[E, out, in]``), so the
runtime's expert parallelism handles both the same way.  Structure::

    model.embed, model.layers[i].{attn_norm, attn(wq, wk, wv, wo), mlp_norm,
                                  mlp(router, experts(w_gate, w_up, w_down), shared?) | mlp(w_gate, w_up, w_down)},
    model.norm, model.lm_head
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo.llama import GQAttention, LlamaConfig, RMSNorm, SwiGLU, rope_tables

__all__ = ["Experts", "SparseMoE", "SparseMoEConfig", "SparseMoELayer", "expert_mm", "routing_histogram"]


# ---------------------------------------------------------------------------------------------------------------------
# the grouped expert matmul: one custom op, so tracing sees one node with static shapes
# ---------------------------------------------------------------------------------------------------------------------
def _expert_mm_eager(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Rows ``x[o_e : o_e + counts[e]]`` times ``w[e].T`` for each expert e (rows sorted by expert)."""
    parts = torch.split(x, [int(c) for c in counts.tolist()], dim=0)
    return torch.cat([p @ w[e].t() for e, p in enumerate(parts)], dim=0) if parts else x.new_empty(0, w.shape[1])


@torch.library.custom_op("autopar_zoo::expert_mm", mutates_args=())
def expert_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """Grouped matmul: x [S, in] with rows sorted by expert, w [E, out, in], counts [E] (sum S) -> [S, out]."""
    return _expert_mm_eager(x, w, counts)


@expert_mm.register_fake
def _(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[1])


def _expert_mm_setup(ctx, inputs, output) -> None:
    x, w, counts = inputs
    ctx.save_for_backward(x, w, counts)


def _expert_mm_backward(ctx, grad):
    x, w, counts = ctx.saved_tensors
    sizes = [int(c) for c in counts.tolist()]
    gx = _expert_mm_eager(grad, w.transpose(1, 2), counts)
    gw = torch.stack([g.t() @ xe for g, xe in zip(torch.split(grad, sizes), torch.split(x, sizes))]) \
        if sizes else torch.zeros_like(w)
    return gx, gw, None


expert_mm.register_autograd(_expert_mm_backward, setup_context=_expert_mm_setup)


# ---------------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class SparseMoEConfig:
    """Size of a sparse MoE decoder.

    layers, hidden, heads, kv_heads, vocab, seq, rope_theta, norm_eps: the Llama backbone (see ``LlamaConfig``).
    experts: routed experts per MoE block (E).
    top_k: experts each token is routed to (k <= E).
    expert_ffn: SwiGLU inner width of one routed expert (f).
    shared_ffn: inner width of the always-on shared expert(s) (0: none; DeepSeekMoE: n_shared x expert width).
    dense_layers: leading blocks with a dense SwiGLU MLP of width ``dense_ffn`` instead of experts.
    dense_ffn: inner width of those dense MLPs.
    norm_topk: renormalize the k gate weights to sum to 1 (Mixtral) or keep the softmax values (DeepSeekMoE).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    seq: int
    experts: int
    top_k: int
    expert_ffn: int
    shared_ffn: int = 0
    dense_layers: int = 0
    dense_ffn: int = 0
    norm_topk: bool = True
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "vocab", "seq", "experts", "top_k", "expert_ffn"):
            if getattr(self, field) <= 0:
                raise ValueError(f"SparseMoEConfig.{field} must be positive, got {getattr(self, field)}")
        if self.top_k > self.experts:
            raise ValueError(f"SparseMoEConfig.top_k ({self.top_k}) must be <= experts ({self.experts})")
        if not 0 <= self.dense_layers <= self.layers or (self.dense_layers and self.dense_ffn <= 0):
            raise ValueError("SparseMoEConfig.dense_layers must be in [0, layers], with dense_ffn > 0 when set")
        if self.shared_ffn < 0:
            raise ValueError(f"SparseMoEConfig.shared_ffn must be >= 0, got {self.shared_ffn}")
        self.backbone()  # validates heads / kv_heads / head_dim

    def backbone(self) -> LlamaConfig:
        """The Llama config of the attention, norms and embeddings (its ``ffn`` is the dense MLP width)."""
        return LlamaConfig(layers=self.layers, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                           ffn=self.dense_ffn or self.expert_ffn, vocab=self.vocab, seq=self.seq,
                           rope_theta=self.rope_theta, norm_eps=self.norm_eps)

    def param_count(self) -> int:
        """Exact ``sum(p.numel() for p in SparseMoE(self).parameters())``."""
        h, b = self.hidden, self.backbone()
        attn = 2 * h * h + 2 * h * b.kv_heads * b.head_dim + 2 * h
        moe = self.experts * 3 * h * self.expert_ffn + h * self.experts + 3 * h * self.shared_ffn
        dense = 3 * h * self.dense_ffn
        return (self.layers * attn + self.dense_layers * dense + (self.layers - self.dense_layers) * moe
                + 2 * self.vocab * h + h)

    def active_params(self) -> int:
        """Parameters each token passes through (the routed experts count k times, not E)."""
        unused = (self.layers - self.dense_layers) * (self.experts - self.top_k) * 3 * self.hidden * self.expert_ffn
        return self.param_count() - unused

    def expert_flops_fwd(self, tokens: int) -> int:
        """Analytic forward FLOPs of all routed experts for ``tokens`` tokens: 2 FLOPs per multiply-add, three
        ``h x f`` matrices per expert, k experts per token, every MoE block."""
        return (self.layers - self.dense_layers) * 2 * tokens * self.top_k * 3 * self.hidden * self.expert_ffn


# ---------------------------------------------------------------------------------------------------------------------
# modules
# ---------------------------------------------------------------------------------------------------------------------
class Experts(nn.Module):
    """E SwiGLU experts stored as ``[E, out, in]`` weights; ``forward(x[T, h], idx[T, k], w[T, k]) -> [T, h]``."""

    def __init__(self, experts: int, hidden: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_gate = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w_up = nn.Parameter(torch.empty(experts, ffn, hidden))
        self.w_down = nn.Parameter(torch.empty(experts, hidden, ffn))

    def forward(self, x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        k = top_k_index.size(-1)
        flat = top_k_index.reshape(-1)  # [S = T*k]
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert
        token = torch.div(order, k, rounding_mode="floor")
        ones = torch.ones_like(flat)
        counts = torch.zeros(self.num_experts, dtype=flat.dtype, device=flat.device).scatter_add(0, flat, ones)
        xs = x[token]  # [S, h] dispatch
        hmid = F.silu(expert_mm(xs, self.w_gate, counts)) * expert_mm(xs, self.w_up, counts)
        ys = expert_mm(hmid, self.w_down, counts) * top_k_weights.reshape(-1)[order].unsqueeze(-1)
        return torch.zeros_like(x).index_add(0, token, ys)  # combine


class SparseMoELayer(nn.Module):
    """Router + top-k + :class:`Experts` (+ shared expert); ``forward(x[b, s, h]) -> [b, s, h]``."""

    def __init__(self, cfg: SparseMoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.top_k, cfg.norm_topk
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.expert_ffn)
        self.shared = SwiGLU(cfg.hidden, cfg.shared_ffn) if cfg.shared_ffn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        flat = x.reshape(b * s, h)
        probs = torch.softmax(self.router(flat), dim=-1)  # [T, E]
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        out = self.experts(flat, top_i, top_w)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.view(b, s, h)


class SparseMoEBlock(nn.Module):
    """Pre-norm block: x + attn(attn_norm(x)), then x + mlp(mlp_norm(x)), mlp routed or dense."""

    def __init__(self, cfg: SparseMoEConfig, dense: bool) -> None:
        super().__init__()
        bb = cfg.backbone()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = GQAttention(bb)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.hidden, cfg.dense_ffn) if dense else SparseMoELayer(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class SparseMoE(nn.Module):
    """Sparse MoE language model; ``forward(idx[B, s]) -> logits[B, s, V]``; untied head, RoPE tables as buffers."""

    def __init__(self, cfg: SparseMoEConfig) -> None:
        super().__init__()
        self.config = cfg
        bb = cfg.backbone()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(SparseMoEBlock(cfg, i < cfg.dense_layers) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        cos, sin = rope_tables(cfg.seq, bb.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute the RoPE tables in place (after ``to_empty`` moved the model off the meta device)."""
        cos, sin = rope_tables(self.config.seq, self.config.backbone().head_dim, self.config.rope_theta)
        self.rope_cos.copy_(cos)
        self.rope_sin.copy_(sin)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        s = idx.size(1)
        x = self.embed(idx)
        cos = torch.narrow(self.rope_cos, 0, 0, s).to(x.dtype)
        sin = torch.narrow(self.rope_sin, 0, 0, s).to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


@torch.no_grad()
def routing_histogram(model: nn.Module, *inputs: torch.Tensor, **kwargs: torch.Tensor) -> list[float]:
    """The measured share of routed (token, expert) pairs each expert received over one forward of ``model``,
    summed over its MoE blocks: the ``expert_load`` input of the planner.  Works on any expert module called as
    ``experts(x, top_k_index, top_k_weights)`` with a ``num_experts`` attribute (this zoo's, Hugging Face Mixtral's)."""
    counts: list[torch.Tensor] = []

    def hook(mod: nn.Module, args: tuple) -> None:
        counts.append(torch.bincount(args[1].reshape(-1), minlength=mod.num_experts)[:mod.num_experts].double())

    handles = [m.register_forward_pre_hook(hook) for m in model.modules()
               if hasattr(m, "num_experts") and any(p.dim() == 3 for p in m.parameters(recurse=False))]
    try:
        model(*inputs, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if not counts:
        raise ValueError("the model has no expert module called as experts(x, top_k_index, top_k_weights)")
    total = torch.stack(counts).sum(0)
    return (total / total.sum()).tolist()
