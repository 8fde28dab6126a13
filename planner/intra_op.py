"""Intra-op (tensor-parallel) sharding: a CP-SAT model per layer group, built from the graph and the cost model.

For the nodes of one layer group, each node's strategies (:mod:`autopar.planner.strategies`) get compute costs, each data edge
the resharding costs between every pair of strategies, and the model of :mod:`autopar.planner.cpsat` (its docstring gives
the formulation: one-choice, tight edge, equality, memory and shared-collective constraint families) picks one
strategy per node.  Groups with equal ``structural_hash`` are solved once (cached by hash, tp, scale, dtype, budget
and boundaries); tp=1 returns the all-replicate solution without calling CP-SAT.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace

from autopar.ir.graph import DTYPE_BYTES, Graph, LayerGroup, Node, TensorMeta
from autopar.ir.plan import OpSharding
from autopar.planner.cpsat import (INF, CoreSolution, Edge, EqualPair, IntraOpOptions, Shared, add_edge_constraint,
                           add_equal_constraint, add_memory_constraint, add_one_choice_constraint,
                           add_shared_cost_constraint, evaluate_costs, solve_costs)
from autopar.ir.placement import is_shard, parse_placement, public_placement, shard
from autopar.planner.strategies import (FLOAT_DTYPES, SavedTensor, Strategy, input_meta, saved_tensors, storage_key,
                                        strategies_for)
from autopar.profiles.cost import CostModel, GroupSpan

__all__ = ["IntraOpOptions", "GroupSolution", "CoreSolution", "solve_costs", "evaluate_costs", "solve_group",
           "solve_graph", "strategy_costs", "add_one_choice_constraint", "add_edge_constraint", "add_equal_constraint",
           "add_memory_constraint", "add_shared_cost_constraint"]

log = logging.getLogger(__name__)
_KIND_MAP = {"loss": "other", "copy": "other", "gather": "other", "creation": "other", "unknown": "other"}
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


class _Coster:
    """Compute and resharding times on the tp group, at the training dtype and micro-batch size."""

    def __init__(self, graph: Graph, cost: CostModel, span: GroupSpan, t: int, dtype: str, scale: float) -> None:
        self.graph, self.cost, self.span, self.t, self.dtype, self.scale = graph, cost, span, t, dtype, scale
        self.item = DTYPE_BYTES.get({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype), 2)
        self._coll: dict[tuple[str, float], float] = {}
        self._saved: dict[str, float] = {}  # node -> bytes its backward re-reads (unsharded)
        pm = graph.param_map
        self.requires_grad: set[str] = set()
        for n in graph.nodes:  # values that depend on a trainable parameter get gradients
            if n.kind in ("input", "creation") or not n.outputs or n.out.dtype not in FLOAT_DTYPES:
                continue
            if any(i in self.requires_grad for i in n.activation_inputs) or any(
                    p in pm and pm[p].kind == "param" and pm[p].meta.dtype in FLOAT_DTYPES for p in n.params):
                self.requires_grad.add(n.name)

    def tensor_bytes(self, meta: TensorMeta, activation: bool = True) -> float:
        item = self.item if meta.dtype in FLOAT_DTYPES else DTYPE_BYTES.get(meta.dtype, 4)
        return meta.numel * item * (self.scale if activation else 1.0)

    def coll(self, kind: str, nbytes: float) -> float:
        key = (kind, nbytes)
        if key not in self._coll:
            self._coll[key] = self.cost.collective_time(kind, nbytes, span=self.span)
        return self._coll[key]

    def convert(self, src: str | None, dst: str | None, nbytes: float) -> tuple[float, str]:
        """Time and collective to turn a value (or gradient) held as ``src`` into ``dst``."""
        if src is None or dst is None or src == dst:
            return 0.0, ""
        if dst == "P":
            return INF, ""
        if src == "R":
            return 0.0, ""  # local slice
        if src == "P":
            kind = "all_reduce" if dst == "R" else "reduce_scatter"
            return self.coll(kind, nbytes), kind
        if dst == "R":
            return self.coll("all_gather", nbytes), "all_gather"
        return self.coll("all_to_all", nbytes / self.t), "all_to_all"

    def reshard(self, out: str, need_in: str | None, grad: str | None, nbytes: float,
                rg: bool = True) -> tuple[float, float, str, str]:
        """(fwd s, bwd s, fwd collective, bwd collective) of one edge: value out -> need_in, gradient grad -> the
        producer's gradient placement (R for a P output, else the output placement); no gradient unless ``rg``."""
        grad = grad if rg else None
        f, fk = self.convert(out, need_in, nbytes)
        b, bk = self.convert(grad, "R" if out == "P" else out, nbytes) if f != INF else (0.0, "")
        return f, b, fk, bk

    def node_bytes(self, node: Node) -> float:
        pm = self.graph.param_map
        pbytes = sum(pm[p].meta.nbytes for p in node.params if p in pm) if node.kind != "embedding" else 0.0
        act = max(0.0, node.bytes_read + node.bytes_written - pbytes)
        traced = next((o.dtype for o in node.outputs if o.dtype in FLOAT_DTYPES), None)
        ratio = self.item / DTYPE_BYTES[traced] if traced else 1.0
        pratio = sum(self.item * pm[p].meta.numel for p in node.params if p in pm) / pbytes if pbytes else 1.0
        return pbytes * pratio + act * self.scale * ratio

    def compute(self, node: Node, strat: Strategy) -> tuple[float, float]:
        kind = _KIND_MAP.get(node.kind, node.kind)
        if kind in ("view", "input") or not node.outputs:
            return 0.0, 0.0
        f, nb = strat.frac, self.node_bytes(node)
        fwd = self.cost.op_time(node.flops_fwd * self.scale * f, nb * f, self.dtype, kind)
        has_grad = any(m is not None and m.dtype in FLOAT_DTYPES
                       for m in (input_meta(self.graph, node, i) for i in range(len(node.inputs))))
        if not has_grad or node.kind == "creation":
            return fwd, 0.0
        if kind in ("matmul", "attention", "conv"):
            # one kernel per gradient (input and weight), each the forward's size: the efficiency is that of a
            # forward-sized problem, not of one problem of the summed FLOPs
            bratio = min(2.0, max(1.0, node.flops_bwd / node.flops_fwd)) if node.flops_fwd > 0 else 1.0
            one = self.cost.op_time(node.flops_bwd * self.scale * f / bratio, nb * f, self.dtype, kind)
            return fwd, one * bratio
        # backward reads the output gradient, writes the input gradients, and re-reads what was saved
        if node.name not in self._saved:  # the same for every strategy of the node
            self._saved[node.name] = sum(self.saved_bytes(st, None) for st in saved_tensors(self.graph, node))
        bwd_bytes = nb + self._saved[node.name]
        bwd = self.cost.op_time(node.flops_bwd * self.scale * f, bwd_bytes * f, self.dtype, kind)
        return fwd, bwd

    def grad_allreduce(self, strat: Strategy) -> float:
        pm = self.graph.param_map
        nbytes = sum(pm[p].meta.numel * self.item for p in strat.grad_allreduce if p in pm)
        return self.coll("all_reduce", nbytes) if nbytes else 0.0

    def saved_bytes(self, st: SavedTensor, placement: str | None) -> float:
        b = self.tensor_bytes(st.meta) if st.meta is not None else st.nbytes * self.scale
        return b / self.t if is_shard(placement) else b


