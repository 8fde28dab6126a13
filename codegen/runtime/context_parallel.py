"""Context parallelism at run time: the sequence split over the mesh's ``cp`` axis, attention exchanging K/V.

The planner's method (:mod:`autopar.planner.inter_op.context`) is read from the attention op's sharding
(``comm`` holds ``cp_ring`` or ``cp_all_gather``).  What is done to a stage's layer-group fx modules:

* Inputs and targets are cut along the sequence (dim 1) into ``2 cp`` chunks; cp rank ``i`` keeps chunks ``i`` and
  ``2cp-1-i`` (the causal load-balanced split), so every rank holds the same number of causal score blocks.
* Position tables follow the tokens: ``torch.arange(n)`` over the local length becomes the local tokens' global
  positions, and ``torch.narrow(table, 0, 0, n)`` (a RoPE or position table sliced to the sequence) becomes a lookup
  of those positions, so learned position embeddings and RoPE see the positions of the whole sequence.
* ``scaled_dot_product_attention`` becomes :class:`CpSDPA`: K and V (packed, one tensor) are exchanged over the cp
  group, by a ring of ``cp - 1`` p2p rotations (``batch_isend_irecv``; the backward sends the K/V gradients back
  around the ring) or by one all-gather (the backward reduces the gradients: reduce-scatter where the backend has
  it, else all-reduce and keep the own slice, as gloo needs); then each rank attends its queries to every key with
  the causal mask written in global positions.  Both are autograd functions, so forward and backward are exact.
  Under tensor parallelism the attention runs on the local head shards (:class:`HeadSDPA`) and the exchange is per
  tp rank.

Why not ``torch.distributed.tensor.experimental.context_parallel``: in torch 2.13 on gloo/CPU it fails on these
models (it resizes its buffers in place, so q/k/v that require grad are refused, and the CPU attention kernel
``aten._scaled_dot_product_flash_attention_for_cpu`` has no sharding strategy), so this small module does the same
load-balanced split on plain ``torch.distributed``.

Not covered: models captured by ``torch.export`` (shapes are fixed at capture) and pipelines (stage boundaries are
sized at the full sequence); :func:`check_supported` says so before anything is built.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn.functional as F

from autopar import ir
from autopar.codegen.runtime.tensor_parallel import _SDPA, HeadSDPA, _swap_node

__all__ = ["CpContext", "CpSDPA", "Positions", "check_supported", "cp_method_of", "rewrite_group_cp", "split_sequence"]

METHODS = ("cp_ring", "cp_all_gather")


@dataclass
class CpContext:
    """This rank's place in its cp group and the exchange it uses; ``counts`` tallies the collectives it issued
    (``p2p`` sends, ``all_gather``, ``reduce``) for checking against what the cost model charged."""

    cp: int
    index: int
    group: Any
    ranks: tuple[int, ...]
    """Global rank of each cp index (the group's ring order)."""
    method: str = "cp_ring"
    counts: dict[str, int] = field(default_factory=lambda: {"p2p": 0, "all_gather": 0, "reduce": 0})

    def positions(self, n: int, index: int | None = None, device: Any = None) -> torch.Tensor:
        """Global positions of the ``n`` local tokens of cp rank ``index`` (default: this rank)."""
        i = self.index if index is None else index
        if n % 2:
            raise ValueError(f"context parallelism needs an even local sequence, got {n}")
        c = n // 2
        return torch.cat((torch.arange(i * c, (i + 1) * c, device=device),
                          torch.arange((2 * self.cp - 1 - i) * c, (2 * self.cp - i) * c, device=device)))


def split_sequence(x: torch.Tensor, cp: int, index: int, dim: int = 1) -> torch.Tensor:
    """Chunks ``index`` and ``2cp-1-index`` of ``x`` cut into ``2 cp`` along ``dim``."""
    if x.shape[dim] % (2 * cp):
        raise ValueError(f"sequence length {x.shape[dim]} is not divisible by 2*cp = {2 * cp}: context parallelism "
                         "cuts it into 2*cp equal chunks")
    parts = x.chunk(2 * cp, dim)
    return torch.cat((parts[index], parts[2 * cp - 1 - index]), dim)


def cp_method_of(plan: ir.Plan) -> str:
    """The exchange the plan chose (the first attention op naming one; ring by default)."""
    for o in plan.op_shardings:
        for m in METHODS:
            if m in o.comm.split("+"):
                return m
    return "cp_ring"


def check_supported(plan: ir.Plan, graph: ir.Graph) -> None:
    if plan.mesh.cp == 1:
        return
    if graph.frontend != "fx":
        raise ValueError(f"context parallelism (cp={plan.mesh.cp}) runs models captured by torch.fx (the zoo); this "
                         f"model was captured by {graph.frontend}. Re-plan with --pin cp=1")
    if plan.mesh.pp > 1:
        raise ValueError(f"context parallelism (cp={plan.mesh.cp}) with pipeline parallelism (pp={plan.mesh.pp}) is "
                         "not supported by the runtime; re-plan with --pin pp=1 or --pin cp=1")


class _Rotate(torch.autograd.Function):
    """Send ``x`` to the next cp rank, receive the previous rank's; the gradient goes the other way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cpc: CpContext) -> torch.Tensor:  # type: ignore[override]
        ctx.cpc = cpc
        return _shift(x.contiguous(), cpc, +1)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return _shift(g.contiguous(), ctx.cpc, -1), None


def _shift(x: torch.Tensor, cpc: CpContext, d: int) -> torch.Tensor:
    out = torch.empty_like(x)
    dst, src = cpc.ranks[(cpc.index + d) % cpc.cp], cpc.ranks[(cpc.index - d) % cpc.cp]
    ops = [dist.P2POp(dist.isend, x, dst, cpc.group), dist.P2POp(dist.irecv, out, src, cpc.group)]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    cpc.counts["p2p"] += 1
    return out


class _Gather(torch.autograd.Function):
    """All-gather ``x`` over the cp group (stacked on a new dim 0 in cp-index order); the backward sums the gradients
    over the group and keeps this rank's slice (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cpc: CpContext) -> torch.Tensor:  # type: ignore[override]
        ctx.cpc = cpc
        parts = [torch.empty_like(x) for _ in range(cpc.cp)]
        dist.all_gather(parts, x.contiguous(), group=cpc.group)
        cpc.counts["all_gather"] += 1
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        cpc = ctx.cpc
        g = g.contiguous()
        if dist.get_backend(cpc.group) == "gloo":  # gloo has no reduce_scatter
            dist.all_reduce(g, group=cpc.group)
            out = g[cpc.index].clone()
        else:
            out = torch.empty_like(g[0])
            dist.reduce_scatter_tensor(out, g, group=cpc.group)
        cpc.counts["reduce"] += 1
        return out, None


def cp_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cpc: CpContext, *, is_causal: bool = False,
                 scale: float | None = None, attn_mask: Any = None, dropout_p: float = 0.0) -> torch.Tensor:
    """Attention of this rank's queries ``[b, h, n, d]`` (its two chunks) to the keys of the whole sequence."""
    if attn_mask is not None or dropout_p:
        raise ValueError("context parallelism supports attention without an explicit mask or dropout (is_causal is "
                         "fine); re-plan with --pin cp=1 for this model")
    dk = k.shape[-1]
    kv = torch.cat((k, v), dim=-1)
    if cpc.method == "cp_all_gather":
        blocks = list(_Gather.apply(kv, cpc).unbind(0))
        order = list(range(cpc.cp))
    else:
        blocks, order, cur = [kv], [cpc.index], kv
        for step in range(1, cpc.cp):
            cur = _Rotate.apply(cur, cpc)
            blocks.append(cur)
            order.append((cpc.index - step) % cpc.cp)
    kv_all = torch.cat(blocks, dim=-2)
    k_all, v_all = kv_all[..., :dk], kv_all[..., dk:]
    mask = None
    if is_causal:
        n = q.shape[-2]
        pos_q = cpc.positions(n, device=q.device)
        pos_k = torch.cat([cpc.positions(n, j, device=q.device) for j in order])
        mask = pos_q[:, None] >= pos_k[None, :]
    return F.scaled_dot_product_attention(q, k_all, v_all, attn_mask=mask, scale=scale)


