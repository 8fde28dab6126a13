"""The cost model: op, collective and point-to-point times from a :class:`~profiles.schema.ClusterProfile`.

Pure functions over profile data: no I/O, no global state; every time is non-decreasing in the message or problem size.

**Ops.** ``time = max(flops / rate, bytes / memory_bandwidth) / sustained_fraction + launch_overhead``. For
matmul-like kinds (``matmul``, ``attention``, ``conv``) ``rate = peak_flops[dtype] * efficiency(dtype, flops)`` from
the device's efficiency table; for the other kinds ``rate = vector_flops`` (non-tensor-core peak). ``view`` ops cost 0.
``sustained_fraction`` (1.0 unless the profile says otherwise) scales isolated-kernel rates down to what a whole
training step sustains (see :class:`~profiles.schema.DeviceProfile`).

**Causal flash attention** (kind ``causal_attention``) is costed as the kernel runs: the caller passes the FLOPs it
performs (half the score matrix; FlashAttention skips fully masked blocks, Dao 2023, sec. 3.1) and the sequence
length (and head dimension), and the rate comes from the device's ``causal_attention_efficiency`` curve (log-linear
in ``seq``, clamped; measured profiles hold one curve per head dimension), not from the GEMM table: short sequences
leave the kernel latency- and softmax-bound.  Without a curve the GEMM table is used at those FLOPs.

**Collectives** follow the NCCL-tests bus-bandwidth convention documented in :mod:`autopar.profiles.schema`.
A group is described by a :class:`GroupSpan`: ``d`` devices in each of ``m`` nodes (``g = d * m`` ranks).

- ``m == 1``: ``t = alpha_intra(d) + f(g) * S / busbw_intra(d)``.
- ``m > 1`` (hierarchical, *slowest level dominates*): NCCL pipelines the intra- and inter-node parts of a
  multi-node ring/tree, so bandwidth terms overlap while latencies add:
  ``t = alpha_intra(d) [if d > 1] + alpha_inter(m) + f(g) * S / min(busbw_intra(d), busbw_inter_eff(m, d))``.
  The inter-node table holds bus bandwidths measured on groups using all ``devices_per_node`` devices of each node
  (rail-optimized: one NIC per device). A group with only ``d`` devices per node drives ``d`` NICs, so for
  all_reduce / all_gather / reduce_scatter (whose per-node off-node traffic does not grow with ``d``)
  ``busbw_inter_eff = busbw_inter(m) * d / devices_per_node``. all_to_all and p2p numbers are per device already and
  are not scaled.

  ``f(g)`` is ``2(g-1)/g`` for all_reduce, ``(g-1)/g`` for all_gather / reduce_scatter / all_to_all, 1 for p2p.

**Group-size interpolation** of a table: linear in group size between points; below the smallest point alpha is
scaled by ``(g-1)/(g0-1)``; above the largest point alpha grows as ``log2(g)/log2(g_max)`` (NCCL switches to
tree-like algorithms whose latency grows logarithmically at scale); busbw is clamped to the nearest point.

**Ring latency at scale.** NCCL runs all_gather and reduce_scatter only as rings (no tree), and a ring of ``g``
ranks takes ``g - 1`` dependent steps, each paying a per-step latency: NCCL's tuning model charges
``baseLat + nsteps * hwLat`` with ``hwLat`` 6.6 us per step once the ring leaves the node (``src/graph/tuning.cc``,
Ring/Simple on the network; Thakur et al. 2005 for the ``alpha (p - 1)`` ring term).  Beyond the largest node count
of the inter-node table, their inter-node alpha is therefore the table's alpha at that count plus
``RING_HOP_S * d * (m - m_last)`` (``d`` ring steps per extra node) instead of the logarithmic growth: with hundreds
of ranks and small per-rank shards these collectives are latency-bound.  all_reduce (tree at scale) keeps the
logarithmic growth.

**Single-level profiles** (e.g. one measured machine, no ``inter_node`` level): asking for a group spanning more
than one node raises :class:`ValueError` with an actionable message (we do not silently pretend the intra-node link
spans nodes: that would make multi-node plans look far too cheap).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Final

from autopar.profiles.schema import (
    COLLECTIVES,
    OP_KINDS,
    PIPELINE_CASES,
    AlphaBeta,
    ClusterProfile,
    EfficiencyPoint,
    LinkProfile,
    SeqEfficiencyPoint,
    pipeline_key,
)

__all__ = [
    "OP_KINDS",
    "MATMUL_KINDS",
    "RAIL_SCALED",
    "RING_HOP_S",
    "GroupSpan",
    "group_span",
    "collective_factor",
    "in_step",
    "interp_alpha_beta",
    "interp_efficiency",
    "interp_seq_efficiency",
    "CostModel",
]

MATMUL_KINDS: Final = frozenset({"matmul", "attention", "causal_attention", "conv"})
RAIL_SCALED: Final = frozenset({"all_reduce", "all_gather", "reduce_scatter"})
_DTYPE_ALIASES: Final = {
    "fp32": "float32", "float": "float32", "torch.float32": "float32",
    "fp16": "float16", "half": "float16", "torch.float16": "float16",
    "bf16": "bfloat16", "torch.bfloat16": "bfloat16",
}
_ITEMSIZE: Final = {"float32": 4, "tf32": 4, "float16": 2, "bfloat16": 2}
RING_HOP_S: Final = 6.6e-6
"""NCCL tuning model, Ring/Simple latency per ring step on the network (``src/graph/tuning.cc``, ``hwLat``)."""
RING_ONLY: Final = frozenset({"all_gather", "reduce_scatter"})


@dataclass(kw_only=True, slots=True, frozen=True)
class GroupSpan:
    """How a communication group maps onto the topology."""

    devices_per_node: int
    """Group members in each node (d >= 1)."""
    nodes: int
    """Nodes the group spans (m >= 1)."""
    groups: int = 1
    """Disjoint groups of this shape on a node running the collective at once (the dp groups of a stage's tp
    ranks): the intra-node tables' points measured with groups in step (``AlphaBeta.groups``) apply."""

    def __post_init__(self) -> None:
        if self.devices_per_node < 1 or self.nodes < 1 or self.groups < 1:
            raise ValueError(f"GroupSpan needs devices_per_node, nodes and groups >= 1, got {self}")

    @property
    def size(self) -> int:
        """Total ranks in the group."""
        return self.devices_per_node * self.nodes


