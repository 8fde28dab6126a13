"""Stage partitioner: the one place that cuts the sequence of layer groups into pipeline stages.

Layer groups ``0..n-1`` (cuts only between groups) are split into ``K = pp * v`` contiguous, non-empty virtual
stages, each given as ``(start, end)``: groups ``start..end-1``. Virtual stage ``k`` runs on rank ``k % pp``
(round-robin chunks, Narayanan et al. SC'21): :func:`rank_chunks`. The same problem is solved at two levels of
detail:

* :func:`minmax_partition`, for screening (every candidate, microseconds): time only. It minimizes the largest stage
  time ``sum(time[i:j])`` by binary search on the bottleneck and a greedy fill (exact for non-negative weights),
  ignoring memory and transfers.
* :func:`partition_stages`, exact (the search's finalists): stage time with its outgoing transfer, under memory
  limits, with a balanced-memory tie-break; the dynamic program below. :func:`stage_cost` gives ``T_k`` and ``M_k``
  of given cuts by the same formulas.

Both are pure solver cores over plain costs (no I/O), so tests compare them with brute-force enumeration (as alpa's
stage DP tests do).

**Exact formulation.** For stage ``k = [i, j)``:

- time ``T_k(i, j) = sum(time[i:j]) + (p2p(out_bytes[j-1], k) if k < K-1 else 0)``: compute of one micro-batch plus
  the transfer across its outgoing boundary (charged to the sender; the caller's ``p2p`` says whether that covers the
  forward activation and the backward gradient, usually both),
- memory ``M_k(i, j) = sum(mem[i:j]) + in_flight(k) * sum(act[i:j])``: model state plus the activations of the
  ``in_flight(k)`` micro-batches the schedule keeps alive on that stage (:mod:`autopar.planner.inter_op.schedule`).

Objective: minimize the bottleneck ``max_k T_k`` (the steady-state pipeline period; total compute is fixed, so this
also minimizes the iteration time ``~ sum_k T_k + (m - 1) max_k T_k`` up to transfers) subject to
``M_k <= capacity`` for every stage (``v == 1``). DP over prefixes, ``O(n^2 K)``:
``best[k][j] = min_i max(best[k-1][i], T_{k-1}(i, j))`` over feasible ``[i, j)``.

**Tie-break (balanced memory).** Among partitions with the optimal bottleneck ``T*`` a second DP minimizes the peak
stage memory ``max_k M_k`` subject to ``T_k <= T*`` (exact: min-max is decomposable once the time bound is a per-stage
constraint). Remaining ties go to the earliest cut (the smallest ``i`` among equal values), so the result is
deterministic.

**Interleaved (v > 1).** A rank holds ``v`` non-contiguous chunks whose memories add up, which does not decompose
over prefixes. We constrain every chunk to ``capacity / v`` (sufficient, not necessary: it can reject a split that
would fit unevenly) and report the true per-rank sums. Pass ``in_flight(k) =
memory.in_flight_microbatches(schedule, ...)[k % pp]`` (the rank's peak chunk-micro-batches divided by ``v``): with
equal chunks the rank's activations ``sum_c act_c * in_flight`` are then exactly the simulator's peak.
"""

from __future__ import annotations

import logging
import math
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import TypeVar

__all__ = ["StagePartition", "minmax_partition", "minmax_partition_hetero", "partition_stages",
           "partition_stages_hetero", "rank_chunks", "stage_cost"]

log = logging.getLogger(__name__)

P2PFn = Callable[[float, int], float]
"""``p2p(nbytes, k)``: transfer time per micro-batch across the boundary after virtual stage ``k``."""
InFlightFn = Callable[[int], float]
"""``in_flight(k)``: micro-batches of activations virtual stage ``k`` holds at its peak."""
_REL = 1e-9
T = TypeVar("T")


def rank_chunks(per_stage: Sequence[T], pp: int, rank: int) -> Sequence[T]:
    """What rank ``rank`` holds of a per-virtual-stage sequence (cuts, memories...): stages ``rank, rank + pp, ...``
    (round-robin)."""
    return per_stage[rank::pp]


