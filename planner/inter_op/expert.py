"""Expert parallelism (``ep``): which layer groups hold routed experts, and what sharding them over ``ep`` ranks of
the data-parallel axis costs and saves.

**Where the experts are.**  A sparse MoE block appears in the IR as grouped matmuls (``grouped_mm``: the zoo's
``expert_mm``, transformers' ``grouped_mm_fallback``, torch's ``_grouped_mm``) whose weight is a stacked
``[E, out, in]`` parameter (through views).  The grouped matmuls of one block share their per-expert counts (or
offsets) input: one *region*, whose first input rows are the dispatched (token, expert) pairs ``S = T * k``.

**What ep changes** (experts sharded over ``ep`` ranks that share data parallelism; DeepSpeed-MoE, Rajbhandari et
al. 2022; GShard, Lepikhin et al. 2021), per layer group and micro-batch, on an ep-scaled copy of the intra-op
:class:`~autopar.planner.inter_op.screen.LayerTable`:

* parameters: a rank holds ``1/ep`` of each expert tensor (``E/ep`` whole experts); the dense part is unchanged.
  Under ZeRO the expert state is sharded over the ``dp/ep`` ranks holding the same experts
  (:func:`autopar.planner.inter_op.memory.memory_breakdown`'s ``expert_elems``/``ep``), so it costs
  ``expert/dp`` per rank as without ep, while the gathered (ZeRO-1/2) or replicated (ZeRO-0) copy shrinks by ep.
  The gradient reduction of the local expert shard is charged on the dp group with the table's (ep-reduced)
  bytes: slightly pessimistic (the real group, dp/ep ranks, is smaller);
* communication: each region's dispatch and combine are one ``all_to_all`` each of ``S x h`` elements per rank,
  forward (after one of the E per-expert counts), and two more backward (their transposes), on the ep group (``ep`` consecutive dp indices: ranks
  ``cp * tp`` apart), charged with the collective model (``CostModel.collective_time("all_to_all")``) and not
  overlapped (the runtime issues them on the critical path);
* load imbalance: with expected per-expert load shares ``w_e`` (uniform unless measured, e.g. by
  :func:`autopar.zoo.routing_histogram`), the busiest ep rank (experts dealt out in contiguous blocks of ``E/ep``)
  receives ``ep * max_r sum_{e in r} w_e`` times the mean, and every rank waits for it: the experts' matmul time and
  the dispatch bytes are scaled by that factor (1 for uniform load);
* tensor parallelism: none.  ``ep > 1`` is searched with ``tp = 1`` only (:func:`ep_choices`): the grouped matmuls
  have no tensor-parallel rule, and the runtime runs every ep plan the search emits (ZeRO 0-3, pp, cp) but not ep
  with tp (:mod:`autopar.codegen.runtime.expert_parallel`);
* memory: the received rows of each region (``S x h``, times the imbalance) and the combine's input are kept for
  backward: ``2 S h`` elements per region on top of the traced activations.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from autopar.ir.graph import DTYPE_BYTES, Graph, Node
from autopar.planner.inter_op.screen import LayerTable
from autopar.profiles.cost import CostModel

__all__ = ["EpCost", "EpLayerTable", "MoERegion", "ep_choices", "ep_cost", "ep_table", "expert_elems", "imbalance",
           "moe_regions", "rank_expert_elems"]


@dataclass(frozen=True, slots=True)
class MoERegion:
    """One MoE block's routed experts, at the traced batch."""

    group: int
    """Layer group index."""
    experts: int
    """Routed experts E (leading dim of the stacked weights)."""
    params: tuple[str, ...]
    """FQNs of the stacked expert weights."""
    elems: int
    """Their elements (all experts)."""
    rows: int
    """Dispatched (token, expert) rows S."""
    width: int
    """Elements per dispatched row (the hidden size h)."""
    flops_fwd: float
    """Forward FLOPs of the grouped matmuls."""
    gemms: tuple[float, ...] = ()
    """Forward FLOPs of each grouped matmul."""


