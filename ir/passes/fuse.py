"""The ``fuse`` pass and its analysis: the fusion groups of a graph and the bytes they save.

:func:`fusion_groups` is a pure analysis over :class:`autopar.ir.Graph` (one stage's nodes after sharding, or the
whole graph): it matches the patterns of :mod:`autopar.ir.passes.patterns` and returns :class:`FusionGroup` s without
editing the graph.  :func:`apply_fused_bytes` is the ``fuse`` pass of the pipeline (:mod:`autopar.ir.passes.pipeline`):
it discounts each fused node's bytes so that a cost model summing node bytes counts a fused group's bytes once.
Generating and running the kernels is codegen's part (``autopar.codegen.triton_gen.spec_of``/``render_kernels``,
``autopar.codegen.kernels.fx_rewrite.fuse_graph_module``).

Bytes: ``bytes_unfused`` is the sum of the members' IR bytes (each op reads its inputs and writes its outputs);
``bytes_fused`` reads each outside input once and writes only values used outside the group.  The planner discounts
``bytes_saved`` (see :func:`fused_bytes_saved`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Iterable

from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.ir.ops import OpKind
from autopar.ir.passes.patterns import EAGER_KIND, KERNEL_KINDS, NodeView, match_patterns

__all__ = ["FusionGroup", "fusion_groups", "fused_bytes_saved", "apply_fused_bytes"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class FusionGroup:
    """A fused group of IR nodes."""

    kind: str
    """``add_norm``, ``swiglu``, ``bias_act``, ``softmax``, ``dropout`` or ``pointwise``."""
    nodes: tuple[str, ...]
    inputs: tuple[tuple[str, TensorMeta], ...]
    """Values read from outside the group (node names or parameter FQNs) with their metas."""
    outputs: tuple[tuple[str, TensorMeta], ...]
    """Values written by the group (used outside it, or graph outputs)."""
    ops: tuple[str, ...]
    """The members' canonical ops, in order."""
    attrs: tuple[tuple[str, Any], ...] = ()
    bytes_unfused: float = 0.0
    bytes_fused: float = 0.0

    @property
    def bytes_saved(self) -> float:
        return max(0.0, self.bytes_unfused - self.bytes_fused)

    @property
    def has_kernel(self) -> bool:
        """Whether the group runs as one generated kernel (every kind but ``pointwise``, which runs eagerly)."""
        return self.kind in KERNEL_KINDS


def _ir_view(n: Node) -> NodeView:
    attrs = {k: v for k, v in n.attrs if k != "args"}
    return NodeView(n.name, n.op, n.kind, n.inputs, n.params, tuple(n.attr("args", ()) or ()), attrs)


def _pointwise_runs(graph: Graph, names: list[str], taken: set[str]) -> list[list[str]]:
    """Connected runs of >= 2 free pointwise nodes whose outputs have the same number of elements."""
    parent: dict[str, str] = {}

    def find(a: str) -> str:
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    cand = [n for n in names if n not in taken and graph.node(n).kind == OpKind.POINTWISE]
    for n in cand:
        parent[n] = n
    for n in cand:
        node = graph.node(n)
        for i in node.activation_inputs:
            if i in parent and graph.node(i).out.numel == node.out.numel:
                parent[find(i)] = find(n)
    runs: dict[str, list[str]] = {}
    for n in cand:
        runs.setdefault(find(n), []).append(n)
    return [r for r in runs.values() if len(r) >= 2]


def _meta(graph: Graph, value: str) -> TensorMeta | None:
    if graph.has_node(value):
        return graph.node(value).out
    p = graph.param_map.get(value)
    return p.meta if p is not None else None


