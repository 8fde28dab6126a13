"""BatchNorm under data parallelism: per-rank statistics by default, synchronized statistics on request.

A training-mode BatchNorm normalizes with the statistics of the batch it sees.  Under data parallelism each replica
sees ``1/dp`` of the global batch, so by default the statistics are per rank (what DDP/FSDP do, and the plan says
so in a note); the loss then differs from one process's by the difference between per-replica and global batch
statistics.  ``sync_batchnorm=True`` replaces every training-mode BatchNorm of a group module by
:class:`SyncBatchNorm`, which all-reduces the per-channel sum and centred sum of squares over the dp group (two
passes: mean first, then the variance about it, as exact as one process's two-pass statistics), so the program
computes what one process computes on the global batch, gradients included (the all-reduces are differentiable).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["SyncBatchNorm", "sync_batch_norms", "has_batch_norm"]

_BN = (torch.ops.aten.batch_norm.default,)


class _AllReduceSum(torch.autograd.Function):
    """Sum over ``group``, differentiable (the gradient of a sum every rank reads is the sum of their gradients).
    Synchronous: ``torch.distributed.nn.functional.all_reduce`` returns a lazily-waited tensor that gave NaNs when
    read before the wait in a training step here."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group  # type: ignore[attr-defined]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = grad.clone()
        dist.all_reduce(out, group=ctx.group)  # type: ignore[attr-defined]
        return out, None


class SyncBatchNorm(nn.Module):
    """``aten.batch_norm`` with statistics over the dp group (see the module docstring)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                running_mean: torch.Tensor | None, running_var: torch.Tensor | None, training: bool, momentum: float,
                eps: float, *rest: object) -> torch.Tensor:
        if not training or dist.get_world_size(self.group) == 1:
            return torch.ops.aten.batch_norm.default(x, weight, bias, running_mean, running_var, training, momentum,
                                                     eps, *rest)
        if isinstance(x, DTensor):  # under tensor parallelism too: normalize whole channels, replicated over tp
            mesh = x.device_mesh
            y = self.forward(x.full_tensor(), *(t.full_tensor() if isinstance(t, DTensor) else t
                                                for t in (weight, bias, running_mean, running_var)),
                             training, momentum, eps, *rest)
            return DTensor.from_local(y, mesh, [Replicate()] * mesh.ndim, run_check=False)
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        count = torch.full((1,), x.numel() / x.shape[1], dtype=x.dtype, device=x.device)
        total = _AllReduceSum.apply(torch.cat([x.sum(dims), count]), self.group)
        n = total[-1]
        mean = total[:-1] / n
        xc = x - mean.view(shape)
        var = _AllReduceSum.apply((xc * xc).sum(dims), self.group) / n
        with torch.no_grad():
            if running_mean is not None:
                running_mean.mul_(1 - momentum).add_(mean.detach(), alpha=momentum)
            if running_var is not None:
                running_var.mul_(1 - momentum).add_(var.detach() * (n / (n - 1)), alpha=momentum)
        y = xc * torch.rsqrt(var + eps).view(shape)
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        return y


def has_batch_norm(gm: fx.GraphModule) -> bool:
    return any(n.op == "call_function" and n.target in _BN for n in gm.graph.nodes)


def sync_batch_norms(gm: fx.GraphModule, group: dist.ProcessGroup) -> int:
    """Swap every ATen ``batch_norm`` of ``gm`` (an exported group module) for :class:`SyncBatchNorm` over
    ``group``, in place; returns how many."""
    count = 0
    for n in list(gm.graph.nodes):
        if n.op != "call_function" or n.target not in _BN:
            continue
        name = f"_syncbn_{n.name}"
        gm.add_submodule(name, SyncBatchNorm(group))
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(name, n.args, dict(n.kwargs))
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count