def _param_of(graph: Graph, name: str, by_name: dict[str, Node]) -> str | None:
    """The parameter ``name`` reads, through views (``transpose`` of a stacked weight)."""
    for _ in range(8):
        if name in graph.param_map:
            return name
        node = by_name.get(name)
        if node is None or node.kind != "view" or not node.inputs:
            return None
        name = node.inputs[0]
    return None


_REGIONS: dict[int, tuple[Graph, tuple[MoERegion, ...]]] = {}


def moe_regions(graph: Graph) -> tuple[MoERegion, ...]:
    """Every MoE region of ``graph`` (memoized per graph), in graph order."""
    got = _REGIONS.get(id(graph))
    if got is not None and got[0] is graph:
        return got[1]
    by_name = {n.name: n for n in graph.nodes}
    group_of = {}
    for g in graph.layers:
        for n in graph.nodes[g.start:g.end]:
            group_of[n.name] = g.index
    regions: dict[str, list[Node]] = {}
    for n in graph.nodes:
        if n.op == "grouped_mm" and len(n.inputs) >= 3:
            regions.setdefault(n.inputs[2], []).append(n)
    out = []
    for nodes in regions.values():
        params = tuple(dict.fromkeys(p for n in nodes if (p := _param_of(graph, n.inputs[1], by_name))))
        if not params:
            continue
        metas = [graph.param_map[p].meta for p in params]
        first = nodes[0]
        src = by_name.get(first.inputs[0])
        rows = first.out.shape[0]
        width = src.out.shape[-1] if src is not None and src.outputs else first.out.shape[-1]
        out.append(MoERegion(group=group_of.get(first.name, 0), experts=metas[0].shape[0], params=params,
                             elems=sum(m.numel for m in metas), rows=rows, width=width,
                             flops_fwd=sum(n.flops_fwd for n in nodes),
                             gemms=tuple(n.flops_fwd for n in nodes)))
    if len(_REGIONS) >= 8:
        _REGIONS.clear()
    _REGIONS[id(graph)] = (graph, tuple(out))
    return tuple(out)


def ep_choices(graph: Graph, dp: int, pinned: int | None = None, tp: int = 1) -> list[int]:
    """ep degrees to try with ``dp`` replicas: divisors of dp that divide every region's expert count (1 for a
    model without routed experts, or with ``tp`` > 1: the runtime has no tensor-parallel rule for the grouped
    matmuls, :func:`autopar.codegen.runtime.expert_parallel.check_supported`); ``pinned`` alone when it qualifies
    (else none)."""
    regions = moe_regions(graph)
    if not regions or tp > 1:
        return [1] if pinned in (None, 1) else []
    ok = [d for d in range(1, dp + 1) if dp % d == 0 and all(r.experts % d == 0 for r in regions)]
    if pinned is not None:
        return [pinned] if pinned in ok else []
    return ok


def imbalance(load: Sequence[float] | None, experts: int, ep: int) -> float:
    """``ep * max_r (share of the pairs routed to rank r's experts)``: 1 for uniform load or ep = 1."""
    if ep == 1 or not load:
        return 1.0
    if len(load) != experts:
        raise ValueError(f"expert_load has {len(load)} entries but the model has {experts} experts per block")
    total = float(sum(load))
    per = experts // ep
    return ep * max(sum(load[r * per:(r + 1) * per]) for r in range(ep)) / total


@dataclass(frozen=True, slots=True)
class EpCost:
    """What ep adds per micro-batch (per rank, all regions), for reports."""

    a2a_fwd_s: float
    a2a_bwd_s: float
    a2a_bytes: float
    """Bytes one rank sends per all_to_all of one region (dispatch; the combine sends the same)."""
    calls: int
    """all_to_all calls per micro-batch, forward and backward: per region the counts, dispatch and combine forward,
    their transposes backward."""
    imbalance: float