# ---- the group model --------------------------------------------------------------------------------------------
@dataclass
class _EdgeInfo:
    u: int
    v: int
    pos: int
    nbytes: float


@dataclass
class _Model:
    nodes: list[Node]
    strats: list[tuple[Strategy, ...]]
    bplaces: list[str]
    """Choices of the boundary-input pseudo-node (empty when the group has no external residual input)."""
    bname: str | None
    pnames: list[str]
    pplaces: list[list[str]]
    edges: list[_EdgeInfo]
    comp: list[list[tuple[float, float]]]
    unary: list[list[tuple[float, float, list[tuple[str, str, float]]]]]
    mem: list[list[float]]
    out_node: int | None
    equal_pairs: list[EqualPair] = field(default_factory=list)
    out_need: str | None = None
    """Placement the group's output must be delivered in (R for graph outputs, or the given boundary_out)."""

    @property
    def n(self) -> int:
        return len(self.nodes)

    def out_of(self, u: int, s: int) -> str:
        return self.strats[u][s].output if u < self.n else self.bplaces[s]


def _placements(meta: TensorMeta, t: int) -> list[str]:
    return ["R", *(shard(d) for d, n in enumerate(meta.shape) if n % t == 0 and n > 0)]


def _build(graph: Graph, group: LayerGroup, t: int, co: _Coster, boundary_in: str | None,
           boundary_out: str | None, fixed_params: dict[str, str]) -> _Model:
    nodes = list(graph.group_nodes(group))
    idx = {n.name: i for i, n in enumerate(nodes)}
    strats = [strategies_for(graph, n, t) for n in nodes]
    outs = [i for i, n in enumerate(nodes) if n.name in graph.outputs
            or any(not (group.start <= graph.index(u) < group.end) for u in graph.users.get(n.name, ()))]
    out_node = (len(nodes) - 1) if (len(nodes) - 1) in outs else (max(outs) if outs else None)
    ext = [i for n in nodes for i in n.activation_inputs if i not in idx and graph.has_node(i)]
    # the residual stream: the latest external input shaped like the group's output (rope tables etc. are side inputs)
    like = [i for i in ext if out_node is not None and graph.node(i).outputs
            and graph.node(i).outputs[0].shape == nodes[out_node].outputs[0].shape]
    bname = max(like or ext, key=graph.index) if ext else None
    bmeta = graph.node(bname).outputs[0] if bname else None
    bplaces = (_placements(bmeta, t) if t > 1 else ["R"]) if bmeta is not None else []
    if boundary_in is not None and bmeta is not None:
        if boundary_in not in bplaces:
            raise ValueError(f"boundary placement {boundary_in} is not valid for {bname} (shape {bmeta.shape}, "
                             f"tp={t}); valid: {', '.join(bplaces)}")
        bplaces = [boundary_in]
    m = _Model(nodes, strats, bplaces, bname, [], [], [], [], [], [], out_node)
    if out_node is not None and (nodes[out_node].name in graph.outputs or boundary_out is not None):
        m.out_need = "R" if nodes[out_node].name in graph.outputs else boundary_out
    for v, n in enumerate(nodes):
        m.comp.append([co.compute(n, s) for s in strats[v]])
        m.unary.append([_unary(graph, co, n, s, v, idx, bname, m, outs, boundary_out, group) for s in strats[v]])
        for s_i, s in enumerate(strats[v]):  # a parameter tied to another group keeps that group's placement
            if any(p in fixed_params and s.inputs[k] != fixed_params[p] for k, p in enumerate(n.inputs)):
                f, b, c = m.unary[v][s_i]
                m.unary[v][s_i] = (INF, b, c)
        for pos, name in enumerate(n.inputs):
            u = idx.get(name, m.n if name == bname else None)
            if u is not None and name not in n.params:
                meta = input_meta(graph, n, pos)
                m.edges.append(_EdgeInfo(u, v, pos, co.tensor_bytes(meta) if meta else 0.0))
    _tie_params(graph, m)
    m.mem = _ilp_memory(graph, co, m)
    return m


