"""Pipeline schedule simulator: GPipe, 1F1B (PipeDream-Flush) and interleaved 1F1B, event by event.

Pure function of plain numbers, no I/O. The model:

- ``pp`` ranks; with ``v`` virtual stages (model chunks) per rank there are ``K = pp * v`` virtual stages and chunk
  ``c`` of rank ``r`` is virtual stage ``k = c * pp + r`` (Narayanan et al., SC'21, sec. 2.2). With ``v == 1`` a
  virtual stage is a stage.
- Each rank executes its ops (``F`` forward / ``B`` backward of one micro-batch on one of its chunks) one at a time,
  in the fixed order of the schedule (below). An op starts when the rank is free *and* its dependency is done:
  ``F(mb, k)`` needs ``F(mb, k-1)`` plus the activation transfer ``p2p[k-1]``; ``B(mb, k)`` needs ``B(mb, k+1)`` plus
  the gradient transfer ``p2p[k]`` (same size as the activation) and its own ``F(mb, k)``.
- Transfers are asynchronous (``isend``/``irecv`` overlapped with compute, no link contention): they delay the
  receiver but never occupy a rank. Sends of two ops in flight on one link are not serialized.
- Orders. GPipe (Huang et al. 2019): all forwards, then all backwards (micro-batch order). 1F1B / PipeDream-Flush
  (Narayanan et al. 2021): ``min(pp - r - 1, m)`` warm-up forwards, then alternate one forward / one backward, then
  the remaining backwards. Interleaved 1F1B (Narayanan et al. SC'21, Megatron-LM): the ``m * v`` chunk-micro-batches
  are taken in groups of ``pp`` micro-batches per chunk (forward: chunks ``0..v-1``, backward: chunks ``v-1..0``);
  ``min((pp - r - 1) * 2 + (v - 1) * pp, m * v)`` warm-up forwards, then 1F1B, then cool-down. Requires
  ``m % pp == 0``.
- Data-parallel gradient sync of rank ``r`` (``dp_sync[r]`` seconds, all of its chunks) starts as gradients become
  final during the backwards of the last micro-batch: it overlaps with those backward ops on the rank (the overlap
  window is their total duration), and the exposed part ``max(0, dp_sync[r] - window)`` is added after the rank's
  last op. The optimizer step ``optimizer_s`` starts when every rank is done (a global barrier, as gradient-norm
  clipping across stages needs) and ends the iteration.
- Shared cores (:class:`SharedCores`, CPU nodes running more ranks than they have cores): the op times are those of
  every rank of a node computing at once. While fewer compute (the others wait for a dependency: a pipeline's fill
  and drain, GPipe's turn between forwards and backwards), the cores are shared among those that do (processor
  sharing), so an op's compute part runs ``max(1, ranks / cores) / max(1, running / cores)`` times faster; its
  communication part (tensor-parallel collectives) does not.

Definitions of the outputs:

- ``pipeline_s``: end of the last compute op (makespan, without sync and optimizer).
- ``busy_s[r]``: sum of the rank's op durations.
- ``bubble_s``: idle time of the critical rank, the busiest one: ``pipeline_s - max(busy_s)``. With equal stages
  and no transfers this is ``(pp - 1) * (f + b)`` for GPipe and 1F1B and ``(pp - 1) * (f + b) / v`` for interleaved
  1F1B (``f``, ``b``: the whole rank's time per micro-batch; Narayanan et al. SC'21, sec. 2.2).
  ``bubble_fraction = bubble_s / pipeline_s``.
- ``peak_in_flight[r]``: max over time of (forwards started - backwards finished) on rank ``r``, in
  chunk-micro-batches: how many micro-batches' activations of one chunk the rank holds at its peak. It depends only
  on the order, not on the times. 1F1B: ``min(pp - r, m)``; GPipe: ``m``; interleaved: first rank
  ``(pp - 1) * 2 + (v - 1) * pp + 1`` chunks, i.e. ``pp + (pp - 1) / v`` stage-micro-batches (Korthikanti et al.
  2022, sec. 4.2).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from autopar.ir.placement import Schedule

__all__ = [
    "SCHEDULES",
    "OpEvent",
    "SharedCores",
    "ScheduleResult",
    "chrome_trace",
    "peak_in_flight",
    "peak_in_flight_count",
    "rank_order",
    "simulate",
]

log = logging.getLogger(__name__)

SCHEDULES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
Op = tuple[Literal["F", "B"], int, int]
"""(kind, micro-batch, chunk) of one op on a rank."""


@dataclass(kw_only=True, slots=True, frozen=True)
class OpEvent:
    """One executed op."""

    rank: int
    """Pipeline rank that ran it."""
    kind: Literal["F", "B"]
    """Forward or backward."""
    microbatch: int
    """Micro-batch index, ``0..m-1``."""
    chunk: int
    """Model chunk on the rank (0 unless interleaved)."""
    stage: int
    """Virtual stage ``chunk * pp + rank``."""
    start: float
    """Start time in seconds."""
    end: float
    """End time in seconds."""


@dataclass(kw_only=True, slots=True, frozen=True)
class ScheduleResult:
    """Simulated timeline of one training iteration (see the module docstring for the definitions)."""

    schedule: Schedule
    """Schedule simulated."""
    pp: int
    """Pipeline ranks."""
    virtual_stages: int
    """Chunks per rank."""
    num_microbatches: int
    """Micro-batches per iteration."""
    iteration_s: float
    """Whole iteration: pipeline, exposed gradient sync, optimizer step."""
    pipeline_s: float
    """End of the last forward/backward op."""
    busy_s: tuple[float, ...]
    """Per rank: time spent computing."""
    bubble_s: float
    """Idle time of the busiest rank within ``pipeline_s``."""
    bubble_fraction: float
    """``bubble_s / pipeline_s``."""
    peak_in_flight: tuple[int, ...]
    """Per rank: peak chunk-micro-batches whose forward started and backward has not finished."""
    exposed_sync_s: tuple[float, ...]
    """Per rank: data-parallel gradient sync not hidden behind the last micro-batch's backwards."""
    optimizer_s: float
    """Optimizer step time."""
    rank_end_s: tuple[float, ...]
    """Per rank: end of its last op plus exposed sync (before the optimizer step)."""
    events: tuple[OpEvent, ...]
    """Every op, sorted by (rank, start); empty when simulated with ``with_events=False``."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SharedCores:
    """Pipeline ranks whose processes time-slice the cores of CPU nodes (see the module docstring)."""

    cores: float
    """Cores' worth of compute of each node (:attr:`autopar.profiles.schema.DeviceProfile.shared_cores`)."""
    ranks_per_node: int
    """Ranks of each node: the op times are those of all of them computing at once."""
    stage_ranks: tuple[tuple[tuple[int, int], ...], ...]
    """Per pipeline rank: ``(node, processes)`` of its group (its dp x cp x tp ranks) on each node it spans."""
    comm_fwd: tuple[float, ...] = ()
    """Per virtual stage: seconds of a forward op that are communication, not sped up (empty: none)."""
    comm_bwd: tuple[float, ...] = ()
    """The same for a backward op."""

    def speeds(self, running: Sequence[bool]) -> list[float]:
        """Per pipeline rank: how many times faster than the op times its compute runs while ``running`` compute."""
        load: dict[int, int] = {}
        for r, on in enumerate(running):
            if on:
                for node, n in self.stage_ranks[r]:
                    load[node] = load.get(node, 0) + n
        full = max(1.0, self.ranks_per_node / self.cores)
        return [min(full / max(1.0, load.get(node, 0) / self.cores) for node, _ in self.stage_ranks[r])
                for r in range(len(running))]


