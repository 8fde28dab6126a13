"""Planning on a heterogeneous cluster: a pipeline split across device types, or one device type alone.

A :class:`~autopar.profiles.hetero.HeteroProfile` holds node groups of different device types.  The search compares

* **one group alone**: the ordinary search (:func:`autopar.planner.search.search`) on each group's own profile, and
* **a pipeline across the groups**: every group takes whole pipeline ranks.  The mesh ``(dp, tp)`` is the same
  everywhere (one DeviceMesh, one sharding of every layer), so group ``g`` holds ``pp_g = devices_g / (dp * tp)``
  pipeline ranks, in the profile's group order (or another order of the groups: the plan records it), and
  ``pp = sum pp_g``.  Each stage is costed with its own device type's intra-op table and memory-checked against that
  type's capacity (:func:`autopar.planner.inter_op.partition.partition_stages_hetero`), so a faster device's stages
  get more layers and a smaller memory fewer; the transfer between the last stage of one group and the first of the
  next uses the profile's inter-group link.  The intra-op solver runs per device type; a ``(tp, micro-batch)`` whose
  fastest sharding differs between the types is not split (a plan has one sharding).

Candidates are screened in closed form like the homogeneous ones (greedy per-device partition, the same pipeline
formula, each rank's data-parallel communication and memory on its own type), the best evaluated exactly
(memory-aware DP partition, event-driven schedule simulation), and the fastest plan of either kind is returned.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, replace

from autopar.ir.graph import DTYPE_BYTES, Graph
from autopar.ir.plan import DeviceGroup, Plan
from autopar.planner.inter_op.evaluate import (
    _op_shardings,
    assemble_plan,
    evaluate_stages,
    param_patterns,
)
from autopar.planner.inter_op.memory import memory_breakdown, model_state_bytes
from autopar.planner.inter_op.partition import minmax_partition_hetero, partition_stages_hetero, rank_chunks
from autopar.planner.inter_op.screen import (
    ADAM_STEP_BYTES,
    Candidate,
    LayerTable,
    Screened,
    divisors,
    dp_time,
    in_flight,
    reserve_for,
)
from autopar.planner.options import PlanOptions
from autopar.planner.search import (
    PlanInfeasibleError,
    SearchResult,
    _mb_choices,
    _model_notes,
    _pin,
    _schedules,
    _Tables,
    search,
)
from autopar.profiles.cost import CostModel
from autopar.profiles.hetero import HeteroProfile, NodeGroup

__all__ = ["best_by_kind", "search_hetero", "tag_group"]

log = logging.getLogger(__name__)
_EXACT = 16  # screened split candidates evaluated exactly


@dataclass(frozen=True)
class _Split:
    """One pipeline split: the groups in rank order and each pipeline rank's group index (into ``groups``)."""

    groups: tuple[NodeGroup, ...]
    rank_group: tuple[int, ...]
    tables: tuple[LayerTable, ...]
    costs: tuple[CostModel, ...]


def tag_group(plan: Plan, group: NodeGroup, cluster: str) -> Plan:
    """A plan made on one group alone, recorded as a plan on that group of the heterogeneous ``cluster``."""
    dg = DeviceGroup(name=group.name, device=group.profile.device.name, nodes=group.nodes)
    stages = tuple(replace(s, device_group=group.name) for s in plan.stages)
    return replace(plan, cluster=cluster, stages=stages, device_groups=(dg,),
                   notes=(*plan.notes, f"runs on group {group.name} alone ({group.nodes} nodes of "
                                       f"{group.profile.device.name})"))


def _same_sharding(graph: Graph, tables: list[LayerTable]) -> bool:
    first = tables[0]
    pats, ops = param_patterns(graph, first), [(o.node, o.strategy, o.inputs, o.output)
                                                for o in _op_shardings(graph, first)]
    return all(param_patterns(graph, t) == pats and
               [(o.node, o.strategy, o.inputs, o.output) for o in _op_shardings(graph, t)] == ops
               for t in tables[1:])


def _link(split: _Split, profile: HeteroProfile, k: int, pp: int, nbytes: float) -> float:
    """Transfer after virtual stage ``k``: the inter-group link between groups, else the group's own link (intra-node
    only when the whole group is one node, as the homogeneous search judges a mesh inside one node)."""
    a, b = split.rank_group[k % pp], split.rank_group[(k + 1) % pp]
    if a != b:
        return profile.p2p_time(nbytes)
    cost = split.costs[a]
    return cost.p2p_time(nbytes, intra_node=cost.profile.nodes == 1)


