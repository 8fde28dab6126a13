"""The model-zoo registry: ``build(name, ...) -> ModelSpec`` and ``list_models()``.

Sizes live in :mod:`autopar.zoo.catalog` (torch-free) with the paper each one comes from. ``build`` also accepts ``"package.module:factory"``
for user models: the factory is called with whichever of ``batch``, ``device``, ``dtype``, ``seq``, ``seed`` it
accepts and may return a ``ModelSpec``, an ``nn.Module`` (inputs then come from its ``example_inputs(batch,
device)`` method if it has one) or a ``(module, example_inputs)`` pair.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from autopar.zoo._init import materialize
from autopar.zoo.catalog import SIZES, Family, list_models, unknown_model
from autopar.zoo.factory_guard import guarded
from autopar.zoo.gpt import GPT, GPTConfig
from autopar.zoo.llama import Llama, LlamaConfig
from autopar.zoo.mlp import MLPConfig, MLPModel
from autopar.zoo.moe import MoEConfig, MoEGPT
from autopar.zoo.sparse_moe import SparseMoE, SparseMoEConfig
from autopar.zoo.vit import ViT, ViTConfig
from autopar.zoo.wrn import WideResNet, WRNConfig

__all__ = ["ModelSpec", "Family", "build", "list_models", "get_config", "lm_loss", "classification_loss",
           "regression_loss"]

ZooConfig = GPTConfig | LlamaConfig | MoEConfig | SparseMoEConfig | WRNConfig | ViTConfig | MLPConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """A built model with everything needed to trace and train it.

    name: registry name (or the ``module:factory`` string).
    family: "gpt" | "llama" | "moe" | "sparse_moe" | "wrn" | "vit" | "mlp", or "custom" for user factories.
    model: the module, on the requested device and dtype.
    example_inputs: positional inputs for ``model(*example_inputs)``, on the same device.
    loss_fn: ``loss_fn(output, target) -> scalar``; cross entropy for LMs, WRN and ViT, MSE for the MLP.
    make_target: ``make_target(batch, device) -> target`` matching ``loss_fn``; None when unknown (custom models).
    example_target: ``make_target(batch, device)`` for the built batch; None when unknown.
    config: the frozen family config (None for custom models).
    batch: the batch size the example inputs were built for.
    """

    name: str
    family: Family
    model: nn.Module
    example_inputs: tuple[torch.Tensor, ...]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    make_target: Callable[[int, torch.device | str], torch.Tensor] | None = None
    example_target: torch.Tensor | None = None
    config: Any = None
    batch: int = 1


# ---------------------------------------------------------------------------------------------------------------------
# Sizes (the table lives in autopar.zoo.catalog, which does not import torch)
# ---------------------------------------------------------------------------------------------------------------------
_CONFIG_TYPES: dict[str, type] = {"gpt": GPTConfig, "llama": LlamaConfig, "moe": MoEConfig,
                                  "sparse_moe": SparseMoEConfig, "wrn": WRNConfig, "vit": ViTConfig,
                                  "mlp": MLPConfig}
_CONFIGS: dict[str, tuple[Family, ZooConfig]] = {name: (fam, _CONFIG_TYPES[fam](**kw)) for name, (fam, kw) in
                                                 SIZES.items()}

_CONSTRUCTORS: dict[str, Callable[[Any], nn.Module]] = {
    "gpt": GPT, "llama": Llama, "moe": MoEGPT, "sparse_moe": SparseMoE, "wrn": WideResNet, "vit": ViT, "mlp": MLPModel,
}




def get_config(name: str) -> ZooConfig:
    """The frozen config of a built-in model, without building it."""
    if name not in _CONFIGS:
        raise unknown_model(name)
    return _CONFIGS[name][1]


# ---------------------------------------------------------------------------------------------------------------------
# Inputs, targets, losses
# ---------------------------------------------------------------------------------------------------------------------
def _randint(high: int, shape: tuple[int, ...], device: torch.device | str, seed: int) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "meta":
        return torch.empty(shape, dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, high, shape, generator=gen).to(device)


def _randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, seed: int) -> torch.Tensor:
    device = torch.device(device)
    if device.type == "meta":
        return torch.empty(shape, dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(device=device, dtype=dtype)


def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Token-level cross entropy: logits [B, s, V], target [B, s]."""
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def classification_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy: logits [B, C], target [B]."""
    return F.cross_entropy(logits.float(), target)


def regression_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(output.float(), target.float())


def _io(family: Family, cfg: Any, batch: int, device: torch.device | str, dtype: torch.dtype, seed: int) -> tuple[
        tuple[torch.Tensor, ...], Callable[[int, torch.device | str], torch.Tensor],
        Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """(example_inputs, make_target, loss_fn) for a built-in family."""
    if family in ("gpt", "llama", "moe", "sparse_moe"):
        inputs = (_randint(cfg.vocab, (batch, cfg.seq), device, seed),)
        return inputs, lambda b, d: _randint(cfg.vocab, (b, cfg.seq), d, seed + 1), lm_loss
    if family in ("wrn", "vit"):
        inputs = (_randn((batch, cfg.channels, cfg.image, cfg.image), dtype, device, seed),)
        return inputs, lambda b, d: _randint(cfg.classes, (b,), d, seed + 1), classification_loss
    inputs = (_randn((batch, cfg.in_features), dtype, device, seed),)
    return inputs, lambda b, d: _randn((b, cfg.out_features), dtype, d, seed + 1), regression_loss


# ---------------------------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------------------------
def build(name: str, *, batch: int = 8, device: torch.device | str = "meta", dtype: torch.dtype = torch.float32,
          seq: int | None = None, seed: int = 0) -> ModelSpec:
    """Build a zoo model (or a user ``"package.module:factory"`` model) with example inputs, target and loss.

    ``device="meta"`` (the default) allocates nothing, so any size builds instantly; on a real device the weights
    are initialized deterministically from ``seed``. ``seq`` overrides the sequence length of language models (the
    position-embedding / RoPE table size and the example input length); None keeps the model's default.
    """
    if batch <= 0:
        raise ValueError(f"batch must be positive, got {batch}")
    if ":" in name:
        return _build_custom(name, batch=batch, device=device, dtype=dtype, seq=seq, seed=seed)
    if name not in _CONFIGS:
        raise unknown_model(name)
    family, cfg = _CONFIGS[name]
    if seq is not None:
        if family not in ("gpt", "llama", "moe", "sparse_moe"):
            raise ValueError(f"seq does not apply to {family!r} model {name!r}; leave it unset")
        cfg = dataclasses.replace(cfg, seq=seq)
    ctor = _CONSTRUCTORS[family]
    model = materialize(lambda: ctor(cfg), device=device, dtype=dtype, seed=seed)
    inputs, make_target, loss_fn = _io(family, cfg, batch, device, dtype, seed)
    return ModelSpec(name=name, family=family, model=model, example_inputs=inputs, loss_fn=loss_fn,
                     make_target=make_target, example_target=make_target(batch, device), config=cfg, batch=batch)


def _load_factory(ref: str) -> Callable[..., Any]:
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise ValueError(f"model {ref!r} must look like 'package.module:factory'")
    try:
        module = guarded(ref, "importing the module of model", lambda: importlib.import_module(module_name))
    except ImportError as exc:
        raise ValueError(f"cannot import module {module_name!r} for model {ref!r}: {exc}; check the name and that "
                         "its directory is on PYTHONPATH") from exc
    except Exception as exc:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ValueError(f"importing module {module_name!r} for model {ref!r} failed: {type(exc).__name__}: "
                         f"{first}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"module {module_name!r} has no attribute {attr!r} (model {ref!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{ref!r} is not callable")
    return obj


def _build_custom(ref: str, *, batch: int, device: torch.device | str, dtype: torch.dtype, seq: int | None,
                  seed: int) -> ModelSpec:
    factory = _load_factory(ref)
    offered: dict[str, Any] = {"batch": batch, "device": device, "dtype": dtype, "seq": seq, "seed": seed}
    params = inspect.signature(factory).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = offered
    else:
        kwargs = {k: v for k, v in offered.items() if k in params}
    result = guarded(ref, "model factory", lambda: factory(**kwargs))
    if isinstance(result, ModelSpec):
        return result
    inputs: tuple[torch.Tensor, ...] = ()
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], nn.Module):
        result, raw = result
        inputs = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
    if not isinstance(result, nn.Module):
        raise ValueError(f"factory {ref!r} returned {type(result).__name__}; expected an nn.Module, "
                         f"a (module, example_inputs) pair or a ModelSpec")
    model = result.to(device=device, dtype=dtype)
    if not inputs and callable(getattr(model, "example_inputs", None)):
        raw = model.example_inputs(batch, device)
        inputs = tuple(raw) if isinstance(raw, (tuple, list)) else (raw,)
    inputs = tuple(t.to(device) for t in inputs)
    return ModelSpec(name=ref, family="custom", model=model, example_inputs=inputs, loss_fn=regression_loss,
                     batch=batch)
