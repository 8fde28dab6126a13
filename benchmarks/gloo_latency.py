"""How long one small collective takes on this machine, three ways, side by side: what ``autopar profile`` times
(each call after a barrier), calls back to back (a tensor-parallel step issues its collectives between small ops), and
back to back with a little compute between them (every rank of the group busy, as in a step).

On GPUs the three agree within microseconds.  On CPU ranks (gloo) that share cores, they do not: the profile's
barrier-separated latency is what one isolated all-reduce (DDP's bucket at the end of backward) sees, and the other
two are what a tp plan's chain of all-reduces sees, where every call waits for the peer to be scheduled.  The cost
model charges the first to both; ``benchmarks/calibrate_cpu.py``'s 4-rank dp=2 x tp=2 plans are where it shows.

For each (ranks, group size): every disjoint group of that size runs at once (as the profile measures since 94e1ef6).
Printed per row: the median per-call time of each way over ``--repeat`` windows, the ratios to the barrier-separated
time, and this benchmark's CPU seconds (the whole machine, /proc/stat) beside its wall seconds.

    python benchmarks/gloo_latency.py [--nbytes 1024] [--calls 300] [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.profiles.profiler import free_port, time_collective
from autopar.profiles.syncs import per_call_s

CASES = ((2, 2), (4, 2), (4, 4))
"""(ranks, group size): 2 ranks on their own; 4 ranks as two pairs (a dp=2 x tp=2 mesh's tp groups) and as one group."""


def machine_cpu_s() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def _gloo_rank(rank: int, world: int, port: int, measure: Callable[..., Any], args: tuple, queue: Any) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    res = measure(rank, world, *args)
    if rank == 0:
        queue.put(res)
    dist.barrier()
    dist.destroy_process_group()


def on_gloo_ranks(world: int, measure: Callable[..., Any], *args: Any) -> Any:
    """``measure(rank, world, *args)`` in ``world`` spawned processes (one compute thread each) in one gloo process
    group; rank 0's result.  ``measure`` must be a module-level function (spawn pickles it)."""
    queue = mp.get_context("spawn").SimpleQueue()
    mp.start_processes(_gloo_rank, args=(world, free_port(), measure, args, queue), nprocs=world, start_method="spawn")
    return queue.get()


def _windows(fn: Any, calls: int, repeat: int) -> float:
    """Median over ``repeat`` windows of the per-call time of ``calls`` calls of ``fn`` (slowest rank's)."""
    return statistics.median(per_call_s(fn, calls) for _ in range(repeat))


def _measure(rank: int, world: int, size: int, args: argparse.Namespace) -> dict[str, float]:
    blocks = world // size
    groups = [dist.new_group(list(range(b * size, (b + 1) * size))) for b in range(blocks)] if size < world else [None]
    group = groups[rank // size]
    x, a = torch.ones(max(1, args.nbytes // 4)), torch.randn(128, 128)

    def reduce() -> None:
        dist.all_reduce(x, group=group)

    def compute() -> None:
        for _ in range(4):
            a @ a

    def both() -> None:
        compute()
        reduce()

    for fn in (reduce, compute, both):  # warm-up
        for _ in range(20):
            fn()
    calls = args.calls
    # what the profiler times: each call after a barrier, the median of the slowest rank's times
    res = {"isolated": time_collective("all_reduce", args.nbytes, group, size, torch.device("cpu"), calls, 2),
           "chained": _windows(reduce, calls, args.repeat),
           "compute": _windows(compute, calls, args.repeat),
           "with compute": _windows(both, calls, args.repeat)}
    res["with compute"] -= res["compute"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nbytes", type=int, default=1024, help="all_reduce message size (bytes)")
    ap.add_argument("--calls", type=int, default=300, help="calls per timed window")
    ap.add_argument("--repeat", type=int, default=3, help="timed windows per way (median)")
    args = ap.parse_args()
    wall0, cpu0 = time.perf_counter(), machine_cpu_s()
    print(f"all_reduce of {args.nbytes} B on gloo, {os.cpu_count()} cores; per call, median of {args.repeat} windows "
          f"of {args.calls} calls")
    print(f"{'ranks':>5} {'group':>5} {'isolated us':>12} {'chained us':>11} {'x':>6} {'with compute us':>16} {'x':>6}")
    for world, size in CASES:
        r = on_gloo_ranks(world, _measure, size, args)
        iso = max(r["isolated"], 1e-9)
        print(f"{world:>5} {size:>5} {r['isolated'] * 1e6:>12.0f} {r['chained'] * 1e6:>11.0f} "
              f"{r['chained'] / iso:>6.2f} {r['with compute'] * 1e6:>16.0f} {r['with compute'] / iso:>6.2f}")
    print(f"benchmark: {time.perf_counter() - wall0:.1f} s wall, {machine_cpu_s() - cpu0:.1f} s CPU (whole machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
