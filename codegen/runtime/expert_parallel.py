"""Expert parallelism at run time: routed experts sharded over ``ep`` ranks of the dp axis, tokens moved to them and
back with ``all_to_all_single`` (the program :mod:`autopar.planner.inter_op.expert` costs).

**Groups.**  The dp axis is viewed as ``(dp / ep, ep)``: an *ep group* is ``ep`` consecutive dp indices at the same
(pp, cp, tp) coordinates, and the ranks with the same position in their ep groups form an *expert-data-parallel*
(edp) group.  Both come from one 5-D ``DeviceMesh`` ``(pp, edp, ep, cp, tp)`` laid over the plan's rank order.  The
ranks holding the same experts are the edp group times the cp group (cp ranks hold the same parameters and see other
tokens): the *expert shard group* (:attr:`ExpertParallel.shard_mesh`).

**Graph rewrite.**  In each layer-group ``fx`` module, the grouped expert matmuls (the zoo's
``autopar_zoo::expert_mm`` taking per-expert counts, transformers' ``grouped_mm_fallback`` taking offsets) that
share a counts/offsets input form one region.  The region (its grouped matmuls, the element-wise ops between them
such as SwiGLU, and the views of its stacked weights) is moved into a submodule of the group, ``_autopar_ep<k>``,
which the group calls with the region's inputs.  In it the counts are exchanged (one ``all_to_all_single`` of E
integers), the entry rows (sorted by expert) are dispatched to the ranks owning their experts and regrouped by local
expert, every grouped matmul runs on the local rows with the local weights and counts, and the exit matmul's rows
are sent back (``combine``) into the original order.  Dispatch and combine are differentiable
(``torch.distributed._functional_collectives.all_to_all_single_autograd``), so the backward issues their
transposes: 5 ``all_to_all_single`` per region and micro-batch, as the planner charges.

**Parameters.**  Each stacked expert weight ``[E, out, in]`` is a ``DTensor`` sharded ``Shard(0)`` on the ep mesh:
the rank at ep index ``r`` holds experts ``[r E/ep, (r+1) E/ep)``.  It is registered in the region submodule under
its original path, so its name (with the ``_autopar_ep<k>`` component dropped:
:func:`autopar.codegen.runtime.weights.strip_group`) is the model's; checkpoints store the global tensor in ep
chunks, and a load under another ep (or none) reads what it needs (:mod:`autopar.codegen.checkpoint`).

**Gradients.**  A rank's expert gradient already sums the contributions of its ep group's tokens, so the sum over
the expert shard group covers every token once, and it must be divided by ``dp * cp`` (as the average over dp x cp
does for the other parameters) = ``ep`` x the shard group's size.  The backward therefore scales the local experts'
gradient by ``1/ep`` (where the region reads its weights), and the shard group then *averages* it like any
data-parallel gradient, which also keeps gradients accumulated over several steps right.  ZeRO 0: one flattened
all-reduce over the shard group (:func:`sync_expert_grads`).  ZeRO >= 1: each region submodule is its own FSDP2
unit on the shard group (``fully_shard`` takes the ep DTensors and shards them further, a 2-D (shard, ep) layout as
for FSDP x TP), reduce-scattering with FSDP2's average; the rest of the group is sharded over the whole dp (x cp)
mesh as without ep.
Expert parameters, gradients and optimizer state are thus sharded over the ranks holding the same experts, the
others over all dp ranks: the layout :func:`autopar.planner.inter_op.memory.memory_breakdown` charges
(``expert_elems``, ``ep``).  ZeRO-3 frees the gathered experts after the region's forward and gathers them again
for its backward (the region is one module, so FSDP2's hooks bracket exactly its uses).

Not supported: tp > 1 (the grouped matmuls have no tensor-parallel rule); the search never emits ep > 1 with tp > 1
(:func:`autopar.planner.inter_op.expert.ep_choices`), and such a hand-made plan is refused up front.
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import fx, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from autopar import ir

__all__ = ["ExpertParallel", "REGION_PREFIX", "check_supported", "sync_expert_grads"]

_GMM_NAMES = {"expert_mm": False, "grouped_mm_fallback": True}  # op -> takes offsets (True) or counts (False)
REGION_PREFIX = "_autopar_ep"
"""Name prefix of the region submodules (``_autopar_ep0``...): not part of any parameter's model name."""


