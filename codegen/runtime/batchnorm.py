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
from torch import fx, nn
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["ModuleSyncBatchNorm", "SyncBatchNorm", "has_batch_norm", "sync_batch_norms"]

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


class ModuleSyncBatchNorm(nn.Module):
    """An ``nn.BatchNorm1d/2d/3d`` call of an fx-captured graph, computed by :class:`SyncBatchNorm` from the module's
    own parameters and running statistics, with ``nn.BatchNorm``'s training-mode rules (``num_batches_tracked``, a
    cumulative average when ``momentum`` is None).  The BatchNorm module is referenced, not registered, so the group's
    parameter and buffer names stay the model's."""

    def __init__(self, bn: nn.modules.batchnorm._BatchNorm, group: dist.ProcessGroup) -> None:
        super().__init__()
        object.__setattr__(self, "bn", bn)
        self.sync = SyncBatchNorm(group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bn = self.bn
        momentum = 0.0 if bn.momentum is None else bn.momentum
        if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
            bn.num_batches_tracked.add_(1)
            if bn.momentum is None:
                momentum = 1.0 / float(bn.num_batches_tracked)
        training = bn.training or (bn.running_mean is None and bn.running_var is None)
        keep = not bn.training or bn.track_running_stats
        return self.sync(x, bn.weight, bn.bias, bn.running_mean if keep else None, bn.running_var if keep else None,
                         training, momentum, bn.eps)


def _is_module_bn(gm: fx.GraphModule, n: fx.Node) -> bool:
    if n.op != "call_module":
        return False
    m = gm.get_submodule(str(n.target))
    return isinstance(m, nn.modules.batchnorm._BatchNorm) and not isinstance(m, nn.SyncBatchNorm)


def has_batch_norm(gm: fx.GraphModule) -> bool:
    return any((n.op == "call_function" and n.target in _BN) or _is_module_bn(gm, n) for n in gm.graph.nodes)


def sync_batch_norms(gm: fx.GraphModule, group: dist.ProcessGroup) -> int:
    """Swap every BatchNorm of ``gm`` (ATen ``batch_norm`` calls of an exported group module, ``nn.BatchNormNd``
    calls of an fx-captured one) for :class:`SyncBatchNorm` over ``group``, in place; returns how many."""
    count = 0
    for n in list(gm.graph.nodes):
        if _is_module_bn(gm, n):
            mod: nn.Module = ModuleSyncBatchNorm(gm.get_submodule(str(n.target)), group)
        elif n.op == "call_function" and n.target in _BN:
            mod = SyncBatchNorm(group)
        else:
            continue
        name = f"_syncbn_{n.name}"
        gm.add_submodule(name, mod)
        with gm.graph.inserting_before(n):
            new = gm.graph.call_module(name, n.args, dict(n.kwargs))
        n.replace_all_uses_with(new)
        gm.graph.erase_node(n)
        count += 1
    if count:
        gm.recompile()
    return count
