"""Profile accuracy on this machine: measure a profile (2 gloo ranks), then predict and measure, side by side,
all-reduce / all-gather times at message sizes not used in fitting and matmul times at unseen shapes.

    python benchmarks/profile_accuracy.py [--ranks 2] [--quick]

Prints one row per case and the median predicted/measured ratio (target: within 0.7-1.4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from autopar.profiles import CostModel, load_profile
from autopar.profiles.profiler import exit_without_finalization, free_port, run_profile_command, time_collective

KIB = 1024
UNSEEN_SIZES = (3 * KIB, 48 * KIB, 768 * KIB, 6 * KIB * KIB, 24 * KIB * KIB)  # fit used powers of 4 from 1 KiB
UNSEEN_SHAPES = ((96, 200, 300), (384, 384, 384), (700, 500, 300), (1000, 1500, 800), (1536, 1024, 1536))


def _time_mm(m: int, n: int, k: int, dtype: torch.dtype, repeats: int = 5) -> float:
    a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    a @ b
    t0 = time.perf_counter()
    a @ b
    inner = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-7)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            a @ b
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _worker(rank: int, ranks: int, port: int, threads: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=ranks)
    rows = []
    torch.set_num_threads(threads)
    for dt in ("float32", "bfloat16"):
        for m, n, k in UNSEEN_SHAPES:
            dist.barrier()
            rows.append(("matmul", dt, (m, n, k), _time_mm(m, n, k, getattr(torch, dt))))
    torch.set_num_threads(1)
    cpu = torch.device("cpu")
    for kind in ("all_reduce", "all_gather"):
        for s in UNSEEN_SIZES:
            rows.append((kind, "float32", s, time_collective(kind, s, None, ranks, cpu, 7, 2)))
    if rank == 0:
        Path(out).write_text(repr(rows))
    dist.barrier()
    dist.destroy_process_group()
    exit_without_finalization(0)  # gloo's threads can abort the interpreter's teardown after the rows are written


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="quick profile (fewer sizes; less accurate)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "here.yaml"
        t0 = time.perf_counter()
        run_profile_command(path, ranks=args.ranks, quick=args.quick, progress=True)
        print(f"profile measured in {time.perf_counter() - t0:.1f} s")
        prof = load_profile(path)
        threads = max(1, (os.cpu_count() or 1) // args.ranks)
        res = Path(tmp) / "rows.txt"
        mp.spawn(_worker, args=(args.ranks, free_port(), threads, str(res)), nprocs=args.ranks, join=True)
        rows = eval(res.read_text())  # noqa: S307 - our own repr of tuples of str/int/float
    cm = CostModel(prof)
    print(f"\n{'case':<12} {'dtype':<9} {'size/shape':<20} {'predicted':>12} {'measured':>12} {'ratio':>7}")
    ratios: dict[str, list[float]] = {"matmul": [], "collective": []}
    for kind, dt, what, measured in rows:
        if kind == "matmul":
            m, n, k = what
            pred = cm.matmul_time(dtype=dt, m=m, n=n, k=k)
            label = f"{m}x{n}x{k}"
        else:
            pred = cm.collective_time(kind, what, args.ranks)
            label = f"{what / KIB:.0f} KiB"
        r = pred / measured
        ratios["matmul" if kind == "matmul" else "collective"].append(r)
        print(f"{kind:<12} {dt:<9} {label:<20} {pred * 1e3:>10.3f}ms {measured * 1e3:>10.3f}ms {r:>7.2f}")
    all_r = ratios["matmul"] + ratios["collective"]
    print(f"\nmedian predicted/measured: matmul {statistics.median(ratios['matmul']):.2f}, "
          f"collectives {statistics.median(ratios['collective']):.2f}, all {statistics.median(all_r):.2f} "
          f"(target 0.7-1.4)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