def _check(pp: int, m: int, v: int, schedule: str) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if pp < 1 or m < 1 or v < 1:
        raise ValueError(f"pp, num_microbatches and virtual_stages must be >= 1, got {pp}, {m}, {v}")
    if schedule != "interleaved_1f1b" and v != 1:
        raise ValueError(f"virtual_stages={v} needs schedule 'interleaved_1f1b' (got {schedule!r})")
    if schedule == "interleaved_1f1b" and m % pp:
        raise ValueError(f"interleaved 1F1B needs num_microbatches divisible by pp (Megatron-LM); got m={m}, "
                         f"pp={pp}: pick m as a multiple of {pp}")


def rank_order(schedule: Schedule, *, rank: int, pp: int, num_microbatches: int,
               virtual_stages: int = 1) -> list[Op]:
    """The ops of ``rank`` in execution order, as ``(kind, microbatch, chunk)``."""
    m, v = num_microbatches, virtual_stages
    _check(pp, m, v, schedule)
    if not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]
    if schedule == "1f1b":
        fwd = [("F", i, 0) for i in range(m)]
        bwd = [("B", i, 0) for i in range(m)]
        warmup = min(pp - rank - 1, m)
    else:
        total = m * v
        # groups of pp micro-batches, each taken chunk by chunk (forward: 0..v-1, backward: v-1..0)
        fwd = [("F", g + x, c) for g in range(0, m, pp) for c in range(v) for x in range(pp)]
        bwd = [("B", g + x, c) for g in range(0, m, pp) for c in reversed(range(v)) for x in range(pp)]
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order: list[Op] = list(fwd[:warmup])
    for i in range(len(fwd) - warmup):
        order += [fwd[warmup + i], bwd[i]]
    order += bwd[len(fwd) - warmup:]
    return order  # type: ignore[return-value]