def _rows(split: _Split, rc: str, pp: int, v: int, options: PlanOptions, memo: dict
          ) -> tuple[list[tuple[int, int]], list[tuple], list[list[int]]] | None:
    """(chunks, per rank (group, time, params, activations, full-recompute extra, largest unit, forward, units,
    tensors), ranks with equal rows): what does not depend on the rest of the candidate, memoized."""
    key = (id(split), rc, pp, v)
    if key in memo:
        return memo[key]
    stage_group = [split.rank_group[k % pp] for k in range(pp * v)]
    chunks = minmax_partition_hetero([t.time(rc) for t in split.tables], stage_group)
    if chunks is None:
        memo[key] = None
        return None
    n, per_tensor = len(split.tables[0].fwd), options.dp_collectives == "tensor"
    rows = []
    for r in range(pp):
        g = split.rank_group[r]
        table, mine = split.tables[g], rank_chunks(chunks, pp, r)
        times = table.time(rc)
        params = sum(sum(table.params[a:b]) for a, b in mine)
        if any(a == 0 for a, _ in mine) and any(b == n for _, b in mine):
            params -= table.shared_params
        rows.append((g, sum(sum(times[a:b]) for a, b in mine), params,
                     sum(sum(table.act[rc][a:b]) for a, b in mine),
                     max(max(table.act_none[a:b]) for a, b in mine) if rc == "full" else 0.0,
                     max(max((table.largest_tensor if per_tensor else table.params)[a:b]) for a, b in mine),
                     sum(sum(table.fwd[a:b]) for a, b in mine), sum(b - a for a, b in mine),
                     sum(sum(table.tensors[a:b]) for a, b in mine) if per_tensor else 0))
    alike: dict[tuple, list[int]] = {}
    for r, row in enumerate(rows):
        alike.setdefault(row, []).append(r)
    memo[key] = (chunks, rows, list(alike.values()))
    return memo[key]


def _screen(c: Candidate, split: _Split, profile: HeteroProfile, options: PlanOptions, memo: dict) -> Screened | None:
    """Closed-form time and memory of a split candidate (the homogeneous screen's formulas, per device type); ranks
    with equal rows differ only in their in-flight micro-batches, so each such set is costed once."""
    pp, v, m, rc = c.pp, c.virtual_stages, c.num_microbatches, c.recompute
    got = _rows(split, rc, pp, v, options, memo)
    if got is None:
        return None
    chunks, rows, alike = got
    flights = in_flight(c.schedule, pp, m, v)
    mixed, worst_end, peak, fits = options.dtype != "float32", 0.0, 0.0, True
    for ranks in alike:
        g, t, params, acts, extra, largest, fwd, units, tensors = rows[ranks[0]]
        cost = split.costs[g]
        cap = cost.profile.device.memory_bytes
        mem = memory_breakdown(param_elems=params, zero=c.zero, dp=c.dp, mixed_precision=mixed,
                               activations=acts * max(flights[r] for r in ranks) + extra, capacity=cap,
                               largest_layer_elems=largest, reduce_bytes=DTYPE_BYTES.get(options.reduce_dtype, 4),
                               reserve=reserve_for(cost)).total
        peak, fits = max(peak, mem / cap), fits and mem <= cap
        comm = dp_time(cost, params=params, units=units, fwd_s=fwd, bwd_s=t - fwd, m=m, dp=c.dp, tp=c.tp,
                       zero=c.zero, dtype=options.dtype, reduce_dtype=options.reduce_dtype,
                       overlap=options.overlap_grad_sync, recompute=rc, tensors=tensors)
        opt = params * ADAM_STEP_BYTES / (c.dp if c.zero >= 1 else 1) / cost.profile.device.memory_bandwidth
        worst_end = max(worst_end, comm.total_s + opt)
    busiest, stage_sum = max(row[1] for row in rows), sum(row[1] for row in rows)
    p2p = max((_link(split, profile, k, pp, split.tables[0].out_bytes[b - 1]) for k, (_, b) in
               enumerate(chunks[:-1])), default=0.0)
    pipe = m * busiest + (pp - 1) * busiest / v if c.schedule == "interleaved_1f1b" else (m - 1) * busiest + stage_sum
    return Screened(c, pipe + 2 * (pp * v - 1) * p2p + worst_end, peak, fits, tuple(chunks))


