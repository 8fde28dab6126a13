"""Screening for the outer search: layer tables and the closed-form cost of a candidate.

A candidate fixes the mesh ``(pp, dp, cp, tp)``, the micro-batch size and count, the schedule (and virtual stages), the
ZeRO level and a recompute mode.  The intra-op solver gives, for one ``(tp, micro_batch)`` pair, every layer group's
forward/backward time (tp communication included), saved activation bytes under each recompute mode and parameter
elements per device: a :class:`LayerTable`.  Screening then costs a candidate in microseconds with closed forms:

* stages: the min-max contiguous partition of the group times into ``pp * v`` chunks
  (:func:`autopar.planner.inter_op.partition.minmax_partition`);
* pipeline time (Narayanan et al. SC'21): ``(m - 1) * R + sum_k (f_k + b_k)`` for GPipe/1F1B and
  ``m * R + (pp - 1) * R / v`` for interleaved 1F1B, ``R`` the busiest rank's time per micro-batch, plus
  ``2 (K - 1)`` activation transfers on the fill/drain critical path;
* data-parallel communication per FSDP unit, overlapped with compute (:mod:`autopar.planner.inter_op.dpcomm`);
* memory per rank from :mod:`autopar.planner.inter_op.memory` with the schedule's in-flight micro-batches.

The best screened candidates are then evaluated exactly (:mod:`autopar.planner.inter_op.evaluate`): memory-aware
stage partition (:func:`autopar.planner.inter_op.partition.partition_stages`) and the event-driven schedule
simulation (:mod:`autopar.planner.inter_op.schedule`).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from autopar.ir.graph import DTYPE_BYTES, Graph, LayerGroup
from autopar.planner.inter_op.dpcomm import DpComm, dp_comm, dp_span
from autopar.planner.inter_op.memory import GiB, MemoryReserve, in_flight_microbatches, memory_breakdown
from autopar.planner.inter_op.partition import minmax_partition, rank_chunks
from autopar.planner.intra_op.solve import GroupSolution
from autopar.profiles.cost import CostModel

__all__ = ["LayerTable", "Candidate", "Screened", "layer_table", "screen", "ADAM_STEP_BYTES", "group_placements",
           "in_flight", "reserve_for", "ScreenMemo", "block_paths", "dp_time", "divisors",
           "optimizer_time", "FinalistBar", "finalist_count", "finalists_of", "EXACT"]

ADAM_STEP_BYTES = 28.0
"""Bytes an Adam step moves per parameter: fp32 master, m and v read+written (24) + gradient read + param write."""


def optimizer_time(cost: CostModel, *, params: float, tensors: float, zero: int, dp: int, tp: int) -> float:
    """One rank's optimizer step: its memory traffic (sharded over ``dp`` at ZeRO >= 1) and its eager work per
    parameter tensor (:meth:`~autopar.profiles.cost.CostModel.optimizer_eager`), on DTensor parameters under tensor
    parallelism or FSDP (ZeRO >= 1 with ``dp > 1``)."""
    sharded = zero >= 1 and dp > 1
    return (params * ADAM_STEP_BYTES / (dp if zero >= 1 else 1) / cost.profile.device.memory_bandwidth
            + cost.optimizer_eager(tensors, dtensor=tp > 1 or sharded))


@dataclass(frozen=True, slots=True)
class LayerTable:
    """Per layer group numbers for one ``(tp, micro_batch)``; lists are indexed by group."""

    tp: int
    micro_batch: int
    fwd: tuple[float, ...]
    bwd: tuple[float, ...]
    recompute_fwd: dict[str, tuple[float, ...]]
    act: dict[str, tuple[float, ...]]
    act_none: tuple[float, ...]
    params: tuple[float, ...]
    out_bytes: tuple[float, ...]
    shared_params: float
    """Local elements of parameters read by both the first and the last group (tied embeddings)."""
    tensors: tuple[int, ...]
    """Parameter tensors per group (the collectives of a per-tensor data-parallel implementation)."""
    largest_tensor: tuple[float, ...]
    """Local elements of each group's largest parameter tensor (what a per-tensor implementation gathers at once)."""
    solutions: tuple[GroupSolution, ...]
    gap: float
    status: str
    solve_s: float

    def time(self, rc: str) -> list[float]:
        r = self.recompute_fwd[rc]
        return [f + b + x for f, b, x in zip(self.fwd, self.bwd, r)]