def peak_in_flight_count(schedule: Schedule, *, rank: int, pp: int, num_microbatches: int,
                         virtual_stages: int = 1) -> float:
    """``peak_in_flight(rank_order(...))`` without building the order: GPipe holds all ``m`` forwards; (interleaved)
    1F1B holds its ``w`` warm-up forwards plus one while it alternates, ``min(w + 1, m * v)``."""
    m, v = num_microbatches, virtual_stages
    _check(pp, m, v, schedule)
    if not 0 <= rank < pp:
        raise ValueError(f"rank must be in [0, {pp}), got {rank}")
    if schedule == "gpipe":
        return float(m)
    total = m if schedule == "1f1b" else m * v
    warmup = min(pp - rank - 1, m) if schedule == "1f1b" else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    return float(min(warmup + 1, total))


def _per_rank(x: float | Sequence[float], n: int, what: str) -> list[float]:
    """``n`` non-negative finite numbers from one number or a sequence."""
    vals = [float(x)] * n if isinstance(x, (int, float)) else [float(y) for y in x]
    if len(vals) != n or any(not 0 <= y < math.inf for y in vals):
        raise ValueError(f"{what} must be a non-negative finite number or {n} of them, got {x!r}")
    return vals


def _run(orders: list[list[Op]], fwd: list[float], bwd: list[float], p2p: list[float],
         pp: int) -> tuple[list[list[float]], list[list[float]]]:
    """Execute the per-rank orders; returns per rank the start and the end time of each op, in its order.

    Each op starts at ``max(rank free, dependency end + transfer)`` (the same float operations in the same order
    whichever rank is advanced first, so the times do not depend on the sweep). A done op's end time sits in a flat
    list indexed by ``micro-batch * K + virtual stage`` (-1: not done yet)."""
    n = len(fwd)
    m = 1 + max((mb for o in orders for _, mb, _ in o), default=0)
    f_end, b_end = [-1.0] * (m * n), [-1.0] * (m * n)
    progs = _program(orders, fwd, bwd, p2p, pp)
    starts: list[list[float]] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    free = [0.0] * pp
    pos = [0] * pp
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            prog, p, t = progs[r], pos[r], free[r]
            st, en = starts[r], ends[r]
            while p < len(prog):
                is_f, i, dur, dep, lat, _ = prog[p]
                start = t
                if is_f:
                    if dep >= 0:
                        d = f_end[dep]
                        if d < 0.0:
                            break
                        d += lat
                        if d > start:  # noqa: PLR1730 - max() costs a call per op in the hottest loop
                            start = d
                    t = start + dur
                    f_end[i] = t
                else:
                    d = f_end[i]
                    if d < 0.0:
                        break
                    if d > start:  # noqa: PLR1730
                        start = d
                    if dep >= 0:
                        d = b_end[dep]
                        if d < 0.0:
                            break
                        d += lat
                        if d > start:  # noqa: PLR1730
                            start = d
                    t = start + dur
                    b_end[i] = t
                st.append(start)
                en.append(t)
                p += 1
            if p != pos[r]:
                remaining -= p - pos[r]
                pos[r], free[r] = p, t
                progressed = True
        assert progressed, "pipeline schedule deadlocked: the per-rank orders are inconsistent"
    return starts, ends


