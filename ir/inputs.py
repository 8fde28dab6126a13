"""A model's example inputs as users hold them: one tensor, a tuple of positional inputs, or a dict of keyword inputs
(Hugging Face style: ``{"input_ids": ..., "attention_mask": ..., "labels": ...}``), possibly with ``None`` for an
optional argument.

Everything that captures or runs a model goes through :func:`normalize`, so the trace, the plan and the runtime see
the same calling convention.  Dimension 0 of every tensor input is the batch (the runtime slices it over data
parallelism and micro-batches).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

__all__ = ["Inputs", "normalize", "tensor_leaves", "with_batch", "batch_size"]

Inputs = tuple[tuple[Any, ...], dict[str, Any]]
"""``(args, kwargs)``."""


def normalize(example: Any) -> Inputs:
    """``(args, kwargs)`` of ``example``: a tensor, a tuple/list of positional inputs, a dict of keyword inputs, or
    an ``(args_tuple, kwargs_dict)`` pair."""
    if isinstance(example, Mapping):
        return (), dict(example)
    if isinstance(example, (tuple, list)):
        if len(example) == 2 and isinstance(example[0], (tuple, list)) and isinstance(example[1], Mapping):
            return tuple(example[0]), dict(example[1])
        return tuple(example), {}
    return (example,), {}


def tensor_leaves(inputs: Inputs, order: Sequence[str] | None = None) -> list[torch.Tensor]:
    """The tensor inputs in capture order: positional ones, then keyword ones in ``order`` (default: the dict's).
    ``None`` and other non-tensor values are constants of the capture and are skipped."""
    args, kwargs = inputs
    keys = list(order) if order is not None else list(kwargs)
    missing = [k for k in keys if k not in kwargs]
    if missing:
        raise ValueError(f"missing keyword input(s) {missing}; the model was captured with {keys}")
    return [x for x in (*args, *(kwargs[k] for k in keys)) if isinstance(x, torch.Tensor)]


def with_batch(inputs: Inputs, batch: int, device: torch.device | str = "meta") -> Inputs:
    """``inputs`` with every tensor's dim 0 set to ``batch`` (zeros on ``device``; non-tensors unchanged)."""

    def one(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.dim() == 0:
            raise ValueError("a scalar tensor input has no batch dimension; pass it as a Python number")
        return torch.zeros((batch, *x.shape[1:]), dtype=x.dtype, device=device)

    args, kwargs = inputs
    return tuple(one(a) for a in args), {k: one(v) for k, v in kwargs.items()}


def batch_size(inputs: Inputs) -> int:
    """Dim 0 of the first tensor input."""
    leaves = tensor_leaves(inputs)
    if not leaves:
        raise ValueError("the model has no tensor input")
    return int(leaves[0].shape[0])