def _local_elems(graph: Graph, names: tuple[str, ...], placements: dict[str, str], tp: int) -> float:
    tot = 0.0
    for n in names:
        info = graph.param_map.get(n)
        if info is None or info.kind != "param":
            continue
        tot += info.meta.numel / (tp if placements.get(n, "R").startswith("S") else 1)
    return tot


_SIZES: dict[int, tuple[Graph, tuple[tuple[tuple[str, int], ...], ...]]] = {}


def _param_sizes(graph: Graph) -> tuple[tuple[tuple[str, int], ...], ...]:
    """Per layer group, ``(name, numel)`` of its trainable parameters in ``group.params`` order (what
    :func:`_local_elems` reads), computed once per graph: every intra-op table of a search needs them."""
    got = _SIZES.get(id(graph))
    if got is None or got[0] is not graph:  # hold the graph, so its id cannot be reused while cached
        if len(_SIZES) >= 8:
            _SIZES.clear()
        pm = graph.param_map
        sizes = tuple(tuple((n, pm[n].meta.numel) for n in g.params if n in pm and pm[n].kind == "param")
                      for g in graph.layers)
        got = _SIZES[id(graph)] = (graph, sizes)
    return got[1]


def _local_sum(sizes: tuple[tuple[str, int], ...], placements: dict[str, str], tp: int) -> float:
    """:func:`_local_elems` over one group's :func:`_param_sizes` (the same sum, term by term)."""
    tot = 0.0
    for n, numel in sizes:
        tot += numel / (tp if placements.get(n, "R").startswith("S") else 1)
    return tot


def param_floor(graph: Graph, tp: int) -> float:
    """The least ``sum(table.params)`` any sharding at ``tp`` can have: every parameter sharded ``tp`` ways, summed
    term by term as :func:`layer_table` sums a table's (each of its terms is this one or larger, and float sums of
    larger terms in the same order are not smaller)."""
    out = []
    for sizes in _param_sizes(graph):
        tot = 0.0
        for _, numel in sizes:
            tot += numel / tp
        out.append(tot)
    return sum(out)


def _largest_local(sizes: tuple[tuple[str, int], ...], placements: dict[str, str], tp: int) -> float:
    return max((numel / (tp if placements.get(n, "R").startswith("S") else 1) for n, numel in sizes), default=0.0)


def block_paths(graph: Graph) -> frozenset[str]:
    """Module paths of the repeated-block groups (for :func:`group_placements`)."""
    return frozenset(g.module_path for g in graph.layers if g.role == "block" and g.module_path)


@lru_cache(maxsize=65536)
def _longest_block_prefix(name: str, blocks: frozenset[str]) -> str:
    """The longest ``b`` in ``blocks`` with ``name.startswith(b + ".")`` (a set lookup per dot of ``name``)."""
    pos = name.rfind(".")
    while pos > 0:
        if name[:pos] in blocks:
            return name[:pos]
        pos = name.rfind(".", 0, pos)
    return ""


