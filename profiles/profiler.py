"""``autopar profile``: measure this machine and write a cluster profile the planner accepts.

Runs ``ranks`` local processes (forked from a server that imported torch once, or spawned where the platform has
none; on a free localhost port; gloo on CPU, NCCL with one rank per GPU on CUDA) and measures, all ranks
concurrently (so shared memory bandwidth and cores are contended as in a real run):

- matmul time over square sizes and dtypes (float32, bfloat16; float16 on GPU), with the threads a rank would use
  (CPU: ``cpu_count // ranks``). The peak of a dtype is its best achieved FLOP/s; efficiency = achieved / peak, with
  the measured launch overhead removed first (the cost model adds it back);
- pointwise memory bandwidth (``out = a + b`` on large tensors, 3 tensors of traffic);
- causal flash attention forward + backward per head dimension and sequence length
  (``causal_attention_efficiency``, :func:`attention_curve`);
- on CPU, the arithmetic rate of non-matmul ops (``vector_flops``: the median over norms, softmax, activations, a sum
  and a product of FLOPs as the IR counts them per second, on cache-resident tensors; on GPU the fp32 peak);
- launch overhead: what one op costs beyond its math in a training step, i.e. a chain of tiny autograd ops run
  forward and backward, per op and pass (dispatch + autograd bookkeeping + kernel launch); a bare one-element op
  (no autograd) is also timed and is what matmul timings are corrected by; and, per op kind of the IR (linear,
  layer norm, attention, pointwise, reduction, view, cat, embedding), a chain of tiny such ops against the same chain
  without them, stored as ``op_overhead`` in units of the launch overhead (an ``nn.Linear`` costs about twice a
  multiply per pass here, a view about half); on CPU also the runtime's eager work beyond the model's ops
  (``runtime_overhead``: AdamW's step per parameter tensor and the ops it dispatches, FSDP2's hooks per unit and
  per parameter tensor, the pipeline schedule's work per micro-batch; in one process of its own, a one-rank gloo
  group, relative to its own op cost per pass; with two ranks or more, two-stage GPipe and 1F1B schedules at several
  micro-batch counts with their sends on every rank pair at once, and the loss sync after compute (:mod:`.syncs`));
- collectives over message sizes (1 KiB .. 64 MiB by powers of 4; ``quick``: 1 KiB .. 16 MiB) on groups of
  2, 4, .. ``ranks`` ranks (one group alone, and every disjoint group of a size in step where there are several):
  ``all_reduce``, ``all_gather_single`` / ``reduce_scatter_single`` (the ``*_into_tensor`` / ``*_tensor`` forms on
  older torch) and ``all_to_all_single`` (all natively supported by gloo in torch >= 2.x, so nothing is emulated),
  and p2p as ping-pong ``send``/``recv`` (one-way time = round trip / 2) between ranks 0 and 1, 2 and 3, .. at once,
  as a pipeline's stage pairs send at once.
  CPU ranks use one compute thread during this phase. Each point: warm-up, then the median over repeats of the
  slowest rank's time. Alpha-beta are fitted per collective and group size (:func:`autopar.profiles.fit.fit_alpha_beta`,
  relative least squares, non-negative) and stored as NCCL-tests bus bandwidth.

The result has ``nodes = 1`` and ``devices_per_node = ranks`` and no ``inter_node`` level.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import platform
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.profiles.cost import collective_factor
from autopar.profiles.eager import (  # noqa: F401  (re-exported: the profiler's public measuring helpers)
    _OVERHEAD_PASSES,
    TINY_REPEATS,
    _op_overheads,
    _sync_fn,
    _time_calls,
    _training_op_overhead,
    oversubscribed,
    probe_send_s,
    process_context,
    time_concurrent,
    with_env,
)
from autopar.profiles.fit import busbw_from_beta, fit_alpha_beta
from autopar.profiles.profiler_args import build_parser
from autopar.profiles.rates import attention_curve, time_matmul, vector_rate
from autopar.profiles.redistribute import measure_runtime_overheads  # noqa: F401  (re-exported, as above)
from autopar.profiles.schema import SCHEMA_VERSION, ClusterProfile, pipeline_key, profile_from_dict, save_profile
from autopar.profiles.syncs import REFERENCE_CASE, loss_sync_under_load, pipeline_overheads

__all__ = ["ProfileOptions", "default_message_sizes", "free_port", "measure_profile", "run_profile_command",
           "time_collective", "time_matmul", "main"]

log = logging.getLogger(__name__)
KIB = 1024
_COLL = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


@dataclass(kw_only=True, slots=True, frozen=True)
class ProfileOptions:
    """What ``measure_profile`` measures."""

    ranks: int = 2
    """Local ranks (processes); on CUDA at most the number of GPUs."""
    quick: bool = False
    """Fewer sizes and repeats (seconds instead of minutes)."""
    backend: str | None = None
    """'gloo' or 'nccl'; None: NCCL if CUDA is available, else gloo."""
    matmul_sizes: tuple[int, ...] | None = None
    """Square matmul sizes; None: a default for the device and mode."""
    message_sizes: tuple[int, ...] | None = None
    """Collective message sizes in bytes; None: :func:`default_message_sizes`."""
    repeats: int | None = None
    """Timed repeats per point (median taken); None: 3 quick, 7 full."""
    warmup: int = 2
    """Untimed warm-up calls per point."""
    threads_per_rank: int | None = None
    """CPU compute threads per rank; None: cpu_count // ranks."""
    progress: bool = True
    """Show a rich progress bar on rank 0."""
    name: str | None = None
    """Profile name; None: derived from the host."""


