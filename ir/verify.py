"""``autopar.ir.verify``: the IR's invariants, checked after every pass (``autopar.ir.passes.run_passes``)."""

from __future__ import annotations

from autopar.ir.errors import IRVerificationError
from autopar.ir.graph import Graph
from autopar.ir.ops import OpKind

__all__ = ["verify"]

_KINDS = frozenset(OpKind)


def _fail(msg: str) -> None:
    raise IRVerificationError(msg)


def verify(graph: Graph) -> Graph:
    """Check that ``graph`` is well formed and return it (so passes can be chained: ``verify(p(g))``).

    Invariants: node names unique and distinct from parameter names; topological order (every input is a parameter
    or an earlier node); every node has at least one output with a non-negative integer shape and a known dtype;
    costs are finite and non-negative; ``params`` of a node are exactly its parameter inputs; graph inputs and outputs
    exist; layer groups are contiguous, ordered, and cover every node exactly once.
    """
    pnames = {p.name for p in graph.params}
    if len(pnames) != len(graph.params):
        _fail("duplicate parameter names")
    seen: set[str] = set()
    for i, n in enumerate(graph.nodes):
        if n.name in seen:
            _fail(f"node {i}: duplicate name {n.name!r}")
        if n.name in pnames:
            _fail(f"node {n.name!r} shadows a parameter name")
        if n.kind not in _KINDS:
            _fail(f"node {n.name!r}: unknown kind {n.kind!r}")
        for inp in n.inputs:
            if inp not in seen and inp not in pnames:
                _fail(f"node {n.name!r} reads {inp!r}, which is neither a parameter nor an earlier node")
        if set(n.params) != {x for x in n.inputs if x in pnames}:
            _fail(f"node {n.name!r}: params {n.params} differ from its parameter inputs")
        if not n.outputs:
            _fail(f"node {n.name!r} has no output metadata")
        for o in n.outputs:
            if not all(isinstance(s, int) and s >= 0 for s in o.shape):
                _fail(f"node {n.name!r}: bad output shape {o.shape}")
            if not o.dtype:
                _fail(f"node {n.name!r}: missing dtype")
        for f in ("flops_fwd", "flops_bwd", "bytes_read", "bytes_written"):
            v = getattr(n, f)
            if not (v >= 0 and v != float("inf")):
                _fail(f"node {n.name!r}: {f}={v}")
        seen.add(n.name)
    for name in graph.inputs:
        if name not in seen or graph.node(name).kind != OpKind.INPUT:
            _fail(f"graph input {name!r} is not an input node")
    for name in graph.outputs:
        if name not in seen and name not in pnames:
            _fail(f"graph output {name!r} is undefined")
    if graph.layers:
        pos = 0
        for gi, g in enumerate(graph.layers):
            if g.index != gi or g.start != pos or g.end <= g.start:
                _fail(f"layer group {gi} [{g.start}, {g.end}) is not contiguous after {pos}")
            pos = g.end
        if pos != len(graph.nodes):
            _fail(f"layer groups cover {pos} of {len(graph.nodes)} nodes")
    return graph
