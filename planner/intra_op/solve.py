"""Solving layer groups: :func:`solve_group` (one group), :func:`solve_graph` (every group of a graph, identical
blocks solved once), :func:`strategy_costs` (a node's alternatives, for ``autopar explain``), and the report of a
solution (:class:`GroupSolution`: chosen strategies, parameter placements, times, collectives, saved activations).

For the nodes of one layer group, :mod:`autopar.planner.intra_op.model` builds the CP-SAT model from each node's
strategies and the costs of :class:`autopar.planner.intra_op.coster._Coster`; :mod:`autopar.planner.intra_op.cpsat`
(its docstring gives the formulation) picks one strategy per node. Groups with equal ``structural_hash`` are solved
once (cached by hash, tp, scale, dtype, budget and boundaries); tp=1 returns the all-replicate solution without
calling CP-SAT.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from autopar.ir.graph import Graph, LayerGroup, Node
from autopar.ir.placement import is_shard, parse_placement, public_placement, shard
from autopar.ir.plan import OpSharding
from autopar.planner.intra_op.coster import _Coster, gradient_values
from autopar.planner.intra_op.cpsat import CoreSolution, IntraOpOptions, evaluate_costs, solve_costs
from autopar.planner.intra_op.model import (
    _build,
    _core_inputs,
    _edge_terms,
    _Model,
    _replicate_choices,
    _saved_entries,
    add_param_memory_price,
)
from autopar.planner.intra_op.rules import strategies_for
from autopar.planner.intra_op.strategy import Strategy
from autopar.profiles.cost import MATMUL_KINDS, CostModel, GroupSpan

__all__ = ["GroupSolution", "solve_group", "solve_graph", "strategy_costs"]

log = logging.getLogger(__name__)
_RECOMPUTE_KINDS = frozenset({"pointwise", "norm", "softmax"})


@dataclass(frozen=True, kw_only=True, slots=True)
class GroupSolution:
    """The tp sharding chosen for one layer group and what it costs (per device, per micro-batch)."""

    group_index: int
    structural_hash: str
    tp: int
    strategies: dict[str, str]
    op_shardings: tuple[OpSharding, ...]
    param_placements: dict[str, str]
    """Parameter FQN -> ``R`` | ``S(d)``."""
    fwd_compute_s: float
    bwd_compute_s: float
    fwd_comm_s: float
    bwd_comm_s: float
    act_bytes_none: float
    act_bytes_selective: float
    act_bytes_full: float
    recompute_fwd_s_selective: float
    recompute_fwd_s_full: float
    param_elems: float
    boundary_in: str
    boundary_out: str
    out_bytes: float
    """Bytes of the group's output activation held by one device per micro-batch (what a pipeline p2p sends)."""
    status: str
    objective_s: float
    best_bound_s: float
    gap: float
    wall_s: float
    param_split_factors: dict[str, int] = field(default_factory=dict)
    """Parameters sharded interleaved (``S(d)`` of ``[k, n/k]``'s inner factor, e.g. a fused qkv weight): FQN -> k."""
    collectives: tuple[tuple[str, str, str, float], ...] = ()
    """(node, "fwd"|"bwd", collective, seconds) for every tp collective, in node order."""
    matmul_fwd_s: float = 0.0
    """The part of ``fwd_compute_s`` spent in matmul-like ops (``profiles.cost.MATMUL_KINDS``: GEMMs, attention,
    convolutions, the kinds costed at the matmul rate), what ``autopar calibrate``'s attribution measures apart
    (``matmul``)."""
    matmul_bwd_s: float = 0.0
    """The same part of ``bwd_compute_s``."""


