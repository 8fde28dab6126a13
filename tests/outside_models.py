"""Models nobody on the team wrote, built from their configs (random weights, no downloads), called the way their
ecosystems call them: Hugging Face transformers models with keyword inputs that compute their own loss from
``labels``.  Tiny configs for runs on CPU ranks; real configs (meta device) for planning at scale.

``tiny(name)`` -> ``(model, batch)`` where ``batch(step)`` is the keyword batch of training step ``step`` (the same on
every rank and in the single-process reference).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import transformers

__all__ = ["TINY", "REAL", "tiny", "real"]

B, S, VOCAB = 4, 16, 64
"""Global batch, sequence length and vocabulary of the tiny models."""

_LM = dict(vocab_size=VOCAB, max_position_embeddings=32, use_cache=False)
_DECODER = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                num_key_value_heads=2, **_LM)


def _tokens(step: int, lo: int = 0) -> torch.Tensor:
    return torch.randint(lo, VOCAB, (B, S), generator=torch.Generator().manual_seed(1000 + step))


def _lm_batch(step: int) -> dict[str, torch.Tensor]:
    ids = _tokens(step)
    return {"input_ids": ids, "labels": ids.clone()}


def _seq2seq_batch(step: int) -> dict[str, torch.Tensor]:
    ids = _tokens(step, lo=1)  # 0 is T5's pad token
    return {"input_ids": ids, "labels": ids.flip(1).clone()}


def _image_batch(step: int, size: int = 32) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(2000 + step)
    return {"pixel_values": torch.randn(B, 3, size, size, generator=g),
            "labels": torch.randint(0, 10, (B,), generator=g)}


def _resnet_batch(step: int) -> dict[str, torch.Tensor]:
    """128 px: ResNet downsamples 32x, so its last BatchNorms see 4x4 positions per sample (at 32 px they would
    normalize over one value per sample: statistics of 4 numbers, so ill-conditioned that rounding differences
    grow to percent-level parameter differences within two SGD steps)."""
    return _image_batch(step, 128)


_Builder = Callable[[], torch.nn.Module]
TINY: dict[str, tuple[_Builder, Callable[[int], dict[str, torch.Tensor]]]] = {
    "gpt2": (lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, use_cache=False, bos_token_id=0, eos_token_id=0)), _lm_batch),
    "llama": (lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(**_DECODER)), _lm_batch),
    "qwen2": (lambda: transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**_DECODER)), _lm_batch),
    "mixtral": (lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        num_local_experts=4, num_experts_per_tok=2, **_DECODER)), _lm_batch),
    "bert": (lambda: transformers.BertForMaskedLM(transformers.BertConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, vocab_size=VOCAB,
        max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _lm_batch),
    "t5": (lambda: transformers.T5ForConditionalGeneration(transformers.T5Config(
        num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8, vocab_size=VOCAB,
        dropout_rate=0.0, use_cache=False, decoder_start_token_id=0, pad_token_id=0)), _seq2seq_batch),
    "vit": (lambda: transformers.ViTForImageClassification(transformers.ViTConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4, image_size=32,
        patch_size=8, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)), _image_batch),
    # ResNet-50's shape (bottleneck blocks), narrow and one block per stage
    "resnet": (lambda: transformers.ResNetForImageClassification(transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1], layer_type="bottleneck",
        num_labels=10)), _resnet_batch),
}


def tiny(name: str, seed: int = 0) -> tuple[torch.nn.Module, Callable[[int], dict[str, torch.Tensor]]]:
    """The tiny ``name`` with weights from ``seed`` (the model's own initialization) and its batch function."""
    build, batch = TINY[name]
    torch.manual_seed(seed)
    return build(), batch


def _real_lm(cls: Any, cfg: Any) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    def make() -> tuple[torch.nn.Module, dict[str, Any]]:
        with torch.device("meta"):
            model = cls(cfg)
        ids = torch.zeros(1, 2048 if cfg.max_position_embeddings >= 2048 else 512, dtype=torch.long, device="meta")
        return model, {"input_ids": ids, "labels": ids}
    return make


def _real_image(cls: Any, cfg: Any) -> Callable[[], tuple[torch.nn.Module, dict[str, Any]]]:
    def make() -> tuple[torch.nn.Module, dict[str, Any]]:
        with torch.device("meta"):
            model = cls(cfg)
        return model, {"pixel_values": torch.zeros(1, 3, 224, 224, device="meta"),
                       "labels": torch.zeros(1, dtype=torch.long, device="meta")}
    return make


REAL: dict[str, tuple[Callable[[], tuple[torch.nn.Module, dict[str, Any]]], int]] = {
    # name: (builder on meta, exact parameter count from the published model cards / configs)
    "gpt2-124m": (_real_lm(transformers.GPT2LMHeadModel, transformers.GPT2Config(use_cache=False)), 124_439_808),
    "llama3-8b": (_real_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
        use_cache=False)), 8_030_261_248),
    "mistral-7b": (_real_lm(transformers.MistralForCausalLM, transformers.MistralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, sliding_window=None,
        use_cache=False)), 7_241_732_096),
    "mixtral-8x7b": (_real_lm(transformers.MixtralForCausalLM, transformers.MixtralConfig(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, vocab_size=32000, max_position_embeddings=32768, num_local_experts=8,
        num_experts_per_tok=2, sliding_window=None, use_cache=False)), 46_702_792_704),
    "t5-base": (_real_lm(transformers.T5ForConditionalGeneration, transformers.T5Config(
        d_model=768, d_ff=3072, num_layers=12, num_heads=12, d_kv=64, vocab_size=32128, use_cache=False,
        decoder_start_token_id=0, pad_token_id=0, max_position_embeddings=512)), 222_903_552),
    "bert-base": (_real_lm(transformers.BertForMaskedLM, transformers.BertConfig()), 109_514_298),
    "vit-base": (_real_image(transformers.ViTForImageClassification, transformers.ViTConfig(num_labels=1000)),
                 86_567_656),
    "resnet-50": (_real_image(transformers.ResNetForImageClassification, transformers.ResNetConfig(
        num_labels=1000)), 25_557_032),
}


def real(name: str) -> tuple[torch.nn.Module, dict[str, Any], int]:
    build, params = REAL[name]
    model, inputs = build()
    return model, inputs, params
