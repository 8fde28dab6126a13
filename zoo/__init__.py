"""The built-in model zoo: GPT (GPT-2, GPT-3, Megatron SC'21 sizes), Llama 3, top-2 MoE, Wide-ResNet and MLP.

    from autopar.zoo import build, list_models, ModelSpec
    spec = build("gpt3-175b", batch=8, device="meta")   # instant: nothing is allocated on meta
    spec.model(*spec.example_inputs)

All models are written in plain PyTorch, build on the meta device at any size, and trace with
``torch.fx.symbolic_trace`` and ``torch.export``.
"""

from autopar.zoo._init import init_weights
from autopar.zoo.gpt import GPT, GPTConfig
from autopar.zoo.llama import Llama, LlamaConfig
from autopar.zoo.mlp import MLPConfig, MLPModel
from autopar.zoo.moe import MoEConfig, MoEGPT
from autopar.zoo.registry import Family, ModelSpec, build, get_config, list_models
from autopar.zoo.wrn import WideResNet, WRNConfig

__all__ = [
    "build", "list_models", "get_config", "init_weights", "ModelSpec", "Family",
    "GPT", "GPTConfig", "Llama", "LlamaConfig", "MoEGPT", "MoEConfig", "WideResNet", "WRNConfig",
    "MLPModel", "MLPConfig",
]
