"""Eager-mode costs the profiler measures on the host: the fixed cost of one op per pass (a chain of tiny autograd
ops, and each IR op kind against it), and the time-slicing of an oversubscribed CPU node (more ranks than cores), with
the profile transform that carries a measured device to such a node."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from autopar.profiles.schema import ClusterProfile

TINY_REPEATS = 15
"""Timed repeats (or pairs) the profiler asks for at least in the measurements of tiny ops below (each takes
milliseconds): on a shared 2-core VM three repeats left a kind's per-op cost varying by 2-3x between two profiles of
an idle machine, and 11 pairs of 3 calls by up to 1.7x."""


PRELOAD = ("torch", "torch.distributed", "autopar.profiles.profiler")
"""What the fork server the profiler starts its processes from imports once (:func:`process_context`)."""


def process_context() -> Any:
    """The multiprocessing context the profiler starts its ranks and helper processes in: a fork server that has
    imported torch once, where the platform has one (each process importing torch afresh costs ~2 CPU-s here, and a
    4-rank profile starts five), else fresh interpreters (``spawn``).  The server never runs an op, so that its
    children start with no OpenMP or CUDA state, as spawned ones do.  A fork server this process already runs (the
    test harness's, ``autopar run``'s agent's) is used as it is; its children take the caller's environment from
    their arguments (:func:`with_env`), not the server's."""
    import multiprocessing
    import multiprocessing.forkserver

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    if getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None) is None:  # type: ignore[attr-defined]
        multiprocessing.set_forkserver_preload(list(PRELOAD))
    return multiprocessing.get_context("forkserver")


