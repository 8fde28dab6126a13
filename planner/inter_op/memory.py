"""Per-device memory model: model state by ZeRO level, activations by schedule and recomputation, reserves.

Pure functions of plain numbers. All results are bytes on one device.

**Model state: what the generated runtime holds** (:mod:`autopar.codegen.runtime`), not DeepSpeed's layout.
Mixed precision there is bf16 autocast (ZeRO 0) or FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16)`` (ZeRO >= 1)
over **fp32 parameters and fp32 gradients**; Adam keeps fp32 momentum and variance.  Per parameter:

- ZeRO 0: 4 (fp32 params) + 4 (fp32 grads) + 8 (Adam m, v) = 16 bytes, replicated; under bf16 autocast also the
  bf16 copy autocast casts every weight to and caches for the whole autocast region (the runtime runs a step's
  forwards and backwards in one region): 2 more, 18 bytes.  (The flattened gradient all-reduce after the backward
  needs 4 more transiently, when the activations are already freed; not charged.)
- ZeRO 3 (FSDP2, ``reshard_after_forward=True``): the same 16 bytes, all sharded over ``dp``: ``16 / dp``.
- ZeRO 1 and 2: FSDP2 realizes both as full sharding without resharding after forward, so the unsharded
  compute-precision parameters (2 bytes, bf16) stay live from a unit's forward to its backward: ``2 + 16 / dp``.
  Gradients are sharded in both (so ZeRO-1 costs what ZeRO-2 does).  DeepSpeed's estimator charges ZeRO-2 at
  ``4 + 16 / dp`` (fp16 parameters and a full fp16 gradient buffer replicated, fp32 master + m + v + fp32 gradient
  partition sharded), 20 bytes at dp = 1 against 18 here; the runtime here holds no replicated gradient buffer.

fp32 training: params 4, grads 4, Adam 8 (ZeRO 1/2 keep a 4-byte unsharded copy).  SGD with momentum: 4 for the
optimizer instead of 8.  Model-state bytes are reported as (params, grads, optimizer); the unsharded copy of ZeRO
1/2 counts as params.

**ZeRO-3 transient** (FSDP2's default behaviour): a sharded unit is all-gathered before its forward and backward,
and the next one is prefetched, so two units' unsharded parameters (compute precision) are live at once; during its
backward the unit's unsharded gradients (compute precision) exist until the reduce-scatter, which runs on a copy in
the reduce dtype when that differs (fp32 reduce of bf16 gradients: 4 more bytes per element).  We charge
``2 * P_layer * w + P_layer * (w + r)`` bytes of the largest layer (``w`` compute width, ``r`` the reduce copy,
0 when the reduce dtype is the compute dtype) under "other".

**Activations.** Bytes saved per micro-batch for a stage's layers (given by the caller for the stage's recompute
mode) times the micro-batches in flight on that stage under the schedule (from
:mod:`autopar.planner.inter_op.schedule`): GPipe ``m``; 1F1B ``min(pp - stage, m)``; interleaved 1F1B the
simulator's per-rank peak in chunk-micro-batches divided by ``v`` (equal chunks assumed): ``pp + (pp - 1) / v`` on
the first rank (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022, sec. 4.2).
Full recomputation also rebuilds one layer's full activations during its backward: the largest layer's no-recompute
bytes are added once.

**Reserve** (:class:`MemoryReserve`): a fixed part for the CUDA context (~0.3-0.5 GiB), cuBLAS/cuDNN workspaces
(tens of MiB), NCCL communicator buffers (``NCCL_BUFFSIZE`` 4 MiB per channel and peer, a few hundred MiB over the
dp/tp/pp communicators) and DDP/FSDP gradient buckets (2 x 25 MiB): 1.5 GiB by default on GPUs. Plus a fractional
allowance for the caching allocator's fragmentation, applied to the dynamic allocations (activations and transient
buffers, which are freed and re-allocated every micro-batch; the model state is allocated once): 10%, within the
5-15% seen on large-model training runs. Both are parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from autopar.ir.placement import Recompute, Schedule
from autopar.ir.plan import MemoryBreakdown
from autopar.planner.inter_op.schedule import peak_in_flight_count

__all__ = [
    "GiB", "MemoryReserve", "model_state_bytes", "zero3_transient_bytes", "in_flight_microbatches",
    "activation_bytes", "memory_breakdown", "fits", "korthikanti_layer_activation_bytes",
]

log = logging.getLogger(__name__)

GiB = float(2**30)
Optimizer = Literal["adam", "sgd"]
# bytes per parameter held sharded by ZeRO >= 1 (or replicated at ZeRO 0): fp32 params, fp32 grads, optimizer state
_STATE_BYTES: dict[str, tuple[int, int, int]] = {"adam": (4, 4, 8), "sgd": (4, 4, 4)}


@dataclass(kw_only=True, slots=True, frozen=True)
class MemoryReserve:
    """Memory not in tensors the model owns (see the module docstring for the numbers)."""

    fixed_bytes: float = 1.5 * GiB
    """CUDA context, library workspaces, communicator buffers, gradient buckets (use ~0.25 GiB for CPU runs)."""
    fragmentation: float = 0.10
    """Fraction of the dynamic allocations (activations + transient buffers) lost to allocator fragmentation."""

    def __post_init__(self) -> None:
        if self.fixed_bytes < 0:
            raise ValueError(f"fixed_bytes must be >= 0, got {self.fixed_bytes}")
        if not 0 <= self.fragmentation < 1:
            raise ValueError(f"fragmentation must be in [0, 1), got {self.fragmentation}")


def _check_zero(zero: int, dp: int) -> None:
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero must be 0, 1, 2 or 3, got {zero}")
    if dp < 1:
        raise ValueError(f"dp must be >= 1, got {dp}")


def model_state_bytes(param_elems: float, *, zero: int, dp: int, mixed_precision: bool,
                      optimizer: Optimizer = "adam") -> tuple[float, float, float]:
    """(params, grads, optimizer state) bytes per device for ``param_elems`` parameters (already split by tp/pp)."""
    _check_zero(zero, dp)
    if param_elems < 0:
        raise ValueError(f"param_elems must be >= 0, got {param_elems}")
    if optimizer not in ("adam", "sgd"):
        raise ValueError(f"optimizer must be 'adam' or 'sgd', got {optimizer!r}")
    bp, bg, bo = _STATE_BYTES[optimizer]
    shard = dp if zero >= 1 else 1
    params = param_elems * bp / shard
    if zero in (1, 2) and dp > 1:  # FSDP2 without resharding after forward: the unsharded copy stays live
        params += param_elems * (2 if mixed_precision else 4)
    elif (zero == 0 or dp == 1) and mixed_precision:  # autocast's cached half-precision copy of every weight
        params += param_elems * 2
    return params, param_elems * bg / shard, param_elems * bo / shard


def zero3_transient_bytes(largest_layer_elems: float, *, zero: int, dp: int, mixed_precision: bool,
                          reduce_bytes: int = 4) -> float:
    """Gathered copies under ZeRO-3: two units' parameters, one unit's gradients and its reduce-dtype copy, of the
    largest layer (0 below ZeRO-3 or dp=1); see the module docstring."""
    _check_zero(zero, dp)
    if zero < 3 or dp == 1:
        return 0.0
    width = 2 if mixed_precision else 4
    return largest_layer_elems * (3 * width + (reduce_bytes if reduce_bytes != width else 0))


def in_flight_microbatches(schedule: Schedule, *, pp: int, num_microbatches: int,
                           virtual_stages: int = 1) -> tuple[float, ...]:
    """Per pipeline rank: peak micro-batches of the rank's activations alive, from the schedule's op order.

    For interleaved 1F1B the peak in chunk-micro-batches is divided by ``v`` (stage-micro-batches, equal chunks).
    """
    v = virtual_stages
    return tuple(peak_in_flight_count(schedule, rank=r, pp=pp, num_microbatches=num_microbatches,
                                      virtual_stages=v) / v for r in range(pp))


def activation_bytes(act_bytes: Mapping[str, float], recompute: Recompute, *, schedule: Schedule, stage_index: int,
                     pp: int, num_microbatches: int, virtual_stages: int = 1,
                     largest_layer_act_none: float = 0.0) -> float:
    """Peak activation bytes of pipeline rank ``stage_index``.

    ``act_bytes[mode]``: bytes saved per micro-batch by all the rank's layers under recompute ``mode`` (only the
    chosen mode is required); ``largest_layer_act_none``: one layer's bytes without recomputation, rebuilt
    transiently during backward under full recomputation.
    """
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
    if recompute not in act_bytes:
        raise ValueError(f"act_bytes has no entry for recompute={recompute!r} (has {sorted(act_bytes)})")
    if not 0 <= stage_index < pp:
        raise ValueError(f"stage_index must be in [0, {pp}), got {stage_index}")
    n = in_flight_microbatches(schedule, pp=pp, num_microbatches=num_microbatches,
                               virtual_stages=virtual_stages)[stage_index]
    extra = largest_layer_act_none if recompute == "full" else 0.0
    return act_bytes[recompute] * n + extra


def memory_breakdown(*, param_elems: float, zero: int, dp: int, mixed_precision: bool, activations: float,
                     capacity: float, optimizer: Optimizer = "adam", largest_layer_elems: float = 0.0,
                     reserve: MemoryReserve | None = None, reduce_bytes: int = 4, expert_elems: float = 0.0,
                     ep: int = 1) -> MemoryBreakdown:
    """Assemble one device's peak memory: model state, activations (from :func:`activation_bytes`), and "other"
    = ZeRO-3 transient + fixed reserve + fragmentation of the dynamic part.  ``largest_layer_elems``: the largest
    unit gathered at once (a layer group for FSDP2, a tensor for per-tensor gathers); ``reduce_bytes``: bytes per
    element of the gradient reduction.  ``expert_elems``: the part of ``param_elems`` that is this rank's shard of
    routed experts under expert parallelism ``ep``; ZeRO shards their state over the ``dp / ep`` ranks holding the
    same experts (:mod:`autopar.planner.inter_op.expert`)."""
    if activations < 0 or capacity < 0:
        raise ValueError(f"activations and capacity must be >= 0, got {activations}, {capacity}")
    if not 0 <= expert_elems <= param_elems + 1e-6 or ep < 1 or dp % ep:
        raise ValueError(f"expert_elems must be within param_elems and ep divide dp, got {expert_elems}, ep={ep}")
    res = reserve or MemoryReserve()
    params, grads, opt = model_state_bytes(param_elems - expert_elems, zero=zero, dp=dp,
                                           mixed_precision=mixed_precision, optimizer=optimizer)
    if expert_elems:
        ep_, eg, eo = model_state_bytes(expert_elems, zero=zero, dp=dp // ep, mixed_precision=mixed_precision,
                                        optimizer=optimizer)
        params, grads, opt = params + ep_, grads + eg, opt + eo
    transient = zero3_transient_bytes(largest_layer_elems, zero=zero, dp=dp, mixed_precision=mixed_precision,
                                      reduce_bytes=reduce_bytes)
    other = transient + res.fixed_bytes + res.fragmentation * (activations + transient)
    return MemoryBreakdown(params=params, grads=grads, optimizer=opt, activations=activations, other=other,
                           capacity=capacity)


def fits(breakdown: MemoryBreakdown) -> bool:
    """Whether the predicted peak fits the device (``total <= capacity``)."""
    if breakdown.capacity <= 0:
        raise ValueError("MemoryBreakdown.capacity is not set; pass the device's memory_bytes")
    return breakdown.total <= breakdown.capacity


def korthikanti_layer_activation_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sp: bool = False,
                                       recompute: Recompute = "none") -> float:
    """Activation bytes one transformer layer saves per micro-batch (16-bit activations, fp8-free), from
    Korthikanti et al. 2022, Table 2: s sequence, b micro-batch, h hidden, a heads, t tensor-parallel size.

    none: ``sbh(34 + 5as/h)`` (t=1), ``sbh(10 + 24/t + 5as/(ht))`` (tp), ``sbh(34/t + 5as/(ht))`` (tp+sp);
    selective (attention core recomputed): the same without the ``5as/h`` term; full: the layer input ``2sbh``
    (``2sbh/t`` with sp, whose input is sequence-sharded).
    """
    if min(s, b, h, a, t) < 1:
        raise ValueError(f"s, b, h, a, t must be >= 1, got {(s, b, h, a, t)}")
    sbh = float(s) * b * h
    attn = 5.0 * a * s / (h * t)
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    base = 34.0 / t if (sp or t == 1) else 10.0 + 24.0 / t
    if recompute == "selective":
        return sbh * base
    if recompute == "none":
        return sbh * (base + attn)
    raise ValueError(f"recompute must be none, selective or full, got {recompute!r}")