# ---- screening: time only --------------------------------------------------------------------------------------
def minmax_partition(times: list[float], k: int) -> list[tuple[int, int]] | None:
    """Split ``times`` into ``k`` non-empty contiguous ranges minimizing the largest range sum (exact)."""
    n = len(times)
    if k > n or k < 1:
        return None
    def fill(limit: float, most: int = n) -> list[tuple[int, int]]:
        """Greedy ranges of sum <= limit (a single item may exceed it); stops after ``most`` cuts."""
        out, start, acc = [], 0, 0.0
        for i, t in enumerate(times):
            if i > start and acc + t > limit:
                out.append((start, i))
                if len(out) == most:
                    break
                start, acc = i, 0.0
            acc += t
        else:
            out.append((start, n))
        return out

    lo, hi = max(times), sum(times)
    for _ in range(100):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        if len(fill(mid, k + 1)) <= k:
            hi = mid
        else:
            lo = mid
    best = fill(hi)
    while len(best) < k:  # split the heaviest multi-item range: the maximum cannot grow
        j = max((i for i, (a, b) in enumerate(best) if b - a > 1), key=lambda i: sum(times[best[i][0]:best[i][1]]))
        a, b = best[j]
        best[j:j + 1] = [(a, b - 1), (b - 1, b)]
    return best


# ---- exact: time and memory -----------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True, frozen=True)
class StagePartition:
    """Result of :func:`partition_stages`."""

    feasible: bool
    """False when no partition fits memory (or there are fewer groups than stages); then the rest is empty."""
    reason: str = ""
    """Why it is infeasible, for the user."""
    boundaries: tuple[tuple[int, int], ...] = ()
    """Per virtual stage ``(start, end)``: layer groups ``start..end-1``."""
    stage_time: tuple[float, ...] = ()
    """Per virtual stage: compute + outgoing transfer per micro-batch (``T_k``)."""
    stage_memory: tuple[float, ...] = ()
    """Per virtual stage: ``M_k`` in bytes."""
    rank_memory: tuple[float, ...] = ()
    """Per rank: sum of its chunks' ``M_k`` (equals ``stage_memory`` when ``v == 1``)."""
    bottleneck_s: float = math.inf
    """``max(stage_time)``: the objective."""


@dataclass(kw_only=True, slots=True, frozen=True)
class _Costs:
    time: Sequence[float]
    mem: Sequence[float]
    act: Sequence[float]
    out_bytes: Sequence[float]
    p2p: P2PFn
    in_flight: InFlightFn
    K: int
    pt: list[float]
    pm: list[float]
    pa: list[float]
    per_group: Sequence[tuple[list[float], list[float], list[float]]] = ()
    """Heterogeneous stages: (pt, pm, pa) per device group, stage ``k`` costed on group ``stage_group[k]``."""
    stage_group: Sequence[int] = ()
    caps: Sequence[float] = ()
    """Heterogeneous stages: each device group's capacity per chunk (``capacity / v`` of that group)."""

    def pre(self, k: int) -> tuple[list[float], list[float], list[float]]:
        """Prefix sums (time, memory, activations) that virtual stage ``k`` is costed with."""
        return self.per_group[self.stage_group[k]] if self.stage_group else (self.pt, self.pm, self.pa)

    def t(self, k: int, i: int, j: int) -> float:
        link = self.p2p(self.out_bytes[j - 1], k) if k < self.K - 1 else 0.0
        pt = self.pre(k)[0]
        return pt[j] - pt[i] + link

    def m(self, k: int, i: int, j: int) -> float:
        _, pm, pa = self.pre(k)
        return pm[j] - pm[i] + self.in_flight(k) * (pa[j] - pa[i])


def _prefix(x: Sequence[float]) -> list[float]:
    return [0.0, *accumulate(float(y) for y in x)]


def _validate(time: Sequence[float], mem: Sequence[float], act: Sequence[float], out_bytes: Sequence[float],
              pp: int, v: int, capacity: float) -> None:
    n = len(time)
    if n == 0:
        raise ValueError("need at least one layer group")
    for name, xs in (("mem", mem), ("act", act), ("out_bytes", out_bytes)):
        if len(xs) != n:
            raise ValueError(f"{name} has {len(xs)} entries but time has {n} (one per layer group)")
    for name, xs in (("time", time), ("mem", mem), ("act", act), ("out_bytes", out_bytes)):
        if any(not math.isfinite(x) or x < 0 for x in xs):
            raise ValueError(f"{name} must be finite and >= 0")
    if pp < 1 or v < 1:
        raise ValueError(f"pp and virtual_stages must be >= 1, got {pp}, {v}")
    if not capacity > 0:
        raise ValueError(f"capacity must be > 0 bytes, got {capacity}")


