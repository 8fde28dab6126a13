"""What a strategy costs on the tp group: :class:`_Coster` turns the graph's FLOPs and bytes into seconds.

At the training dtype and micro-batch size (``scale`` times the traced batch), per device:

* compute: forward and backward time of a node under a strategy doing ``frac`` of the work
  (:meth:`_Coster.compute`); each backward GEMM is costed at forward size, memory-bound backward reads the output
  gradient and re-reads the saved tensors;
* resharding: the collective that turns a value (or its gradient) from one placement into another
  (:meth:`_Coster.convert`, :meth:`_Coster.reshard`): ``P -> R`` all-reduce, ``P -> S`` reduce-scatter,
  ``S -> R`` all-gather, ``S(d) -> S(d')`` all-to-all, ``R -> S`` a local slice, anything ``-> P`` forbidden (INF);
* the tp all-reduce of partial weight gradients (:meth:`_Coster.grad_allreduce`) and saved-tensor bytes
  (:meth:`_Coster.saved_bytes`).
"""

from __future__ import annotations

from autopar.ir.graph import DTYPE_BYTES, FLOAT_DTYPES, Graph, Node, SavedTensor, TensorMeta
from autopar.ir.placement import is_shard
from autopar.planner.intra_op.cpsat import INF
from autopar.planner.intra_op.strategy import Strategy
from autopar.profiles.cost import MATMUL_KINDS, CostModel, GroupSpan

_KIND_MAP = {"loss": "other", "copy": "other", "gather": "other", "creation": "other", "unknown": "other"}


def gradient_values(graph: Graph) -> frozenset[str]:
    """Nodes whose values get gradients: float values that depend on a trainable parameter (one pass over the
    graph; pass the result to every :class:`_Coster` of the same graph)."""
    pm = graph.param_map
    out: set[str] = set()
    for n in graph.nodes:
        if n.kind in ("input", "creation") or not n.outputs or n.out.dtype not in FLOAT_DTYPES:
            continue
        if any(i in out for i in n.activation_inputs) or any(
                p in pm and pm[p].kind == "param" and pm[p].meta.dtype in FLOAT_DTYPES for p in n.params):
            out.add(n.name)
    return frozenset(out)


class _Coster:
    """Compute and resharding times on the tp group, at the training dtype and micro-batch size."""

    def __init__(self, graph: Graph, cost: CostModel, span: GroupSpan, t: int, dtype: str, scale: float,
                 requires_grad: frozenset[str] | None = None) -> None:
        self.graph, self.cost, self.span, self.t, self.dtype, self.scale = graph, cost, span, t, dtype, scale
        self.item = DTYPE_BYTES.get({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype), 2)
        self._coll: dict[tuple[str, float], float] = {}
        self._saved: dict[str, float] = {}  # node -> bytes its backward re-reads (unsharded)
        self.requires_grad = gradient_values(graph) if requires_grad is None else requires_grad
        self.redistribute_s = cost.redistribute_overhead()  # DTensor's eager work per conversion and pass

    def tensor_bytes(self, meta: TensorMeta, activation: bool = True) -> float:
        item = self.item if meta.dtype in FLOAT_DTYPES else DTYPE_BYTES.get(meta.dtype, 4)
        return meta.numel * item * (self.scale if activation else 1.0)

    def coll(self, kind: str, nbytes: float) -> float:
        key = (kind, nbytes)
        if key not in self._coll:
            self._coll[key] = self.cost.collective_time(kind, nbytes, span=self.span)
        return self._coll[key]

    def convert(self, src: str | None, dst: str | None, nbytes: float) -> tuple[float, str]:
        """Time and collective to turn a value (or gradient) held as ``src`` into ``dst``: the collective's time
        plus DTensor's eager work for the resharding (:attr:`redistribute_s`, which a local slice pays alone)."""
        if src is None or dst is None or src == dst:
            return 0.0, ""
        if dst == "P":
            return INF, ""
        o = self.redistribute_s
        if src == "R":
            return o, ""  # local slice
        if src == "P":
            kind = "all_reduce" if dst == "R" else "reduce_scatter"
            return self.coll(kind, nbytes) + o, kind
        if dst == "R":
            return self.coll("all_gather", nbytes) + o, "all_gather"
        return self.coll("all_to_all", nbytes / self.t) + o, "all_to_all"

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
        """(forward, backward) seconds of ``node`` under ``strat``; under tp every op, views included, also pays
        the profile's DTensor dispatch (:meth:`~autopar.profiles.cost.CostModel.sharded_op_extra`) once forward and
        once per backward kernel of a matmul (a linear's two GEMMs; one for the other kinds), per pass as the profiler
        measures it (``autopar.profiles.eager``)."""
        fwd, bwd = self._compute(node, strat)
        if self.t > 1 and node.kind != "input" and node.outputs:
            kind = _KIND_MAP.get(node.kind, node.kind)
            extra = self.cost.sharded_op_extra(kind)
            passes = self._gemm_passes(node) if bwd > 0 and kind == "matmul" else \
                1.0 if bwd > 0 or node.kind == "view" else 0.0
            return fwd + extra, bwd + extra * passes
        return fwd, bwd

    @staticmethod
    def _gemm_passes(node: Node) -> float:
        """Backward kernels of a GEMM-like op: one per gradient (input and weight), each the forward's size."""
        return min(2.0, max(1.0, node.flops_bwd / node.flops_fwd)) if node.flops_fwd > 0 else 1.0

    def _compute(self, node: Node, strat: Strategy) -> tuple[float, float]:
        kind = _KIND_MAP.get(node.kind, node.kind)
        if kind == "input" or not node.outputs:
            return 0.0, 0.0
        if kind == "view":  # no data moved; its eager overhead (0 unless the profile measured one) each way
            o = self.cost.op_overhead("view")
            return o, (o if node.name in self.requires_grad else 0.0)
        f, nb = strat.frac, self.node_bytes(node)
        seq, hd, work = None, None, 1.0
        if kind == "attention" and dict(node.attrs).get("is_causal") and node.out is not None and node.out.shape:
            # a causal flash kernel skips the masked half of the scores: half the counted FLOPs, at the kernel's own
            # sequence-length- and head-dimension-dependent rate (profiles.cost, "Causal flash attention")
            kind, work, seq, hd = "causal_attention", 0.5, int(node.out.shape[-2]), int(node.out.shape[-1])
        fwd = self.cost.op_time(node.flops_fwd * self.scale * f * work, nb * f, self.dtype, kind, seq, hd)
        has_grad = any(m is not None and m.dtype in FLOAT_DTYPES
                       for m in (self.graph.input_meta(node, i) for i in range(len(node.inputs))))
        if not has_grad or node.kind == "creation":
            return fwd, 0.0
        if kind in MATMUL_KINDS:
            # one kernel per gradient (input and weight), each the forward's size: the efficiency is that of a
            # forward-sized problem, not of one problem of the summed FLOPs
            bratio = self._gemm_passes(node)
            one = self.cost.op_time(node.flops_bwd * self.scale * f * work / bratio, nb * f, self.dtype, kind, seq, hd)
            return fwd, one * bratio
        # backward reads the output gradient, writes the input gradients, and re-reads what was saved
        if node.name not in self._saved:  # the same for every strategy of the node
            self._saved[node.name] = sum(self.saved_bytes(st, None) for st in self.graph.saved_tensors(node))
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
