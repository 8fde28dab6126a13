"""The outer search: mesh shape x micro-batching x schedule x ZeRO x recomputation, over a traced graph.

For every tensor-parallel degree ``tp`` and micro-batch size, the intra-op CP-SAT solver
(:mod:`autopar.planner.intra_op`) shards each distinct layer group once (identical blocks reuse the answer).  Every
``(pp, dp)`` split of the rest of the cluster, every schedule (GPipe, 1F1B, interleaved 1F1B with 2..4 virtual
stages), ZeRO level 0-3 and recompute mode is then screened with closed forms (:mod:`autopar.planner.inter_op.screen`,
microseconds each); the best screened candidates are evaluated exactly (:mod:`autopar.planner.inter_op.evaluate`:
memory-aware stage partition, event-driven schedule simulation) and turned into :class:`autopar.ir.Plan` objects.
Pins (``tp=8``, ``schedule=1f1b``...) restrict the space; when nothing fits in memory the error names the smallest
cluster (in nodes) on which the model does fit.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from fractions import Fraction

from autopar.ir.errors import AutoparError
from autopar.ir.graph import Graph
from autopar.ir.passes.pipeline import PassOptions, default_pipeline, run_passes
from autopar.ir.plan import Plan
from autopar.planner.inter_op import Candidate, LayerTable, Screened, build_plan, divisors, layer_table, screen
from autopar.planner.inter_op.context import cp_choices, cp_table
from autopar.planner.inter_op.expert import ep_choices, ep_note, ep_table
from autopar.planner.inter_op.screen import (
    FinalistBar,
    ScreenMemo,
    finalist_count,
    finalists_of,
    param_floor,
)
from autopar.planner.intra_op import IntraOpOptions, solve_graph
from autopar.planner.intra_op.coster import gradient_values
from autopar.planner.intra_op.cpsat import CPSAT_WORKERS
from autopar.planner.options import PlanOptions, validate_pins
from autopar.planner.pool import Pool
from autopar.profiles.builtin import with_nodes
from autopar.profiles.cost import CostModel
from autopar.profiles.schema import ClusterProfile

__all__ = ["PlanInfeasibleError", "SearchResult", "search"]

log = logging.getLogger(__name__)
Progress = Callable[[str, float], None]
LEAN_PRICE_S_PER_BYTE = 1e-10
"""Price on parameter-state bytes for the memory-lean intra-op solve: 0.1 s per GB outweighs any collective a
replicated weight could save, so weights get sharded wherever the solver can shard them."""
_LEANER = 0.999
"""The memory-lean sharding is a candidate of its own when it holds under this fraction of the fastest one's
parameters."""


class PlanInfeasibleError(AutoparError):
    """No plan fits in device memory; the message names the smallest cluster that would work."""


@dataclass(frozen=True)
class SearchResult:
    best: Plan
    alternatives: tuple[Plan, ...]
    screened: int
    wall_s: float


def _pin(options: PlanOptions, key: str) -> int | str | None:
    return options.pins.get(key)


def _tp_choices(world: int, dpn: int, options: PlanOptions) -> list[int]:
    if (t := _pin(options, "tp")) is not None:
        return [int(t)]
    limit = options.max_tp or min(world, 2 * dpn)
    return [d for d in divisors(world) if d <= limit and (d & (d - 1) == 0 or d == dpn)]


def _pp_choices(rest: int, n_groups: int, options: PlanOptions) -> list[int]:
    if (p := _pin(options, "pp")) is not None:
        return [int(p)] if rest % int(p) == 0 else []
    return [d for d in divisors(rest) if d <= n_groups]


def _mb_choices(per_replica: int, trace_batch: int, options: PlanOptions) -> list[int]:
    if (mb := _pin(options, "micro_batch")) is not None:
        return [int(mb)]
    out = [d for d in divisors(per_replica) if d <= options.max_micro_batch and (d & (d - 1) == 0)]
    if not out:
        out = [d for d in divisors(per_replica) if d <= options.max_micro_batch] or [1]
    return out


def _schedules(pp: int, m: int, n_groups: int, options: PlanOptions) -> list[tuple[str, int]]:
    pinned_s, pinned_v = _pin(options, "schedule"), _pin(options, "virtual_stages")
    out: list[tuple[str, int]] = []
    for s in options.schedules:
        if pinned_s is not None and s != pinned_s:
            continue
        if s == "interleaved_1f1b":
            if pp == 1 or m % pp:
                continue
            for v in range(2, options.max_virtual_stages + 1):
                if pp * v <= n_groups and (pinned_v is None or v == pinned_v):
                    out.append((s, v))
        elif pinned_v in (None, 1):
            if pp == 1 and s == "gpipe" and pinned_s is None:
                continue  # identical to 1f1b without a pipeline
            if s == "1f1b" and 1 < pp and m < pp:
                continue  # torch.distributed.pipelining's 1F1B needs m >= pp; with fewer it is GPipe anyway
            out.append((s, 1))
    return out


class _Tables:
    """Intra-op solutions per (tp, micro_batch), solved lazily and cached (or all at once in worker processes)."""

    def __init__(self, graph: Graph, cost: CostModel, options: PlanOptions) -> None:
        self.graph, self.cost, self.options = graph, cost, options
        # the pipeline's fuse pass (ir.passes): fused groups move their bytes once; the runtime fuses only stages
        # without tp, so only the tp = 1 tables see the fused graph
        fuse = default_pipeline(PassOptions(fused_kernels=options.fused_kernels), start="fuse")
        self.fused = run_passes(graph, fuse)
        self.requires_grad = {id(g): gradient_values(g) for g in (graph, self.fused)}
        self.trace_batch = graph.batch
        self._cache: dict[tuple[int, int, bool], LayerTable] = {}
        self._floor: dict[int, float] = {}
        self._cp: dict[tuple[int, int], tuple[LayerTable, LayerTable]] = {}
        self._ep: dict[tuple[int, int, int], tuple[LayerTable, LayerTable]] = {}
        self.opts = IntraOpOptions(time_limit_s=options.intra_op_time_limit_s, workers=CPSAT_WORKERS,
                                   seed=options.seed)
        self.lean_opts = replace(self.opts, param_byte_price_s=LEAN_PRICE_S_PER_BYTE,
                                 param_state_bytes=16.0)

    @staticmethod
    def key(tp: int, mb: int | Fraction, lean: bool = False) -> tuple[int, int | Fraction, bool]:
        """A table's key; ``mb`` is a fraction for a cp rank's share of a micro-batch (an integer when cp divides
        it, so that such a rank reads the ordinary table of that micro-batch)."""
        if isinstance(mb, Fraction) and mb.denominator == 1:
            mb = int(mb)
        return (tp, mb, lean and tp > 1)

    def solve(self, key: tuple[int, int, bool]) -> LayerTable | None:
        """The intra-op table for ``key``; None when no sharding of some layer is valid at this tp (an op whose
        every strategy is forbidden, e.g. channel counts tp does not divide): the search skips that tp."""
        tp, mb, lean = key
        graph = self.fused if tp == 1 else self.graph
        try:
            sols = solve_graph(graph, tp=tp, cost=self.cost, tp_span=self.cost.span(tp, 1),
                               dtype=self.options.dtype, micro_batch_scale=float(mb) / self.trace_batch,
                               options=self.lean_opts if lean else self.opts,
                               requires_grad=self.requires_grad[id(graph)])
        except ValueError as e:
            log.info("no intra-op sharding at tp=%d micro-batch %d: %s", tp, mb, e)
            return None
        return layer_table(graph, tuple(sols), tp, mb)

    def get(self, tp: int, mb: int, lean: bool = False) -> LayerTable | None:
        key = self.key(tp, mb, lean)
        if key not in self._cache:
            self._cache[key] = self.solve(key)
        return self._cache[key]

    def prefetch(self, keys: list[tuple[int, int, bool]], pool: Pool[_Screening]) -> None:
        """Solve the missing ``keys`` on the pool's workers (the largest tp first: the longest solves): the fastest
        shardings, then the memory-lean ones that :meth:`variants` can use."""
        for lean in (False, True):
            todo = sorted({k for k in keys if k[2] == lean and k not in self._cache
                           and (not lean or self.lean_may_help(k[0], k[1]))}, key=lambda k: (-k[0], k[1]))
            for k, table in zip(todo, pool.map(_solve_task, todo)):
                self._cache[k] = table

    def lean_may_help(self, tp: int, mb: int) -> bool:
        """Whether the memory-lean sharding could hold fewer parameters than the fastest one by the margin
        :meth:`variants` asks for: not when the fastest already comes within it of :func:`param_floor` (every
        parameter sharded), which no sharding undercuts; then the lean solve is skipped."""
        fast = self.get(tp, mb)
        if fast is None or tp == 1:
            return False
        if tp not in self._floor:
            self._floor[tp] = param_floor(self.graph, tp)
        return not self._floor[tp] >= sum(fast.params) * _LEANER

    def with_cp(self, table: LayerTable, cp: int, lean: bool = False) -> LayerTable | None:
        """``table`` (one ``(tp, micro_batch)``) for a rank of a cp group: the table solved at ``micro_batch / cp``
        with the K/V exchange added (:func:`autopar.planner.inter_op.context.cp_table`), memoized; None when no
        sharding is valid at that size."""
        if cp == 1:
            return table
        key = (id(table), cp)
        got = self._cp.get(key)
        if got is None or got[0] is not table:  # hold the table, so its id cannot be reused while memoized
            base = self.get(table.tp, Fraction(table.micro_batch, cp), lean)
            got = self._cp[key] = (table, None if base is None else
                                   cp_table(self.graph, base, self.cost, cp, self.options.dtype, table.micro_batch))
        return got[1]

    def with_ep(self, table: LayerTable, ep: int, cp: int) -> LayerTable:
        """``table`` (already cp-scaled) under expert parallelism ``ep``
        (:func:`autopar.planner.inter_op.expert.ep_table`), memoized; ``table`` itself without routed experts."""
        key = (id(table), ep, cp)
        got = self._ep.get(key)
        if got is None or got[0] is not table:  # hold the table, so its id cannot be reused while memoized
            got = self._ep[key] = (table, ep_table(table, self.graph, self.cost, ep=ep, cp=cp,
                                                   dtype=self.options.dtype, load=self.options.expert_load))
        return got[1]

    def for_candidate(self, c: Candidate) -> LayerTable | None:
        table = self.get(c.tp, c.micro_batch, c.lean)
        table = None if table is None else self.with_cp(table, c.cp, c.lean)
        return None if table is None else self.with_ep(table, c.ep, c.cp)

    def solved(self, key: tuple[int, int, bool]) -> bool:
        return key in self._cache

    def numbers(self, key: tuple[int, int, bool]) -> LayerTable | None:
        """The solved table for ``key`` without its per-group solutions (what screening reads, a fraction of the
        bytes to send to a worker)."""
        table = self._cache[key]
        return None if table is None else replace(table, solutions=())

    def adopt(self, tables: dict[tuple[int, int, bool], LayerTable | None]) -> None:
        """Take tables solved elsewhere (in a worker: by the parent or another worker)."""
        self._cache.update(tables)

    def variants(self, tp: int, mb: int) -> list[tuple[bool, LayerTable]]:
        """The fastest sharding and, when it differs in parameter memory, the memory-lean one."""
        fast = self.get(tp, mb)
        if fast is None:
            return []
        if not self.lean_may_help(tp, mb):
            return [(False, fast)]
        lean = self.get(tp, mb, True)
        return [(False, fast)] + ([(True, lean)] if lean is not None and
                                  sum(lean.params) < sum(fast.params) * _LEANER else [])


@dataclass(frozen=True)
class _Screening:
    """What screening one ``(tp, pp)`` and evaluating a finalist need; forked workers inherit it."""

    graph: Graph
    profile: ClusterProfile
    options: PlanOptions
    tables: _Tables
    memo: ScreenMemo


def _cp_choices(s: _Screening, tp: int) -> list[int]:
    world = s.profile.nodes * s.profile.devices_per_node
    pin = _pin(s.options, "cp")
    return cp_choices(s.graph, s.tables.cost, world // tp, tp, s.options.dtype, None if pin is None else int(pin))


def _units(s: _Screening) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, bool]]]:
    """The ``(tp, pp, cp)`` triples to screen, in screening order, and the intra-op tables they read."""
    world = s.profile.nodes * s.profile.devices_per_node
    units, keys = [], []
    for tp in _tp_choices(world, s.profile.devices_per_node, s.options):
        for cp in _cp_choices(s, tp):
            for pp in _pp_choices(world // (tp * cp), len(s.graph.layers), s.options):
                units.append((tp, pp, cp))
                dp = world // (tp * pp * cp)
                if ((pd := _pin(s.options, "dp")) is not None and dp != pd) or s.options.global_batch % dp:
                    continue
                for mb in _mb_choices(s.options.global_batch // dp, s.tables.trace_batch, s.options):
                    keys += [_Tables.key(tp, mb)] + ([_Tables.key(tp, mb, True)] if tp > 1 else [])
                    if cp > 1:  # a cp rank's table: solved at its share of the micro-batch's tokens
                        keys += [_Tables.key(tp, Fraction(mb, cp))]
    return units, keys


def _screen_unit(s: _Screening, unit: tuple[int, int, int], bar: FinalistBar | None = None
                 ) -> tuple[list[Screened], int, float]:
    """Screen every candidate with mesh ``tp`` x ``pp`` x ``cp``: (those that fit, how many were screened, least
    peak).  With a ``bar``, candidates that cannot be finalists (see
    :class:`~autopar.planner.inter_op.screen.FinalistBar`) are counted but neither costed in full nor returned; the
    least peak then covers only those costed (it is reported only when none fits)."""
    tp, pp, cp = unit
    options, tables, cost = s.options, s.tables, s.tables.cost
    world, dpn = s.profile.nodes * s.profile.devices_per_node, s.profile.devices_per_node
    capacity = s.profile.device.memory_bytes
    n_groups = len(s.graph.layers)
    out: list[Screened] = []
    count, min_peak = 0, float("inf")
    dp = world // (tp * pp * cp)
    if ((pd := _pin(options, "dp")) is not None and dp != pd) or options.global_batch % dp:
        return out, count, min_peak
    per_replica = options.global_batch // dp
    eps = ep_choices(s.graph, dp, None if (pe := _pin(options, "ep")) is None else int(pe), tp)
    for mb in _mb_choices(per_replica, tables.trace_batch, options):
        m = per_replica // mb
        variants = [(lean, tables.with_cp(t, cp, lean)) for lean, t in tables.variants(tp, mb)]
        variants = [(lean, ep, tables.with_ep(t, ep, cp)) for lean, t in variants if t is not None for ep in eps]
        p2p_intra = dp * cp * tp * pp <= dpn  # neighbouring stages are dp*cp*tp ranks apart
        for sched, v in _schedules(pp, m, n_groups, options):
            for rc in options.recompute_modes:
                if (pr := _pin(options, "recompute")) is not None and rc != pr:
                    continue
                for zero in options.zero_levels:
                    if (pz := _pin(options, "zero")) is not None and zero != pz:
                        continue
                    if zero and dp == 1 and _pin(options, "zero") is None:
                        continue  # ZeRO without data parallelism changes nothing
                    for lean, ep, table in variants:
                        c = Candidate(pp, dp, tp, mb, m, sched, v, zero, rc, lean, cp, ep)
                        count += 1
                        sc = screen(c, table, cost, dtype=options.dtype, capacity=capacity, p2p_intra=p2p_intra,
                                    overlap_grad_sync=options.overlap_grad_sync, memo=s.memo,
                                    reduce_dtype=options.reduce_dtype, dp_collectives=options.dp_collectives,
                                    bound=bar.time if bar is not None else math.inf)
                        if sc is None:
                            continue
                        min_peak = min(min_peak, sc.peak_mem)
                        if sc.fits:
                            out.append(sc)
                            if bar is not None:
                                bar.add(sc.time_s)
    return out, count, min_peak


def _solve_task(s: _Screening, key: tuple[int, int, bool]) -> LayerTable | None:
    return s.tables.solve(key)


def _screen_task(s: _Screening, task: tuple[list[tuple[int, int, int]], dict[tuple[int, int, bool], LayerTable | None]]
                 ) -> list[tuple[list[Screened], int, float]]:
    """Screen ``(tp, pp)`` units in a worker, with the tables they read (solved elsewhere, sent along)."""
    units, tables = task
    s.tables.adopt(tables)
    bar = FinalistBar(finalist_count(s.options.top_k))
    return [_screen_unit(s, u, bar) for u in units]


def _screen_tasks(s: _Screening, units: list[tuple[int, int, int]], keys: list[tuple[int, int, bool]], workers: int
                  ) -> list[tuple[list[int], tuple[list[tuple[int, int, int]], dict]]]:
    """Units grouped by tp (each group's tables travel once, without the per-group solutions screening does not
    read), a tp's units dealt round-robin into several tasks when there are fewer tps than workers; with the
    indices of their units."""
    tps = list(dict.fromkeys(u[0] for u in units))
    split = -(-workers // len(tps))
    out = []
    for tp in tps:
        idx = [i for i, u in enumerate(units) if u[0] == tp]
        mine = {k: s.tables.numbers(k) for k in dict.fromkeys(keys) if k[0] == tp and s.tables.solved(k)}
        for part in (idx[j::split] for j in range(min(split, len(idx)))):
            out.append((part, ([units[i] for i in part], mine)))
    return out


def _screen_all(graph: Graph, profile: ClusterProfile, options: PlanOptions, tables: _Tables,
                progress: Progress | None, pool: Pool[_Screening] | None = None) -> tuple[list[Screened], int, float]:
    """Screen every candidate; on a parallel ``pool`` (whose state is this search's :class:`_Screening`) the tables,
    then the ``(tp, pp, cp)`` units, are computed in worker processes and merged in the serial order, so the result does
    not depend on the worker count."""
    s = pool.state if pool is not None else _Screening(graph, profile, options, tables, ScreenMemo())
    units, keys = _units(s)
    done: list[tuple[list[Screened], int, float]] | None = None
    if pool is not None and pool.parallel and len(units) > 1:
        tables.prefetch(keys, pool)
        tasks = _screen_tasks(s, units, keys, options.workers)
        done = [None] * len(units)  # type: ignore[list-item]
        for (idx, _), res in zip(tasks, pool.map(_screen_task, [t for _, t in tasks])):
            for i, r in zip(idx, res):
                done[i] = r
    out: list[Screened] = []
    count, min_peak = 0, float("inf")
    tps = list(dict.fromkeys(u[0] for u in units))
    bar = FinalistBar(finalist_count(options.top_k))
    for i, unit in enumerate(units):
        found, n, peak = done[i] if done is not None else _screen_unit(s, unit, bar)
        out += found
        count += n
        min_peak = min(min_peak, peak)
        if progress and (i + 1 == len(units) or units[i + 1][0] != unit[0]):
            progress(f"tp={unit[0]}: {count} candidates screened, {len(out)} fit and in the running",
                     (tps.index(unit[0]) + 1) / len(tps))
    if progress and not units:
        progress("no candidates", 1.0)
    return out, count, min_peak


def _smallest_fitting_nodes(graph: Graph, profile: ClusterProfile, options: PlanOptions) -> int | None:
    """Fewest nodes (doubling) on which some memory-minimal plan fits; None beyond 16384 nodes."""
    base = replace(options, pins={}, recompute_modes=("full",), zero_levels=(3,), schedules=("1f1b",),
                   max_micro_batch=1, intra_op_time_limit_s=min(options.intra_op_time_limit_s, 5.0), top_k=0)
    nodes = profile.nodes * 2
    tables: _Tables | None = None  # one set of intra-op tables for every node count (they do not depend on it)
    while nodes <= 16384:
        prof = with_nodes(profile, nodes)
        world = nodes * prof.devices_per_node
        gb = max(options.global_batch, world)
        opts = replace(base, global_batch=gb, max_tp=prof.devices_per_node)
        cost = CostModel(prof)
        tables = tables or _Tables(graph, cost, opts)
        tables.cost, tables.options = cost, opts
        with Pool(_Screening(graph, prof, opts, tables, ScreenMemo()), opts.workers) as pool:
            fits, _, _ = _screen_all(graph, prof, opts, tables, None, pool)
        if fits:
            return nodes
        nodes *= 2
    return None


def search(graph: Graph, profile: ClusterProfile, options: PlanOptions,
           progress: Progress | None = None, *, memo: dict | None = None) -> SearchResult:
    """Find the fastest plan that fits (see the module docstring).  ``memo``, a dict the caller keeps, holds the
    intra-op tables for searches on other node counts (a table does not depend on the node count)."""
    t0 = time.perf_counter()
    world = profile.nodes * profile.devices_per_node
    validate_pins(world, options, profile)
    pp, vs, groups = options.pins.get("pp"), int(options.pins.get("virtual_stages", 1)), len(graph.layers)
    if pp is not None and int(pp) * vs > groups:
        raise ValueError(f"pin pp={pp} (x {vs} virtual stages) needs more stages than the {groups} layer groups of "
                         f"{graph.model_name or 'the model'} (a stage holds at least one); pin pp <= {groups // vs}")
    cost = CostModel(profile)
    # what a table depends on besides its (tp, micro-batch): not the node count, batch, pins or inter-op choices
    key = (graph.fingerprint, options.dtype, options.fused_kernels, options.intra_op_time_limit_s, options.seed,
           options.expert_load, repr(replace(profile, nodes=1)))
    tables = (memo or {}).get(key) or _Tables(graph, cost, options)
    if memo is not None:
        memo[key] = tables
    tables.cost, tables.options = cost, options  # each search checks its collectives against its own cluster's size
    with Pool(_Screening(graph, profile, options, tables, ScreenMemo()), options.workers) as pool:
        feasible, count, min_peak = _screen_all(graph, profile, options, tables, progress, pool)
        finalists = finalists_of(feasible, options.top_k)
        # the exact evaluations run on the workers when they are up (each takes its table along)
        args = [(f, tables.for_candidate(f.cand)) for f in finalists]
        built = pool.map(_build_task, args) if pool.started else [_build_task(pool.state, a) for a in args]
    if not feasible:
        if count == 0:
            if not options.pins:  # every device must be used: pp*dp*tp = world with dp <= batch, pp <= layer groups
                raise ValueError(f"no mesh uses all {world} devices with global batch {options.global_batch}: a plan "
                                 f"needs pp*dp*tp = {world} with dp dividing the batch and pp at most "
                                 f"{len(graph.layers)} (the layer groups); use fewer --nodes or a larger "
                                 "--global-batch")
            raise ValueError(f"no candidate plan satisfies the pins {dict(options.pins)} with global batch "
                             f"{options.global_batch} on {world} devices; relax a pin or change the batch")
        gib = profile.device.memory_bytes / 2**30
        msg = (f"{graph.model_name or 'the model'} does not fit on {profile.nodes} x {profile.devices_per_node} "
               f"{profile.device.name} ({gib:.0f} GiB each) under any plan searched"
               f"{' with pins ' + str(dict(options.pins)) if options.pins else ''}: the leanest needs "
               f"{min_peak / 2**30:.1f} GiB per device.")
        nodes = _smallest_fitting_nodes(graph, profile, options) if not options.pins else None
        if nodes is not None:
            msg += (f" The smallest cluster that fits is {nodes} nodes ({nodes * profile.devices_per_node} "
                    f"devices): try `--nodes {nodes}`.")
        elif options.pins:
            msg += " Try without pins, or on more nodes."
        raise PlanInfeasibleError(msg)
    plans = [p for p in built if p is not None]
    if not plans:
        raise PlanInfeasibleError("every screened plan failed the exact memory check; try more nodes")
    plans.sort(key=lambda p: p.time.total)
    plans = [_ep_notes(_model_notes(p, graph), graph, cost, options) for p in plans]
    wall = time.perf_counter() - t0
    best = plans[0]
    best = replace(best, solver=replace(best.solver, wall_s=wall, candidates=count))
    log.info("searched %d candidates in %.2fs; best %s", count, wall, _describe(best))
    return SearchResult(best=best, alternatives=tuple(plans[1: options.top_k + 1]), screened=count, wall_s=wall)


def _build_task(s: _Screening, arg: tuple[Screened, LayerTable | None]) -> Plan | None:
    screened, table = arg
    assert table is not None, "a screened candidate's table was solved"
    return build_plan(s.graph, s.profile, s.options, screened, table, s.tables.cost)


def _model_notes(plan: Plan, graph: Graph) -> Plan:
    """What the plan changes about the model's own semantics, in one line each (BatchNorm statistics)."""
    if not any(n.op == "batch_norm" for n in graph.nodes):
        return plan
    notes = []
    if plan.mesh.dp > 1:
        notes.append(f"BatchNorm statistics are per rank ({plan.global_batch // plan.mesh.dp} samples per replica, "
                     "not the global batch); sync_batchnorm=True computes them over the data-parallel group")
    if plan.num_microbatches > 1:
        notes.append(f"BatchNorm statistics are per micro-batch of {plan.micro_batch} samples")
    return replace(plan, notes=(*plan.notes, *notes)) if notes else plan


def _ep_notes(plan: Plan, graph: Graph, cost: CostModel, options: PlanOptions) -> Plan:
    """Where experts are sharded (ep > 1): the ep groups and what their all_to_all costs, in one line."""
    if plan.mesh.ep == 1:
        return plan
    note = ep_note(graph, cost, mesh=plan.mesh, micro_batch=plan.micro_batch,
                   num_microbatches=plan.num_microbatches, dtype=options.dtype, load=options.expert_load)
    return replace(plan, notes=(*plan.notes, note))


def _describe(p: Plan) -> str:
    return (f"pp={p.mesh.pp} dp={p.mesh.dp} tp={p.mesh.tp} mb={p.micro_batch}x{p.num_microbatches} {p.schedule}"
            f"{'/v' + str(p.virtual_stages) if p.virtual_stages > 1 else ''} zero={p.zero} "
            f"recompute={','.join(sorted({s.recompute for s in p.stages}))} {p.time.total:.4g}s")