def group_span(group_size: int, stride: int, devices_per_node: int) -> GroupSpan:
    """Span of a mesh axis of ``group_size`` ranks spaced ``stride`` apart in global rank order.

    Assumes the group starts at a node boundary (true for the usual row-major meshes with power-of-two sizes):
    with ``stride >= devices_per_node`` every member sits on its own node; otherwise ``devices_per_node // stride``
    members share a node.
    """
    if group_size < 1 or stride < 1 or devices_per_node < 1:
        raise ValueError(
            f"group_span needs positive integers, got group_size={group_size}, stride={stride}, "
            f"devices_per_node={devices_per_node}"
        )
    if group_size == 1:
        return GroupSpan(devices_per_node=1, nodes=1)
    if stride >= devices_per_node:
        return GroupSpan(devices_per_node=1, nodes=group_size)
    per_node = min(group_size, max(1, math.ceil(devices_per_node / stride)))
    return GroupSpan(devices_per_node=per_node, nodes=math.ceil(group_size / per_node))


def collective_factor(kind: str, group_size: int) -> float:
    """Bus-bandwidth factor ``f(g)``: bytes each rank moves per byte of message, NCCL-tests convention."""
    if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")
    if kind == "p2p":
        return 1.0
    g = group_size
    return (2.0 if kind == "all_reduce" else 1.0) * (g - 1) / g