def group_placements(graph: Graph, group: LayerGroup, sol: GroupSolution,
                     blocks: frozenset[str] | None = None) -> dict[str, str]:
    """``sol``'s parameter placements under ``group``'s own names.

    A solution reused across identical blocks names the parameters of the block it was solved on
    (``blocks.0.mlp.fc1.weight``); rename them into ``group`` (``blocks.7.mlp.fc1.weight``).  Interleaved shardings
    of fused weights keep their split factor (``S(0)[3]``: each rank holds its slice of every part).  ``blocks``:
    :func:`block_paths` of ``graph``, when the caller already has it."""
    src = graph.layers[sol.group_index].module_path if sol.group_index < len(graph.layers) else ""
    own = set(group.params)
    if blocks is None:
        blocks = block_paths(graph)
    out: dict[str, str] = {}
    for name, pl in sol.param_placements.items():
        k = sol.param_split_factors.get(name, 1)
        if k > 1 and "[" not in pl:
            pl = f"{pl}[{k}]"
        if name not in own and group.module_path:
            prefix = src if src and name.startswith(src + ".") else _longest_block_prefix(name, blocks)
            if prefix:
                name = group.module_path + name[len(prefix):]
        out[name] = pl
    return out


def layer_table(graph: Graph, sols: tuple[GroupSolution, ...], tp: int, micro_batch: int) -> LayerTable:
    placements: dict[str, str] = {}
    blocks = block_paths(graph)
    for g, s in zip(graph.layers, sols):
        placements.update(group_placements(graph, g, s, blocks))
    sizes = _param_sizes(graph)
    params = tuple(_local_sum(sz, placements, tp) for sz in sizes)
    first, last = graph.layers[0], graph.layers[-1]
    shared = _local_elems(graph, tuple(set(first.params) & set(last.params)), placements, tp) \
        if len(graph.layers) > 1 else 0.0
    zero = tuple(0.0 for _ in sols)
    gaps = [s.gap for s in sols]
    status = "optimal" if all(s.status == "optimal" for s in sols) else \
        ("timeout" if any(s.status == "timeout" for s in sols) else "feasible")
    return LayerTable(
        tp=tp, micro_batch=micro_batch,
        fwd=tuple(s.fwd_compute_s + s.fwd_comm_s for s in sols),
        bwd=tuple(s.bwd_compute_s + s.bwd_comm_s for s in sols),
        recompute_fwd={"none": zero, "selective": tuple(s.recompute_fwd_s_selective for s in sols),
                       "full": tuple(s.recompute_fwd_s_full for s in sols)},
        act={"none": tuple(s.act_bytes_none for s in sols),
             "selective": tuple(s.act_bytes_selective for s in sols),
             "full": tuple(s.act_bytes_full for s in sols)},
        act_none=tuple(s.act_bytes_none for s in sols),
        params=params, out_bytes=tuple(s.out_bytes for s in sols), shared_params=shared,
        tensors=tuple(len(sz) for sz in sizes),
        largest_tensor=tuple(_largest_local(sz, placements, tp) for sz in sizes),
        solutions=sols, gap=max(gaps) if gaps else 0.0, status=status,
        solve_s=sum(s.wall_s for s in sols))


@dataclass(frozen=True, slots=True)
class Candidate:
    pp: int
    dp: int
    tp: int
    micro_batch: int
    num_microbatches: int
    schedule: str
    virtual_stages: int
    zero: int
    recompute: str
    lean: bool = False
    """Use the memory-lean intra-op sharding (parameter memory priced) instead of the fastest one."""
    cp: int = 1
    """Context-parallel degree (:mod:`autopar.planner.inter_op.context`); its table is the cp-scaled one."""
    ep: int = 1
    """Expert-parallel degree (divides dp; :mod:`autopar.planner.inter_op.expert`); its table is the ep one."""

    @property
    def grad_dp(self) -> int:
        """Ranks holding the same parameters: the group of the gradient reduction and of ZeRO sharding (dp x cp)."""
        return self.dp * self.cp


@dataclass(frozen=True, slots=True)
class Screened:
    cand: Candidate
    time_s: float
    peak_mem: float
    fits: bool
    chunks: tuple[tuple[int, int], ...]


def _expert_elems(table: LayerTable, chunks: list[tuple[int, int]], pp: int, rank: int) -> float:
    """Local routed-expert elements of pipeline rank ``rank`` (an ep table's ``expert_params``; 0 otherwise)."""
    ex = getattr(table, "expert_params", ())
    return float(sum(sum(ex[a:b]) for a, b in rank_chunks(chunks, pp, rank))) if ex else 0.0


@lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, m: int, v: int) -> tuple[float, ...]:
    """Per rank: micro-batches of its stage's activations alive at the peak (from the schedule's op order)."""
    return in_flight_microbatches(schedule, pp=pp, num_microbatches=m, virtual_stages=v)  # type: ignore[arg-type]


def reserve_for(cost: CostModel) -> MemoryReserve:
    """CPU processes need far less fixed reserve than a CUDA context with NCCL buffers."""
    if "cpu" in cost.profile.device.name.lower():
        return MemoryReserve(fixed_bytes=0.25 * GiB)
    return MemoryReserve()


def dp_time(cost: CostModel, *, params: float, units: int, fwd_s: float, bwd_s: float, m: int, dp: int, tp: int,
            zero: int, dtype: str, reduce_dtype: str, overlap: bool | None, memo: ScreenMemo | None = None,
            tensors: int = 0, recompute: str = "none", param_tensors: float = 0.0) -> DpComm:
    """Data-parallel communication of one rank per iteration (:func:`autopar.planner.inter_op.dpcomm.dp_comm`),
    the one formula screening and exact evaluation share; ``memo`` memoizes its collective times.  ``tensors``:
    the rank's parameter tensors for a per-tensor implementation (``PlanOptions.dp_collectives == "tensor"``, which
    also re-gathers for a full recompute), 0 for FSDP2's one collective per unit; ``param_tensors``: the rank's
    parameter tensors (FSDP2's eager work per tensor).  ``overlap=None``: ZeRO 0's sync overlapped with the backward
    or after it, whichever costs less (:attr:`~autopar.planner.options.PlanOptions.overlap_grad_sync`)."""
    coll = None if memo is None else memo.collectives(cost, dp, tp)

    def run(ov: bool) -> DpComm:
        return dp_comm(cost, params=params, units=units, fwd_s=fwd_s, bwd_s=bwd_s, num_microbatches=m, dp=dp, tp=tp,
                       zero=zero, param_item=DTYPE_BYTES.get(dtype, 4), reduce_item=DTYPE_BYTES.get(reduce_dtype, 4),
                       overlap=ov, coll=coll, per_unit=tensors / units if tensors else 1.0,
                       recompute_regather=bool(tensors) and recompute == "full", param_tensors=param_tensors)

    if overlap is not None or zero != 0:
        return run(overlap is not False)
    return min(run(True), run(False), key=lambda d: d.total_s)  # ties: overlapped