def ep_cost(graph: Graph, cost: CostModel, *, ep: int, tp: int, cp: int, micro_batch: int, dtype: str,
            load: Sequence[float] | None = None) -> tuple[dict[int, tuple[float, float, float, float]], EpCost]:
    """Per layer group ``(extra fwd s, extra bwd s, local expert elems saved, extra activation bytes)`` and the
    totals, for ``ep`` at ``micro_batch`` (see the module docstring)."""
    regions = moe_regions(graph)
    scale = micro_batch / graph.batch
    item = DTYPE_BYTES.get(dtype, 4)
    span = cost.span(ep, cp * tp)
    sustained = cost.profile.device.sustained_fraction
    per_group: dict[int, tuple[float, float, float, float]] = {}
    fwd_tot = bwd_tot = 0.0
    calls = 0
    nbytes = 0.0
    imb = 1.0
    for r in regions:
        imb = imbalance(load, r.experts, ep)
        nbytes = r.rows * r.width * item * scale / cp * imb
        a2a = cost.collective_time("all_to_all", nbytes, span=span) if ep > 1 else 0.0
        # the per-expert counts go first (E int64 per rank), so every rank can size what it receives
        counts = cost.collective_time("all_to_all", 8.0 * r.experts, span=span) if ep > 1 else 0.0
        f, b = (counts + 2 * a2a, 2 * a2a) if ep > 1 else (0.0, 0.0)
        for flops in (x * scale / cp for x in r.gemms):
            # a grouped matmul is E/ep GEMMs of ep/E of its rows each: costed at that size's efficiency (the intra-op
            # coster charged the whole op's), and the busiest rank's share
            t = flops / cost.compute_rate(dtype, "matmul", flops * ep / r.experts) / sustained * imb
            charged = flops / cost.compute_rate(dtype, "matmul", flops) / sustained
            f, b = f + t - charged, b + 2 * (t - charged)
        saved = r.elems * (1.0 - 1.0 / ep)  # grouped matmuls (and their weights) are replicated over tp
        act = 2.0 * nbytes if ep > 1 else 0.0
        old = per_group.get(r.group, (0.0, 0.0, 0.0, 0.0))
        per_group[r.group] = (old[0] + f, old[1] + b, old[2] + saved, old[3] + act)
        fwd_tot, bwd_tot, calls = fwd_tot + counts + 2 * a2a, bwd_tot + 2 * a2a, calls + (5 if ep > 1 else 0)
    return per_group, EpCost(a2a_fwd_s=fwd_tot, a2a_bwd_s=bwd_tot, a2a_bytes=nbytes, calls=calls, imbalance=imb)


def expert_elems(graph: Graph, ep: int) -> tuple[float, ...]:
    """Local elements of routed-expert weights per layer group under ``ep`` (0 where none)."""
    out = [0.0] * len(graph.layers)
    for r in moe_regions(graph):
        out[r.group] += r.elems / ep  # replicated over tp (no sharding rule for grouped matmuls)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class EpLayerTable(LayerTable):
    """A :class:`LayerTable` under expert parallelism (:func:`ep_table`)."""

    expert_params: tuple[float, ...] = ()
    """Local elements of routed-expert weights per group (included in ``params``); ZeRO shards their state over
    ``dp / ep`` ranks."""
    ep: int = 1


def rank_expert_elems(table: LayerTable, chunks: Sequence[tuple[int, int]]) -> float:
    """Local expert elements of the groups in ``chunks`` (0 for a table without ep)."""
    ex = getattr(table, "expert_params", ())
    return float(sum(sum(ex[a:b]) for a, b in chunks)) if ex else 0.0


