"""The dp axis: FSDP2 ``fully_shard`` for ZeRO >= 1, gradient all-reduce (replication) for ZeRO 0.

ZeRO levels map onto FSDP2 as follows.  FSDP2 always shards parameters, gradients and optimizer states together
(Rajbhandari et al. 2020, "ZeRO", stage 3 layout); levels 1 and 2 differ from 3 only in that parameters stay
gathered between forward and backward (``reshard_after_forward=False``), so the backward all-gather is skipped as
in ZeRO-1/2's communication pattern, while the memory of parameters is that of the gathered copy during a step.
Level 0 keeps full replicas and averages gradients with one flattened all-reduce per step (the same collective a
DDP bucket issues; DDP itself does not accept DTensor parameters, hence the explicit sync).
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["apply_fsdp", "allreduce_grads", "local_grad", "fix_grad_placements"]

log = logging.getLogger(__name__)


def apply_fsdp(stages: list[nn.Module], group_lists: list[list[nn.Module]], dp_mesh: DeviceMesh,
               zero: int) -> None:
    """``fully_shard`` every layer-group module (one all-gather/reduce-scatter unit per block) and each stage.

    Groups holding a parameter shared with another group (tied embeddings) are left to their stage's root unit."""
    reshard = zero >= 3
    owners: dict[int, int] = {}
    for groups in group_lists:
        for g in groups:
            for p in g.parameters():
                owners[id(p)] = owners.get(id(p), 0) + 1
    for stage, groups in zip(stages, group_lists):
        for g in groups:
            params = list(g.parameters())
            if params and all(owners[id(p)] == 1 for p in params):
                fully_shard(g, mesh=dp_mesh, reshard_after_forward=reshard)
        fully_shard(stage, mesh=dp_mesh, reshard_after_forward=reshard)


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