class ScreenMemo:
    """What screening computes that does not depend on the whole candidate, kept for one search.

    The min-max partition depends only on the table's times (its recompute mode) and ``pp * v``; the per-rank sums
    over those chunks also on ``pp``; a collective's time only on its bytes and group.  Values are computed by
    exactly the formulas :func:`screen` used before, so memoized and fresh results are bit-identical."""

    __slots__ = ("_tables", "_coll")

    def __init__(self) -> None:
        self._tables: dict[int, tuple[LayerTable, dict[tuple, object]]] = {}
        self._coll: dict[tuple[str, float, int, int], float] = {}

    def _of(self, table: LayerTable) -> dict[tuple, object]:
        got = self._tables.get(id(table))
        if got is None or got[0] is not table:  # hold the table, so its id cannot be reused while memoized
            got = self._tables[id(table)] = (table, {})
        return got[1]

    def collective(self, cost: CostModel, kind: str, nbytes: float, dp: int, tp: int) -> float:
        key = (kind, nbytes, dp, tp)
        t = self._coll.get(key)
        if t is None:
            t = self._coll[key] = cost.collective_time(kind, nbytes, span=dp_span(cost, dp, tp))
        return t

    def collectives(self, cost: CostModel, dp: int, tp: int) -> Callable[[str, float], float]:
        """``(kind, nbytes) -> s`` on the dp group of ``(dp, tp)``, memoized (for :func:`dp_time`)."""
        return lambda kind, nbytes: self.collective(cost, kind, nbytes, dp, tp)

    def ranks(self, table: LayerTable, rc: str, pp: int, v: int, cost: CostModel, p2p_intra: bool
              ) -> tuple[list[tuple[int, int]], float, float, tuple[tuple[float, ...], ...],
                         tuple[tuple[int, ...], ...]] | None:
        """``(chunks, sum of times, p2p, per rank (time, params, act sum, full-recompute extra, largest layer,
        forward, layer groups, parameter tensors, largest tensor), ranks with equal numbers)`` or None when
        ``pp * v`` exceeds the groups. The last item groups the rank indices whose per-rank numbers are equal (most
        ranks of a model of identical blocks), in order of first occurrence."""
        memo = self._of(table)
        key = (rc, pp, v, p2p_intra)
        if key in memo:
            return memo[key]  # type: ignore[return-value]
        pkey = ("part", rc, pp * v)
        if pkey not in memo:
            memo[pkey] = (table.time(rc), minmax_partition(table.time(rc), pp * v))
        times, chunks = memo[pkey]  # type: ignore[misc]
        if chunks is None:
            memo[key] = None
            return None
        act, n = table.act[rc], len(times)
        p2p = max((cost.p2p_time(table.out_bytes[b - 1], intra_node=p2p_intra) for _, b in chunks[:-1]),
                  default=0.0)
        per_rank = []
        for r in range(pp):
            mine = rank_chunks(chunks, pp, r)
            t = sum(sum(times[a:b]) for a, b in mine)
            params = sum(sum(table.params[a:b]) for a, b in mine)
            if any(a == 0 for a, _ in mine) and any(b == n for _, b in mine):
                params -= table.shared_params
            acts = sum(sum(act[a:b]) for a, b in mine)
            extra = max(max(table.act_none[a:b]) for a, b in mine) if rc == "full" else 0.0
            largest = max(max(table.params[a:b]) for a, b in mine)
            largest_t = max(max(table.largest_tensor[a:b]) for a, b in mine)
            fwd = sum(sum(table.fwd[a:b]) for a, b in mine)
            units = sum(b - a for a, b in mine)
            tensors = sum(sum(table.tensors[a:b]) for a, b in mine)
            per_rank.append((t, params, acts, extra, largest, fwd, units, tensors, largest_t))
        alike: dict[tuple[float, ...], list[int]] = {}
        for r, numbers in enumerate(per_rank):
            alike.setdefault(numbers, []).append(r)
        out = (chunks, sum(times), p2p, tuple(per_rank), tuple(tuple(rs) for rs in alike.values()))
        memo[key] = out
        return out