def _unary(graph: Graph, co: _Coster, n: Node, s: Strategy, v: int, idx: dict[str, int], bname: str | None,
           m: _Model, outs: list[int], boundary_out: str | None,
           group: LayerGroup) -> tuple[float, float, list[tuple[str, str, float]]]:
    """Costs of one (node, strategy) that involve no other choice: side inputs produced (replicated) outside the
    group, outputs consumed outside, and the tp all-reduce of partial weight gradients."""
    f = b = 0.0
    colls: list[tuple[str, str, float]] = []
    for pos, name in enumerate(n.inputs):
        if name in idx or name == bname or name in n.params or not graph.has_node(name):
            continue
        meta = input_meta(graph, n, pos)
        nb = co.tensor_bytes(meta) if meta else 0.0
        df, db, kf, kb = co.reshard("R", s.inputs[pos], s.grads[pos], nb, name in co.requires_grad)
        f, b = f + df, b + db
        colls += [("fwd", kf, df)] * bool(kf) + [("bwd", kb, db)] * bool(kb)
    if v in outs:
        if n.name in graph.outputs:
            need: str | None = "R"
        elif v == m.out_node and boundary_out is not None:
            need = boundary_out
        elif v == m.out_node and group.role == "block" and bname is not None:
            need = None  # tied to the boundary input by an equality
        else:
            need = "R" if v != m.out_node else None
        if v == m.out_node and need is None and s.output == "P":
            f = INF
        elif need is not None:
            nb = co.tensor_bytes(n.outputs[0])
            df, db, kf, kb = co.reshard(s.output, need, need, nb, n.name in co.requires_grad)
            f, b = f + df, b + db
            colls += [("fwd", kf, df)] * bool(kf) + [("bwd", kb, db)] * bool(kb)
    ar = co.grad_allreduce(s)
    if ar:
        b += ar
        colls.append(("bwd", "all_reduce", ar))
    return f, b, colls


