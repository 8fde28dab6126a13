"""The dp axis: FSDP2 ``fully_shard`` for ZeRO >= 1, gradient all-reduce (replication) for ZeRO 0.

ZeRO levels map onto FSDP2 as follows.  FSDP2 always shards parameters, gradients and optimizer states together
(Rajbhandari et al. 2020, "ZeRO", stage 3 layout); levels 1 and 2 differ from 3 only in that parameters stay
gathered between forward and backward (``reshard_after_forward=False``), so the backward all-gather is skipped as
in ZeRO-1/2's communication pattern, while the memory of parameters is that of the gathered copy during a step.
Level 0 keeps full replicas and averages gradients as the plan says (``Plan.overlap_grad_sync``, which the planner
picks by cost): as DDP does (DDP itself does not accept DTensor parameters, hence :class:`GradSync`), one flattened
all-reduce per unit (layer group), issued asynchronously as soon as the unit's gradients are final, during the last
micro-batch's backward, so it overlaps the backward of the units before it; or one flattened all-reduce after the
backward (:func:`allreduce_grads`).  These are the two programs ``planner.inter_op.dpcomm`` costs for ZeRO 0.

Precision (:func:`mp_policy`): parameters, gradients and optimizer state stay fp32 (sharded); for a half-precision
plan FSDP2 casts the gathered parameters to the plan's dtype (``param_dtype``), so all-gathers move 2 bytes per
element and the unsharded copies are half precision, and reduces gradients in the plan's ``reduce_dtype`` (fp32 by
default).  This is the program the cost and memory models describe (``planner.inter_op.dpcomm``, ``memory``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

__all__ = ["GradSync", "apply_fsdp", "mp_policy", "allreduce_grads", "local_grad", "fix_grad_placements"]

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


def _flat_grads(params: list[nn.Parameter]) -> tuple[list[torch.Tensor], torch.Tensor] | None:
    """The local gradients of ``params`` (those that have one) and one flattened copy of them (None: no gradient)."""
    grads = [g for g in (local_grad(p) for p in params) if g is not None]
    return (grads, torch.cat([g.reshape(-1) for g in grads])) if grads else None


def _unflatten_into(grads: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Write ``flat`` (as :func:`_flat_grads` laid it out) back into ``grads``: one multi-tensor copy (one kernel on
    GPUs instead of one per tensor; on this VM's CPU 55 us instead of 92 for gpt-tiny's 28 gradients)."""
    parts = flat.split([g.numel() for g in grads])
    torch._foreach_copy_(grads, [v.view_as(g) for v, g in zip(parts, grads)])


@torch.no_grad()
def allreduce_grads(params: list[nn.Parameter], group: dist.ProcessGroup, *, average: bool) -> None:
    """All-reduce the local gradients of ``params`` over ``group`` in one flattened buffer."""
    got = _flat_grads(params)
    if got is None:
        return
    grads, flat = got
    dist.all_reduce(flat, group=group)
    if average:
        flat /= dist.get_world_size(group)
    _unflatten_into(grads, flat)


class GradSync:
    """ZeRO 0's gradient all-reduce over ``group``, one bucket per unit, overlapped with the backward (see the module
    docstring).  A post-accumulate-grad hook counts each parameter's accumulations while :attr:`active` (the
    program's step); at the ``microbatches``-th one the parameter is final, and a unit whose parameters are all final
    is flattened and all-reduced asynchronously.  Replicas run the same backward, so they issue the buckets in the
    same order.  :meth:`finish` issues what is left (parameters without a gradient this step), waits, and writes the
    averaged values back.  A parameter accumulated more often than expected (used by two of the rank's chunks) makes
    the step fall back to one synchronous all-reduce of everything, as before."""

    def __init__(self, units: list[list[nn.Parameter]], group: dist.ProcessGroup, microbatches: int,
                 later_scale: int = 1) -> None:
        seen: set[int] = set()
        self.units: list[list[nn.Parameter]] = []
        for unit in units:
            mine = [p for p in unit if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in mine)
            if mine:
                self.units.append(mine)
        self.group, self.microbatches = group, microbatches
        self.later_scale = later_scale  # what the gradients are divided by after the backward (a pipeline schedule
        # averages over its micro-batches when its step ends): a bucket taken before that is divided by it, too
        self.active = False
        self._unit_of = {id(p): i for i, u in enumerate(self.units) for p in u}
        self._reset()
        for unit in self.units:
            for p in unit:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _reset(self) -> None:
        self._count: dict[int, int] = {}
        self._left = [len(u) for u in self.units]
        self._pending: list[tuple[list[torch.Tensor], torch.Tensor, dist.Work, bool]] = []
        self._issued: set[int] = set()
        self._late = False

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """The hooks count (and issue buckets) only inside this: a step's forward and backward passes."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _on_grad(self, p: nn.Parameter) -> None:
        if not self.active:
            return
        n = self._count.get(id(p), 0) + 1
        self._count[id(p)] = n
        if n > self.microbatches:
            self._late = True
        elif n == self.microbatches:
            i = self._unit_of[id(p)]
            self._left[i] -= 1
            if self._left[i] == 0:
                self._issue(i)

    @torch.no_grad()
    def _issue(self, i: int) -> None:
        self._issued.add(i)
        fix_grad_placements(self.units[i])
        got = _flat_grads(self.units[i])
        if got is not None:
            grads, flat = got
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            self._pending.append((grads, flat, work, self.active))

    @torch.no_grad()
    def finish(self) -> None:
        """Issue the units not issued yet, wait for every bucket and write the averages into the gradients."""
        try:
            for i in range(len(self.units)):
                if i not in self._issued:
                    self._issue(i)
            for _, _, work, _ in self._pending:
                work.wait()
            if self._late:  # a bucket went out before its last accumulation: redo the whole sync at once
                params = [p for u in self.units for p in u]
                fix_grad_placements(params)
                allreduce_grads(params, self.group, average=True)
                return
            size = dist.get_world_size(self.group)
            for grads, flat, _, early in self._pending:
                flat /= size * (self.later_scale if early else 1)
                _unflatten_into(grads, flat)
        finally:
            self._reset()