def _program(orders: list[list[Op]], fwd: list[float], bwd: list[float], p2p: list[float], pp: int,
             comm_f: Sequence[float] = (), comm_b: Sequence[float] = ()) -> list[list[tuple]]:
    """Per rank, per op: (forward?, its slot, its duration, the slot it waits for (-1: none), that transfer's time,
    the communication part of its duration); a slot is ``micro-batch * K + virtual stage``."""
    n = len(fwd)
    progs = []
    for r, order in enumerate(orders):
        prog = []
        for kind, mb, c in order:
            k = c * pp + r
            i = mb * n + k
            if kind == "F":
                prog.append((True, i, fwd[k], i - 1 if k else -1, p2p[k - 1] if k else 0.0,
                             comm_f[k] if comm_f else 0.0))
            else:
                prog.append((False, i, bwd[k], i + 1 if k < n - 1 else -1, p2p[k] if k < n - 1 else 0.0,
                             comm_b[k] if comm_b else 0.0))
        progs.append(prog)
    return progs


def _run_shared(orders: list[list[Op]], fwd: list[float], bwd: list[float], p2p: list[float], pp: int,
                shared: SharedCores) -> tuple[list[list[float]], list[list[float]]]:
    """:func:`_run` on shared cores: time advances from event to event (an op ends, a waiting op's input arrives),
    and in between every running op progresses at its rank's speed (:meth:`SharedCores.speeds`)."""
    n = len(fwd)
    m = 1 + max((mb for o in orders for _, mb, _ in o), default=0)
    f_end, b_end = [-1.0] * (m * n), [-1.0] * (m * n)
    progs = _program(orders, fwd, bwd, p2p, pp, shared.comm_fwd, shared.comm_bwd)
    starts: list[list[float]] = [[] for _ in range(pp)]
    ends: list[list[float]] = [[] for _ in range(pp)]
    pos, left, running = [0] * pp, [0.0] * pp, [False] * pp
    t, remaining = 0.0, sum(len(o) for o in orders)

    def ready(op: tuple) -> float | None:  # when the op's inputs are in (None: its dependency has not run)
        is_f, i, _, dep, lat, _ = op
        at = 0.0
        if not is_f:
            at = f_end[i]
            if at < 0.0:
                return None
        if dep >= 0:
            d = (f_end if is_f else b_end)[dep]
            if d < 0.0:
                return None
            at = max(at, d + lat)
        return at

    while remaining:
        arrival = math.inf
        for r in range(pp):
            if running[r] or pos[r] == len(progs[r]):
                continue
            at = ready(progs[r][pos[r]])
            if at is not None and at <= t:
                running[r], left[r] = True, progs[r][pos[r]][2]
                starts[r].append(t)
            elif at is not None:
                arrival = min(arrival, at)
        speed = shared.speeds(running)
        rates, finish = [0.0] * pp, math.inf
        for r in range(pp):
            if running[r]:
                dur, comm = progs[r][pos[r]][2], progs[r][pos[r]][5]
                wall = (dur - comm) / speed[r] + comm
                rates[r] = dur / wall if wall > 0 else 1.0
                finish = min(finish, left[r] / rates[r])
        assert finish < math.inf or arrival < math.inf, "pipeline schedule deadlocked: inconsistent per-rank orders"
        step = finish if t + finish <= arrival else arrival - t
        now = t + step if step == finish else arrival
        for r in range(pp):
            if not running[r]:
                continue
            if step == finish and left[r] / rates[r] <= finish * (1 + 1e-12):
                is_f, i = progs[r][pos[r]][:2]
                (f_end if is_f else b_end)[i] = now
                ends[r].append(now)
                running[r], pos[r] = False, pos[r] + 1
                remaining -= 1
            else:
                left[r] -= rates[r] * step
        t = now
    return starts, ends