def check_supported(plan: ir.Plan) -> None:
    """Refuse, before anything is built, an ep plan this runtime cannot run (the search never emits one)."""
    m = plan.mesh
    if m.ep > 1 and m.tp != 1:
        raise NotImplementedError(f"expert parallelism (ep={m.ep}) runs with tp=1 here (the grouped expert matmuls "
                                  f"have no tensor-parallel rule); the plan has tp={m.tp}: re-plan (the planner "
                                  f"never pairs ep > 1 with tp > 1) or pin --pin ep={m.ep} --pin tp=1")


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
    """This rank's ep and expert shard groups, and the rewrite of a program's stage modules (module docstring)."""

    def __init__(self, plan: ir.Plan, device: torch.device) -> None:
        m = plan.mesh
        self.ep, self.dp, self.cp = m.ep, m.dp, m.cp
        layout = torch.arange(m.world_size).view(m.pp, m.dp // m.ep, m.ep, m.cp, m.tp)
        self.mesh = DeviceMesh(device.type, layout, mesh_dim_names=("pp", "edp", "ep", "cp", "tp"))
        self.ep_mesh = self.mesh["ep"]
        self.group = self.ep_mesh.get_group()
        self.rank = self.ep_mesh.get_local_rank()
        self.shard_mesh = self.mesh["edp"] if m.cp == 1 else self.mesh["edp", "cp"]._flatten("edp_cp")
        """The ranks holding the same experts (edp x cp): their gradient sum, their ZeRO shards."""
        self.regions: list[nn.Module] = []
        self._sharded: dict[int, nn.Parameter] = {}

    @property
    def layout(self) -> tuple[int, int, int, int]:
        """(ep, ep rank, expert shard group size, rank in it): how a full expert tensor is cut for this rank."""
        return self.ep, self.rank, self.shard_mesh.size(), self.shard_mesh.get_local_rank()

    def parameters(self) -> Iterator[nn.Parameter]:
        """The expert parameters (as the region modules hold them now: FSDP replaces them when it shards)."""
        seen: set[int] = set()
        for r in self.regions:
            for p in r.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p

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
        """Move every group module's expert regions into ep submodules with ep-sharded (meta) weights; returns the
        regions rewritten.  Run on the program's meta stages, before ``fully_shard`` and the weights' loading."""
        done = 0
        for root in modules:
            for gm in [m for m in root.modules() if isinstance(m, fx.GraphModule)]:
                done += self._rewrite(gm)
        return done

    def fully_shard(self, zero: int, policy: object) -> None:
        """ZeRO >= 1: each region its own FSDP2 unit on the expert shard group, which averages the (1/ep-scaled)
        gradients over it (module docstring).  Call before the enclosing groups are sharded."""
        from torch.distributed.fsdp import fully_shard

        for r in self.regions:
            fully_shard(r, mesh=self.shard_mesh, reshard_after_forward=zero >= 3, mp_policy=policy)

    def _shard_param(self, full: nn.Parameter) -> nn.Parameter:
        """The ep-sharded ``Shard(0)`` DTensor parameter of a stacked expert weight (meta, filled after loading)."""
        if id(full) in self._sharded:
            return self._sharded[id(full)]
        if full.shape[0] % self.ep:
            raise ValueError(f"{full.shape[0]} experts do not divide over ep={self.ep}")
        local = torch.empty((full.shape[0] // self.ep, *full.shape[1:]), dtype=full.dtype, device="meta")
        dt = DTensor.from_local(local, self.ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                stride=full.stride())
        p = nn.Parameter(dt, requires_grad=full.requires_grad)
        self._sharded[id(full)] = p
        return p

    def _rewrite(self, gm: fx.GraphModule) -> int:
        regions: dict[fx.Node, list[fx.Node]] = {}
        for n in gm.graph.nodes:
            if _gmm_kind(n) is not None:
                regions.setdefault(n.args[2], []).append(n)  # type: ignore[arg-type]
        for k, (counts, nodes) in enumerate(regions.items()):
            self._extract(gm, counts, nodes, f"{REGION_PREFIX}{k}")
        if regions:
            gm.graph.lint()
            gm.recompile()
        return len(regions)

    def _extract(self, gm: fx.GraphModule, counts: fx.Node, gmms: list[fx.Node], name: str) -> None:
        """Replace one region of ``gm`` by a call of a new submodule ``name`` that runs it under ep."""
        g = gm.graph
        order = {n: i for i, n in enumerate(g.nodes)}
        members = set(gmms)
        offsets = bool(_gmm_kind(gmms[0]))
        inside = set(members)
        down: set[fx.Node] = set()
        up: set[fx.Node] = set()
        for n in gmms:
            down |= _descendants(n)
            up |= _ancestors(n)
            inside |= _weight_chain(n.args[1])
        inside |= down & up  # between the grouped matmuls (SwiGLU...)
        nodes = sorted(inside, key=order.__getitem__)
        ext = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        outs = [n for n in nodes if any(u not in inside for u in n.users)]
        exits = {n for n in gmms if not (_descendants(n) & (members - {n}))}
        users = [u for o in outs for u in o.users if u not in inside]
        first = min(users, key=order.__getitem__)
        if counts not in ext or any(order[a] >= order[first] for a in ext) or any(o.op == "get_attr" for o in outs):
            raise NotImplementedError(f"cannot move the expert region of {[n.name for n in gmms]} into one module")
        # the region's own graph: inputs -> route, dispatch, local grouped matmuls, combine -> outputs
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {a: sub.placeholder(a.name) for a in ext}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # fx warns that the attribute is no parameter, buffer or module
            epx = sub.get_attr("_autopar_ep")
        route = sub.call_function(_ep_route, (epx, env[counts], offsets))
        dispatched: dict[fx.Node, fx.Node] = {}
        holder = nn.Module()
        for n in nodes:
            if n.op == "get_attr":
                _holder_param(holder, str(n.target), self._shard_param(_pop_param(gm, str(n.target))))
            if n in members:
                x = n.args[0]
                xe = env[x]  # type: ignore[index]
                if not (_ancestors(x) & members):  # an entry: rows still in this rank's sorted order
                    if x not in dispatched:
                        dispatched[x] = sub.call_function(_ep_dispatch, (epx, xe, route))  # type: ignore[arg-type]
                    xe = dispatched[x]  # type: ignore[index]
                local_c = sub.call_function(_ep_local_counts, (route, offsets, env[counts]))
                w_local = sub.call_function(_ep_local, (epx, env[n.args[1]]))  # type: ignore[index]
                c = sub.node_copy(n, lambda a: env[a])
                c.args = (xe, w_local, local_c, *c.args[3:])
            else:
                c = sub.node_copy(n, lambda a: env[a])
            env[n] = c
        sub.output(tuple(sub.call_function(_ep_combine, (epx, env[o], route)) if o in exits else env[o]
                         for o in outs))
        holder._autopar_ep = self  # the region's graph reads this object with get_attr
        region = fx.GraphModule(holder, sub, "ExpertRegion")
        gm.add_submodule(name, region)
        self.regions.append(region)
        with g.inserting_before(first):
            call = g.call_module(name, tuple(ext))
            got = [g.call_function(operator.getitem, (call, i)) for i in range(len(outs))]
        for o, v in zip(outs, got):
            o.replace_all_uses_with(v, delete_user_cb=lambda u: u not in inside)
        for n in reversed(nodes):
            g.erase_node(n)


def _holder_param(root: nn.Module, target: str, p: nn.Parameter) -> None:
    """Register ``p`` in ``root`` under the dotted path ``target`` (creating plain modules on the way)."""
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if part not in mod._modules:
            mod._modules[part] = nn.Module()
        mod = mod._modules[part]  # type: ignore[assignment]
    mod._parameters[leaf] = p


def _pop_param(gm: fx.GraphModule, target: str) -> nn.Parameter:
    """Remove the parameter at ``target`` from ``gm`` (it moves into a region) and return it."""
    owner_path, _, attr = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    p = owner._parameters.pop(attr, None)
    if p is None:
        raise TypeError(f"the expert weight {target} is no parameter of its group module")
    return p


def _weight_chain(w: object) -> set[fx.Node]:
    """The ``get_attr`` a grouped matmul's weight reads and the views (a transpose) on the way."""
    out: set[fx.Node] = set()
    node = w
    while isinstance(node, fx.Node) and node.op != "get_attr":
        out.add(node)
        node = node.args[0] if node.args else None
    if not isinstance(node, fx.Node):
        raise TypeError(f"cannot find the expert weight behind {w}")
    out.add(node)
    return out


def _ep_route(epx: ExpertParallel, counts: torch.Tensor, offsets: bool) -> _Route:
    return epx.route(counts, offsets)


def _ep_dispatch(epx: ExpertParallel, x: torch.Tensor, r: _Route) -> torch.Tensor:
    return epx.dispatch(x, r)


def _ep_combine(epx: ExpertParallel, y: torch.Tensor, r: _Route) -> torch.Tensor:
    return epx.combine(y, r)


def _ep_local_counts(r: _Route, offsets: bool, like: torch.Tensor) -> torch.Tensor:
    return ExpertParallel.local_counts(r, offsets, like)


def _ep_local(epx: ExpertParallel, w: torch.Tensor) -> torch.Tensor:
    """The local experts' weights; their gradient is scaled by 1/ep on the way back (module docstring)."""
    return _ScaleGrad.apply(w.to_local() if isinstance(w, DTensor) else w, 1.0 / epx.ep)


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        ctx.scale = scale  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None  # type: ignore[attr-defined]


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


@torch.no_grad()
def sync_expert_grads(epx: ExpertParallel) -> None:
    """ZeRO 0: average the (1/ep-scaled) expert gradients over the expert shard group (module docstring)."""
    grads = [(g.to_local() if isinstance(g, DTensor) else g) for p in epx.parameters() if (g := p.grad) is not None]
    if not grads or epx.shard_mesh.size() == 1:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=epx.shard_mesh.get_group())
    flat /= epx.shard_mesh.size()
    off = 0
    for g in grads:
        g.copy_(flat[off:off + g.numel()].view_as(g))
        off += g.numel()