class CpSDPA(HeadSDPA):
    """:class:`HeadSDPA` whose local attention is :func:`cp_attention` (the same DTensor handling under tp)."""

    def __init__(self, mesh: Any, cpc: CpContext) -> None:
        super().__init__(mesh, recompute=False)
        self.cpc = cpc

    def _local(self, q: Any, k: Any, v: Any, kwargs: dict[str, Any]) -> Any:
        return cp_attention(q, k, v, self.cpc, **kwargs)


class Positions:
    """The local sequence length of the current step (the program sets it before each forward)."""

    def __init__(self) -> None:
        self.n = 0


_CONTEXTS: dict[int, tuple[CpContext, Positions]] = {}
"""Contexts of this process's cp programs by id, read by :func:`cp_arange` / :func:`cp_narrow` (fx calls
module-level functions; a plain call keeps the group module's graph free of extra submodules)."""


def cp_arange(key: int, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``torch.arange(n)`` over the local sequence length: the local tokens' global positions."""
    cpc, local = _CONTEXTS[key]
    dtype = kwargs.get("dtype") or torch.long
    if len(args) == 1 and args[0] == local.n and not dtype.is_floating_point:
        return cpc.positions(local.n, device=kwargs.get("device")).to(dtype)
    return torch.arange(*args, **kwargs)


def cp_narrow(key: int, t: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``torch.narrow(table, 0, 0, n)`` over the local sequence length: the table's rows at the global positions."""
    cpc, local = _CONTEXTS[key]
    if dim == 0 and start == 0 and length == local.n:
        return t.index_select(0, cpc.positions(length, device=t.device))
    return torch.narrow(t, dim, start, length)


def rewrite_group_cp(gm: fx.GraphModule, cpc: CpContext, local: Positions) -> None:
    """Attention to :class:`CpSDPA`, sequence-length ``arange``/``narrow`` to global positions; in place."""
    key = id(cpc)
    _CONTEXTS[key] = (cpc, local)
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target in _SDPA:
            _swap_node(gm, n, CpSDPA(None, cpc), f"_cp_sdpa_{n.name}")
        elif n.op == "call_module" and type(gm.get_submodule(str(n.target))) is HeadSDPA:
            gm.add_submodule(str(n.target), CpSDPA(gm.get_submodule(str(n.target)).mesh, cpc))
        elif n.op == "call_function" and n.target in (torch.arange, torch.narrow):
            n.target = cp_arange if n.target is torch.arange else cp_narrow
            n.args = (key, *n.args)
    gm.recompile()


class CpRuntime:
    """What a program needs for ``cp > 1``: the context, the sequence slicing of a batch, and the gradient group
    (dp x cp: every cp rank holds the same parameters, and each computed the gradient of its tokens' loss)."""

    def __init__(self, plan: ir.Plan, mesh: Any) -> None:
        m, me = plan.mesh, plan.mesh.coords(dist.get_rank())
        ranks = tuple(m.rank(pp=me.pp, dp=me.dp, cp=j, tp=me.tp) for j in range(m.cp))
        self.ctx = CpContext(cp=m.cp, index=me.cp, group=mesh["cp"].get_group(), ranks=ranks,
                             method=cp_method_of(plan))
        self.positions = Positions()
        self.grad_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        self.grad_rank = me.dp * m.cp + me.cp
        self.seq = 0

    def slice(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's two sequence chunks of an input or target (tensors with a sequence dim 1)."""
        if x.dim() < 2:
            raise ValueError(f"context parallelism cuts inputs along dim 1 (the sequence); got shape {tuple(x.shape)}")
        self.seq = x.shape[1]
        out = split_sequence(x, self.ctx.cp, self.ctx.index)
        self.positions.n = out.shape[1]
        return out