def peak_in_flight(order: Sequence[Op], weights: Sequence[float] | None = None) -> float:
    """Peak of (forwards started - backwards finished) over a rank's op order.

    With ``weights[chunk]`` (e.g. activation bytes of each chunk) it returns the peak weighted sum instead.
    """
    cur = peak = 0.0
    for kind, _, c in order:
        w = 1.0 if weights is None else float(weights[c])
        if kind == "F":
            cur += w
            peak = max(peak, cur)
        else:
            cur -= w
    return peak


def simulate(fwd: Sequence[float], bwd: Sequence[float], *, pp: int, num_microbatches: int,
             schedule: Schedule = "1f1b", virtual_stages: int = 1, p2p: float | Sequence[float] = 0.0,
             dp_sync: float | Sequence[float] = 0.0, optimizer_s: float = 0.0,
             with_events: bool = True, shared: SharedCores | None = None) -> ScheduleResult:
    """Simulate one iteration.

    ``fwd[k]``/``bwd[k]``: time of one micro-batch on virtual stage ``k`` (``pp * virtual_stages`` entries).
    ``p2p[k]``: transfer time between virtual stages ``k`` and ``k+1`` (``pp * v - 1`` entries, or one number).
    ``dp_sync[r]``: gradient-sync time of rank ``r`` (or one number for all).
    ``with_events=False`` leaves ``events`` empty (the search needs only the totals: it saves a third of the time).
    ``shared``: the ranks time-slice CPU cores (see the module docstring); None, or no more ranks than cores: each
    rank computes on its own device.
    """
    v, m = virtual_stages, num_microbatches
    _check(pp, m, v, schedule)
    n = pp * v
    if len(fwd) != n or len(bwd) != n:
        raise ValueError(f"fwd and bwd need pp*virtual_stages = {n} entries, got {len(fwd)} and {len(bwd)}")
    fw, bw = _per_rank(fwd, n, "fwd"), _per_rank(bwd, n, "bwd")
    links = _per_rank(p2p, n - 1, "p2p") if n > 1 else []
    sync = _per_rank(dp_sync, pp, "dp_sync")
    if optimizer_s < 0:
        raise ValueError(f"optimizer_s must be >= 0, got {optimizer_s}")
    orders = [rank_order(schedule, rank=r, pp=pp, num_microbatches=m, virtual_stages=v) for r in range(pp)]
    if shared is not None and shared.ranks_per_node > shared.cores and pp > 1:
        starts, ends = _run_shared(orders, fw, bw, links, pp, shared)
    else:
        starts, ends = _run(orders, fw, bw, links, pp)
    events = tuple(OpEvent(rank=r, kind=op[0], microbatch=op[1], chunk=op[2], stage=op[2] * pp + r, start=s, end=e)
                   for r in range(pp) for op, s, e in zip(orders[r], starts[r], ends[r])) if with_events else ()
    busy = tuple(sum(e - s for s, e in zip(starts[r], ends[r])) for r in range(pp))
    pipeline = max(en[-1] for en in ends)
    exposed, rank_end = [], []
    for r in range(pp):
        window = sum(e - s for (kind, mb, _), s, e in zip(orders[r], starts[r], ends[r]) if kind == "B" and mb == m - 1)
        exposed.append(max(0.0, sync[r] - window))
        rank_end.append(ends[r][-1] + exposed[-1])
    bubble = pipeline - max(busy)
    result = ScheduleResult(
        schedule=schedule, pp=pp, virtual_stages=v, num_microbatches=m,
        iteration_s=max(rank_end) + optimizer_s, pipeline_s=pipeline, busy_s=busy, bubble_s=bubble,
        bubble_fraction=bubble / pipeline if pipeline > 0 else 0.0,
        peak_in_flight=tuple(int(peak_in_flight_count(schedule, rank=r, pp=pp, num_microbatches=m, virtual_stages=v))
                             for r in range(pp)), exposed_sync_s=tuple(exposed),
        optimizer_s=optimizer_s, rank_end_s=tuple(rank_end), events=events)
    log.debug("simulated %s pp=%d v=%d m=%d: %.6gs, bubble %.3f", schedule, pp, v, m, result.iteration_s,
              result.bubble_fraction)
    return result


