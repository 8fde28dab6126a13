"""The dp axis: FSDP2 ``fully_shard`` for ZeRO >= 1, gradient all-reduce (replication) for ZeRO 0.

ZeRO levels map onto FSDP2 as follows.  FSDP2 always shards parameters, gradients and optimizer states together
(Rajbhandari et al. 2020, "ZeRO", stage 3 layout); levels 1 and 2 differ from 3 only in that parameters stay
gathered between forward and backward (``reshard_after_forward=False``), so the backward all-gather is skipped as
in ZeRO-1/2's communication pattern, while the memory of parameters is that of the gathered copy during a step.
Level 0 keeps full replicas and averages gradients with one flattened all-reduce per step (the same collective a
DDP bucket issues; DDP itself does not accept DTensor parameters, hence the explicit sync).

Precision (:func:`mp_policy`): parameters, gradients and optimizer state stay fp32 (sharded); for a half-precision
plan FSDP2 casts the gathered parameters to the plan's dtype (``param_dtype``), so all-gathers move 2 bytes per
element and the unsharded copies are half precision, and reduces gradients in the plan's ``reduce_dtype`` (fp32 by
default).  This is the program the cost and memory models describe (``planner.inter_op.dpcomm``, ``memory``).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["apply_fsdp", "mp_policy", "allreduce_grads", "local_grad", "fix_grad_placements"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mp_policy(dtype: str, reduce_dtype: str = "float32") -> MixedPrecisionPolicy:
    """FSDP2's policy for a plan: gather parameters in ``dtype`` (no cast for fp32), reduce in ``reduce_dtype``."""
    if dtype not in _DTYPES or reduce_dtype not in _DTYPES:
        raise ValueError(f"unsupported plan dtypes {dtype!r}/{reduce_dtype!r}; expected one of {', '.join(_DTYPES)}")
    param = None if dtype == "float32" else _DTYPES[dtype]
    reduce = None if reduce_dtype == dtype == "float32" else _DTYPES[reduce_dtype]
    return MixedPrecisionPolicy(param_dtype=param, reduce_dtype=reduce)

log = logging.getLogger(__name__)


def apply_fsdp(stages: list[nn.Module], group_lists: list[list[nn.Module]], dp_mesh: DeviceMesh,
               zero: int, *, policy: MixedPrecisionPolicy | None = None) -> None:
    """``fully_shard`` every layer-group module (one all-gather/reduce-scatter unit per block) and each stage.

    Groups holding a parameter shared with another group (tied embeddings) are left to their stage's root unit.
    ``policy``: the plan's :func:`mp_policy` (default: no casting, fp32 throughout)."""
    reshard = zero >= 3
    policy = policy or MixedPrecisionPolicy()
    owners: dict[int, int] = {}
    for groups in group_lists:
        for g in groups:
            for p in g.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
    for stage, groups in zip(stages, group_lists):
        for g in groups:
            params = list(g.parameters())
            if params and all(owners[id(p)] == 1 for p in params):
                fully_shard(g, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=policy)


def local_grad(p: torch.Tensor) -> torch.Tensor | None:
    g = p.grad
    if g is None:
        return None
    return g.to_local() if isinstance(g, DTensor) else g


@torch.no_grad()
def fix_grad_placements(params: list[nn.Parameter]) -> None:
    """Give every DTensor gradient its parameter's placement (a replicated weight used on sequence-sharded
    activations receives a partial gradient, which is reduced here)."""
    for p in params:
        if isinstance(p, DTensor) and isinstance(p.grad, DTensor) and p.grad.placements != p.placements:
            p.grad = p.grad.redistribute(p.device_mesh, p.placements)


@torch.no_grad()
def allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup, *, average: bool) -> None:
    """All-reduce the local gradients of ``params`` over ``group`` in one flattened buffer."""
    grads = [g for g in (local_grad(p) for p in params) if g is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    off = 0
    for g in grads:
        n = g.numel()
        g.copy_(flat[off:off + n].view_as(g))
        off += n