def _report(graph: Graph, group: LayerGroup, t: int, co: _Coster, m: _Model, choices: list[int],
            core: CoreSolution, wall: float) -> GroupSolution:
    chosen = [m.strats[v][choices[v]] for v in range(m.n)]
    b_in = m.bplaces[choices[m.n]] if m.bplaces else "R"
    fwd_c = bwd_c = fwd_m = bwd_m = mm_f = mm_b = 0.0
    colls: list[tuple[str, str, str, float]] = []
    for v, n in enumerate(m.nodes):
        cf, cb = m.comp[v][choices[v]]
        uf, ub, uc = m.unary[v][choices[v]]
        fwd_c, bwd_c, fwd_m, bwd_m = fwd_c + cf, bwd_c + cb, fwd_m + uf, bwd_m + ub
        if n.kind in MATMUL_KINDS:
            mm_f, mm_b = mm_f + cf, mm_b + cb
        colls += [(n.name, d, k, s) for d, k, s in uc]
    seen: set[tuple] = set()  # one collective per (value, conversion), shared by its consumers
    eager: dict[str, float] = {}  # DTensor's eager work of the conversions into each node: compute on its rank
    for e in m.edges:
        kf_, f, kf, kb_, b, kb = _edge_terms(m, co, e, choices[e.u], choices[e.v])
        name = m.nodes[e.v].name
        for key, sec, kind, d in ((kf_, f, kf, "fwd"), (kb_, b, kb, "bwd")):
            if (kind or sec > 0) and (e.u, e.nbytes, key) not in seen:
                seen.add((e.u, e.nbytes, key))
                o = min(sec, co.redistribute_s)
                eager[name] = eager.get(name, 0.0) + o
                if kind:
                    colls.append((name, d, kind, sec - o))
                if d == "fwd":
                    fwd_m, fwd_c = fwd_m + sec - o, fwd_c + o
                else:
                    bwd_m, bwd_c = bwd_m + sec - o, bwd_c + o
    colls.sort(key=lambda c: graph.index(c[0]))
    ops = []
    for v, n in enumerate(m.nodes):
        mine = [c for c in colls if c[0] == n.name]
        ins = []
        for pos, name in enumerate(n.inputs):
            p = chosen[v].inputs[pos]
            if p is None:
                u = m.nodes.index(graph.node(name)) if name in [x.name for x in m.nodes] else None
                p = chosen[u].output if u is not None else "R"
            ins.append(public_placement(p))
        comm = "+".join(f"{d}:{k}" for _, d, k, _ in mine)
        ops.append(OpSharding(node=n.name, op=n.op, strategy=chosen[v].name, inputs=tuple(ins),
                              output=public_placement(chosen[v].output),
                              compute_s=sum(m.comp[v][choices[v]]) + eager.get(n.name, 0.0),
                              comm_s=sum(c[3] for c in mine), comm=comm))
    pp, split = _param_placements(graph, group, m, chosen)
    acts = _activation_report(graph, group, co, m, chosen, b_in, fwd_c, fwd_m)
    out_pl = chosen[m.out_node].output if m.out_node is not None else "R"
    out_pl = m.out_need or out_pl  # what the next group receives (the conversion to it is charged here)
    out_b = co.tensor_bytes(m.nodes[m.out_node].outputs[0]) if m.out_node is not None else 0.0
    pm = graph.param_map
    elems = sum(pm[p].meta.numel / (t if pp.get(p, "R") != "R" else 1) for p in group.params
                if p in pm and pm[p].kind == "param")
    return GroupSolution(
        group_index=group.index, structural_hash=group.structural_hash, tp=t,
        strategies={n.name: s.name for n, s in zip(m.nodes, chosen)}, op_shardings=tuple(ops),
        param_placements={p: public_placement(x) for p, x in pp.items()}, fwd_compute_s=fwd_c, bwd_compute_s=bwd_c,
        fwd_comm_s=fwd_m, bwd_comm_s=bwd_m, act_bytes_none=acts[0], act_bytes_selective=acts[1],
        act_bytes_full=acts[2], recompute_fwd_s_selective=acts[3], recompute_fwd_s_full=acts[4],
        param_elems=float(elems), boundary_in=public_placement(b_in), boundary_out=public_placement(out_pl),
        out_bytes=out_b / t if is_shard(out_pl) else out_b, status=core.status, objective_s=core.objective,
        best_bound_s=core.bound, gap=core.gap, wall_s=wall, param_split_factors=split,
        collectives=tuple(colls), matmul_fwd_s=mm_f, matmul_bwd_s=mm_b)


def _param_placements(graph: Graph, group: LayerGroup, m: _Model,
                      chosen: list[Strategy]) -> tuple[dict[str, str], dict[str, int]]:
    pp: dict[str, str] = {}
    for n, s in zip(m.nodes, chosen):
        for pos, p in enumerate(n.inputs):
            if p in n.params and p not in pp:
                pp[p] = s.inputs[pos] or "R"
    split = {p: parse_placement(x).chunks for p, x in pp.items() if is_shard(x) and parse_placement(x).chunks > 1}
    return pp, split


