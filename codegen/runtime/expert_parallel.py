"""Expert parallelism at run time: routed experts sharded over ``ep`` ranks of the dp axis, tokens moved to them and
back with ``all_to_all_single`` (the program :mod:`autopar.planner.inter_op.expert` costs).

**Groups.**  The dp axis is viewed as ``(dp / ep, ep)``: an *ep group* is ``ep`` consecutive dp indices at the same
(pp, cp, tp) coordinates, and the ranks with the same position in their ep groups form an *expert-data-parallel*
(edp) group.  Both come from one 5-D ``DeviceMesh`` ``(pp, edp, ep, cp, tp)`` laid over the plan's rank order.

**Parameters.**  Each stacked expert weight ``[E, out, in]`` becomes a ``DTensor`` sharded ``Shard(0)`` on the ep
mesh: the rank at ep index ``r`` holds experts ``[r E/ep, (r+1) E/ep)``.  Checkpoints therefore store the global
tensor in ep chunks, and a load under another ep (or none) reads what it needs
(:mod:`autopar.codegen.checkpoint`).  Their gradients are summed over the edp group and divided by dp: a rank's
expert gradient already sums the contributions of its ep group's tokens, so the sum over edp covers every replica
once, and dp divides as the all-reduce average does for the other parameters.

**Graph rewrite.**  In each layer-group ``fx`` module, the grouped expert matmuls (the zoo's
``autopar_zoo::expert_mm`` taking per-expert counts, transformers' ``grouped_mm_fallback`` taking offsets) that
share a counts/offsets input form one region.  The region's counts are exchanged (one ``all_to_all_single`` of E
integers), its entry rows (sorted by expert) are dispatched to the ranks owning their experts and regrouped by local
expert, every grouped matmul runs on the local rows with the local weights and counts, and the exit matmul's rows
are sent back (``combine``) into the original order.  Element-wise ops between the matmuls (SwiGLU) run on the local
rows unchanged.  Dispatch and combine are differentiable (``torch.distributed.nn.functional.all_to_all_single``), so
the backward issues their transposes: 5 ``all_to_all_single`` per region and micro-batch, as the planner charges.

Supported: ZeRO 0, tp = 1 (the grouped matmuls have no tensor-parallel rule); other plans are refused up front.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar import ir

__all__ = ["ExpertParallel", "check_supported", "split_expert_params", "sync_expert_grads"]

_GMM_NAMES = {"expert_mm": False, "grouped_mm_fallback": True}  # op -> takes offsets (True) or counts (False)


def check_supported(plan: ir.Plan) -> None:
    """Refuse, before anything is built, an ep plan this runtime cannot run."""
    m = plan.mesh
    if m.ep > 1 and (plan.zero != 0 or m.tp != 1):
        raise NotImplementedError(f"expert parallelism (ep={m.ep}) runs with ZeRO 0 and tp=1 here; the plan has "
                                  f"ZeRO-{plan.zero}, tp={m.tp}: re-plan with --pin ep={m.ep} --pin zero=0 "
                                  "--pin tp=1")


def _gmm_kind(node: fx.Node) -> bool | None:
    if node.op != "call_function":
        return None
    name = str(node.target).split(".")
    for part in reversed(name):
        if part in _GMM_NAMES:
            return _GMM_NAMES[part]
    return None


@dataclass
class _Route:
    """Where this rank's sorted rows go and what it receives, for one region and micro-batch."""

    send: list[int]
    recv: list[int]
    perm: torch.Tensor
    inv: torch.Tensor
    local_counts: torch.Tensor


def _route(counts: torch.Tensor, offsets: bool, ep: int, group: dist.ProcessGroup) -> _Route:
    c = counts.detach().to(torch.int64)
    if offsets:
        c = torch.diff(c, prepend=c.new_zeros(1))
    per = c.numel() // ep
    send_counts = c.view(ep, per).contiguous()  # [destination rank, its local expert]
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # [source rank, my local expert]
    sizes = recv_counts.flatten().tolist()
    blocks = torch.split(torch.arange(sum(sizes)), sizes)
    perm = torch.cat([blocks[s * per + e] for e in range(per) for s in range(ep)]) if sizes else torch.zeros(0)
    perm = perm.to(torch.int64)
    return _Route(send=send_counts.sum(1).tolist(), recv=recv_counts.sum(1).tolist(), perm=perm,
                  inv=torch.argsort(perm), local_counts=recv_counts.sum(0))