def _tie_params(graph: Graph, m: _Model) -> None:
    readers: dict[str, list[tuple[int, int]]] = {}
    for v, n in enumerate(m.nodes):
        for pos, p in enumerate(n.inputs):
            if p in n.params and all(r[0] != v for r in readers.get(p, [])):
                readers.setdefault(p, []).append((v, pos))
    base = m.n + (1 if m.bplaces else 0)
    for p, rs in readers.items():
        if len(rs) < 2:
            continue
        places = list(dict.fromkeys(pl for v, pos in rs for s in m.strats[v] for pl in [s.inputs[pos] or "R"]))
        k = base + len(m.pnames)
        m.pnames.append(p)
        m.pplaces.append(places)
        for v, pos in rs:
            m.equal_pairs.append((k, v, places, [s.inputs[pos] or "R" for s in m.strats[v]]))


def _saved_entries(graph: Graph, n: Node, s: Strategy) -> list[tuple[str, str, SavedTensor]]:
    out = []
    for st in saved_tensors(graph, n):
        pl = s.inputs[st.pos] if st.pos >= 0 else s.output
        out.append((st.key, pl or "R", st))
    return out


def _ilp_memory(graph: Graph, co: _Coster, m: _Model) -> list[list[float]]:
    """saved(v,s): a tensor saved by several nodes is charged to the first of them (exact dedupe is reported)."""
    first: dict[str, int] = {}
    for v, n in enumerate(m.nodes):
        for st in saved_tensors(graph, n):
            first.setdefault(st.key, v)
    mem = []
    for v, n in enumerate(m.nodes):
        mem.append([sum(co.saved_bytes(st, pl) for key, pl, st in _saved_entries(graph, n, s) if first[key] == v)
                    for s in m.strats[v]])
    return mem


def _edge_terms(m: _Model, co: _Coster, e: _EdgeInfo, s: int, s2: int) -> tuple[tuple, float, str, tuple, float, str]:
    """(fwd key, fwd s, fwd collective, bwd key, bwd s, bwd collective) of edge ``e`` under choices (s, s2)."""
    a, st = m.out_of(e.u, s), m.strats[e.v][s2]
    uname = m.nodes[e.u].name if e.u < m.n else (m.bname or "")
    g = st.grads[e.pos] if uname in co.requires_grad else None
    f, b, kf, kb = co.reshard(a, st.inputs[e.pos], g, e.nbytes)
    return ("f", a, st.inputs[e.pos]), f, kf, ("b", a, g), b, kb


