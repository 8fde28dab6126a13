"""The ``group`` pass: cut a graph into the ordered layer sequence the planner works on.

A *block* is a module at the shortest path that ends in an index (``blocks.3``, ``model.layers.17``, ``layer2.1``):
the children of an ``nn.ModuleList``/``nn.Sequential``.  Every node belongs to the block its module path starts with;
nodes before the first block form the ``prefix`` group (embeddings), nodes after the last block the ``suffix`` group
(final norm, head, loss), and a stray node between two blocks joins the block before it.  A model with no indexed
children is one ``whole`` group.

Each group gets a structural hash over its ops, attributes, shapes, dataflow (inputs renamed relative to the group)
and parameter shapes (names relative to the block), so identical blocks hash equal: the planner solves one and reuses
the answer, and pipeline stages are cut only at group boundaries.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

from autopar.ir.graph import Graph, LayerGroup, Node
from autopar.ir.ops import OpKind

__all__ = ["group_layers", "block_key", "structural_hash"]


def block_key(module_path: str) -> str | None:
    """Shortest prefix of ``module_path`` that ends in a numeric component, or None."""
    if not module_path:
        return None
    parts = module_path.split(".")
    for i, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: i + 1])
    return None


def _rel(name: str, prefix: str) -> str:
    if prefix and name == prefix:
        return ""
    return name[len(prefix) + 1:] if prefix and name.startswith(prefix + ".") else name


def structural_hash(graph: Graph, nodes: tuple[Node, ...], prefix: str) -> str:
    """Name-independent hash of a run of nodes (see module docstring)."""
    local = {n.name: i for i, n in enumerate(nodes)}
    pmap = graph.param_map
    h = hashlib.sha256()
    for n in nodes:
        refs = []
        for i in n.inputs:
            if i in local:
                refs.append(f"n{local[i]}")
            elif i in pmap:
                refs.append(f"p:{_rel(i, prefix)}:{list(pmap[i].meta.shape)}:{pmap[i].meta.dtype}")
            else:
                src = graph.node(i).out if graph.has_node(i) else None
                refs.append(f"x:{list(src.shape) if src else '?'}")
        item = [n.op, n.kind, _rel(n.module_path, prefix), repr(n.attrs), refs,
                [[list(o.shape), o.dtype] for o in n.outputs]]
        h.update(json.dumps(item).encode())
    return h.hexdigest()[:16]


def group_layers(graph: Graph, module_types: dict[str, str] | None = None) -> Graph:
    """Return ``graph`` with ``layers`` set to its ordered layer groups (any previous grouping is replaced).

    ``module_types`` maps a block's module path to its class name (``LayerGroup.module_type``); without it a block
    takes the type of a node whose module path is the block itself, or ``""``."""
    nodes = graph.nodes
    keys = [None if n.kind == OpKind.INPUT else block_key(n.module_path) for n in nodes]
    block_idx = [i for i, k in enumerate(keys) if k is not None]
    groups: list[tuple[int, int, str, str]] = []  # (start, end, key, role)
    if not block_idx:
        groups.append((0, len(nodes), "", "whole"))
    else:
        first, last = block_idx[0], block_idx[-1]
        if first > 0:
            groups.append((0, first, "", "prefix"))
        start, cur = first, keys[first]
        for i in range(first + 1, last + 1):
            k = keys[i]
            if k is not None and k != cur:
                groups.append((start, i, cur or "", "block"))
                start, cur = i, k
        groups.append((start, last + 1, cur or "", "block"))
        if last + 1 < len(nodes):
            groups.append((last + 1, len(nodes), "", "suffix"))
    layers = []
    for gi, (s, e, key, role) in enumerate(groups):
        members = nodes[s:e]
        params = tuple(dict.fromkeys(p for n in members for p in n.params))
        mtype = (module_types or {}).get(key, "")
        if not mtype and key:
            mtype = next((n.module_type for n in members if n.module_path == key), "")
        layers.append(LayerGroup(gi, s, e, key, mtype, role,  # type: ignore[arg-type]
                                 structural_hash(graph, members, key), params))
    return replace(graph, layers=tuple(layers))