def _activation_report(graph: Graph, group: LayerGroup, co: _Coster, m: _Model, chosen: list[Strategy], b_in: str,
                       fwd_c: float, fwd_m: float) -> tuple[float, float, float, float, float]:
    """(none, selective, full) saved bytes and the extra forward time of selective and full recompute."""
    saved: dict[tuple[str, str], float] = {}  # one copy per storage and sharded-ness (views share storage)
    for n, s in zip(m.nodes, chosen):
        for key, pl, st in _saved_entries(graph, n, s):
            saved.setdefault((key, "S" if is_shard(pl) else pl), co.saved_bytes(st, pl))
    none = sum(saved.values())
    # selective (Korthikanti et al. 2022 Sec. 5, applied to our IR): outputs of pointwise/norm/softmax ops are
    # recomputed in backward instead of kept, when everything they need is kept or itself recomputable
    idx = {n.name: v for v, n in enumerate(m.nodes)}
    avail = {k for k, _ in saved} | {graph.storage_key(i) + "@in" for n in m.nodes for i in n.activation_inputs
                                     if i not in idx}
    extra = 0.0
    for v, n in enumerate(m.nodes):
        key = n.name + "@in"
        if n.kind in _RECOMPUTE_KINDS and any(k == key for k, _ in saved) and all(
                graph.storage_key(i) + "@in" in avail for i in n.activation_inputs):
            # a recomputed dropout re-draws its mask from the saved RNG state: the mask is not kept either
            drop = {key, n.name + "@mask"} if n.op == "dropout" else {key}
            saved = {k: b for k, b in saved.items() if k[0] not in drop}
            extra += m.comp[v][m.strats[v].index(chosen[v])][0]
    selective = sum(saved.values())
    if m.bname is not None:
        meta = graph.node(m.bname).outputs[0]
        full = co.tensor_bytes(meta) / (co.t if is_shard(b_in) else 1)
    else:
        full = sum(co.tensor_bytes(n.outputs[0]) for n in m.nodes if n.kind == "input" and n.outputs)
    return none, selective, full, extra, fwd_c + fwd_m


