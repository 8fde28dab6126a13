"""Models from training stacks other than Hugging Face, built from their own configs (random weights, no downloads)
and called the way those stacks call them: a positional input tensor and a loss outside the model.

* torchtitan 0.3's Llama 3 (``torchtitan.models.llama3``): its builder, its initialization (``init_states``), with
  the SDPA inner attention.  torchtitan's language-model configs default to FlexAttention with per-document block
  masks built from ``positions``; the SDPA backend is its maskless causal attention (the one its Decoder keeps for
  AutoParallel-style callers), which is what a single-document causal LM batch needs.
* timm's ``vit_base_patch16_224`` and ``resnet50``, shrunk through ``timm.create_model`` keyword overrides.

Each builder imports its library lazily: ``available(name)`` says whether it imports here (timm needs a torchvision
that matches torch, which CPU-only machines with torch 2.13 lack).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["TINY", "REAL", "available", "tiny", "loss_fn"]

B, S, VOCAB, CLASSES = 4, 16, 64, 10
"""Global batch, sequence length, vocabulary and classes of the tiny models."""

Batch = tuple[torch.Tensor, torch.Tensor]


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over logits of any leading shape (token logits or class logits)."""
    return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]).float(), target.reshape(-1))


def _token_batch(step: int) -> Batch:
    ids = torch.randint(0, VOCAB, (B, S + 1), generator=torch.Generator().manual_seed(1000 + step))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def _image_batch(size: int) -> Callable[[int], Batch]:
    def batch(step: int) -> Batch:
        g = torch.Generator().manual_seed(2000 + step)
        return torch.randn(B, 3, size, size, generator=g), torch.randint(0, CLASSES, (B,), generator=g)
    return batch


def _titan_config(dim: int, n_layers: int, n_heads: int, n_kv_heads: int, vocab: int, multiple_of: int,
                  ffn_multiplier: float | None) -> Any:
    """torchtitan's Llama 3 config for these sizes, built with torchtitan's own layer builder, SDPA attention."""
    from torchtitan.models import llama3 as tt
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, compute_ffn_hidden_dim
    from torchtitan.models.common.attention import ScaledDotProductAttention

    layers = tt._build_llama3_layers(
        n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads, fuse_qkv=True, attn_backend="flex",
        hidden_dim=compute_ffn_hidden_dim(dim, multiple_of=multiple_of, ffn_dim_multiplier=ffn_multiplier),
        rope=ComplexRoPE.Config(dim=dim // n_heads, max_seq_len=8192, theta=500000, scaling="llama"))
    for layer in layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    return tt.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=tt._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=tt._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=tt._output_linear_init(dim)),
        layers=layers)


def _titan(meta: bool = False, **sizes: Any) -> torch.nn.Module:
    cfg = _titan_config(**sizes)
    if meta:
        with torch.device("meta"):
            return cfg.build()
    model = cfg.build()
    model.init_states()  # torchtitan's own initialization (its models are built uninitialized)
    return model


_TITAN_TINY = dict(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab=VOCAB, multiple_of=16, ffn_multiplier=None)
_TITAN_8B = dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab=128256, multiple_of=1024,
                 ffn_multiplier=1.3)


def _timm(name: str, **kwargs: Any) -> Callable[[], torch.nn.Module]:
    def build() -> torch.nn.Module:
        import timm
        return timm.create_model(name, pretrained=False, **kwargs)
    return build


class ConvNet(torch.nn.Module):
    """A plain PyTorch convolutional classifier of the kind fx captures (the planner's fast path): convolutions
    (one grouped), BatchNorm and an optional forward argument left at its default, as timm's models have."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.block = nn.Sequential(nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                                   nn.Conv2d(32, 32, 3, padding=1, groups=2), nn.BatchNorm2d(32), nn.ReLU())
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x: torch.Tensor, scale: float = 1.0, mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.block(self.stem(x * scale))
        return self.head(h.mean((2, 3)))


class _Gate(torch.nn.Module):
    """Data-dependent Python control flow: neither fx nor torch.export captures it."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        if h.mean() > 0:
            return x + 0.5 * h
        return x + h


class _GatedBlock(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.gate = _Gate(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(torch.relu(self.fc(x)))


class GatedNet(torch.nn.Module):
    """A token model whose blocks each hold an uncapturable region (``blocks.N.gate``): it is planned and run with
    those regions opaque (:mod:`autopar.ir.opaque`)."""

    def __init__(self, d: int = 32, layers: int = 4) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.blocks = torch.nn.Sequential(*[_GatedBlock(d) for _ in range(layers)])
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(ids)))


TINY: dict[str, tuple[Callable[[], torch.nn.Module], Callable[[int], Batch]]] = {
    "torch-gated": (GatedNet, _token_batch),
    "torch-convnet": (ConvNet, _image_batch(16)),
    "torchtitan-llama3": (lambda: _titan(**_TITAN_TINY), _token_batch),
    "timm-vit": (_timm("vit_base_patch16_224", img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=4,
                       num_classes=CLASSES), _image_batch(32)),
    # resnet50's bottleneck blocks and widths, one block per stage; 128 px so the last BatchNorms see 4x4 positions
    "timm-resnet50": (_timm("resnet50", layers=(1, 1, 1, 1), num_classes=CLASSES), _image_batch(128)),
}

REAL: dict[str, tuple[Callable[[], tuple[torch.nn.Module, torch.Tensor]], int]] = {
    # exact parameter counts: Llama 3 8B 8,030,261,248 (Meta's model card: 8.03B); timm's model cards
    "torchtitan-llama3-8b": (lambda: (_titan(meta=True, **_TITAN_8B),
                                      torch.zeros(1, 2048, dtype=torch.long, device="meta")), 8_030_261_248),
    "timm-vit_base_patch16_224": (lambda: (_meta(_timm("vit_base_patch16_224")),
                                           torch.zeros(1, 3, 224, 224, device="meta")), 86_567_656),
    "timm-resnet50": (lambda: (_meta(_timm("resnet50")), torch.zeros(1, 3, 224, 224, device="meta")), 25_557_032),
}


def _meta(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    with torch.device("meta"):
        return build()


def available(name: str) -> str | None:
    """None when ``name``'s library imports here, else why not (for ``pytest.skip``)."""
    lib = name.split("-")[0]
    try:
        importlib.import_module({"torchtitan": "torchtitan.models.llama3", "timm": "timm", "torch": "torch"}[lib])
    except Exception as e:  # timm raises ModuleNotFoundError (torchvision) or RuntimeError (a mismatched one)
        return f"{lib} does not import here: {type(e).__name__}: {e}"
    return None


def tiny(name: str, seed: int = 0) -> tuple[torch.nn.Module, Callable[[int], Batch]]:
    build, batch = TINY[name]
    torch.manual_seed(seed)
    return build(), batch