def _build(graph: Graph, profile: HeteroProfile, options: PlanOptions, s: Screened, split: _Split) -> Plan | None:
    """The exact plan of a screened split candidate (per-device stage partition, simulation), or None."""
    c = s.cand
    mixed = options.dtype != "float32"
    flights = in_flight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)
    reserves = [reserve_for(cost) for cost in split.costs]
    part = partition_stages_hetero(
        [t.time(c.recompute) for t in split.tables],
        [[sum(model_state_bytes(p, zero=c.zero, dp=c.dp, mixed_precision=mixed)) for p in t.params]
         for t in split.tables],
        [[a * (1 + res.fragmentation) for a in t.act[c.recompute]] for t, res in zip(split.tables, reserves)],
        list(split.tables[0].out_bytes), pp=c.pp, rank_group=split.rank_group,
        capacity=[max(cost.profile.device.memory_bytes - res.fixed_bytes, 1.0)
                  for cost, res in zip(split.costs, reserves)],
        virtual_stages=c.virtual_stages, p2p=lambda nbytes, k: _link(split, profile, k, c.pp, nbytes),
        in_flight=lambda k: flights[k % c.pp])
    per_rank = [(split.tables[g], split.costs[g]) for g in split.rank_group]

    def run(chunks: list[tuple[int, int]]):  # noqa: ANN202
        p2p = [_link(split, profile, k, c.pp, split.tables[0].out_bytes[b - 1]) for k, (_, b) in
               enumerate(chunks[:-1])]
        return evaluate_stages(split.tables[0], s, split.costs[0], options, chunks, False, per_rank=per_rank,
                               p2p_s=p2p)

    chunks = list(part.boundaries) if part.feasible else list(s.chunks)
    got = run(chunks)
    if got is None and part.feasible and list(s.chunks) != chunks:
        chunks = list(s.chunks)
        got = run(chunks)
    if got is None:
        return None
    dpn = split.groups[0].profile.devices_per_node
    peaks = [cost.profile.device.peak_flops.get(options.dtype) or max(cost.profile.device.peak_flops.values())
             for cost in split.costs]
    world = [g.world_size for g in split.groups]
    mean_peak = sum(p * w for p, w in zip(peaks, world)) / sum(world)
    groups = tuple(DeviceGroup(name=g.name, device=g.profile.device.name, nodes=g.nodes) for g in split.groups)
    names = [split.groups[g].name for g in split.rank_group]
    plan = assemble_plan(graph, options, s, split.tables[0], chunks, got, cluster=profile.name, nodes=profile.nodes,
                         dpn=dpn, peak_flops=mean_peak, rank_tables=[t for t, _ in per_rank], device_groups=groups,
                         rank_groups=names)
    where = ", ".join(f"{g.name}: {sum(st.layer_end - st.layer_start for st in plan.stages if st.device_group == g.name)}"  # noqa: E501
                      f" layer groups on {names.count(g.name)} pipeline ranks" for g in split.groups)
    return replace(plan, notes=(*plan.notes, f"pipeline split across device types ({where})"))