def chrome_trace(result: ScheduleResult, stage_names: Sequence[str] | None = None) -> dict[str, Any]:
    """Chrome Trace Event JSON (loadable in Perfetto / chrome://tracing) of a simulated schedule.

    One process per pipeline rank; thread 0 ("compute") holds one complete (``ph: "X"``) event per op named
    ``F<mb>``/``B<mb>`` (``F<mb>.c<chunk>`` when interleaved); thread 1 ("comm/optimizer") holds the exposed gradient
    sync and the optimizer step. Times are microseconds. ``stage_names[k]`` labels virtual stage ``k``.
    """
    n = result.pp * result.virtual_stages
    if stage_names is not None and len(stage_names) != n:
        raise ValueError(f"stage_names needs {n} entries (one per virtual stage), got {len(stage_names)}")
    us = 1e6
    ev: list[dict[str, Any]] = []
    for r in range(result.pp):
        ev.append({"ph": "M", "name": "process_name", "pid": r, "tid": 0, "args": {"name": f"pp rank {r}"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        ev.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "comm/optimizer"}})
    for e in result.events:
        name = f"{e.kind}{e.microbatch}" + (f".c{e.chunk}" if result.virtual_stages > 1 else "")
        args: dict[str, Any] = {"microbatch": e.microbatch, "chunk": e.chunk, "stage": e.stage}
        if stage_names is not None:
            args["stage_name"] = stage_names[e.stage]
        ev.append({"ph": "X", "name": name, "cat": "forward" if e.kind == "F" else "backward", "pid": e.rank,
                   "tid": 0, "ts": e.start * us, "dur": (e.end - e.start) * us, "args": args})
    for r in range(result.pp):
        t = result.rank_end_s[r] - result.exposed_sync_s[r]
        if result.exposed_sync_s[r] > 0:
            ev.append({"ph": "X", "name": "dp grad sync (exposed)", "cat": "comm", "pid": r, "tid": 1,
                       "ts": t * us, "dur": result.exposed_sync_s[r] * us, "args": {}})
        if result.optimizer_s > 0:
            start = result.iteration_s - result.optimizer_s
            ev.append({"ph": "X", "name": "optimizer step", "cat": "optimizer", "pid": r, "tid": 1,
                       "ts": start * us, "dur": result.optimizer_s * us, "args": {}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"schedule": result.schedule, "pp": result.pp, "virtual_stages": result.virtual_stages,
                          "num_microbatches": result.num_microbatches, "iteration_s": result.iteration_s,
                          "bubble_fraction": result.bubble_fraction}}