def screen(cand: Candidate, table: LayerTable, cost: CostModel, *, dtype: str, capacity: float,
           p2p_intra: bool, overlap_grad_sync: bool = True, memo: ScreenMemo | None = None,
           reduce_dtype: str = "float32", dp_collectives: str = "unit", bound: float = math.inf) -> Screened | None:
    """Closed-form time and memory of a candidate (see the module docstring); None if it cannot be built, or when
    its pipeline time alone (compute, the schedule's work and the fill/drain transfers, to which data-parallel
    communication and the optimizer step only add) exceeds ``bound``: then memory and the rest are not costed (the
    search's :class:`FinalistBar`).

    Pass one ``memo`` to every call of a search to skip recomputing what does not depend on the candidate."""
    memo = memo or ScreenMemo()
    pp, v, m = cand.pp, cand.virtual_stages, cand.num_microbatches
    k = pp * v
    got = memo.ranks(table, cand.recompute, pp, v, cost, p2p_intra)
    if got is None:
        return None
    chunks, sum_times, p2p, ranks, alike = got
    pm = cost.pipeline_overhead(cand.schedule, m) if pp > 1 else 0.0  # the schedule's work per chunk and mb
    busiest = max(r[0] for r in ranks) + v * pm
    sum_times += k * pm
    if cand.schedule == "interleaved_1f1b":
        pipe = m * busiest + (pp - 1) * busiest / v
    else:
        pipe = (m - 1) * busiest + sum_times
    pipe += 2 * (k - 1) * p2p
    if pipe > bound:
        return None
    mixed = dtype != "float32"
    worst_end, peak = 0.0, 0.0
    flights = in_flight(cand.schedule, pp, m, v)
    reserve = reserve_for(cost)
    full = cand.recompute == "full"
    dp, tp, zero = cand.grad_dp, cand.tp, cand.zero  # cp ranks reduce gradients and shard ZeRO state with dp
    # ranks with equal numbers differ only in their in-flight micro-batches: their dp communication is the same, and
    # memory grows with the activations, so the one holding the most micro-batches has the group's peak (float
    # products and sums of non-negative numbers are monotone: the same maximum as evaluating every rank)
    for group in alike:
        t, params, acts, extra, largest, fwd, units, tensors, largest_t = ranks[group[0]]
        t, fwd = t + v * pm, fwd + v * pm / 2
        acts = acts * max(flights[r] for r in group)
        if full:
            acts += extra
        mem = memory_breakdown(param_elems=params, zero=zero, dp=dp, mixed_precision=mixed,
                               activations=acts, capacity=capacity,
                               largest_layer_elems=largest_t if dp_collectives == "tensor" else largest,
                               reduce_bytes=DTYPE_BYTES.get(reduce_dtype, 4),
                               reserve=reserve, ep=cand.ep,
                               expert_elems=_expert_elems(table, chunks, pp, group[0])).total
        peak = max(peak, mem)
        comm = dp_time(cost, params=params, units=units, fwd_s=fwd, bwd_s=t - fwd, m=m, dp=dp, tp=tp, zero=zero,
                       dtype=dtype, reduce_dtype=reduce_dtype, overlap=overlap_grad_sync, memo=memo,
                       tensors=tensors if dp_collectives == "tensor" else 0, recompute=cand.recompute,
                       param_tensors=tensors)
        opt = optimizer_time(cost, params=params, tensors=tensors, zero=zero, dp=dp, tp=tp)
        worst_end = max(worst_end, comm.total_s + opt)
    total = pipe + worst_end
    return Screened(cand, total, peak, peak <= capacity, tuple(chunks))


EXACT = 24
"""Screened candidates evaluated exactly (at least; one more than the alternatives asked for)."""


def finalist_count(top_k: int) -> int:
    """How many screened candidates the search evaluates exactly."""
    return max(EXACT, top_k + 1)


def finalists_of(feasible: list[Screened], top_k: int) -> list[Screened]:
    """The best screened candidates (each once), to be evaluated exactly; sorts ``feasible`` by time."""
    feasible.sort(key=lambda s: (s.time_s, s.peak_mem))
    out: list[Screened] = []
    seen: set[Candidate] = set()
    for s in feasible[: finalist_count(top_k)]:
        if s.cand not in seen:
            seen.add(s.cand)
            out.append(s)
    return out


class FinalistBar:
    """The time a screened candidate must beat to be among the finalists, from the fitting candidates seen so far: the
    ``keep``-th best time (infinite until ``keep`` fit).  A candidate whose pipeline time (a lower bound on its
    screened time: :func:`screen`'s ``bound``) is already above it cannot be a finalist, so screening skips costing
    its memory and data-parallel communication.  Every finalist is kept whatever the order or split of the units: a
    finalist's time is at most the ``keep``-th best of all fitting candidates, so at most the ``keep``-th best of any
    subset."""

    __slots__ = ("keep", "_heap")

    def __init__(self, keep: int) -> None:
        self.keep, self._heap = keep, []  # the negated times of the best ``keep`` so far (a max-heap)

    @property
    def time(self) -> float:
        return -self._heap[0] if len(self._heap) == self.keep else math.inf

    def add(self, t: float) -> None:
        if len(self._heap) < self.keep:
            heapq.heappush(self._heap, -t)
        elif t < -self._heap[0]:
            heapq.heapreplace(self._heap, -t)


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(math.isqrt(n)) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
