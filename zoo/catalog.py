"""The built-in models by name, without torch: ``list_models()`` and each model's family and size arguments.

``autopar models`` and argument checks read this table without importing torch (a cold ``import torch`` costs seconds
on a small machine); :mod:`autopar.zoo.registry` turns each entry into its family's config and builds the model.
Sizes are hard-coded here with the paper each one comes from.
"""

from __future__ import annotations

import difflib
from typing import Any, Literal

__all__ = ["SIZES", "Family", "family_of", "list_models", "unknown_model"]

Family = Literal["gpt", "llama", "moe", "sparse_moe", "wrn", "vit", "mlp", "custom"]


def _gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> dict[str, Any]:
    return {"layers": layers, "hidden": hidden, "heads": heads, "seq": seq, "vocab": vocab}



def _llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> dict[str, Any]:
    return {"layers": layers, "hidden": hidden, "heads": heads, "kv_heads": kv_heads, "ffn": ffn, "vocab": vocab,
            "seq": seq}


_GPT2_V, _GPT3_V, _SC21_V = 50257, 50257, 51200
SIZES: dict[str, tuple[Family, dict[str, Any]]] = {
    # GPT-2: Radford et al. 2019, "Language Models are Unsupervised Multitask Learners", Table 2 (context 1024).
    "gpt2-small": ("gpt", _gpt(12, 768, 12, 1024, _GPT2_V)),
    "gpt2-medium": ("gpt", _gpt(24, 1024, 16, 1024, _GPT2_V)),
    "gpt2-large": ("gpt", _gpt(36, 1280, 20, 1024, _GPT2_V)),
    "gpt2-xl": ("gpt", _gpt(48, 1600, 25, 1024, _GPT2_V)),
    # GPT-3: Brown et al. 2020, "Language Models are Few-Shot Learners", Table 2.1 (n_ctx 2048).
    # Two printed values are not self-consistent and are fixed to d_head 128 as in the table's d_head column:
    # GPT-3 XL lists 24 heads with d_model 2048 (-> 16 heads), GPT-3 13B lists d_model 5140 with 40 heads (-> 5120).
    "gpt3-1.3b": ("gpt", _gpt(24, 2048, 16, 2048, _GPT3_V)),
    "gpt3-2.7b": ("gpt", _gpt(32, 2560, 32, 2048, _GPT3_V)),
    "gpt3-6.7b": ("gpt", _gpt(32, 4096, 32, 2048, _GPT3_V)),
    "gpt3-13b": ("gpt", _gpt(40, 5120, 40, 2048, _GPT3_V)),
    "gpt3-175b": ("gpt", _gpt(96, 12288, 96, 2048, _GPT3_V)),
    # Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"
    # (SC'21), Table 1: seq 2048, vocab 51200. Names carry the paper's parameter counts.
    "megatron-1.7b": ("gpt", _gpt(24, 2304, 24, 2048, _SC21_V)),
    "megatron-3.6b": ("gpt", _gpt(30, 3072, 32, 2048, _SC21_V)),
    "megatron-7.5b": ("gpt", _gpt(36, 4096, 32, 2048, _SC21_V)),
    "megatron-18.4b": ("gpt", _gpt(40, 6144, 48, 2048, _SC21_V)),
    "megatron-39.1b": ("gpt", _gpt(48, 8192, 64, 2048, _SC21_V)),
    "megatron-76.1b": ("gpt", _gpt(60, 10240, 80, 2048, _SC21_V)),
    "megatron-145.6b": ("gpt", _gpt(80, 12288, 96, 2048, _SC21_V)),
    "megatron-310.1b": ("gpt", _gpt(96, 16384, 128, 2048, _SC21_V)),
    "megatron-529.6b": ("gpt", _gpt(105, 20480, 128, 2048, _SC21_V)),
    "megatron-1008b": ("gpt", _gpt(128, 25600, 160, 2048, _SC21_V)),
    "gpt-tiny": ("gpt", _gpt(2, 64, 4, 32, 128)),
    # Llama 3: Grattafiori et al. 2024, "The Llama 3 Herd of Models", Table 3 (vocab 128256, RoPE theta 500000,
    # pre-training context 8192).
    "llama3-8b": ("llama", _llama(32, 4096, 32, 8, 14336, 128256, 8192)),
    "llama3-70b": ("llama", _llama(80, 8192, 64, 8, 28672, 128256, 8192)),
    "llama3-405b": ("llama", _llama(126, 16384, 128, 8, 53248, 128256, 8192)),
    "llama-tiny": ("llama", _llama(2, 64, 4, 2, 128, 128, 32)),
    # Top-2 MoE (GShard/Mixtral-style routing): 8 experts on a GPT-3 XL (1.3B) backbone, ~7.0B params in total.
    "moe-8x1b": ("moe", {"layers": 24, "hidden": 2048, "heads": 16, "seq": 2048, "vocab": _GPT3_V, "experts": 8}),
    "moe-tiny": ("moe", {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 128, "experts": 4}),
    # Sparse top-k MoE, dropless, on a Llama backbone (autopar.zoo.sparse_moe). Mixtral 8x7B: Jiang et al. 2024,
    # "Mixtral of Experts", Table 1 (dim 4096, 32 layers, 32 heads / 8 kv, hidden 14336, 8 experts, top 2, vocab
    # 32000, RoPE theta 1e6): 46,702,792,704 parameters, as transformers' MixtralForCausalLM with that config.
    "mixtral-8x7b": ("sparse_moe", {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "vocab": 32000,
                                    "seq": 4096, "experts": 8, "top_k": 2, "expert_ffn": 14336}),
    # DeepSeekMoE 16B: Dai et al. 2024, "DeepSeekMoE", and the released deepseek-moe-16b-base config.json (hidden
    # 2048, 28 layers, 16 heads, 64 routed experts of width 1408, top 6 without renormalization, 2 shared experts
    # (one SwiGLU of width 2 x 1408), first layer dense with width 10944, vocab 102400, context 4096, theta 1e4).
    "deepseek-moe-16b": ("sparse_moe", {"layers": 28, "hidden": 2048, "heads": 16, "kv_heads": 16,
                                        "vocab": 102400, "seq": 4096, "experts": 64, "top_k": 6,
                                        "expert_ffn": 1408, "shared_ffn": 2816, "dense_layers": 1,
                                        "dense_ffn": 10944, "norm_topk": False, "rope_theta": 10000.0,
                                        "norm_eps": 1e-6}),
    "sparse-moe-tiny": ("sparse_moe", {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2, "vocab": 64,
                                       "seq": 16, "experts": 4, "top_k": 2, "expert_ffn": 48}),
    "deepseek-moe-tiny": ("sparse_moe", {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 4, "vocab": 64,
                                         "seq": 16, "experts": 8, "top_k": 3, "expert_ffn": 16, "shared_ffn": 32,
                                         "dense_layers": 1, "dense_ffn": 64, "norm_topk": False}),
    # Wide-ResNet: Zagoruyko & Komodakis 2016, WRN-50-2 / WRN-101-2 (ImageNet, 224x224).
    "wrn-50-2": ("wrn", {"blocks": (3, 4, 6, 3)}),
    "wrn-101-2": ("wrn", {"blocks": (3, 4, 23, 3)}),
    "wrn-tiny": ("wrn", {"blocks": (1, 1, 1, 1), "base": 8, "classes": 10, "image": 32}),
    # Vision Transformer: Dosovitskiy et al. 2021, "An Image is Worth 16x16 Words", Table 1 (Base 86M, Large 307M,
    # Huge 632M; MLP 4h), at ImageNet's 224x224 with 1000 classes; the name carries the patch size.
    "vit-b-16": ("vit", {"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072, "patch": 16}),
    "vit-l-16": ("vit", {"layers": 24, "hidden": 1024, "heads": 16, "ffn": 4096, "patch": 16}),
    "vit-h-14": ("vit", {"layers": 32, "hidden": 1280, "heads": 16, "ffn": 5120, "patch": 14}),
    "vit-tiny": ("vit", {"layers": 2, "hidden": 32, "heads": 4, "ffn": 64, "patch": 8, "image": 32, "classes": 10}),
    "mlp-tiny": ("mlp", {"layers": 2, "hidden": 64, "in_features": 32, "out_features": 16}),
    "mlp-large": ("mlp", {"layers": 8, "hidden": 8192, "in_features": 8192, "out_features": 8192}),
}


def list_models() -> list[str]:
    """Names of the built-in models, in registry order."""
    return list(SIZES)


def family_of(name: str) -> Family:
    """The family of a built-in model ("custom" for a ``package.module:factory`` reference)."""
    if ":" in name:
        return "custom"
    if name not in SIZES:
        raise unknown_model(name)
    return SIZES[name][0]


def unknown_model(name: str) -> ValueError:
    """The error for a model name that is neither built in nor a ``package.module:factory`` reference."""
    close = difflib.get_close_matches(name, list(SIZES), n=3, cutoff=0.5)
    hint = f" (did you mean {', '.join(repr(c) for c in close)}?)" if close else ""
    return ValueError(f"unknown model {name!r}{hint}; built-in models: {', '.join(SIZES)}, "
                      f"or give 'package.module:factory'")