def ep_table(table: LayerTable, graph: Graph, cost: CostModel, *, ep: int, cp: int = 1, dtype: str,
             load: Sequence[float] | None = None) -> LayerTable:
    """The intra-op table of ``(tp, micro_batch)`` as it is under ``ep``: expert parameters sharded, all_to_all and
    imbalance added to the MoE groups' forward/backward (and to a full recompute's forward), dispatch buffers to
    their saved activations, and ``expert_params`` set.  ``table`` itself for a model without experts."""
    if not moe_regions(graph):
        return table
    tp, mb = table.tp, table.micro_batch
    per_group = ep_cost(graph, cost, ep=ep, tp=tp, cp=cp, micro_batch=mb, dtype=dtype, load=load)[0]
    add = [per_group.get(i, (0.0, 0.0, 0.0, 0.0)) for i in range(len(table.fwd))]

    def plus(xs: tuple[float, ...], k: int) -> tuple[float, ...]:
        return tuple(x + a[k] for x, a in zip(xs, add))

    fields = {f.name: getattr(table, f.name) for f in dataclasses.fields(LayerTable)}
    fields.update(
        fwd=plus(table.fwd, 0), bwd=plus(table.bwd, 1),
        recompute_fwd={k: plus(v, 0) if k == "full" else v for k, v in table.recompute_fwd.items()},
        act={k: v if k == "full" else plus(v, 3) for k, v in table.act.items()}, act_none=plus(table.act_none, 3),
        params=tuple(p - a[2] for p, a in zip(table.params, add)),
        largest_tensor=tuple(lt if a[2] == 0 else lt / ep for lt, a in zip(table.largest_tensor, add)))
    return EpLayerTable(**fields, expert_params=expert_elems(graph, ep), ep=ep)


def ep_groups(mesh: object) -> list[list[int]]:
    """The ep groups of a mesh (an ``ir.MeshPlan``): ``ep`` consecutive dp indices at the same (pp, cp, tp)."""
    m = mesh
    out = []
    for pp in range(m.pp):  # type: ignore[attr-defined]
        for cp in range(m.cp):  # type: ignore[attr-defined]
            for tp in range(m.tp):  # type: ignore[attr-defined]
                for d0 in range(0, m.dp, m.ep):  # type: ignore[attr-defined]
                    out.append([m.rank(pp=pp, dp=d, cp=cp, tp=tp) for d in range(d0, d0 + m.ep)])  # type: ignore
    return out


EP_NOTE = "expert parallel"


def ep_note(graph: Graph, cost: CostModel, *, mesh: object, micro_batch: int, num_microbatches: int, dtype: str,
            load: Sequence[float] | None = None) -> str:
    """One line for a plan with ep > 1: the groups, the all_to_all calls and bytes and their cost per micro-batch
    and per iteration (included in the stages' forward/backward times), the imbalance, the expert memory saved."""
    m = mesh
    ep, tp, cp = m.ep, m.tp, m.cp  # type: ignore[attr-defined]
    regions = moe_regions(graph)
    _, c = ep_cost(graph, cost, ep=ep, tp=tp, cp=cp, micro_batch=micro_batch, dtype=dtype, load=load)
    groups = ep_groups(m)
    first = groups[0]
    per_it = (c.a2a_fwd_s + c.a2a_bwd_s) * num_microbatches
    experts = regions[0].experts if regions else 0
    return (f"{EP_NOTE}: ep={ep}, {experts // ep} of {experts} experts per rank; {len(groups)} ep groups of ranks "
            f"{m.rank(dp=1) - m.rank(dp=0)} apart (first: {', '.join(map(str, first))}); all_to_all dispatch + "  # type: ignore
            f"combine: {c.calls} calls of {c.a2a_bytes / 2**20:.1f} MiB per rank per micro-batch "
            f"({len(regions)} MoE blocks), {c.a2a_fwd_s * 1e3:.3g} ms fwd + {c.a2a_bwd_s * 1e3:.3g} ms bwd per "
            f"micro-batch, {per_it * 1e3:.3g} ms per iteration (in the stage times, not overlapped); load "
            f"imbalance x{c.imbalance:.2f}")
