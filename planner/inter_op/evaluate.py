"""Exact evaluation of one screened candidate and its assembly into an :class:`autopar.ir.Plan`.

Stages come from the memory-aware partitioner (:func:`autopar.planner.inter_op.partition.partition_stages`); each
pipeline rank then takes the least recomputation that still fits (later 1F1B stages hold fewer micro-batches, so they
often need none); the iteration is simulated event by event (:func:`autopar.planner.inter_op.schedule.simulate`).
Time is reported as

    total = compute + exposed communication + bubble + optimizer step

for the critical (busiest) pipeline rank, with tensor-parallel collectives counted as exposed communication (they
sit on the critical path of every layer), data-parallel sync only where it outlasts the last backward, and the step's
loss all-reduce over every rank.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

from autopar.ir.graph import DTYPE_BYTES, Graph
from autopar.ir.plan import (
    DeviceGroup,
    MemoryBreakdown,
    MeshPlan,
    OpSharding,
    ParamSharding,
    Plan,
    SolverReport,
    StagePlan,
    TimeBreakdown,
)
from autopar.planner.inter_op.dpcomm import DpComm
from autopar.planner.inter_op.expert import rank_expert_elems
from autopar.planner.inter_op.memory import memory_breakdown, model_state_bytes
from autopar.planner.inter_op.partition import partition_stages, rank_chunks
from autopar.planner.inter_op.schedule import ScheduleResult, SharedCores, simulate
from autopar.planner.inter_op.screen import (
    Candidate,
    LayerTable,
    Screened,
    block_paths,
    dp_time,
    group_placements,
    in_flight,
    optimizer_time,
    reserve_for,
)
from autopar.planner.intra_op.cpsat import CPSAT_WORKERS
from autopar.planner.options import PlanOptions
from autopar.profiles.cost import CostModel, GroupSpan
from autopar.profiles.schema import ClusterProfile

__all__ = ["build_plan", "assemble_plan", "param_patterns", "evaluate_stages"]

_RC_ORDER = ("none", "selective", "full")


def param_patterns(graph: Graph, table: LayerTable) -> tuple[ParamSharding, ...]:
    """Sharded parameters as patterns, ``*`` standing for the block index of repeated blocks."""
    out: dict[str, str] = {}
    blocks = block_paths(graph)
    for group, sol in zip(graph.layers, table.solutions):
        for fqn, placement in group_placements(graph, group, sol, blocks).items():
            if placement == "R":
                continue
            pat = fqn
            if group.role == "block" and group.module_path and fqn.startswith(group.module_path + "."):
                head, _, idx = group.module_path.rpartition(".")
                pat = (head + "." if head else "") + "*" + fqn[len(group.module_path):]
            out.setdefault(pat, placement)
    return tuple(ParamSharding(pattern=k, placement=v) for k, v in sorted(out.items()))


def _op_shardings(graph: Graph, table: LayerTable) -> tuple[OpSharding, ...]:
    seen: set[str] = set()
    ops: list[OpSharding] = []
    for group, sol in zip(graph.layers, table.solutions):
        key = f"{group.role}:{group.structural_hash}"
        if key in seen:
            continue
        seen.add(key)
        ops.extend(sol.op_shardings)
    return tuple(ops)


def _rank_params(table: LayerTable, chunks: Sequence[tuple[int, int]], n: int) -> float:
    params = sum(sum(table.params[a:b]) for a, b in chunks)
    if any(a == 0 for a, _ in chunks) and any(b == n for _, b in chunks):
        params -= table.shared_params
    return params


def _rank_memory(table: LayerTable, chunks: Sequence[tuple[int, int]], rc: str, flights: float, s: Screened,
                 cost: CostModel, options: PlanOptions, n: int) -> MemoryBreakdown:
    acts = sum(sum(table.act[rc][a:b]) for a, b in chunks) * flights
    if rc == "full":
        acts += max(max(table.act_none[a:b]) for a, b in chunks)
    per_tensor = options.dp_collectives == "tensor"
    largest = max(max((table.largest_tensor if per_tensor else table.params)[a:b]) for a, b in chunks)
    return memory_breakdown(param_elems=_rank_params(table, chunks, n), zero=s.cand.zero, dp=s.cand.grad_dp,
                            mixed_precision=options.dtype != "float32", activations=acts,
                            capacity=cost.profile.device.memory_bytes, largest_layer_elems=largest,
                            reduce_bytes=DTYPE_BYTES.get(options.reduce_dtype, 4), reserve=reserve_for(cost),
                            ep=s.cand.ep, expert_elems=rank_expert_elems(table, chunks))


def _step_syncs(comms: list[DpComm], tc: Sequence[tuple[LayerTable, CostModel]], c: Candidate) -> list[DpComm]:
    """``comms`` with the gradient all-reduce of parameters tied across the first and the last pipeline stage
    (embeddings; Megatron-LM's embedding group does the same), which the runtime runs after every backward pass
    (``codegen.runtime.program._sync_grads``), added to those two ranks, and every rank's training-loop work per
    step (the loss, autograd's start, the optimizer's and ``zero_grad``'s fixed paths: ``runtime_overhead["step"]``,
    :mod:`autopar.profiles.loop`; 0 on GPU profiles), compute on its timeline.

    The step's loss all-reduce (one number over every rank, ``_reduce_loss``) is :func:`_loss_sync`."""
    pp = c.pp
    out = [replace(x, eager_s=x.eager_s + tc[r][1].runtime_overhead("step")) for r, x in enumerate(comms)]
    (table, cost) = tc[0]
    if pp > 1 and table.shared_params > 0:  # float32 gradients of the tied parameters, two ranks a stage-span apart
        tie = cost.collective_time("all_reduce", table.shared_params * DTYPE_BYTES["float32"],
                                   span=_span_within(cost, 2, (pp - 1) * c.dp * c.cp * c.tp))
        for r in (0, pp - 1):
            out[r] = replace(out[r], exposed_s=out[r].exposed_s + tie, collective_s=out[r].collective_s + tie)
    return out


def _loss_sync(cost: CostModel, world: int) -> float:
    """The step's loss all-reduce: one float over every rank, after the last backward and the gradient sync and
    before the optimizer step (``codegen.runtime.program._reduce_loss``), so a global synchronization of its own.
    Pure latency: tens of microseconds on GPUs, against steps of seconds; with CPU ranks that time-slice their cores
    it is milliseconds (every rank must be scheduled), which the measured steps show as time after the last rank's
    work."""
    return cost.loss_sync(world, _span_within(cost, world)) if world > 1 else 0.0


def _span_within(cost: CostModel, size: int, stride: int = 1) -> GroupSpan:
    """``cost.span`` clipped to the cost model's own profile (a heterogeneous pipeline's rank costs with its own
    device group's profile, smaller than the whole cluster)."""
    s, prof = cost.span(size, stride), cost.profile
    return GroupSpan(devices_per_node=min(s.devices_per_node, prof.devices_per_node), nodes=min(s.nodes, prof.nodes))


def _shared_cores(profile: ClusterProfile, c: Candidate, chunks: Sequence[tuple[int, int]],
                  table: LayerTable) -> SharedCores | None:
    """The schedule's shared cores where a CPU profile's ranks outnumber its cores (``device.shared_cores``): each
    pipeline rank's group of ``dp x cp x tp`` ranks, pipeline-outermost as the runtime lays the mesh out, on the nodes
    it spans; its tensor-parallel collectives are the part of a stage's op that sharing does not speed up."""
    cores, dpn = profile.device.shared_cores, profile.devices_per_node
    if cores is None or dpn <= cores or c.pp == 1:
        return None
    g = c.dp * c.cp * c.tp
    spans = []
    for r in range(c.pp):
        nodes: dict[int, int] = {}
        for rank in range(r * g, (r + 1) * g):
            nodes[rank // dpn] = nodes.get(rank // dpn, 0) + 1
        spans.append(tuple(nodes.items()))
    return SharedCores(cores=cores, ranks_per_node=dpn, stage_ranks=tuple(spans),
                       comm_fwd=tuple(sum(x.fwd_comm_s for x in table.solutions[a:b]) for a, b in chunks),
                       comm_bwd=tuple(sum(x.bwd_comm_s for x in table.solutions[a:b]) for a, b in chunks))


def evaluate_stages(table: LayerTable, s: Screened, cost: CostModel, options: PlanOptions,
                    chunks: Sequence[tuple[int, int]], p2p_intra: bool,
                    per_rank: Sequence[tuple[LayerTable, CostModel]] = (), p2p_s: Sequence[float] = ()
                    ) -> tuple[ScheduleResult, list[str], list[MemoryBreakdown], list[float], list[DpComm]] | None:
    """Per-rank recompute choice, memory and the simulated schedule for fixed stage boundaries.

    Heterogeneous pipelines: ``per_rank[r]`` is pipeline rank ``r``'s own (table, cost model), its device type's, and
    ``p2p_s`` the transfer time after each stage; otherwise every rank uses ``table`` and ``cost``."""
    c = s.cand
    pp, n = c.pp, len(table.fwd)
    tc = list(per_rank) or [(table, cost)] * pp
    flights = in_flight(c.schedule, pp, c.num_microbatches, c.virtual_stages)
    allowed = _RC_ORDER[: _RC_ORDER.index(c.recompute) + 1]
    if options.pins.get("recompute") is not None:
        allowed = (c.recompute,)
    rcs, mems = [], []
    for r in range(pp):
        mine = list(rank_chunks(chunks, pp, r))
        for rc in allowed:
            mem = _rank_memory(tc[r][0], mine, rc, flights[r], s, tc[r][1], options, n)
            if mem.total <= mem.capacity:
                break
        else:
            return None
        rcs.append(rc)
        mems.append(mem)
    fwd, bwd, tp_comm = [], [], [0.0] * pp
    for k, (a, b) in enumerate(chunks):
        rc, tab = rcs[k % pp], tc[k % pp][0]
        fwd.append(sum(tab.fwd[a:b]))
        bwd.append(sum(tab.bwd[a:b]) + sum(tab.recompute_fwd[rc][a:b]))
        tp_comm[k % pp] += sum(sol.fwd_comm_s + sol.bwd_comm_s for sol in tab.solutions[a:b])
    if pp > 1:  # the pipeline schedule's eager work per chunk and micro-batch, half in each pass
        pm = [tc[k % pp][1].pipeline_overhead(c.schedule, c.num_microbatches) / 2 for k in range(len(chunks))]
        fwd, bwd = [f + x for f, x in zip(fwd, pm)], [b + x for b, x in zip(bwd, pm)]
    p2p = list(p2p_s) or [cost.p2p_time(table.out_bytes[b - 1], intra_node=p2p_intra) for _, b in chunks[:-1]]
    ranks, opt = [], 0.0
    for r in range(pp):
        table, cost = tc[r]
        mine = list(rank_chunks(chunks, pp, r))
        params = _rank_params(table, mine, n)
        ks = range(r, len(chunks), pp)
        tensors = sum(sum(table.tensors[a:b]) for a, b in mine)
        ranks.append((cost, {"params": params, "units": sum(b - a for a, b in mine), "fwd_s": sum(fwd[k] for k in ks),
                             "bwd_s": sum(bwd[k] for k in ks), "recompute": rcs[r], "param_tensors": tensors,
                             "tensors": tensors if options.dp_collectives == "tensor" else 0}))
        opt = max(opt, optimizer_time(cost, params=params, tensors=tensors, zero=c.zero, dp=c.grad_dp, tp=c.tp))
    # ZeRO 0 without a given mode: the gradient sync overlapped or after the backward, one mode for every rank (the
    # runtime runs one), whichever leaves the slowest rank's sync shorter
    modes = [options.overlap_grad_sync] if options.overlap_grad_sync is not None or c.zero else [True, False]
    comms = min(([dp_time(cst, m=c.num_microbatches, dp=c.grad_dp, tp=c.tp, zero=c.zero, dtype=options.dtype,
                          reduce_dtype=options.reduce_dtype, overlap=mode, **kw) for cst, kw in ranks]
                 for mode in modes), key=lambda cs: max(x.total_s for x in cs))
    comms = _step_syncs(comms, tc, c)
    shared = None if per_rank else _shared_cores(cost.profile, c, chunks, tc[0][0])
    sim = simulate(fwd, bwd, pp=pp, num_microbatches=c.num_microbatches, schedule=c.schedule,  # type: ignore[arg-type]
                   virtual_stages=c.virtual_stages, p2p=p2p if p2p else 0.0, optimizer_s=opt,
                   with_events=False, shared=shared)
    # data-parallel communication (exposed part and overlap contention) lengthens each rank's iteration, and every
    # rank waits for the loss all-reduce
    loss = _loss_sync(cost, pp * c.dp * c.cp * c.tp)
    extra = [x.total_s + loss for x in comms]
    if any(extra):
        ends = tuple(e + x for e, x in zip(sim.rank_end_s, extra))
        exposed = tuple(e + x.exposed_s for e, x in zip(sim.exposed_sync_s, comms))
        sim = replace(sim, rank_end_s=ends, exposed_sync_s=exposed, iteration_s=max(ends) + opt)
    return sim, rcs, mems, [x * c.num_microbatches for x in tp_comm], comms


def build_plan(graph: Graph, profile: ClusterProfile, options: PlanOptions, s: Screened, table: LayerTable,
               cost: CostModel) -> Plan | None:
    """The exact plan for a screened candidate, or None if its exact memory check fails."""
    c = s.cand
    dpn = profile.devices_per_node
    p2p_intra = c.dp * c.cp * c.tp * c.pp <= dpn
    mixed = options.dtype != "float32"
    reserve = reserve_for(cost)
    flights = in_flight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)
    act_frac = 1 + reserve.fragmentation
    part = partition_stages(
        table.time(c.recompute),
        [sum(model_state_bytes(p - e, zero=c.zero, dp=c.grad_dp, mixed_precision=mixed))
         + sum(model_state_bytes(e, zero=c.zero, dp=c.grad_dp // c.ep, mixed_precision=mixed))
         for p, e in zip(table.params, getattr(table, "expert_params", ()) or [0.0] * len(table.params))],
        [a * act_frac for a in table.act[c.recompute]], list(table.out_bytes), pp=c.pp,
        capacity=max(profile.device.memory_bytes - reserve.fixed_bytes, 0.0), virtual_stages=c.virtual_stages,
        p2p=lambda nbytes, k: cost.p2p_time(nbytes, intra_node=p2p_intra),
        in_flight=lambda k: flights[k % c.pp])
    chunks = list(part.boundaries) if part.feasible else list(s.chunks)
    got = evaluate_stages(table, s, cost, options, chunks, p2p_intra)
    if got is None and part.feasible and list(s.chunks) != chunks:
        chunks = list(s.chunks)
        got = evaluate_stages(table, s, cost, options, chunks, p2p_intra)
    if got is None:
        return None
    peak = profile.device.peak_flops.get(options.dtype) or max(profile.device.peak_flops.values())
    return assemble_plan(graph, options, s, table, chunks, got, cluster=profile.name, nodes=profile.nodes, dpn=dpn,
                         peak_flops=peak)


def _matmul_s(chunks: Sequence[tuple[int, int]], rank: int, pp: int, rc: str, table: LayerTable) -> float:
    """Seconds of matmul-like ops (``GroupSolution.matmul_*``) of one micro-batch on pipeline rank ``rank``: its
    chunks' forward and backward, and the forward again under full recomputation (selective recomputes none)."""
    again = 1.0 if rc == "full" else 0.0
    return sum(sol.matmul_fwd_s * (1.0 + again) + sol.matmul_bwd_s
               for k, (a, b) in enumerate(chunks) if k % pp == rank for sol in table.solutions[a:b])


def assemble_plan(graph: Graph, options: PlanOptions, s: Screened, table: LayerTable,
                  chunks: Sequence[tuple[int, int]],
                  got: tuple[ScheduleResult, list[str], list[MemoryBreakdown], list[float], list[DpComm]], *,
                  cluster: str, nodes: int, dpn: int, peak_flops: float, rank_tables: Sequence[LayerTable] = (),
                  device_groups: tuple[DeviceGroup, ...] = (), rank_groups: Sequence[str] = ()) -> Plan:
    """The :class:`Plan` of an evaluated candidate (:func:`evaluate_stages`' result ``got``); ``peak_flops``: the
    devices' mean peak (for MFU). Heterogeneous pipelines: ``rank_tables[r]`` and ``rank_groups[r]`` are pipeline rank
    ``r``'s layer table and device group, ``device_groups`` the plan's groups."""
    c = s.cand
    sim, rcs, mems, tp_comm, comms = got
    crit = max(range(c.pp), key=lambda r: sim.busy_s[r])
    busy = sim.busy_s[crit]
    last = max(range(c.pp), key=lambda r: sim.rank_end_s[r])
    tail = max(sim.rank_end_s) - sim.pipeline_s
    contention = min(comms[last].contention_s, tail)
    eager = min(comms[last].eager_s, tail - contention)  # FSDP2's hooks: compute on the rank's timeline
    exposed = tp_comm[crit] + tail - contention - eager
    tb = TimeBreakdown(compute=busy - tp_comm[crit] + eager, exposed_comm=exposed, bubble=sim.bubble_s,
                       optimizer=sim.optimizer_s, contention=contention,
                       dp_exposed=min(comms[last].exposed_s, tail - contention - eager),
                       dp_collectives=max(x.collective_s for x in comms),
                       matmul=_matmul_s(chunks, crit, c.pp, rcs[crit], rank_tables[crit] if rank_tables else table)
                       * c.num_microbatches)
    stages = []
    for k, (a, b) in enumerate(chunks):
        names = tuple("<prefix>" if g.role == "prefix" else "<suffix>" if g.role == "suffix" else
                      (g.module_path or "<whole>") for g in graph.layers[a:b])
        rc = rcs[k % c.pp]
        tab = rank_tables[k % c.pp] if rank_tables else table
        stages.append(StagePlan(index=k, layer_start=a, layer_end=b, modules=names, recompute=rc,  # type: ignore
                                fwd_s=sum(tab.fwd[a:b]),
                                bwd_s=sum(tab.bwd[a:b]) + sum(tab.recompute_fwd[rc][a:b]),
                                memory=mems[k % c.pp], device_group=rank_groups[k % c.pp] if rank_groups else ""))
    total = tb.total
    per_sample = graph.flops() / graph.batch
    world = nodes * dpn
    tflops = per_sample * options.global_batch / total / world / 1e12
    notes = []
    if table.status != "optimal":
        notes.append(f"intra-op solve status {table.status}, optimality gap {table.gap:.2%}")
    if c.zero in (1, 2):
        notes.append("FSDP2 realizes ZeRO-1/2 as full sharding without resharding after forward")
    return Plan(
        model=graph.model_name, graph_fingerprint=graph.fingerprint, num_params=graph.num_params,
        cluster=cluster, nodes=nodes, devices_per_node=dpn, global_batch=options.global_batch,
        micro_batch=c.micro_batch, num_microbatches=c.num_microbatches,
        mesh=MeshPlan(pp=c.pp, dp=c.dp, ep=c.ep, cp=c.cp, tp=c.tp),
        schedule=c.schedule, virtual_stages=c.virtual_stages, zero=c.zero, dtype=options.dtype,  # type: ignore
        reduce_dtype=options.reduce_dtype, overlap_grad_sync=comms[0].overlapped,
        stages=tuple(stages), param_shardings=param_patterns(graph, table),
        op_shardings=_op_shardings(graph, table), time=tb, samples_per_s=options.global_batch / total,
        tflops_per_device=tflops, mfu=tflops * 1e12 / peak_flops, fused_kernels=options.fused_kernels,
        pins=tuple(f"{k}={v}" for k, v in sorted(options.pins.items())),
        solver=SolverReport(status="optimal" if table.status == "optimal" else "feasible",  # type: ignore
                            objective_s=total, best_bound_s=total * (1 - table.gap), gap=table.gap,
                            wall_s=table.solve_s, seed=options.seed, workers=CPSAT_WORKERS),
        notes=tuple(notes), device_groups=device_groups)