def with_env(env: dict[str, str], fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` with ``os.environ`` set to ``env`` first (a fork server's child starts with the server's)."""
    os.environ.clear()
    os.environ.update(env)
    return fn(*args)


def _training_op_overhead(device: torch.device, sync: Callable[[], None], repeats: int, ops: int = 32) -> float:
    """Seconds per op per pass (forward or backward) of a chain of tiny autograd ops: the fixed cost every op of a
    training step pays, which the cost model charges as launch overhead."""
    leaf = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        y = leaf
        for _ in range(ops):
            y = y * 1.0001
        y.sum().backward()

    return _time_calls(chain, sync, repeats, 5, warmup=20) / (2 * (ops + 1))


_OVERHEAD_PASSES = {"matmul": 3, "embedding": 1}
"""Passes the cost model charges one op of a kind's overhead for (``planner.intra_op.coster``): forward plus one
per backward kernel (a linear's two GEMMs; an embedding, whose input is integer, is charged forward only); 2
otherwise."""


def _kind_chains(device: torch.device, ops: int, mesh: Any = None
                 ) -> tuple[dict[str, Callable[[], None]], Callable[[], None], dict[str, int], dict[str, int]]:
    """One forward + backward of a chain of ``ops`` tiny ops of each IR kind, the same chain without them, and what
    else each kind's chain step runs (views, pointwise ops).  With a ``mesh`` every operand and parameter is a
    replicated DTensor on it, as under tensor parallelism (a kind DTensor cannot run raises when called)."""
    import torch.nn.functional as F  # noqa: N812

    x = torch.ones(2, 8, device=device)
    # the pointwise op: one kernel forward and one backward (an activation times a constant of its shape, as RoPE's
    # cos/sin, a mask or a scale): a broadcast weight with a gradient would add a second product and a reduction to
    # its backward, ~2x what most of a transformer's pointwise ops (adds, gates, RoPE) run per pass
    w = torch.full((2, 8), 1.0001, device=device)
    lin = [torch.nn.Linear(8, 8).to(device) for _ in range(ops)]
    norm = [torch.nn.LayerNorm(8).to(device) for _ in range(ops)]
    emb = torch.nn.Embedding(16, 8).to(device)
    idx = torch.zeros(2, dtype=torch.long, device=device)
    if mesh is not None:
        from torch.distributed.tensor import Replicate, distribute_module, distribute_tensor

        x, w, idx = (distribute_tensor(t, mesh, [Replicate()]) for t in (x, w, idx))
        for m in (*lin, *norm, emb):
            distribute_module(m, mesh)
    x.requires_grad_(True)
    q = (1, 1, 2, 8)

    def attn(y: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(y.view(q), y.view(q), y.view(q), is_causal=True).view(2, 8)

    chains: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {
        "matmul": lambda y, i: lin[i](y),
        "norm": lambda y, i: norm[i](y),
        "attention": lambda y, i: attn(y),
        "pointwise": lambda y, i: y * w,
        "reduction": lambda y, i: y.sum(-1, keepdim=True).expand(2, 8),
        "view": lambda y, i: y.view(16).view(2, 8),
        "other": lambda y, i: torch.cat([y, y])[:2],
        "embedding": lambda y, i: y + emb(idx),
    }
    # what else each chain step runs, in views and pointwise ops, removed from its time below
    views = {"attention": 4, "reduction": 1, "view": 2, "other": 1}
    pointwise = {"embedding": 1}

    def run(op: Callable[[torch.Tensor, int], torch.Tensor] | None, n: int) -> Callable[[], None]:
        def f() -> None:
            y = x * 1.0
            for i in range(n):
                y = op(y, i) if op is not None else y
            y.sum().backward()
        return f

    return {k: run(op, ops) for k, op in chains.items()}, run(None, 0), views, pointwise


def _per_pass_costs(step: dict[str, float], views: dict[str, int], pointwise: dict[str, int],
                    per_pass: float) -> dict[str, float]:
    """Seconds per chain step of each kind -> one op's cost per pass the cost model charges
    (:data:`_OVERHEAD_PASSES`), in units of ``per_pass``, less the views and pointwise ops the step also runs."""
    if "view" not in step or "pointwise" not in step:
        return {}
    one = {"view": step["view"] / 2}
    one["pointwise"] = max(step["pointwise"], 0.0)
    out = {}
    for kind, t in step.items():
        if kind == "view":
            t = one["view"]
        else:
            t -= views.get(kind, 0) * one["view"] + pointwise.get(kind, 0) * one["pointwise"]
        out[kind] = max(t, 0.0) / (_OVERHEAD_PASSES.get(kind, 2) * per_pass)
    return out


def _op_overheads(device: torch.device, sync: Callable[[], None], repeats: int, per_pass: float,
                  ops: int = 16) -> dict[str, float]:
    """Eager cost of one op of each IR kind (forward + backward, on tiny operands so that the math is negligible),
    per pass the cost model charges (:data:`_OVERHEAD_PASSES`), in units of ``per_pass`` (the scalar-multiply
    chain's cost per op and pass).  Each kind is a chain of ``ops`` such ops timed against the same chain without
    them (:func:`_paired_extra`), so that the leaf, the loss and ``backward()`` cancel.  DTensor's extra cost on
    top: :func:`_sharded_op_overheads`."""
    chains, base, views, pointwise = _kind_chains(device, ops)
    step = {k: _paired_extra(f, base, sync, repeats) / ops for k, f in chains.items()}
    return _per_pass_costs(step, views, pointwise, per_pass)


def _sharded_op_overheads(device: torch.device, sync: Callable[[], None], repeats: int, per_pass: float,
                          mesh: Any, ops: int = 16) -> dict[str, float]:
    """DTensor's extra eager cost of one op of each kind per pass (sharding propagation, wrapping the local
    result), in units of ``per_pass``: the kind's chain on replicated DTensors of a one-rank ``mesh`` timed against
    the same chain on plain tensors, pair by pair (:func:`_paired_extra`; a difference of the two kinds' separately
    measured costs varied by 2-6x between profiles)."""
    plain, _, views, pointwise = _kind_chains(device, ops)
    sharded, _, _, _ = _kind_chains(device, ops, mesh)
    step = {}
    for k, f in sharded.items():
        try:
            step[k] = _paired_extra(f, plain[k], sync, repeats) / ops
        except Exception:  # noqa: BLE001 - DTensor has no rule for this kind here: not measured
            continue
    return _per_pass_costs(step, views, pointwise, per_pass)


def _runtime_overheads(device: torch.device, sync: Callable[[], None], repeats: int, per_pass: float,
                       tensors: int = 32, units: int = 8) -> dict[str, float]:
    """The training runtime's eager work beyond the model's ops (``DeviceProfile.runtime_overhead``), in units of
    ``per_pass``: AdamW's step per parameter tensor (the worker's optimizer) on plain tensors and, in a one-rank
    process group (:func:`measure_one_rank_overheads`), on DTensor ones (as tensor parallelism and FSDP hold them);
    in that group also FSDP2's per-unit and per-tensor work for one forward and backward (``fully_shard`` on the
    one-rank mesh, so that its collectives cost next to nothing: ``units`` units of 1 and of 8 tiny linears, each
    against the same modules unsharded) and the pipeline
    schedule's work per stage and micro-batch (:func:`_pipeline_overhead`)."""
    import torch.distributed as dist

    def adamw(wrap: Callable[[torch.Tensor], torch.Tensor]) -> float:
        params = [torch.nn.Parameter(wrap(torch.ones(8, 8, device=device))) for _ in range(tensors)]
        for q in params:
            q.grad = torch.ones_like(q)
        opt = torch.optim.AdamW(params, lr=1e-6)
        return _time_calls(opt.step, sync, repeats, 5) / tensors / per_pass

    out = {"optimizer_tensor": adamw(lambda t: t)}
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() == 1:
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.tensor import Shard, distribute_tensor

        group = dist.group.WORLD
        mesh = DeviceMesh.from_group(group, device.type)
        out["optimizer_dtensor"] = adamw(lambda t: distribute_tensor(t, mesh, [Shard(0)]))
        out.update(_fsdp_overheads(device, sync, repeats, per_pass, units, group))
        out["pipeline_microbatch"] = _pipeline_overhead(device, sync, repeats, group) / per_pass
    return out


def _runtime_worker(queue: Any, threads: int, repeats: int) -> None:
    import tempfile

    import torch.distributed as dist

    torch.set_num_threads(threads)
    with tempfile.TemporaryDirectory(prefix="autopar-runtime-") as d:
        dist.init_process_group("gloo", store=dist.FileStore(os.path.join(d, "store"), 1), rank=0, world_size=1)
        try:
            from torch.distributed.device_mesh import DeviceMesh

            cpu, sync = torch.device("cpu"), (lambda: None)
            per_pass = _training_op_overhead(cpu, sync, repeats)
            mesh = DeviceMesh.from_group(dist.group.WORLD, cpu.type)
            queue.put((_runtime_overheads(cpu, sync, repeats, per_pass),
                       _sharded_op_overheads(cpu, sync, repeats, per_pass, mesh)))
        finally:
            dist.destroy_process_group()


def measure_one_rank_overheads(*, threads: int = 1, repeats: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """:func:`_runtime_overheads` and :func:`_sharded_op_overheads` on CPU in a process of its own (a one-rank gloo
    group), relative to the op cost per pass measured in that process (with DTensor's resharding cost,
    :func:`autopar.profiles.redistribute.measure_runtime_overheads`: the ``runtime_overhead`` and the
    ``dtensor_op_overhead`` of a CPU profile)."""
    runtime, sharded = in_own_process(_runtime_worker, threads, repeats)
    return dict(runtime), dict(sharded)


def in_own_process(worker: Callable[..., None], *args: Any, timeout: float = 600.0) -> Any:
    """What ``worker(queue, *args)`` puts on ``queue``, run in a process of its own (:func:`process_context`) with
    this process's environment: a measurement that needs a fresh process group or torch state."""
    ctx = process_context()
    queue = ctx.Queue()
    proc = ctx.Process(target=with_env, args=(dict(os.environ), worker, queue, *args))
    proc.start()
    try:
        return queue.get(timeout=timeout)
    finally:
        proc.join()


def _pipeline_probe(device: torch.device, microbatches: int
                    ) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Callable[..., torch.Tensor]]:
    """The stage both pipeline measurements time: four tiny linears, ``microbatches`` micro-batches of 2 samples and
    their targets, and a loss that reads both."""
    net = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)]).to(device)
    x, tgt = torch.ones(2 * microbatches, 8, device=device), torch.zeros(2 * microbatches, device=device)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return out.sum() + 0 * target.sum()

    return net, x, tgt, loss_fn


def _pipeline_overhead(device: torch.device, sync: Callable[[], None], repeats: int, group: Any,
                       microbatches: int = 4) -> float:
    """Seconds per micro-batch that ``torch.distributed.pipelining``'s schedule adds to one stage's forward and
    backward (input/output bookkeeping, the stage's backward call, the loss per micro-batch): a one-stage 1F1B
    schedule on a one-rank group (no sends) against the same micro-batches run in a plain loop."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    m = microbatches
    net, x, tgt, loss_fn = _pipeline_probe(device, m)
    stage = PipelineStage(net, 0, 1, device, group=group, input_args=(torch.empty(2, 8, device=device),),
                          output_args=(torch.empty(2, 8, device=device),))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn)

    def plain() -> None:
        for xi, ti in zip(torch.chunk(x, m), torch.chunk(tgt, m)):
            (loss_fn(net(xi), ti) / m).backward()

    def scheduled() -> None:
        schedule.step(x, target=tgt, losses=[])

    return _paired_extra(scheduled, plain, sync, repeats) / m


def pipeline_overhead_two_ranks(device: torch.device, rank: int, repeats: int, group: Any = None,
                                microbatches: int = 8, p2p_s: float = 0.0, schedule: str = "1f1b") -> float:
    """Seconds per micro-batch and chunk that a two-rank pipeline schedule on ranks 0 and 1 (``rank``, in ``group``)
    adds to each chunk's forward and backward, its sends and receives included: with NCCL they overlap compute, on
    gloo each stage waits for every activation and gradient, in the steady state too.  ``schedule``: ``"1f1b"``,
    ``"gpipe"`` (one chunk per rank) or ``"interleaved_1f1b"`` (two per rank, as a plan with ``virtual_stages=2``).
    The schedule's time over the ``m * v + 1`` chunk slots the cost model gives two ranks of ``v`` chunks
    (``(m - 1) R + 2 R`` for ``v = 1``, ``R`` a rank's time per micro-batch; the interleaved bubble is ``R / v``,
    :mod:`autopar.planner.inter_op.screen`), less a chunk's forward and backward of a micro-batch run in a plain loop
    on both ranks at once.  Both ranks call it; the returned number is rank 0's (rank 0 finishes the schedule last).

    ``p2p_s``: what the cost model charges for one send between the stages at the probe's size (the profile's p2p
    table).  The schedule simulator adds it on every dependency between stages, :func:`simulated_sends` of them on
    this schedule's critical path, so that much is taken out of the measured time here rather than charged twice."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    kinds = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "interleaved_1f1b": ScheduleInterleaved1F1B}
    if schedule not in kinds:
        raise ValueError(f"unknown schedule {schedule!r}; expected one of {', '.join(kinds)}")
    m, v = microbatches, 2 if schedule == "interleaved_1f1b" else 1
    nets = []
    for _ in range(v):
        net, x, tgt, loss_fn = _pipeline_probe(device, m)
        nets.append(net)
    # rank r holds chunks r, r + 2, .. (shapes inferred on the first step)
    stages = [PipelineStage(net, rank + 2 * k, 2 * v, device, group=group) for k, net in enumerate(nets)]
    sched = kinds[schedule](stages if v > 1 else stages[0], n_microbatches=m, loss_fn=loss_fn)

    def scheduled() -> None:
        if rank == 0:
            sched.step(x)
        else:
            sched.step(target=tgt, losses=[])

    def plain() -> None:
        for xi in torch.chunk(x, m):
            for net in nets:
                net(xi).sum().backward()

    def timed(fn: Callable[[], None]) -> float:
        dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    for _ in range(3):  # warm-up: the first schedule step also infers the stages' shapes
        timed(scheduled)
        timed(plain)
    # adjacent pairs (see _paired_extra): the machine's speed, which moves over seconds, cancels in each difference
    pairs = [timed(scheduled) / (m * v + 1) - timed(plain) / (m * v) for _ in range(max(repeats, 1))]
    return max(statistics.median(pairs) - simulated_sends(m, p2p_s, schedule), 0.0)


def simulated_sends(m: int, p2p_s: float, schedule: str = "1f1b") -> float:
    """Per chunk slot, the sends the schedule simulator charges a two-rank schedule of ``m`` micro-batches on its
    critical path (:func:`autopar.planner.inter_op.schedule.simulate`), over its ``m * v + 1`` slots: 1F1B crosses
    between the ranks ``2 * ceil(m / 2)`` times, GPipe twice (the first forward and the last backward), interleaved
    1F1B with two chunks per rank six times."""
    sends, v = {"gpipe": (2, 1), "interleaved_1f1b": (6, 2)}.get(schedule, (2 * ((m + 1) // 2), 1))
    return sends * p2p_s / (m * v + 1)


def probe_send_s(links: dict[str, Any] | None) -> float:
    """The p2p time the cost model charges for one send of the pipeline probe's activations (2 x 8 floats), from the
    p2p table of measured links (``_measure_links``'s result; 0 without one: ranks other than 0 hold none)."""
    rows = (links or {}).get("tables", {}).get("p2p")
    return rows[0]["alpha_s"] + 64 / rows[0]["busbw"] if rows else 0.0


def _fsdp_overheads(device: torch.device, sync: Callable[[], None], repeats: int, per_pass: float,
                    units: int, group: Any) -> dict[str, float]:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    mesh = DeviceMesh.from_group(group, device.type)
    x = torch.ones(2, 8, device=device)

    def step_of(per_unit: int, shard: bool) -> Callable[[], None]:
        net = torch.nn.Sequential(*[torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(per_unit)])
                                    for _ in range(units)]).to(device)
        if shard:  # ZeRO-1/2 as the runtime applies it: every unit, then the root; gathered from forward to backward
            for u in net:
                fully_shard(u, mesh=mesh, reshard_after_forward=False)
            fully_shard(net, mesh=mesh, reshard_after_forward=False)

        def step() -> None:
            net(x).sum().backward()
            for q in net.parameters():
                q.grad = None
        return step

    extra = {k: _paired_extra(step_of(k, True), step_of(k, False), sync, repeats) for k in (1, 8)}
    per_tensor = max(extra[8] - extra[1], 0.0) / (2 * 7 * units)  # a linear holds 2 tensors
    per_unit = max(extra[1] - 2 * per_tensor * units, 0.0) / (units + 1)  # the root is a unit too
    return {"fsdp_unit": per_unit / per_pass, "fsdp_tensor": per_tensor / per_pass}


def _paired_extra(with_fn: Callable[[], Any], without_fn: Callable[[], Any], sync: Callable[[], None],
                  repeats: int, inner: int = 5, warmup: int = 10) -> float:
    """Seconds per call that ``with_fn`` takes beyond ``without_fn`` (at least 0): the median over ``repeats``
    adjacent pairs of timings (``inner`` calls each), after ``warmup`` calls of both.  Each difference is taken
    between two timings milliseconds apart, so that the machine's speed, which moves over seconds on a shared host,
    and the first calls' lazy initialisation cancel in it; a difference of two medians timed one after the other
    carries whatever the speed did between them (on a 2-core VM a kind's per-op cost came out anywhere from 0.5 to
    22 us in four back-to-back measurements on the idle machine)."""
    for _ in range(warmup):
        without_fn()
        with_fn()
    sync()
    diffs = []
    for i in range(max(repeats, 1)):
        pair = [0.0, 0.0]
        for j in ((0, 1) if i % 2 == 0 else (1, 0)):  # alternate the order: neither always runs first
            fn = with_fn if j == 0 else without_fn
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            sync()
            pair[j] = (time.perf_counter() - t0) / inner
        diffs.append(pair[0] - pair[1])
    return max(statistics.median(diffs), 0.0)


def _sync_fn(device: torch.device) -> Callable[[], None]:
    """What waits for ``device``'s queued work before a clock is read (nothing on CPU)."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def _time_calls(fn: Callable[[], Any], sync: Callable[[], None], repeats: int, inner: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)

def _slicing_worker(barrier: Any, queue: Any, iters: int, threads: int,
                    workload: Callable[[], Callable[[], None]] | None) -> None:
    torch.set_num_threads(threads)
    if workload is not None:  # e.g. a model's own training step: its op mix and its memory footprint
        work = workload()
    else:
        a = torch.randn(64, 64)
        leaf = torch.ones(8, requires_grad=True)

        def work() -> None:  # a training step in miniature: small matmuls and a chain of tiny autograd ops
            for _ in range(4):
                a @ a
            y = leaf
            for _ in range(8):
                y = y * 1.0001
            y.sum().backward()

    for _ in range(max(1, iters // 10)):
        work()
    barrier.wait()
    t0 = time.perf_counter()
    for _ in range(iters):
        work()
    queue.put(time.perf_counter() - t0)


def time_concurrent(processes: int, *, iters: int | None = None, threads: int = 1,
                    workload: Callable[[], Callable[[], None]] | None = None) -> float:
    """Median wall seconds of a fixed CPU workload run by ``processes`` processes at once (started together).

    Against the same with fewer processes, this is the time-slicing factor of an oversubscribed CPU node: more
    ranks than cores (or other work on the machine) share the cores, and each rank's every op takes that much
    longer (:func:`oversubscribed`).  The workload is a miniature training step (3000 iterations), or what
    ``workload()`` returns, called in each process (picklable; 100 iterations), e.g. a model's own training step
    (:func:`autopar.planner.calibrate.model_step`): processes that switch on a core evict each other's caches,
    which costs a model's larger working set more (4 vs 2 processes on 2 cores here: x2.1-2.5 for gpt-tiny, x1.9-2.1
    for the miniature)."""
    iters = iters or (100 if workload is not None else 3000)
    ctx = process_context()
    barrier, queue = ctx.Barrier(processes), ctx.Queue()
    env = dict(os.environ)
    procs = [ctx.Process(target=with_env, args=(env, _slicing_worker, barrier, queue, iters, threads, workload))
             for _ in range(processes)]
    for p in procs:
        p.start()
    times = [queue.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return statistics.median(times)


def oversubscribed(profile: ClusterProfile, slowdown: float, *, note: str = "") -> ClusterProfile:
    """``profile`` with every device time (arithmetic, memory traffic, per-op overhead) ``slowdown`` times longer:
    the device of a node whose ranks share fewer cores than they need (e.g. a 2-rank CPU profile carried to 4 ranks
    on the same 2 cores, ``slowdown = time_concurrent(4) / time_concurrent(2)``), all of them computing at once.
    Ranks that compute while others wait are charged the same (no ``shared_cores``): measured here, two two-stage
    pipelines on 4 ranks took x1.7-2.7 the step of one on 2 ranks (``benchmarks/cpu_sync_costs.py``), where a stage
    computing beside a waiting one would have a core to itself (x1).  Links are left as they are."""
    if not slowdown > 0:
        raise ValueError(f"slowdown must be positive, got {slowdown}")
    import dataclasses

    dev = profile.device
    tag = note or f"time-sliced x{slowdown:.3g}"
    sources = dict(dev.sources)
    for k in ("peak_flops", "vector_flops", "memory_bandwidth", "launch_overhead_s"):
        sources[k] = f"{sources.get(k, '')}; {tag}".lstrip("; ")
    device = dataclasses.replace(
        dev, peak_flops={k: v / slowdown for k, v in dev.peak_flops.items()},
        vector_flops=None if dev.vector_flops is None else dev.vector_flops / slowdown,
        memory_bandwidth=dev.memory_bandwidth / slowdown, launch_overhead_s=dev.launch_overhead_s * slowdown,
        sources=sources)
    return dataclasses.replace(profile, device=device)