def solve_group(graph: Graph, group: LayerGroup, *, tp: int, cost: CostModel, tp_span: GroupSpan,
                dtype: str = "bfloat16", micro_batch_scale: float = 1.0, boundary_in: str | None = None,
                options: IntraOpOptions = IntraOpOptions(), boundary_out: str | None = None,
                fixed_params: dict[str, str] | None = None,
                requires_grad: frozenset[str] | None = None, chain: bool | None = None) -> GroupSolution:
    """Choose every op's tp sharding in ``group``.

    ``boundary_in``/``boundary_out`` fix the placement of the residual stream entering/leaving the group (None: the
    solver chooses; for a ``block`` with ``boundary_out=None`` the output must equal the input placement so identical
    blocks chain; ``chain=False`` drops that rule for a block that has no identical neighbour). ``fixed_params``
    pins parameters shared with an already solved group (internal placements).
    ``requires_grad``: :func:`~autopar.planner.intra_op.coster.gradient_values` of ``graph`` when the caller has it."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if micro_batch_scale <= 0:
        raise ValueError(f"micro_batch_scale must be > 0, got {micro_batch_scale}")
    if tp_span.size != tp:
        raise ValueError(f"tp_span {tp_span} has {tp_span.size} ranks but tp={tp}")
    t0 = time.perf_counter()
    co = _Coster(graph, cost, tp_span, tp, dtype, micro_batch_scale, requires_grad)
    m = _build(graph, group, tp, co, boundary_in if tp > 1 else None, boundary_out if tp > 1 else None,
               dict(fixed_params or {}) if tp > 1 else {})
    hint = _replicate_choices(m)
    chained = boundary_out is None and (group.role == "block" if chain is None else chain)
    num, ncost, edges, mem, pairs, shared = _core_inputs(m, co, chained)
    if options.param_byte_price_s > 0:
        add_param_memory_price(graph, m, ncost, tp, options.param_byte_price_s * options.param_state_bytes)
    if tp == 1:
        obj = evaluate_costs(ncost, edges, hint, shared)
        core = CoreSolution(hint, obj, obj, "optimal", 0.0)
    else:
        core = solve_costs(num, ncost, edges, mem=mem, budget=options.activation_budget_bytes, equal_pairs=pairs,
                           shared=shared, hint=hint, options=options)
    wall = time.perf_counter() - t0
    log.debug("group %d (%s): tp=%d %s objective %.3g s gap %.3g in %.2f s", group.index, group.module_path, tp,
             core.status, core.objective, core.gap, wall)
    return _report(graph, group, tp, co, m, core.choices, core, wall)


def strategy_costs(graph: Graph, node: Node, *, tp: int, cost: CostModel, tp_span: GroupSpan,
                   dtype: str = "bfloat16", micro_batch_scale: float = 1.0
                   ) -> list[tuple[Strategy, float, float, float]]:
    """Every strategy of ``node`` with its forward time, backward time and weight-gradient all-reduce time, per
    device per micro-batch, as the solver costs them (``autopar explain`` lists these as the alternatives)."""
    co = _Coster(graph, cost, tp_span, tp, dtype, micro_batch_scale)
    out = []
    for st in strategies_for(graph, node, tp):
        f, b = co.compute(node, st)
        out.append((st, f, b, co.grad_allreduce(st)))
    return out


def solve_graph(graph: Graph, *, tp: int, cost: CostModel, tp_span: GroupSpan, dtype: str = "bfloat16",
                micro_batch_scale: float = 1.0, options: IntraOpOptions = IntraOpOptions(),
                requires_grad: frozenset[str] | None = None) -> tuple[GroupSolution, ...]:
    """One :class:`GroupSolution` per ``graph.layers`` entry.

    Order: repeated blocks first (each distinct hash once, boundary in = out), then the other groups in graph order
    with the previous group's output placement as their input, the prefix last (its output fixed to what the first
    block expects; parameters tied across groups, e.g. a tied embedding/LM head, keep the first placement chosen).
    ``requires_grad``: :func:`~autopar.planner.intra_op.coster.gradient_values` of ``graph``, computed if not given."""
    layers = graph.layers
    if not layers:
        raise ValueError("graph has no layer groups; trace it with ir.trace (which groups layers)")
    counts: dict[str, int] = {}
    for g in layers:
        if g.role == "block":
            counts[g.structural_hash] = counts.get(g.structural_hash, 0) + 1
    cache: dict[tuple, GroupSolution] = {}
    sols: dict[int, GroupSolution] = {}
    fixed: dict[str, str] = {}
    kw = dict(tp=tp, cost=cost, tp_span=tp_span, dtype=dtype, micro_batch_scale=micro_batch_scale, options=options,
              requires_grad=gradient_values(graph) if requires_grad is None else requires_grad)

    def run(g: LayerGroup, b_in: str | None, b_out: str | None) -> GroupSolution:
        key = (g.structural_hash, tp, micro_batch_scale, dtype, options.activation_budget_bytes,
               options.param_byte_price_s, b_in, b_out,
               tuple(sorted((p, fixed[p]) for p in g.params if p in fixed)), g.role)
        if key in cache and g.role == "block":
            return replace(cache[key], group_index=g.index)
        pinned = {p: fixed[p] for p in g.params if p in fixed}
        try:
            sol = solve_group(graph, g, boundary_in=b_in, boundary_out=b_out, fixed_params=pinned,
                              **kw)  # type: ignore[arg-type]
        except ValueError:
            # A block leaves in the placement it entered in, so that it chains with its copies.  A block that occurs
            # once and cannot (a conv-net's BatchNorm entered batch-split: BatchNorm splits channels only) may leave
            # in another placement.
            if g.role != "block" or counts[g.structural_hash] > 1 or b_out is not None:
                raise
            sol = solve_group(graph, g, boundary_in=b_in, boundary_out=b_out, fixed_params=pinned, chain=False,
                              **kw)  # type: ignore[arg-type]
        cache[key] = sol
        for p, pl in sol.param_placements.items():
            k = sol.param_split_factors.get(p, 1)
            fixed.setdefault(p, pl if k == 1 else shard(parse_placement(pl).dim, k))
        return sol

    for g in layers:
        if g.role == "block" and counts[g.structural_hash] > 1:
            sols[g.index] = run(g, None, None)
    for i, g in enumerate(layers):
        if g.index in sols or (g.role == "prefix" and i == 0 and len(layers) > 1):
            continue
        prev = sols.get(layers[i - 1].index) if i > 0 else None
        nxt = sols.get(layers[i + 1].index) if i + 1 < len(layers) else None
        sols[g.index] = run(g, prev.boundary_out if prev else None,
                            nxt.boundary_in if nxt and counts.get(layers[i + 1].structural_hash, 0) > 1 else None)
    if layers[0].index not in sols:
        nxt = sols.get(layers[1].index)
        sols[layers[0].index] = run(layers[0], None, nxt.boundary_in if nxt else None)
    return tuple(sols[g.index] for g in layers)