def _make_group(graph: Graph, kind: str, members: tuple[str, ...], attrs: tuple[tuple[str, Any], ...],
                scope: set[str]) -> FusionGroup:
    inside = set(members)
    nodes = [graph.node(m) for m in members]
    ins: dict[str, TensorMeta] = {}
    for n in nodes:
        for i in n.inputs:
            meta = _meta(graph, i)
            if i not in inside and meta is not None:
                ins.setdefault(i, meta)
    outs: dict[str, TensorMeta] = {}
    for n in nodes:
        users = graph.users.get(n.name, ())
        if n.name == members[-1] or n.name in graph.outputs or any(u not in inside for u in users):
            outs[n.name] = n.out
    unfused = float(sum(n.bytes_read + n.bytes_written for n in nodes))
    fused = float(sum(m.nbytes for m in ins.values()) + sum(m.nbytes for m in outs.values()))
    return FusionGroup(kind, members, tuple(ins.items()), tuple(outs.items()), tuple(n.op for n in nodes), attrs,
                       unfused, fused)


def fusion_groups(graph: Graph, nodes: Iterable[str] | None = None) -> tuple[FusionGroup, ...]:
    """Fusion groups of ``graph`` (restricted to ``nodes``, e.g. one pipeline stage), in graph order."""
    names = [n.name for n in graph.nodes] if nodes is None else [n for n in nodes if graph.has_node(n)]
    scope = set(names)
    views = [_ir_view(graph.node(n)) for n in names]
    # values leaving the scope count as outputs, so a stage never fuses away a value another stage reads
    leaving = {n for n in names if n in graph.outputs or any(u not in scope for u in graph.users.get(n, ()))}
    groups = [_make_group(graph, m.kind, m.nodes, m.attrs, scope) for m in match_patterns(views, leaving)]
    taken = {n for g in groups for n in g.nodes}
    for run in _pointwise_runs(graph, names, taken):
        groups.append(_make_group(graph, EAGER_KIND, tuple(run), (), scope))
    groups.sort(key=lambda g: graph.index(g.nodes[0]))
    return tuple(groups)


def fused_bytes_saved(graph: Graph, nodes: Iterable[str] | None = None, *,
                      kernels_only: bool = False) -> dict[str, float]:
    """Bytes each node no longer moves thanks to fusion: a group's ``bytes_saved`` split over its members in
    proportion to their unfused bytes (nodes outside groups are absent).  Subtract from a node's bytes to cost it.
    ``kernels_only`` leaves out the ``pointwise`` runs, which have no generated kernel and run eagerly."""
    out: dict[str, float] = {}
    for g in fusion_groups(graph, nodes):
        if g.bytes_saved <= 0.0 or g.bytes_unfused <= 0.0 or (kernels_only and not g.has_kernel):
            continue
        for name in g.nodes:
            n = graph.node(name)
            out[name] = g.bytes_saved * (n.bytes_read + n.bytes_written) / g.bytes_unfused
    return out


def apply_fused_bytes(graph: Graph) -> Graph:
    """The ``fuse`` pass (``Graph -> Graph``): ``graph`` with every fused node's ``bytes_read``/``bytes_written``
    reduced by its share of :func:`fused_bytes_saved`, so that a cost model summing node bytes counts a fused group's
    bytes once.

    Groups are matched per layer group (``graph.layers``; the whole graph when there are none), exactly as the runtime
    fuses each layer-group module, so no group spans two layer groups (or two pipeline stages) and identical blocks
    get identical savings.  Only groups with a generated kernel count: the ``pointwise`` runs execute eagerly.  Layer
    groups, names, FLOPs and the fingerprint are unchanged; a node keeps its read/write split (both scale by
    ``1 - saved / (read + written)``).  Run it once: applied twice, it would discount the savings twice."""
    scopes = [[n.name for n in graph.group_nodes(g)] for g in graph.layers] or [[n.name for n in graph.nodes]]
    saved: dict[str, float] = {}
    for names in scopes:
        saved.update(fused_bytes_saved(graph, names, kernels_only=True))
    nodes = []
    for n in graph.nodes:
        total = n.bytes_read + n.bytes_written
        s = saved.get(n.name, 0.0)
        if s <= 0.0 or total <= 0.0:
            nodes.append(n)
            continue
        keep = max(0.0, 1.0 - s / total)
        nodes.append(replace(n, bytes_read=n.bytes_read * keep, bytes_written=n.bytes_written * keep))
    log.debug("fusion saves %.3g of %.3g forward bytes", sum(saved.values()),
              sum(n.bytes_read + n.bytes_written for n in graph.nodes))
    return replace(graph, nodes=tuple(nodes))