def _dp(c: _Costs, n: int, cap: float, bound: float | None = None) -> tuple[float, list[list[int]]]:
    """Min over partitions of max_k cost(k, i, j), every stage within ``cap``; returns (value, argmin table).

    ``bound`` None: cost is the stage time ``T_k``. Otherwise cost is the stage memory ``M_k`` and only stages with
    ``T_k <= bound`` are allowed. ``T_k`` and ``M_k`` are :meth:`_Costs.t` and :meth:`_Costs.m`, inlined with the
    same arithmetic (this loop is the exact evaluation's hot spot)."""
    K, inf = c.K, math.inf
    best = [[inf] * (n + 1) for _ in range(K + 1)]
    arg = [[-1] * (n + 1) for _ in range(K + 1)]
    best[0][0] = 0.0
    for k in range(1, K + 1):
        s = k - 1
        prev, cur, a = best[s], best[k], arg[k]
        f = c.in_flight(s)
        pt, pm, pa = c.pre(s)
        cap_s = c.caps[c.stage_group[s]] if c.stage_group else cap
        # The scan runs from the last start down: prefix sums of non-negative numbers make T and M grow as the start
        # moves down (float rounding is monotone), so once T or M alone exceeds what can still win or fit, every
        # earlier start does too and the scan stops. Ties keep the earliest start, as an upward scan with strict
        # improvement does.
        mono = f >= 0
        # stage s = [i, j); leave at least one group for each later stage
        for j in range(k, n - (K - k) + 1):
            link = c.p2p(c.out_bytes[j - 1], s) if s < K - 1 else 0.0
            ptj, pmj, paj = pt[j], pm[j], pa[j]
            bj, aj = inf, -1
            for i in range(j - 1, s - 1, -1):
                mem = pmj - pm[i] + f * (paj - pa[i])
                if mem > cap_s:
                    if mono:
                        break
                    continue
                t = ptj - pt[i] + link
                if bound is None:
                    if t > bj:
                        break
                    b = prev[i]
                    if b == inf:
                        continue
                    val = max(b, t)
                else:
                    if t > bound or (mono and mem > bj):
                        break
                    b = prev[i]
                    if b == inf:
                        continue
                    val = max(b, mem)
                if val <= bj:
                    bj, aj = val, i
            cur[j], a[j] = bj, aj
    return best[K][n], arg


def _cuts(arg: list[list[int]], K: int, n: int) -> tuple[tuple[int, int], ...]:
    out, j = [], n
    for k in range(K, 0, -1):
        i = arg[k][j]
        out.append((i, j))
        j = i
    assert j == 0
    return tuple(reversed(out))


def _partition(costs: _Costs, *, n: int, pp: int, v: int, capacity: float) -> StagePartition:
    """Run the two DPs on prepared costs (see the module docstring)."""
    K = pp * v
    if n < K:
        return StagePartition(feasible=False, reason=f"{n} layer groups cannot fill pp*v = {K} stages; lower pp "
                                                    "or virtual_stages")
    cap = capacity / v
    t_star, _ = _dp(costs, n, cap)
    if t_star == math.inf:
        return StagePartition(feasible=False, reason=f"no split into {K} stages fits {capacity / 2**30:.2f} GiB "
                                                    "per device; add devices, raise zero or recomputation")
    bound = t_star * (1 + _REL) + 1e-15
    _, arg = _dp(costs, n, cap, bound)
    cuts = _cuts(arg, K, n)
    times = tuple(costs.t(k, i, j) for k, (i, j) in enumerate(cuts))
    mems = tuple(costs.m(k, i, j) for k, (i, j) in enumerate(cuts))
    ranks = tuple(sum(rank_chunks(mems, pp, r)) for r in range(pp))
    assert all(m <= (costs.caps[costs.stage_group[r]] * v if costs.stage_group else capacity) * (1 + _REL)
               for r, m in enumerate(ranks))
    log.debug("partitioned %d groups into %d stages: bottleneck %.6gs, cuts %s", n, K, max(times), cuts)
    return StagePartition(feasible=True, boundaries=cuts, stage_time=times, stage_memory=mems, rank_memory=ranks,
                          bottleneck_s=max(times))


def partition_stages(time: Sequence[float], mem: Sequence[float], act: Sequence[float],
                     out_bytes: Sequence[float], *, pp: int, capacity: float, virtual_stages: int = 1,
                     p2p: P2PFn | None = None, in_flight: InFlightFn | None = None) -> StagePartition:
    """Split layer groups into ``pp * virtual_stages`` stages minimizing the bottleneck stage time.

    ``time[i]``: forward+backward time per micro-batch of group ``i`` (including its tp communication);
    ``mem[i]``: model-state bytes of group ``i`` per device; ``act[i]``: activation bytes per micro-batch;
    ``out_bytes[i]``: activation bytes crossing a cut after group ``i``; ``p2p(nbytes, k)``: transfer time after
    virtual stage ``k`` (default: free); ``in_flight(k)``: micro-batches alive on virtual stage ``k`` (default 1);
    ``capacity``: bytes per device available to these costs.
    """
    _validate(time, mem, act, out_bytes, pp, virtual_stages, capacity)
    costs = _Costs(time=time, mem=mem, act=act, out_bytes=out_bytes, p2p=p2p or (lambda b, k: 0.0),
                   in_flight=in_flight or (lambda k: 1.0), K=pp * virtual_stages, pt=_prefix(time),
                   pm=_prefix(mem), pa=_prefix(act))
    return _partition(costs, n=len(time), pp=pp, v=virtual_stages, capacity=capacity)