def _core_inputs(m: _Model, co: _Coster, boundary_equal: bool) -> tuple[list[int], list[list[float]], list[Edge],
                                                                        list[list[float]], list[EqualPair],
                                                                        list[Shared]]:
    num = [len(s) for s in m.strats] + ([len(m.bplaces)] if m.bplaces else []) + [len(p) for p in m.pplaces]
    cost = [[c[0] + c[1] + u[0] + u[1] for c, u in zip(m.comp[v], m.unary[v])] for v in range(m.n)]
    cost += [[0.0] * k for k in num[m.n:]]
    mem = [list(x) for x in m.mem] + [[0.0] * k for k in num[m.n:]]
    by_value: dict[tuple[int, float], list[int]] = {}
    for ei, e in enumerate(m.edges):
        by_value.setdefault((e.u, e.nbytes), []).append(ei)
    edges: list[Edge] = []
    shared: list[Shared] = []
    for (u, _), eis in by_value.items():
        fk: list[tuple[int, list[list[tuple]]]] = []
        bk: list[tuple[int, list[list[tuple]]]] = []
        fc: dict[tuple, float] = {}
        bc: dict[tuple, float] = {}
        for ei in eis:
            e = m.edges[ei]
            terms = [[_edge_terms(m, co, e, s, s2) for s2 in range(num[e.v])] for s in range(num[e.u])]
            if len(eis) == 1:
                edges.append((e.u, e.v, [[t[1] + t[4] for t in row] for row in terms]))
                continue
            edges.append((e.u, e.v, [[INF if t[1] == INF else 0.0 for t in row] for row in terms]))
            fk.append((len(edges) - 1, [[t[0] for t in row] for row in terms]))
            bk.append((len(edges) - 1, [[t[3] for t in row] for row in terms]))
            for row in terms:
                for t in row:
                    if t[1] != INF:
                        fc[t[0]], bc[t[3]] = t[1], t[4]
        if fk:
            shared += [(fk, fc), (bk, bc)]
    pairs = list(m.equal_pairs)
    if boundary_equal and m.bplaces and m.out_node is not None:
        pairs.append((m.n, m.out_node, m.bplaces, [s.output for s in m.strats[m.out_node]]))
    return num, cost, edges, mem, pairs, shared


# ---- reporting ------------------------------------------------------------------------------------------------------
def _report(graph: Graph, group: LayerGroup, t: int, co: _Coster, m: _Model, choices: list[int],
            core: CoreSolution, wall: float) -> GroupSolution:
    chosen = [m.strats[v][choices[v]] for v in range(m.n)]
    b_in = m.bplaces[choices[m.n]] if m.bplaces else "R"
    fwd_c = bwd_c = fwd_m = bwd_m = 0.0
    colls: list[tuple[str, str, str, float]] = []
    for v, n in enumerate(m.nodes):
        cf, cb = m.comp[v][choices[v]]
        uf, ub, uc = m.unary[v][choices[v]]
        fwd_c, bwd_c, fwd_m, bwd_m = fwd_c + cf, bwd_c + cb, fwd_m + uf, bwd_m + ub
        colls += [(n.name, d, k, s) for d, k, s in uc]
    seen: set[tuple] = set()  # one collective per (value, conversion), shared by its consumers
    for e in m.edges:
        kf_, f, kf, kb_, b, kb = _edge_terms(m, co, e, choices[e.u], choices[e.v])
        name = m.nodes[e.v].name
        for key, sec, kind, d in ((kf_, f, kf, "fwd"), (kb_, b, kb, "bwd")):
            if kind and (e.u, e.nbytes, key) not in seen:
                seen.add((e.u, e.nbytes, key))
                colls.append((name, d, kind, sec))
                fwd_m, bwd_m = (fwd_m + sec, bwd_m) if d == "fwd" else (fwd_m, bwd_m + sec)
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
                              output=public_placement(chosen[v].output), compute_s=sum(m.comp[v][choices[v]]),
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
        collectives=tuple(colls))


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
    avail = {k for k, _ in saved} | {storage_key(graph, i) + "@in" for n in m.nodes for i in n.activation_inputs
                                     if i not in idx}
    extra = 0.0
    for v, n in enumerate(m.nodes):
        key = n.name + "@in"
        if n.kind in _RECOMPUTE_KINDS and any(k == key for k, _ in saved) and all(
                storage_key(graph, i) + "@in" in avail for i in n.activation_inputs):
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


# ---- public entry points ----------------------------------------------------------------------------------------
def _replicate_choices(m: _Model) -> list[int]:
    hint = [0] * m.n
    if m.bplaces:
        hint.append(m.bplaces.index("R") if "R" in m.bplaces else 0)
    hint += [p.index("R") if "R" in p else 0 for p in m.pplaces]
    return hint