def in_step(points: tuple[AlphaBeta, ...], groups: int) -> tuple[AlphaBeta, ...]:
    """A table's ``groups: 1`` points, each moved toward its group size's point measured with the most groups in
    step, linearly in the number of groups up to ``groups`` (no such point: as measured alone)."""
    alone = tuple(p for p in points if p.groups == 1)
    if groups <= 1 or len(alone) == len(points):
        return alone
    out = []
    for p in alone:
        q = max((q for q in points if q.group_size == p.group_size), key=lambda q: q.groups)
        w = (min(groups, q.groups) - 1) / (q.groups - 1) if q.groups > 1 else 0.0
        out.append(replace(p, alpha_s=p.alpha_s + w * (q.alpha_s - p.alpha_s), busbw=p.busbw + w * (q.busbw - p.busbw)))
    return tuple(out)


def interp_alpha_beta(points: tuple[AlphaBeta, ...], group_size: int, groups: int = 1) -> tuple[float, float]:
    """(alpha_s, busbw) at ``group_size`` from a table sorted by group size (see module docstring), with ``groups``
    disjoint groups in step (:func:`in_step`)."""
    points = in_step(points, groups)
    if not points:
        raise ValueError("empty alpha-beta table")
    g = group_size
    first, last = points[0], points[-1]
    if g <= first.group_size:
        scale = 1.0 if first.group_size <= 1 else max(0.0, (g - 1) / (first.group_size - 1))
        return first.alpha_s * scale, first.busbw
    if g >= last.group_size:
        scale = 1.0 if last.group_size <= 1 else math.log2(g) / math.log2(last.group_size)
        return last.alpha_s * scale, last.busbw
    for a, b in zip(points, points[1:]):
        if a.group_size <= g <= b.group_size:
            w = (g - a.group_size) / (b.group_size - a.group_size)
            return a.alpha_s + w * (b.alpha_s - a.alpha_s), a.busbw + w * (b.busbw - a.busbw)
    raise AssertionError("unreachable: table not sorted")


def interp_efficiency(points: tuple[EfficiencyPoint, ...], flops: float) -> float:
    """Efficiency at ``flops``: power law between points (linear in log-log), clamped at the ends."""
    if flops <= points[0].flops:
        return points[0].efficiency
    if flops >= points[-1].flops:
        return points[-1].efficiency
    x = math.log(flops)
    for a, b in zip(points, points[1:]):
        if a.flops <= flops <= b.flops:
            w = (x - math.log(a.flops)) / (math.log(b.flops) - math.log(a.flops))
            return math.exp(math.log(a.efficiency) + w * (math.log(b.efficiency) - math.log(a.efficiency)))
    raise AssertionError("unreachable: table not sorted")


def interp_seq_efficiency(points: tuple[SeqEfficiencyPoint, ...], seq: int, head_dim: int | None = None) -> float:
    """Efficiency at sequence length ``seq``: linear in ``log(seq)`` between points, clamped at the ends.  A table
    measured per head dimension is read on the curve of the head dimension nearest ``head_dim`` (by ratio; the
    largest when ``head_dim`` is unknown)."""
    dims = sorted({q.head_dim for q in points if q.head_dim is not None})
    if dims:
        pick = dims[-1] if not head_dim else min(dims, key=lambda d: (abs(math.log(d / head_dim)), -d))
        points = tuple(q for q in points if q.head_dim == pick)
    if seq <= points[0].seq:
        return points[0].efficiency
    if seq >= points[-1].seq:
        return points[-1].efficiency
    x = math.log(seq)
    for a, b in zip(points, points[1:]):
        if a.seq <= seq <= b.seq:
            w = (x - math.log(a.seq)) / (math.log(b.seq) - math.log(a.seq))
            return a.efficiency + w * (b.efficiency - a.efficiency)
    raise AssertionError("unreachable: table not sorted")


def _per_kind(table: dict[str, float], kind: str) -> float | None:
    """A per-op-kind table's entry for ``kind`` (causal attention falls back to attention's); None if absent."""
    ratio = table.get(kind)
    if ratio is None and kind == "causal_attention":
        ratio = table.get("attention")
    return ratio


