"""Shared construction helpers for the model zoo: meta-first building and deterministic initialization.

Every factory builds its model on the meta device first (allocation-free, so a 405B model takes milliseconds) and,
for a real device, moves it with ``Module.to_empty`` and initializes every parameter deterministically from a seeded
``torch.Generator``: ``normal(0, 0.02)`` for Linear and Embedding weights (GPT-2 / Megatron convention), zeros for
biases, ones/zeros for norms, Kaiming-normal for convolutions. Modules that hold derived buffers (RoPE tables)
implement ``reset_buffers()``, which is called after the move.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["materialize", "init_weights", "INIT_STD"]

INIT_STD: float = 0.02
"""Standard deviation of the normal init for Linear and Embedding weights (GPT-2, Megatron-LM)."""


@torch.no_grad()
def init_weights(model: nn.Module, seed: int = 0) -> None:
    """Initialize all parameters of ``model`` deterministically from ``seed`` (no-op for meta tensors)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(t: torch.Tensor, std: float) -> None:
        # Draw on the CPU generator so the result is identical on every device.
        t.copy_(torch.empty(t.shape, dtype=torch.float32).normal_(0.0, std, generator=gen).to(t.dtype))

    seen: set[int] = set()
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if id(p) not in seen]
        if not params or params[0].is_meta:
            continue
        seen.update(id(p) for p in params)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            if id(module.weight) in {id(p) for p in params}:
                normal_(module.weight, INIT_STD)
            bias = getattr(module, "bias", None)
            if bias is not None:
                bias.zero_()
        elif isinstance(module, nn.Conv2d):
            fan_out = module.out_channels * module.kernel_size[0] * module.kernel_size[1] // module.groups
            normal_(module.weight, (2.0 / fan_out) ** 0.5)
            if module.bias is not None:
                module.bias.zero_()
        else:
            # Norms (LayerNorm, RMSNorm, BatchNorm): weight 1, bias 0; stacked expert weights [E, out, in]: normal
            for name, p in module.named_parameters(recurse=False):
                if p.dim() >= 2:
                    normal_(p, INIT_STD)
                else:
                    p.fill_(1.0 if name == "weight" else 0.0)


_RANDOM_INIT = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, *(getattr(nn.init, f) for f in (
    "normal_", "trunc_normal_", "uniform_", "kaiming_normal_", "kaiming_uniform_", "xavier_normal_",
    "xavier_uniform_"))})


class _MetaInitSkipped(TorchFunctionMode):
    """Random in-place initializations of meta tensors do nothing (they hold no values).  Module constructors call
    them (``reset_parameters``), and the first meta ``normal_`` of a process imports torch._dynamo (~1.4 s), which
    the command line (``autopar run``'s checks, ``explain``) would pay on every call for nothing."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        kwargs = kwargs or {}
        if func in _RANDOM_INIT:
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def materialize(
    build_fn: Callable[[], nn.Module], *, device: torch.device | str, dtype: torch.dtype, seed: int
) -> nn.Module:
    """Build a module on meta with ``build_fn`` and, unless ``device`` is meta, move it there and initialize it.

    ``build_fn`` must construct the module without allocating storage (it is called under ``torch.device('meta')``).
    Tied weights are restored through the module's ``tie_weights()`` method, if it has one, after the move.
    """
    device = torch.device(device)
    with torch.device("meta"), _MetaInitSkipped():
        model = build_fn()
    model = model.to(dtype=dtype)
    if device.type == "meta":
        return model
    model = model.to_empty(device=device)
    for module in model.modules():
        tie = getattr(module, "tie_weights", None)
        if callable(tie):
            tie()
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            module.reset_running_stats()
        reset = getattr(module, "reset_buffers", None)
        if callable(reset):
            reset()
    init_weights(model, seed)
    return model