def partition_stages_hetero(time: Sequence[Sequence[float]], mem: Sequence[Sequence[float]],
                            act: Sequence[Sequence[float]], out_bytes: Sequence[float], *, pp: int,
                            rank_group: Sequence[int], capacity: Sequence[float], virtual_stages: int = 1,
                            p2p: P2PFn | None = None, in_flight: InFlightFn | None = None) -> StagePartition:
    """:func:`partition_stages` for a pipeline whose ranks run on different device types.

    ``time[g]``, ``mem[g]``, ``act[g]``: the per-layer-group costs on device group ``g``; ``rank_group[r]``: the
    group pipeline rank ``r`` runs on (virtual stage ``k`` on ``rank_group[k % pp]``); ``capacity[g]``: bytes per
    device of group ``g``. Each stage is costed and memory-checked on its own group, by the same two DPs; ``p2p``
    should charge the inter-group link at a boundary between groups."""
    if len(rank_group) != pp or any(not 0 <= g < len(time) for g in rank_group):
        raise ValueError(f"rank_group needs one group index (< {len(time)}) per pipeline rank, got {rank_group}")
    if not (len(time) == len(mem) == len(act) == len(capacity)) or not time:
        raise ValueError("time, mem, act and capacity need one entry per device group")
    for g in range(len(time)):
        _validate(time[g], mem[g], act[g], out_bytes, pp, virtual_stages, capacity[g])
    K = pp * virtual_stages
    costs = _Costs(time=time[0], mem=mem[0], act=act[0], out_bytes=out_bytes, p2p=p2p or (lambda b, k: 0.0),
                   in_flight=in_flight or (lambda k: 1.0), K=K, pt=[], pm=[], pa=[],
                   per_group=[(_prefix(t), _prefix(m), _prefix(a)) for t, m, a in zip(time, mem, act)],
                   stage_group=[rank_group[k % pp] for k in range(K)],
                   caps=[c / virtual_stages for c in capacity])
    return _partition(costs, n=len(time[0]), pp=pp, v=virtual_stages, capacity=min(capacity))


def minmax_partition_hetero(times: Sequence[Sequence[float]], stage_group: Sequence[int]
                            ) -> list[tuple[int, int]] | None:
    """Screening's :func:`minmax_partition` for stages on different device types: ``times[g]`` the layer groups'
    times on device group ``g``, ``stage_group[k]`` the group of stage ``k``. Binary search on the bottleneck with a
    greedy fill that gives each stage, in order, as many layer groups as stay under it on its own device (leaving
    one for each later stage); exact up to a single layer group heavier than the bottleneck."""
    n, K = len(times[0]), len(stage_group)
    if K > n or K < 1:
        return None
    pre = [_prefix(t) for t in times]

    def fill(limit: float) -> list[tuple[int, int]] | None:
        out, start = [], 0
        for k, g in enumerate(stage_group):
            p, last = pre[g], n - (K - k - 1)
            # the furthest end with p[end] - p[start] <= limit, at least start + 1 and at most last
            end = n if k == K - 1 else max(start + 1, min(last, bisect_right(p, p[start] + limit) - 1))
            out.append((start, end))
            start = end
        ok = all(pre[g][b] - pre[g][a] <= limit or b - a == 1 for g, (a, b) in zip(stage_group, out))
        return out if ok else None

    lo, hi = 0.0, max(p[n] for p in pre)
    best = fill(hi)
    for _ in range(60):
        if hi - lo <= 1e-6 * max(hi, 1e-30):  # screening: a millionth of the bottleneck is close enough
            break
        mid = (lo + hi) / 2
        got = fill(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return best


def stage_cost(time: Sequence[float], mem: Sequence[float], act: Sequence[float], out_bytes: Sequence[float],
               cuts: Sequence[tuple[int, int]], *, p2p: P2PFn | None = None,
               in_flight: InFlightFn | None = None) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(``T_k``, ``M_k``) of a given partition, by the same formulas (for checking and for pinned plans)."""
    costs = _Costs(time=time, mem=mem, act=act, out_bytes=out_bytes, p2p=p2p or (lambda b, k: 0.0),
                   in_flight=in_flight or (lambda k: 1.0), K=len(cuts), pt=_prefix(time), pm=_prefix(mem),
                   pa=_prefix(act))
    return (tuple(costs.t(k, i, j) for k, (i, j) in enumerate(cuts)),
            tuple(costs.m(k, i, j) for k, (i, j) in enumerate(cuts)))