class CostModel:
    """Times in seconds for ops, collectives and p2p transfers on ``profile``.

    ``allow_tf32``: float32 matmul-like ops use the 'tf32' peak when the profile has one.
    """

    __slots__ = ("profile", "allow_tf32")

    def __init__(self, profile: ClusterProfile, *, allow_tf32: bool = False) -> None:
        self.profile = profile
        self.allow_tf32 = allow_tf32

    # ---- compute -------------------------------------------------------------------------------------------

    def _dtype(self, dtype: str) -> str:
        dt = _DTYPE_ALIASES.get(str(dtype), str(dtype))
        if dt not in self.profile.device.peak_flops:
            have = ", ".join(sorted(self.profile.device.peak_flops))
            raise ValueError(f"profile {self.profile.name!r} has no peak FLOP/s for dtype {dtype!r} (has: {have})")
        return dt

    def efficiency(self, dtype: str, flops: float) -> float:
        """Matmul efficiency for a problem of ``flops`` FLOPs in ``dtype``."""
        dt = self._dtype(dtype)
        tables = self.profile.device.matmul_efficiency
        table = tables.get(dt) or tables.get("default") or next(iter(tables.values()))
        return interp_efficiency(table, max(flops, 1.0))

    def compute_rate(self, dtype: str, kind: str, flops: float, seq: int | None = None,
                     head_dim: int | None = None) -> float:
        """Achieved FLOP/s of an op of ``kind`` (``seq``: key length, ``head_dim``: its head dimension, for
        ``causal_attention``)."""
        dev = self.profile.device
        dt = self._dtype(dtype)
        if kind == "causal_attention" and dev.causal_attention_efficiency and seq:
            return dev.peak_flops[dt] * interp_seq_efficiency(dev.causal_attention_efficiency, seq, head_dim)
        if kind in MATMUL_KINDS:
            peak_key = "tf32" if (dt == "float32" and self.allow_tf32 and "tf32" in dev.peak_flops) else dt
            return dev.peak_flops[peak_key] * self.efficiency(dt, flops)
        if dev.vector_flops is not None:
            return dev.vector_flops
        return dev.peak_flops.get("float32", dev.peak_flops[dt])

    def op_time(self, flops: float, bytes: float, dtype: str, kind: str = "other",  # noqa: A002
                seq: int | None = None, head_dim: int | None = None) -> float:
        """``max(flops / rate, bytes / memory_bandwidth) / sustained_fraction + op_overhead(kind)``; a view moves
        no data and costs only its eager overhead (0 unless the profile measured one)."""
        if kind not in OP_KINDS:
            raise ValueError(f"unknown op kind {kind!r}; expected one of {', '.join(OP_KINDS)}")
        if flops < 0 or bytes < 0:
            raise ValueError(f"op_time needs non-negative flops and bytes, got flops={flops}, bytes={bytes}")
        if kind == "view":
            return self.op_overhead(kind)
        dev = self.profile.device
        compute = flops / self.compute_rate(dtype, kind, flops, seq, head_dim) if flops > 0 else 0.0
        memory = bytes / dev.memory_bandwidth
        return max(compute, memory) / dev.sustained_fraction + self.op_overhead(kind)

    def op_overhead(self, kind: str) -> float:
        """Fixed eager cost of one op of ``kind`` per pass: ``launch_overhead_s`` times the profile's measured ratio
        for the kind (``DeviceProfile.op_overhead``; 1 when not measured, 0 for views)."""
        dev = self.profile.device
        ratio = _per_kind(dev.op_overhead, kind)
        if ratio is None:
            ratio = 0.0 if kind == "view" else 1.0
        return dev.launch_overhead_s * ratio

    def sharded_op_extra(self, kind: str | None = None) -> float:
        """Extra eager time of one op of ``kind`` (forward or backward, views included) on tensor-parallel operands:
        DTensor's dispatch (sharding propagation, local-tensor wrapping).  From the profile's measured table per kind
        (``DeviceProfile.dtensor_op_overhead``, scaled by ``sharded_op_overhead``; a kind it lacks: the table's
        mean), else ``sharded_op_overhead - 1`` launch overheads for every op."""
        dev = self.profile.device
        table = dev.dtensor_op_overhead
        if not table:
            return dev.launch_overhead_s * max(dev.sharded_op_overhead - 1.0, 0.0)
        ratio = _per_kind(table, kind) if kind is not None else None
        if ratio is None:
            ratio = sum(table.values()) / len(table)
        return dev.launch_overhead_s * ratio * dev.sharded_op_overhead

    def redistribute_overhead(self) -> float:
        """Seconds of DTensor's eager work for one tensor-parallel resharding per pass, its collective excluded
        (``runtime_overhead["redistribute"]``, :mod:`autopar.profiles.redistribute`; 0 when not measured, as on GPU
        profiles), scaled like DTensor's per-op dispatch by ``sharded_op_overhead``."""
        return self.runtime_overhead("redistribute") * self.profile.device.sharded_op_overhead

    def runtime_overhead(self, kind: str) -> float:
        """Seconds of the runtime's eager work ``kind`` (``DeviceProfile.runtime_overhead``; 0 when not measured)."""
        dev = self.profile.device
        return dev.launch_overhead_s * dev.runtime_overhead.get(kind, 0.0)

    def pipeline_overhead(self, schedule: str, microbatches: int) -> float:
        """Seconds of the pipeline schedule's work per chunk and micro-batch slot for ``schedule`` at
        ``microbatches``: the profile's measured cases of that schedule (``pipeline_<schedule>_<m>``, see
        :mod:`autopar.profiles.syncs`) interpolated linearly in ``log2(m)`` and clamped at the ends; a profile
        without them: 1F1B's cases, else ``pipeline_microbatch`` (one case, 1F1B with 8 micro-batches).  Plus the
        stage's compute resumed after its waits for the neighbour (``pipeline_resume``; 0 when not measured)."""
        table = self.profile.device.runtime_overhead
        pts: list[tuple[int, float]] = []
        for kind in (schedule, "1f1b"):
            pts = pts or sorted((m, table[pipeline_key(k, m)]) for k, m in PIPELINE_CASES
                                if k == kind and pipeline_key(k, m) in table)
        resume = self.runtime_overhead("pipeline_resume")
        if not pts:
            return self.runtime_overhead("pipeline_microbatch") + resume
        x = math.log2(max(microbatches, 1))
        units = pts[0][1] if x <= math.log2(pts[0][0]) else pts[-1][1]
        for (m0, v0), (m1, v1) in zip(pts, pts[1:]):
            a, b = math.log2(m0), math.log2(m1)
            if a <= x <= b:
                units = v0 + (v1 - v0) * (x - a) / (b - a)
        return units * self.profile.device.launch_overhead_s + resume

    def loss_sync(self, world: int, span: GroupSpan | None = None) -> float:
        """Seconds of the training loop's loss sync, an all-reduce of one float over ``world`` ranks after the
        step's compute: the profile's measurement (``runtime_overhead["loss_sync"]``, over all its ranks) when
        ``world`` is the profile's, else the all-reduce table at 4 bytes over ``span`` (default: ``span(world)``)."""
        if world <= 1:
            return 0.0
        measured = self.profile.device.runtime_overhead.get("loss_sync")
        if measured is not None and world == self.profile.world_size:
            return measured * self.profile.device.launch_overhead_s
        return self.collective_time("all_reduce", 4, span=span or self.span(world))

    def optimizer_eager(self, tensors: float, dtensor: bool) -> float:
        """Eager time of one optimizer step over ``tensors`` parameter tensors, on DTensor parameters (tensor
        parallelism, FSDP: DTensor's dispatch on every op of the step) when ``dtensor``."""
        table = self.profile.device.runtime_overhead
        per = table.get("optimizer_dtensor", table.get("optimizer_tensor", 0.0)) if dtensor else \
            table.get("optimizer_tensor", 0.0)
        return tensors * per * self.profile.device.launch_overhead_s

    def fsdp_eager(self, units: float, tensors: float) -> float:
        """Eager time of FSDP2's hooks for one micro-batch's forward and backward over ``units`` units holding
        ``tensors`` parameter tensors (its collectives excluded)."""
        return units * self.runtime_overhead("fsdp_unit") + tensors * self.runtime_overhead("fsdp_tensor")

    def matmul_time(
        self,
        flops: float | None = None,
        bytes: float | None = None,  # noqa: A002
        dtype: str = "float32",
        m: int | None = None,
        n: int | None = None,
        k: int | None = None,
        batch: int = 1,
    ) -> float:
        """Time of a (batched) ``[m,k] @ [k,n]`` matmul; flops/bytes default from the shape."""
        if flops is None or bytes is None:
            if m is None or n is None or k is None:
                raise ValueError("matmul_time needs flops and bytes, or all of m, n, k")
            item = _ITEMSIZE.get(_DTYPE_ALIASES.get(dtype, dtype), 4)
            flops = 2.0 * m * n * k * batch if flops is None else flops
            bytes = float(batch * (m * k + k * n + m * n) * item) if bytes is None else bytes  # noqa: A001
        return self.op_time(flops, bytes, dtype, "matmul")

    # ---- communication -------------------------------------------------------------------------------------

    def span(self, group_size: int, stride: int = 1, stage: int | None = None) -> GroupSpan:
        """:func:`group_span` with this profile's devices per node; with ``stage`` (the ranks of the pipeline stage
        whose groups of this shape run the collective at once, laid out contiguously), as many ``groups`` as fit a
        node's share of it."""
        dpn = self.profile.devices_per_node
        span = group_span(group_size, stride, dpn)
        return span if not stage else replace(span, groups=max(1, min(dpn, stage) // span.devices_per_node))

    def _level(self, level: str) -> LinkProfile:
        link = self.profile.links.get(level)
        if link is None:
            if level == "inter_node":
                raise ValueError(
                    f"profile {self.profile.name!r} has no inter_node link level (a single-node profile, e.g. one "
                    "measured by `autopar profile`); use a built-in multi-node profile or add an inter_node section"
                )
            raise ValueError(f"profile {self.profile.name!r} has no {level} link level")
        return link

    def collective_time(
        self, kind: str, nbytes: float, group_size: int | None = None, span: GroupSpan | None = None
    ) -> float:
        """Time of collective ``kind`` on ``nbytes`` (see the module docstring for the size convention).

        Give ``group_size`` (contiguous ranks) or ``span`` (or both, consistently).
        """
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        if span is None:
            if group_size is None:
                raise ValueError("collective_time needs group_size or span")
            span = self.span(group_size)
        elif group_size is not None and group_size != span.size:
            raise ValueError(f"group_size {group_size} does not match span {span} (size {span.size})")
        g, d, m = span.size, span.devices_per_node, span.nodes
        if g == 1:
            return 0.0
        if kind == "p2p":
            return self.p2p_time(nbytes, intra_node=m == 1)
        prof = self.profile
        if d > prof.devices_per_node or m > prof.nodes:
            raise ValueError(
                f"group {span} does not fit profile {prof.name!r} ({prof.nodes} nodes x {prof.devices_per_node} "
                "devices); use profiles.builtin.with_nodes() to size the cluster"
            )
        alpha, bws = 0.0, []
        if d > 1:
            a, bw = interp_alpha_beta(self._level("intra_node").table(kind), d, span.groups)
            alpha += a
            bws.append(bw)
        if m > 1:
            table = self._level("inter_node").table(kind)
            last = table[-1].group_size
            if kind in RING_ONLY and m > last:
                a, bw = interp_alpha_beta(table, last)
                a += RING_HOP_S * d * (m - last)
            else:
                a, bw = interp_alpha_beta(table, m)
            if kind in RAIL_SCALED:
                bw *= d / prof.devices_per_node
            alpha += a
            bws.append(bw)
        return alpha + collective_factor(kind, g) * nbytes / min(bws)

    def bus_bandwidth(self, kind: str, nbytes: float, span: GroupSpan) -> float:
        """Predicted NCCL-tests bus bandwidth (bytes/s) of ``kind`` on ``nbytes`` over ``span``."""
        t = self.collective_time(kind, nbytes, span=span)
        return collective_factor(kind, span.size) * nbytes / t

    def p2p_time(self, nbytes: float, intra_node: bool = True) -> float:
        """Time to send ``nbytes`` from one rank to another (pipeline stage boundary)."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        link = self._level("intra_node" if intra_node else "inter_node")
        alpha, bw = interp_alpha_beta(link.p2p, 2)
        return alpha + nbytes / bw