def default_message_sizes(quick: bool) -> tuple[int, ...]:
    """1 KiB .. 64 MiB by powers of 4 (quick: 1 KiB .. 16 MiB).

    Quick still reaches 16 MiB: gloo ranks on a shared-core machine take 0.5-8 ms per collective of any size up to
    1 MiB (scheduling, not bytes), so a fit over sizes up to 1 MiB finds its bandwidth term in that noise (measured
    here: 198 MB/s one run, 990 GB/s another); at 4-16 MiB the bytes take longer than the noise."""
    top = 16 * KIB * KIB if quick else 64 * KIB * KIB
    out, s = [], KIB
    while s <= top:
        out.append(s)
        s *= 4
    return tuple(out)


def free_port() -> int:
    """A TCP port free on localhost right now, for a local process group's rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def exit_without_finalization(code: int = 0) -> NoReturn:
    """End a rank whose process groups are destroyed without the interpreter's finalization.

    After ``destroy_process_group()`` a gloo worker thread may still hold the last collective's work, whose tensors
    are owned by Python.  When it lets go of them while the interpreter finalizes, taking the GIL ends the thread
    inside a C++ destructor and the whole process aborts (``terminate called without an active exception``,
    SIGABRT) after its work is done and saved: seen about once in 25-50 two-rank runs on a loaded machine
    (pytorch/pytorch#179291 describes the race).  Flush what was written and leave with ``os._exit``."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream has nothing left to flush
            pass
    os._exit(code)


def time_collective(
    kind: str, nbytes: int, group: Any, group_size: int, device: torch.device, repeats: int, warmup: int,
    start: Any = None,
) -> float:
    """Median over repeats of the slowest rank's time for one collective of ``nbytes`` (schema size convention).

    Must be called by every rank of ``group``; p2p (``kind='p2p'``) by both ranks of pairs 2i, 2i+1 of the world.
    ``start``: the group whose barrier starts each sample and whose slowest rank counts (None: ``group``'s own;
    groups measured in step share one: a step waits for the slowest of them)."""
    sync, step_group = _sync_fn(device), group if start is None else start
    g = group_size
    numel = max(g, (nbytes // 4) // g * g)
    if kind == "all_reduce":
        x = torch.ones(numel, device=device)
        fn: Callable[[], Any] = lambda: dist.all_reduce(x, group=group)  # noqa: E731
    elif kind == "all_gather":
        out, inp = torch.empty(numel, device=device), torch.ones(numel // g, device=device)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn = lambda: ag(out, inp, group=group)  # noqa: E731
    elif kind == "reduce_scatter":
        inp, out = torch.ones(numel, device=device), torch.empty(numel // g, device=device)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn = lambda: rs(out, inp, group=group)  # noqa: E731
    elif kind == "all_to_all":
        inp, out = torch.ones(numel, device=device), torch.empty(numel, device=device)
        fn = lambda: dist.all_to_all_single(out, inp, group=group)  # noqa: E731
    elif kind == "p2p":
        buf = torch.ones(max(1, nbytes // 4), device=device)
        rank = dist.get_rank()
        first, then = (dist.send, dist.recv) if rank % 2 == 0 else (dist.recv, dist.send)

        def fn() -> None:  # ping-pong; the caller halves the time
            first(buf, rank ^ 1)
            then(buf, rank ^ 1)
    else:
        raise ValueError(f"unknown collective {kind!r}")
    for _ in range(warmup):
        fn()
    sync()
    samples = []
    for _ in range(repeats):
        if kind != "p2p":
            dist.barrier(group=step_group)
        t0 = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - t0)
    ts = torch.tensor(samples, dtype=torch.float64, device=device)
    if kind != "p2p":
        dist.all_reduce(ts, op=dist.ReduceOp.MAX, group=step_group)
    med = statistics.median(ts.tolist())
    return med / 2 if kind == "p2p" else med


def _progress(enabled: bool, total: int) -> Any:
    if not enabled:
        return None
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]autopar profile[/] {task.description}"), BarColumn(), TimeElapsedColumn(),
                 console=Console(stderr=True))  # stdout stays for results
    p.start()
    p.add_task("starting", total=total)
    return p


def _step(p: Any, desc: str) -> None:
    log.debug("profiling: %s", desc)
    if p is not None:
        p.update(p.task_ids[0], advance=1, description=desc)


def _matmul_sizes(opts: ProfileOptions, cuda: bool) -> tuple[int, ...]:
    if opts.matmul_sizes:
        return opts.matmul_sizes
    if cuda:
        return (256, 512, 1024, 2048) if opts.quick else (256, 512, 1024, 2048, 4096, 8192)
    return (64, 128, 256) if opts.quick else (128, 256, 512, 1024, 2048)


def _measure_device(opts: ProfileOptions, device: torch.device, rank: int, prog: Any) -> dict[str, Any]:
    cuda = device.type == "cuda"
    quick, reps = opts.quick, opts.repeats or (3 if opts.quick else 7)
    sync = _sync_fn(device)
    # launch overhead: a one-element op
    x, y = torch.ones(1, device=device), torch.ones(1, device=device)
    out = torch.empty(1, device=device)
    launch = _time_calls(lambda: torch.add(x, y, out=out), sync, reps, 200)
    tiny = max(reps, TINY_REPEATS)  # tiny ops: cheap to repeat, and noisy
    per_op = _training_op_overhead(device, sync, tiny)
    op_overhead = _op_overheads(device, sync, tiny, max(launch, per_op))
    _step(prog, "launch overhead")
    # pointwise bandwidth: out = a + b
    numel = (4 if quick else 16) * 1024 * 1024 * (16 if cuda else 1)
    a, b, c = (torch.ones(numel, device=device) for _ in range(3))
    t_add = _time_calls(functools.partial(torch.add, a, b, out=c), sync, reps, 3)
    del a, b, c
    mem_bw = 3 * numel * 4 / t_add
    _step(prog, "memory bandwidth")
    dtypes = ["float32", "bfloat16"] + (["float16"] if cuda else [])
    sizes = _matmul_sizes(opts, cuda)
    limit = 0.2 if quick else 1.0
    peak: dict[str, float] = {}
    eff: dict[str, list[dict[str, float]]] = {}
    for dt in dtypes:
        rates: list[tuple[float, float]] = []
        for n in sizes:
            if rates and rates[-1][0] / rates[-1][1] > limit:
                log.info("skipping %s matmul >= %d: too slow on this device", dt, n)
                _step(prog, f"matmul {dt} {n} (skipped)")
                continue
            t = time_matmul(n, getattr(torch, dt), device, reps, budget_s=0.01 if quick else 0.05)
            flops = 2.0 * n**3
            rates.append((flops, flops / max(t - launch, 0.5 * t)))
            _step(prog, f"matmul {dt} {n}")
        peak[dt] = max(r for _, r in rates)
        pts: list[dict[str, float]] = []
        for f, r in rates:
            e = min(1.0, r / peak[dt])
            if pts:  # keep implied time f/e non-decreasing (timing noise can break it)
                e = min(e, pts[-1]["efficiency"] * f / pts[-1]["flops"])
            pts.append({"flops": f, "efficiency": e})
        eff[dt] = pts
    attn_peak = peak["bfloat16" if cuda else "float32"]
    attn_overhead = op_overhead.get("attention", 1.0) * max(launch, per_op)
    attention = attention_curve(device, sync, tiny, attn_peak, attn_overhead, quick)
    _step(prog, "attention")
    # non-matmul arithmetic: on a GPU these ops are memory-bound at any size worth costing, and a rate timed from one
    # would be the bandwidth again, so the fp32 peak stands for it; a CPU core runs them far below its matmul peak
    vector = peak["float32"] if cuda else vector_rate(device, sync, tiny, launch)[0]
    _step(prog, "vector ops")
    if cuda:
        name = torch.cuda.get_device_name(device)
        mem = int(torch.cuda.get_device_properties(device).total_memory)
    else:
        name = f"{platform.processor() or platform.machine()} CPU ({torch.get_num_threads()} threads/rank)"
        mem = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // max(1, opts.ranks)
    src = f"measured by autopar profile on {platform.node()} ({time.strftime('%Y-%m-%d')})"
    return {
        "name": name,
        "memory_bytes": mem,
        "peak_flops": peak,
        "matmul_efficiency": eff,
        "memory_bandwidth": mem_bw,
        "launch_overhead_s": max(launch, per_op),
        "op_overhead": op_overhead,
        "vector_flops": vector,
        "causal_attention_efficiency": attention,
        "sources": {
            k: src
            for k in ("name", "memory_bytes", "peak_flops", "matmul_efficiency", "memory_bandwidth",
                      "launch_overhead_s", "op_overhead", "vector_flops", "causal_attention_efficiency")
        },
    }


def _group_sizes(ranks: int) -> list[int]:
    gs, g = [], 2
    while g < ranks:
        gs.append(g)
        g *= 2
    return gs + [ranks]


def _measure_links(opts: ProfileOptions, device: torch.device, rank: int, prog: Any) -> dict[str, Any]:
    sizes = opts.message_sizes or default_message_sizes(opts.quick)
    reps = opts.repeats or (3 if opts.quick else 7)
    backend = dist.get_backend()
    src = f"measured by autopar profile ({backend}, {len(sizes)} sizes {sizes[0]}..{sizes[-1]} B) on {platform.node()}"
    tables: dict[str, list[dict[str, Any]]] = {k: [] for k in (*_COLL, "p2p")}
    raw: dict[str, dict[int, list[float]]] = {k: {} for k in (*_COLL, "p2p")}
    for g in _group_sizes(opts.ranks):
        # each disjoint block of g ranks: block 0 alone (the others wait), then all blocks in step, each sample started
        # at one barrier of them all, as a stage's tp ranks' dp groups communicate at once (ranks sharing cores wait for
        # the cores the others hold: on 4 CPU ranks on 2 cores a pair's all-reduce of 64 KiB-1 MiB took 0.4-0.9 ms
        # alone, 2.2-4.9 in step).  Two points, ``groups`` 1 and ``blocks``; ranks past the last whole block sit out
        blocks = opts.ranks // g
        groups = [dist.new_group(list(range(b * g, (b + 1) * g))) for b in range(blocks)] if g < opts.ranks else [None]
        everyone = dist.group.WORLD if blocks * g == opts.ranks else dist.new_group(list(range(blocks * g)))
        measures = rank // g < blocks
        group = groups[rank // g] if measures else None
        for kind in _COLL:
            for n in (1, blocks) if blocks > 1 else (1,):
                ts, start = [], everyone if n > 1 else None
                for s in sizes:
                    if rank // g < n:
                        r = reps if s <= 4 * KIB * KIB else max(3, reps // 2)
                        t = time_collective(kind, s, group, g, device, r, opts.warmup, start=start)
                        ts += [t] if rank < g else []
                    _step(prog if n == 1 else None, f"{kind} g={g} {s // KIB} KiB" + f" x{n} in step" * (n > 1))
                raw[kind].setdefault(g, ts)  # block 0 alone
                if rank == 0:
                    alpha, beta = fit_alpha_beta(sizes, ts)
                    busbw = busbw_from_beta(beta, collective_factor(kind, g))
                    tables[kind].append({"group_size": g, "alpha_s": alpha, "busbw": busbw, "source": src,
                                         **({"groups": n} if n > 1 else {})})
                if blocks > 1 and measures:  # block 0's pass ends before the others start theirs
                    dist.barrier(group=everyone)
        dist.barrier()
    ts = []
    for s in sizes:  # every pair at once (a world of odd size leaves its last rank out); rank 0's time is kept
        t = time_collective("p2p", s, None, 2, device, reps, opts.warmup) if rank < opts.ranks // 2 * 2 else 0.0
        ts += [t] if rank == 0 else []
        _step(prog, f"p2p {s // KIB} KiB")
    raw["p2p"][2] = ts
    if rank == 0:
        alpha, beta = fit_alpha_beta(sizes, ts)
        tables["p2p"].append({"group_size": 2, "alpha_s": alpha, "busbw": 1.0 / beta, "source": src})
    return {"tables": tables, "raw": raw, "sizes": list(sizes)}


def _rank_entry(rank: int, env: dict[str, str], opts: ProfileOptions, port: int, backend: str, result_path: str
                ) -> None:
    """One profiling rank, in the caller's environment (see :func:`~autopar.profiles.eager.process_context`)."""
    with_env(env, _worker, rank, opts, port, backend, result_path)


def _worker(rank: int, opts: ProfileOptions, port: int, backend: str, result_path: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    threads = opts.threads_per_rank or max(1, (os.cpu_count() or 1) // opts.ranks)
    torch.set_num_threads(threads)
    dist.init_process_group(backend, rank=rank, world_size=opts.ranks)
    try:
        n_mm = len(_matmul_sizes(opts, cuda)) * (3 if cuda else 2)
        n_coll = len(opts.message_sizes or default_message_sizes(opts.quick))
        total = 4 + n_mm + (len(_group_sizes(opts.ranks)) * 4 + 1) * n_coll * (opts.ranks > 1)
        prog = _progress(opts.progress and rank == 0, total)
        try:
            dev = _measure_device(opts, device, rank, prog)
            dist.barrier()
            torch.set_num_threads(1)
            links = _measure_links(opts, device, rank, prog) if opts.ranks > 1 else None
            pipeline = None
            if not cuda and opts.ranks > 1:  # gloo: the pipeline schedules (their sends too) on every pair at once
                pairs = [dist.new_group([i, i + 1]) for i in range(0, opts.ranks - 1, 2)] if opts.ranks > 2 else [None]
                if rank // 2 < len(pairs):  # rank 0 holds the p2p table (the simulator charges the sends)
                    pipeline = pipeline_overheads(device, rank % 2, max(opts.repeats or 5, 4 * TINY_REPEATS),
                                                  pairs[rank // 2], p2p_s=probe_send_s(links))  # 60 pairs: spread /2
                dist.barrier()
                pipeline = {**(pipeline or {}), "loss_sync": loss_sync_under_load()}
        finally:
            if prog is not None:
                prog.stop()
        if rank == 0:
            Path(result_path).write_text(json.dumps({"device": dev, "links": links, "threads": threads,
                                                     "syncs_s": pipeline}))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_without_finalization(0)  # only after a clean finish: a raised error goes back to start_processes as usual


def measure_profile(ranks: int = 2, *, quick: bool = False, **options: Any) -> ClusterProfile:
    """Measure this machine with ``ranks`` local processes; returns a validated single-node profile.

    ``options`` are further :class:`ProfileOptions` fields (``backend``, ``matmul_sizes``, ``message_sizes``,
    ``repeats``, ``warmup``, ``threads_per_rank``, ``progress``, ``name``).
    """
    return _measure(ProfileOptions(ranks=ranks, quick=quick, **options))[0]


def _measure(opts: ProfileOptions) -> tuple[ClusterProfile, dict[str, Any]]:
    if opts.ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {opts.ranks}")
    backend = opts.backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl" and opts.ranks > torch.cuda.device_count():
        raise ValueError(f"--ranks {opts.ranks} exceeds the {torch.cuda.device_count()} visible GPUs "
                         "(NCCL: one per GPU)")
    with tempfile.TemporaryDirectory(prefix="autopar-profile-") as tmp:
        result = os.path.join(tmp, "result.json")
        log.info("profiling with %d %s rank(s)%s", opts.ranks, backend, " (quick)" if opts.quick else "")
        ctx = process_context()
        mp.start_processes(_rank_entry, args=(dict(os.environ), opts, free_port(), backend, result), nprocs=opts.ranks,
                           join=True, start_method=ctx.get_start_method())
        data = json.loads(Path(result).read_text())
    if backend == "gloo":  # the runtime's eager work, in a one-rank process group of its own
        dev = data["device"]
        dev["runtime_overhead"], dev["dtensor_op_overhead"] = measure_runtime_overheads(
            threads=data["threads"], repeats=max(opts.repeats or 5, TINY_REPEATS))
        dev["sources"]["runtime_overhead"] = dev["sources"]["op_overhead"] + " (one process)"
        dev["sources"]["dtensor_op_overhead"] = (dev["sources"]["op_overhead"] + " (one process: each kind's chain on "
                                                 "replicated DTensors of a one-rank mesh less on plain tensors)")
        syncs = data.get("syncs_s") or {}  # with 2+ ranks: the schedules and the loss sync, measured
        dev["runtime_overhead"].update({k: v / dev["launch_overhead_s"] for k, v in syncs.items()})
        if pipeline_key(*REFERENCE_CASE) in syncs:  # the two-rank schedule (its sends too) replaces the one-rank one
            dev["runtime_overhead"]["pipeline_microbatch"] = dev["runtime_overhead"][pipeline_key(*REFERENCE_CASE)]
            dev["sources"]["runtime_overhead"] += ("; pipeline_*: two-stage schedules, sends and handovers on every "
                                                   "rank pair at once; loss_sync: one-float all-reduce after compute")
        dev["overlap_slowdown"], dev["sources"]["overlap_slowdown"] = 1.0, "gloo: collectives share the ranks' cores"
    links: dict[str, Any] = {}
    if data["links"] is not None:
        links["intra_node"] = data["links"]["tables"]
    name = opts.name or f"{platform.node() or 'local'}-{opts.ranks}x{'gpu' if backend == 'nccl' else 'cpu'}"
    prof = profile_from_dict(
        {
            "schema_version": SCHEMA_VERSION,
            "name": name,
            "source": f"measured by autopar profile ({backend}, {opts.ranks} ranks, "
            f"{data['threads']} compute threads/rank{', quick' if opts.quick else ''})",
            "nodes": 1,
            "devices_per_node": opts.ranks,
            "device": data["device"],
            "links": links,
        }
    )
    return prof, data


def run_profile_command(
    output: str | Path, ranks: int | None = None, quick: bool = False, *, progress: bool = True, **options: Any
) -> ClusterProfile:
    """What ``autopar profile -o FILE [--ranks N] [--quick]`` does: measure, validate, write ``output``.

    ``ranks`` defaults to the number of GPUs on CUDA, else 2.
    """
    if ranks is None:
        ranks = torch.cuda.device_count() if torch.cuda.is_available() else 2
    prof = measure_profile(ranks, quick=quick, progress=progress, **options)
    save_profile(prof, output)
    log.info("wrote %s", output)
    return prof


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m profiles.profiler -o FILE``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    prof = run_profile_command(
        args.output, args.ranks, args.quick, progress=not args.no_progress, backend=args.backend, name=args.name
    )
    log.info(
        "%s: %d rank(s), matmul peak %s, memory %.1f GB/s",
        prof.name,
        prof.devices_per_node,
        {k: f"{v / 1e9:.1f} GFLOP/s" for k, v in prof.device.peak_flops.items()},
        prof.device.memory_bandwidth / 1e9,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
