"""The CP-SAT model of one layer group, built from the graph: choices, edges, costs and memory rows.

:func:`_build` lists each node's strategies (:func:`autopar.planner.intra_op.rules.strategies_for`) with their
compute costs (:class:`_Model` ``comp``) and the costs that involve no other choice (``unary``: side inputs and
outputs crossing the group boundary, weight-gradient all-reduces), the data edges between nodes (:class:`_EdgeInfo`),
the boundary-input pseudo-node (the residual stream entering the group) and, via :func:`_tie_params`, one pseudo-node
per parameter read by several nodes. :func:`_ilp_memory` gives the memory rows (saved bytes per choice), and
:func:`_core_inputs` turns the model into the plain costs of :func:`autopar.planner.intra_op.cpsat.solve_costs`,
grouping the edges that read one value into shared collectives. :func:`add_param_memory_price` adds the Lagrangian
price on parameter memory of the memory-lean variant. The formulation is in :mod:`autopar.planner.intra_op.cpsat`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.ir.graph import Graph, LayerGroup, Node, SavedTensor, TensorMeta
from autopar.ir.placement import shard
from autopar.planner.intra_op.coster import _Coster
from autopar.planner.intra_op.cpsat import INF, Edge, EqualPair, Shared
from autopar.planner.intra_op.rules import strategies_for
from autopar.planner.intra_op.strategy import Strategy

__all__ = ["add_param_memory_price"]


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
                meta = graph.input_meta(n, pos)
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
        meta = graph.input_meta(n, pos)
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
    for st in graph.saved_tensors(n):
        pl = s.inputs[st.pos] if st.pos >= 0 else s.output
        out.append((st.key, pl or "R", st))
    return out


def _ilp_memory(graph: Graph, co: _Coster, m: _Model) -> list[list[float]]:
    """saved(v,s): a tensor saved by several nodes is charged to the first of them (exact dedupe is reported)."""
    first: dict[str, int] = {}
    for v, n in enumerate(m.nodes):
        for st in graph.saved_tensors(n):
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