def _splits(graph: Graph, profile: HeteroProfile, options: PlanOptions, tables: dict[str, _Tables]
            ) -> list[tuple[Candidate, _Split]]:
    """Every split candidate: group order x (dp, tp) x micro-batch x schedule x recompute x ZeRO x sharding."""
    dpn = profile.devices_per_node
    n_layers = len(graph.layers)
    if dpn is None or len(profile.groups) < 2 or any(_pin(options, k) is not None for k in ("pp", "cp", "ep")):
        return []  # a split needs one node size; pinned pp/cp/ep: plan each group alone
    common = divisors(min(g.world_size for g in profile.groups))
    out: list[tuple[Candidate, _Split]] = []
    splits: dict[tuple, _Split | None] = {}
    orders = list(itertools.permutations(profile.groups)) if len(profile.groups) <= 3 else [profile.groups]
    limit = options.max_tp or 2 * dpn
    for order in orders:
        for tp in [d for d in common if d <= limit and (d & (d - 1) == 0 or d == dpn)]:
            if (t := _pin(options, "tp")) is not None and tp != int(t):
                continue
            for dp in common:
                if any(g.world_size % (dp * tp) for g in order) or options.global_batch % dp:
                    continue
                if (pd := _pin(options, "dp")) is not None and dp != int(pd):
                    continue
                rank_group = tuple(i for i, g in enumerate(order) for _ in range(g.world_size // (dp * tp)))
                pp = len(rank_group)
                if pp > n_layers:
                    continue
                per_replica = options.global_batch // dp
                for mb in _mb_choices(per_replica, graph.batch, options):
                    m = per_replica // mb
                    for lean in (False, True):
                        key = (tuple(g.name for g in order), tp, mb, lean, rank_group)
                        if key not in splits:
                            tabs = [dict(tables[g.name].variants(tp, mb)).get(lean) for g in order]
                            ok = all(t is not None for t in tabs) and _same_sharding(graph, tabs)  # type: ignore
                            splits[key] = _Split(tuple(order), rank_group, tuple(tabs),  # type: ignore[arg-type]
                                                 tuple(tables[g.name].cost for g in order)) if ok else None
                        split = splits[key]
                        if split is None:
                            continue
                        for sched, v in _schedules(pp, m, n_layers, options):
                            for rc in options.recompute_modes:
                                if (pr := _pin(options, "recompute")) is not None and rc != pr:
                                    continue
                                for zero in options.zero_levels:
                                    if ((pz := _pin(options, "zero")) is not None and zero != pz) or (
                                            zero and dp == 1 and pz is None):
                                        continue
                                    out.append((Candidate(pp, dp, tp, mb, m, sched, v, zero, rc, lean), split))
    return out


def best_by_kind(graph: Graph, profile: HeteroProfile, options: PlanOptions, progress=None  # noqa: ANN001
                 ) -> tuple[dict[str, list[Plan]], int]:
    """Plans by kind, fastest first: each group's name -> its plans alone (tagged with the group), ``"split"`` -> the
    pipelines across groups; and how many candidates were screened."""
    out: dict[str, list[Plan]] = {}
    screened = 0
    memos: dict[str, dict] = {g.name: {} for g in profile.groups}  # each group's intra-op tables, reused for splits
    for g in profile.groups:
        try:
            res = search(graph, g.profile, options, memo=memos[g.name])
        except PlanInfeasibleError as e:
            log.info("group %s alone: %s", g.name, e)
            continue
        screened += res.screened
        out[g.name] = [tag_group(p, g, profile.name) for p in (res.best, *res.alternatives)]
        if progress:
            progress(f"group {g.name} alone: {res.best.samples_per_s:.4g} samples/s", 0.5)
    tables = {g.name: next(iter(memos[g.name].values()), None) or _Tables(graph, CostModel(g.profile), options)
              for g in profile.groups}
    memo: dict = {}
    found = []
    for cand, split in _splits(graph, profile, options, tables):
        sc = _screen(cand, split, profile, options, memo)
        screened += 1
        if sc is not None and sc.fits:
            found.append((sc, split))
    found.sort(key=lambda x: (x[0].time_s, x[0].peak_mem))
    seen: set = set()
    split_plans = []
    for sc, split in found:
        if len(seen) == _EXACT:
            break
        if (sc.cand, id(split)) in seen:
            continue
        seen.add((sc.cand, id(split)))
        plan = _build(graph, profile, options, sc, split)
        if plan is not None:
            split_plans.append(plan)
    if split_plans:
        out["split"] = sorted(split_plans, key=lambda p: p.time.total)
    if progress:
        progress(f"pipelines across device types: {len(found)} screened candidates fit", 1.0)
    return out, screened


def search_hetero(graph: Graph, profile: HeteroProfile, options: PlanOptions, progress=None) -> SearchResult:  # noqa: ANN001
    """The fastest plan on a heterogeneous cluster: split across device types, or one group alone (see above)."""
    t0 = time.perf_counter()
    kinds, screened = best_by_kind(graph, profile, options, progress)
    plans = [p for ps in kinds.values() for p in ps]
    if not plans:
        raise PlanInfeasibleError(f"{graph.model_name or 'the model'} fits neither on one group of {profile.name} nor "
                                  "on a pipeline across its groups; use a larger cluster")
    plans.sort(key=lambda p: p.time.total)
    plans = [_model_notes(p, graph) for p in plans]
    wall = time.perf_counter() - t0
    best = replace(plans[0], solver=replace(plans[0].solver, wall_s=wall, candidates=screened))
    return SearchResult(best=best, alternatives=tuple(plans[1: options.top_k + 1]), screened=screened, wall_s=wall)