def _a2a(x: torch.Tensor, out_sizes: list[int], in_sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` (its backward is the transposed exchange)."""
    y = funcol.all_to_all_single_autograd(x.contiguous(), out_sizes, in_sizes, group)
    return funcol.wait_tensor(y) if isinstance(y, funcol.AsyncCollectiveTensor) else y


class ExpertParallel:
    """This rank's ep and edp groups, and the rewrite of a program's stage modules (module docstring)."""

    def __init__(self, plan: ir.Plan, device: torch.device) -> None:
        m = plan.mesh
        self.ep, self.dp = m.ep, m.dp
        layout = torch.arange(m.world_size).view(m.pp, m.dp // m.ep, m.ep, m.cp, m.tp)
        self.mesh = DeviceMesh(device.type, layout, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        self.ep_mesh = self.mesh["ep"]
        self.group = self.ep_mesh.get_group()
        self.edp_group = self.mesh["edp"].get_group()
        self.rank = self.ep_mesh.get_local_rank()

    # ---- functions the rewritten graphs call ------------------------------------------------------------------
    def route(self, counts: torch.Tensor, offsets: bool) -> _Route:
        return _route(counts, offsets, self.ep, self.group)

    def dispatch(self, x: torch.Tensor, r: _Route) -> torch.Tensor:
        return _a2a(x, r.recv, r.send, self.group)[r.perm]

    def combine(self, y: torch.Tensor, r: _Route) -> torch.Tensor:
        return _a2a(y[r.inv], r.send, r.recv, self.group)

    @staticmethod
    def local_counts(r: _Route, offsets: bool, like: torch.Tensor) -> torch.Tensor:
        c = r.local_counts
        return (torch.cumsum(c, 0) if offsets else c).to(like.dtype)

    # ---- building ---------------------------------------------------------------------------------------------
    def apply(self, modules: Iterable[nn.Module]) -> int:
        """Rewrite every group module's expert regions and shard their weights; returns the regions rewritten."""
        done = 0
        for root in modules:
            for gm in [m for m in root.modules() if isinstance(m, fx.GraphModule)]:
                done += self._rewrite(gm)
        return done

    def _shard_param(self, gm: fx.GraphModule, target: str) -> None:
        owner_path, _, attr = target.rpartition(".")
        owner = gm.get_submodule(owner_path) if owner_path else gm
        full = getattr(owner, attr)
        if isinstance(full, DTensor):
            return  # shared by another group module: done already
        per = full.shape[0] // self.ep
        local = full.detach()[self.rank * per:(self.rank + 1) * per].clone()
        p = nn.Parameter(DTensor.from_local(local, self.ep_mesh, [Shard(0)], run_check=False),
                         requires_grad=full.requires_grad)
        p._autopar_expert = self  # type: ignore[attr-defined]
        setattr(owner, attr, p)

    def _rewrite(self, gm: fx.GraphModule) -> int:
        g = gm.graph
        regions: dict[fx.Node, list[fx.Node]] = {}
        for n in g.nodes:
            if _gmm_kind(n) is not None:
                regions.setdefault(n.args[2], []).append(n)  # type: ignore[arg-type]
        for counts, nodes in regions.items():
            offsets = bool(_gmm_kind(nodes[0]))
            members = set(nodes)
            gm._autopar_ep = self  # the graph reads this object with get_attr (module docstring)
            with g.inserting_after(counts), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fx warns that the attribute is no parameter, buffer or module
                epx = g.get_attr("_autopar_ep")
            with g.inserting_after(epx):
                route = g.call_function(_ep_route, (epx, counts, offsets))
            dispatched: dict[fx.Node, fx.Node] = {}
            for n in nodes:
                x, w = n.args[0], n.args[1]
                if not (_ancestors(x) & members):  # an entry: rows still in this rank's sorted order
                    if x not in dispatched:
                        with g.inserting_before(n):
                            dispatched[x] = g.call_function(_ep_dispatch, (epx, x, route))
                    x = dispatched[x]
                with g.inserting_before(n):
                    local_c = g.call_function(_ep_local_counts, (route, offsets, counts))
                    w_local = g.call_function(_ep_local, (w,))
                n.args = (x, w_local, local_c, *n.args[3:])
                self._shard_param(gm, _param_target(w))
            for n in nodes:
                if not (_descendants(n) & (members - {n})):  # an exit: send the rows back
                    with g.inserting_after(n):
                        back = g.call_function(_ep_combine, (epx, n, route))
                    n.replace_all_uses_with(back, delete_user_cb=lambda u, b=back: u is not b)
        if regions:
            g.lint()
            gm.recompile()
        return len(regions)



def _ep_route(epx: ExpertParallel, counts: torch.Tensor, offsets: bool) -> _Route:
    return epx.route(counts, offsets)


def _ep_dispatch(epx: ExpertParallel, x: torch.Tensor, r: _Route) -> torch.Tensor:
    return epx.dispatch(x, r)


def _ep_combine(epx: ExpertParallel, y: torch.Tensor, r: _Route) -> torch.Tensor:
    return epx.combine(y, r)


def _ep_local_counts(r: _Route, offsets: bool, like: torch.Tensor) -> torch.Tensor:
    return ExpertParallel.local_counts(r, offsets, like)


def _ep_local(w: torch.Tensor) -> torch.Tensor:
    return w.to_local() if isinstance(w, DTensor) else w


def _param_target(w: object) -> str:
    """The ``get_attr`` target a grouped matmul's weight reads (through views such as a transpose)."""
    node = w
    while isinstance(node, fx.Node) and node.op != "get_attr":
        node = node.args[0] if node.args else None
    if not isinstance(node, fx.Node):
        raise TypeError(f"cannot find the expert weight behind {w}")
    return str(node.target)


def _ancestors(x: object) -> set[fx.Node]:
    out: set[fx.Node] = set()
    todo = [x] if isinstance(x, fx.Node) else []
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(a for a in n.all_input_nodes)
    return out


def _descendants(x: fx.Node) -> set[fx.Node]:
    out: set[fx.Node] = set()
    todo = list(x.users)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        todo.extend(n.users)
    return out


def split_expert_params(params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the other parameters, the ep-sharded expert weights)."""
    rest, experts = [], []
    for p in params:
        (experts if hasattr(p, "_autopar_expert") else rest).append(p)
    return rest, experts


@torch.no_grad()
def sync_expert_grads(experts: list[nn.Parameter]) -> None:
    """Sum expert gradients over the edp group and divide by dp (module docstring)."""
    if not experts:
        return
    epx: ExpertParallel = experts[0]._autopar_expert  # type: ignore[attr-defined]
    grads = [(g.to_local() if isinstance(g, DTensor) else g) for p in experts if (g := p.grad) is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    if dist.get_world_size(epx.edp_group) > 1:
        dist.all_reduce(flat, group=epx.edp_group)
    flat /= epx.dp
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