def add_param_memory_price(graph: Graph, m: _Model, ncost: list[list[float]], tp: int, price: float) -> None:
    """cost += price * local parameter elements: charged on the shared parameter variables (tied weights) and, for
    every other parameter, on the strategies of the node that reads it (by the placement the strategy gives it)."""
    def local(name: str, pl: str | None) -> float:
        info = graph.param_map.get(name)
        if info is None or info.kind != "param":
            return 0.0
        return info.meta.numel / (tp if pl is not None and pl.startswith("S") else 1)

    shared = set(m.pnames)
    seen: set[str] = set()
    for v, n in enumerate(m.nodes):
        mine = [(i, p) for i, p in enumerate(n.inputs) if p in n.params and p not in shared and p not in seen]
        seen.update(p for _, p in mine)
        if mine:
            ncost[v] = [c + price * sum(local(p, st.inputs[i] if i < len(st.inputs) else None) for i, p in mine)
                        for c, st in zip(ncost[v], m.strats[v])]
    base = m.n + (1 if m.bplaces else 0)
    for j, (name, places) in enumerate(zip(m.pnames, m.pplaces)):
        ncost[base + j] = [c + price * local(name, pl) for c, pl in zip(ncost[base + j], places)]


def solve_group(graph: Graph, group: LayerGroup, *, tp: int, cost: CostModel, tp_span: GroupSpan,
                dtype: str = "bfloat16", micro_batch_scale: float = 1.0, boundary_in: str | None = None,
                options: IntraOpOptions = IntraOpOptions(), boundary_out: str | None = None,
                fixed_params: dict[str, str] | None = None) -> GroupSolution:
    """Choose every op's tp sharding in ``group``.

    ``boundary_in``/``boundary_out`` fix the placement of the residual stream entering/leaving the group (None: the
    solver chooses; for a ``block`` with ``boundary_out=None`` the output must equal the input placement so identical
    blocks chain). ``fixed_params`` pins parameters shared with an already solved group (internal placements)."""
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    if micro_batch_scale <= 0:
        raise ValueError(f"micro_batch_scale must be > 0, got {micro_batch_scale}")
    if tp_span.size != tp:
        raise ValueError(f"tp_span {tp_span} has {tp_span.size} ranks but tp={tp}")
    t0 = time.perf_counter()
    co = _Coster(graph, cost, tp_span, tp, dtype, micro_batch_scale)
    m = _build(graph, group, tp, co, boundary_in if tp > 1 else None, boundary_out if tp > 1 else None,
               dict(fixed_params or {}) if tp > 1 else {})
    hint = _replicate_choices(m)
    num, ncost, edges, mem, pairs, shared = _core_inputs(m, co, boundary_out is None and group.role == "block")
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
                micro_batch_scale: float = 1.0,
                options: IntraOpOptions = IntraOpOptions()) -> tuple[GroupSolution, ...]:
    """One :class:`GroupSolution` per ``graph.layers`` entry.

    Order: repeated blocks first (each distinct hash once, boundary in = out), then the other groups in graph order
    with the previous group's output placement as their input, the prefix last (its output fixed to what the first
    block expects; parameters tied across groups, e.g. a tied embedding/LM head, keep the first placement chosen)."""
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
    kw = dict(tp=tp, cost=cost, tp_span=tp_span, dtype=dtype, micro_batch_scale=micro_batch_scale, options=options)

    def run(g: LayerGroup, b_in: str | None, b_out: str | None) -> GroupSolution:
        key = (g.structural_hash, tp, micro_batch_scale, dtype, options.activation_budget_bytes,
               options.param_byte_price_s, b_in, b_out,
               tuple(sorted((p, fixed[p]) for p in g.params if p in fixed)), g.role)
        if key in cache and g.role == "block":
            return replace(cache[key], group_index=g.index)
        sol = solve_group(graph, g, boundary_in=b_in, boundary_out=b_out,
                          fixed_params={p: fixed[p] for p in g.params if p in fixed}, **kw)  # type: ignore[arg-type]
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

