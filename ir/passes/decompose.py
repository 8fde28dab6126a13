"""The ``decompose`` pass: fused attention written out as the unfused ops of pre-FlashAttention frameworks."""

from __future__ import annotations

from dataclasses import replace

from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.ir.ops import op_cost
from autopar.ir.passes.group import group_layers

__all__ = ["decompose_attention"]


def _node(name: str, op: str, inputs: tuple[str, ...], ins: list[TensorMeta], out: TensorMeta, like: Node,
          attrs: tuple = ()) -> Node:
    kind, ffwd, fbwd, br, bw = op_cost(op, ins, [out], dict(attrs))
    return Node(name, op, kind, inputs, (out,), like.module_path, like.module_type, (), ffwd, fbwd, br, bw, attrs,
                f"decomposed {like.target}")


def decompose_attention(graph: Graph, *, dropout_p: float = 0.0) -> Graph:
    """Replace every fused ``sdpa`` node with the unfused attention of pre-FlashAttention frameworks.

    ``scores = q @ k^T`` (a batched matmul), ``probs = softmax(scale * scores + mask)`` (one fused kernel, as in
    Megatron-LM's scale-mask-softmax), optional ``dropout(probs)``, then ``out = probs @ v``.  The ``[B, H, Sq, Sk]``
    score tensors are materialized, so their memory traffic and the activations they pin for backward (Korthikanti et
    al. 2022's ``5as/h`` term) show up in the costs.  Use it to cost frameworks that do not use flash attention,
    e.g. when comparing against published Megatron-LM (2021) measurements.

    A grouped graph stays grouped: its layer groups are recomputed over the new nodes (same boundaries, new structural
    hashes) and keep their module types; an ungrouped graph stays ungrouped.
    """
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    meta = {n.name: n.out for n in graph.nodes}
    nodes: list[Node] = []
    changed = False
    for n in graph.nodes:
        if n.op != "sdpa" or len(n.activation_inputs) < 3:
            nodes.append(n)
            continue
        changed = True
        q, k, v = n.inputs[:3]
        mq, mk, mv = meta[q], meta[k], meta[v]
        *lead, sq, _ = mq.shape
        sk = mk.shape[-2]
        if mk.shape[:-2] != mq.shape[:-2]:  # grouped-query attention: k/v heads are repeated to q's
            lead = list(mq.shape[:-2])
        scores = TensorMeta((*lead, sq, sk), mq.dtype)
        kt = TensorMeta((*lead, mk.shape[-1], sk), mk.dtype)
        s = _node(f"{n.name}_scores", "matmul", (q, k), [mq, kt], scores, n)
        p = _node(f"{n.name}_probs", "softmax", (s.name,), [scores], scores, n, (("dim", -1),))
        nodes += [s, p]
        last = p.name
        if dropout_p > 0:
            d = _node(f"{n.name}_dropout", "dropout", (p.name,), [scores], scores, n, (("p", dropout_p),))
            nodes.append(d)
            last = d.name
        nodes.append(_node(n.name, "matmul", (last, v), [scores, mv], n.out, n))
    if not changed:
        return graph
    out = replace(graph, nodes=tuple(nodes), layers=())
    if not graph.layers:
        return out
    return group_layers(out, {g.module_path: g.module_type for g in graph.layers if g.module_type})
