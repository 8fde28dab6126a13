"""The built-in model zoo: GPT (GPT-2, GPT-3, Megatron SC'21 sizes), Llama 3, top-2 MoE, Wide-ResNet, ViT and MLP.

    from autopar.zoo import build, list_models, ModelSpec
    spec = build("gpt3-175b", batch=8, device="meta")   # instant: nothing is allocated on meta
    spec.model(*spec.example_inputs)

All models are written in plain PyTorch, build on the meta device at any size, and trace with
``torch.fx.symbolic_trace`` and ``torch.export``. ``list_models`` answers without importing torch; the other names
load their modules (and torch) on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from autopar.zoo.catalog import Family, list_models

_LAZY = {
    "build": "registry", "get_config": "registry", "ModelSpec": "registry", "init_weights": "_init",
    "GPT": "gpt", "GPTConfig": "gpt", "Llama": "llama", "LlamaConfig": "llama", "MoEGPT": "moe", "MoEConfig": "moe",
    "SparseMoE": "sparse_moe", "SparseMoEConfig": "sparse_moe", "routing_histogram": "sparse_moe",
    "WideResNet": "wrn", "WRNConfig": "wrn", "ViT": "vit", "ViTConfig": "vit", "MLPModel": "mlp",
    "MLPConfig": "mlp",
}

__all__ = [
    "GPT", "Family", "GPTConfig", "Llama", "LlamaConfig", "MLPConfig", "MLPModel", "MoEConfig", "MoEGPT", "ModelSpec",
    "SparseMoE", "SparseMoEConfig", "ViT", "ViTConfig", "WRNConfig", "WideResNet", "build", "get_config",
    "init_weights", "list_models", "routing_histogram",
]

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only (names resolved lazily below)
    from autopar.zoo._init import init_weights
    from autopar.zoo.gpt import GPT, GPTConfig
    from autopar.zoo.llama import Llama, LlamaConfig
    from autopar.zoo.mlp import MLPConfig, MLPModel
    from autopar.zoo.moe import MoEConfig, MoEGPT
    from autopar.zoo.registry import ModelSpec, build, get_config
    from autopar.zoo.sparse_moe import SparseMoE, SparseMoEConfig, routing_histogram
    from autopar.zoo.vit import ViT, ViTConfig
    from autopar.zoo.wrn import WideResNet, WRNConfig


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"autopar.zoo.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'autopar.zoo' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
