"""Ops the tensor-parallel runtime computes on local shards itself, where DTensor's own rule is wrong or missing:
convolutions on channel-sharded weights (as ATen calls in exported graphs, as ``nn.ConvNd`` modules in fx graphs)
and in-place ops whose target is a plain tensor.  Used by :func:`autopar.codegen.runtime.tensor_parallel.rewrite_group`.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["CONV_OPS", "ChannelConv", "InplaceOnPlain", "ModuleConv", "WholeOp", "custom_op", "inplace_op",
           "to_dtensor"]

CONV_OPS = (torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default, torch.ops.aten.conv3d.default)


def to_dtensor(x: Any, mesh: Any) -> Any:
    """A plain tensor entering a tensor-parallel stage becomes a replicated DTensor (no communication)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
        return DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return x


class ChannelConv(nn.Module):
    """A convolution (ATen ``conv1d/2d/3d``) on a tp-sharded weight, computed on local shards.

    DTensor's own convolution rule mis-sizes the output of an out-channel-sharded weight (torch 2.13: it reports a
    replicated output holding only the local channels), so the runtime does it: an out-channel shard ``S(0)`` of the
    weight convolves the replicated input into a channel-sharded output ``S(1)``; an in-channel shard ``S(1)`` of
    the weight convolves the channel-sharded input into partial sums (bias added once, after the reduction).  Other
    layouts (grouped convolutions) gather the weight and run replicated."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, x: Any, w: Any, b: Any = None, *args: Any) -> Any:
        if not isinstance(w, DTensor):
            return self.op(x, w, b, *args)
        mesh, pl = w.device_mesh, w.placements[0]
        groups = args[3] if len(args) > 3 else 1  # (stride, padding, dilation, groups) follow the bias
        x = to_dtensor(x, mesh)
        if pl == Shard(0) and groups == 1:
            # each rank's input gradient covers its output channels only: partial sums, not a replicated value
            xl = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            bl = b.redistribute(mesh, [Shard(0)]).to_local() if isinstance(b, DTensor) else \
                (None if b is None else torch.chunk(b, mesh.size())[mesh.get_local_rank()])
            return DTensor.from_local(self.op(xl, w.to_local(), bl, *args), mesh, [Shard(1)], run_check=False)
        if pl == Shard(1) and groups == 1:
            xl = x.redistribute(mesh, [Shard(1)]).to_local()
            out = DTensor.from_local(self.op(xl, w.to_local(), None, *args), mesh, [Partial()], run_check=False)
            if b is None:
                return out
            bias = to_dtensor(b, mesh).redistribute(mesh, [Replicate()])
            return out + bias.reshape(-1, *([1] * (out.dim() - 2)))
        xl = x.redistribute(mesh, [Replicate()]).to_local()
        bf = b.full_tensor() if isinstance(b, DTensor) else b
        return DTensor.from_local(self.op(xl, w.full_tensor(), bf, *args), mesh, [Replicate()], run_check=False)


class InplaceOnPlain(nn.Module):
    """An in-place ATen op (``add_``, ``fill_``...) whose target is a plain tensor: DTensor arguments (values the plan
    replicated, sharded ones gathered) are made whole first, since an in-place op cannot make its target a DTensor;
    a replicated DTensor target is updated through its local tensor (DTensor has no rule for some, e.g.
    ``fill_.Tensor``).  A sharded target runs the op as DTensor does."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, target: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(target, DTensor):
            try:
                return self.op(target, *args, **kwargs)
            except NotImplementedError:  # no DTensor rule: a replicated target is updated through its local tensor
                if not all(isinstance(p, Replicate) for p in target.placements):
                    raise
        args = tuple(a.full_tensor() if isinstance(a, DTensor) else a for a in args)
        kwargs = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in kwargs.items()}
        self.op(target.to_local() if isinstance(target, DTensor) else target, *args, **kwargs)
        return target


def inplace_op(n: fx.Node) -> bool:
    """An in-place ATen op (its first argument is written)."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
        n.target._schema.name.endswith("_") and bool(n.target._schema.arguments) and \
        n.target._schema.arguments[0].is_write


class ModuleConv(nn.Module):
    """An ``nn.Conv1d/2d/3d`` call of an fx-captured graph, computed by :class:`ChannelConv` from the module's own
    parameters (read at call time: tensor parallelism and FSDP replace them on the module).  The conv module is
    referenced, not registered, so the group's parameter names stay the model's."""

    TYPES = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    _OPS: ClassVar[dict[type, Any]] = {nn.Conv1d: F.conv1d, nn.Conv2d: F.conv2d, nn.Conv3d: F.conv3d}

    def __init__(self, conv: nn.Module) -> None:
        super().__init__()
        object.__setattr__(self, "conv", conv)
        self.local = ChannelConv(self._OPS[type(conv)])

    def forward(self, x: Any) -> Any:
        c = self.conv
        if c.padding_mode != "zeros" or not isinstance(c.weight, DTensor):
            return c(x)
        return self.local(x, c.weight, c.bias, c.stride, c.padding, c.dilation, c.groups)


def custom_op(n: fx.Node) -> bool:
    """A library's own registered op (``transformers::grouped_mm_fallback``...): DTensor has no rule for it."""
    return n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload) and \
        n.target.namespace not in ("aten", "prims", "_c10d_functional", "c10d")


class WholeOp(nn.Module):
    """An op without a DTensor rule, run on whole tensors: DTensor arguments are gathered (differentiably) and the
    result is a plain tensor, the same on every tp rank, which the program's implicit replication treats as
    replicated.  The planner gives such ops (unknown to its registry) the replicated strategy only."""

    def __init__(self, op: Any) -> None:
        super().__init__()
        self.op = op

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        def whole(a: Any) -> Any:
            return a.full_tensor() if isinstance(a, DTensor) else a
        return self.op(*fx.node.map_aggregate(args, whole), **fx.node.map_aggregate(kwargs, whole))
