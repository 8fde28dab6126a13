"""What a CPU step's synchronizations cost on this machine: the measurements behind ``autopar.profiles.syncs``.

Three measurements, each with 2 ranks and with 4 ranks (on a 2-core machine: oversubscribed), side by side:

1. The pipeline schedule's overhead per micro-batch slot (:func:`autopar.profiles.syncs.pipeline_overheads`: a
   two-stage schedule of tiny linears on gloo, less the same micro-batches in a plain loop; sends included here) for
   each case of ``PIPELINE_CASES``.  Profiles used to time one case, 1F1B with 8 micro-batches on ranks 0 and 1
   alone, and the cost model charged it to every pipeline plan; the ratio columns are each case against that one.
   With 4 ranks: the first pair alone, and both pairs at once (as profiles now time them).
2. The training loop's loss sync, an all-reduce of one float over every rank: timed after a barrier (as profiles
   time collectives), and after compute (:func:`autopar.profiles.syncs.loss_sync_under_load`, what profiles now
   store), beside the profile's smallest collective point, 1 KiB after a barrier, from which the all-reduce table's
   latency is fitted (what the cost model charged the loss sync before).
3. Two independent two-stage GPipe pipelines of one micro-batch with real compute (6 x Linear(256, 256) + GELU per
   stage), on 2 ranks (one pipeline) and on 4 (two at once, as a pp=2 x dp=2 plan runs): the 4-rank step over the
   2-rank one.  The schedule simulator's shared cores (``DeviceProfile.shared_cores``) would have a stage computing
   while the other waits get a core to itself, x1.0; a fully time-sliced step is the time-slicing factor, printed
   beside.  ``autopar profile`` no longer records shared cores: here the ratio came out x1.7-2.7.

    python benchmarks/cpu_sync_costs.py [--repeats 40]

Prints the benchmark's CPU seconds (the whole machine, /proc/stat) beside its wall seconds.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from gloo_latency import machine_cpu_s, on_gloo_ranks  # this folder's benchmark: busy CPU s, spawned gloo ranks

from autopar.profiles.eager import time_concurrent
from autopar.profiles.profiler import time_collective
from autopar.profiles.schema import PIPELINE_CASES, pipeline_key
from autopar.profiles.syncs import REFERENCE_CASE, loss_sync_under_load, pipeline_overheads, slowest


def _loss_sync(repeats: int) -> dict[str, float]:
    x = torch.ones(1)
    isolated = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        isolated.append(slowest(time.perf_counter() - t0))
    world = dist.get_world_size()
    return {"isolated": statistics.median(isolated), "loaded": loss_sync_under_load(),
            "1KiB": time_collective("all_reduce", 1024, None, world, torch.device("cpu"), repeats, 2)}


def _pipeline_step(pair: Any, me: int, repeats: int) -> float:
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    net = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)])
    x, tgt = torch.randn(8, 256), torch.zeros(8)
    stage = PipelineStage(net, me, 2, torch.device("cpu"), group=pair)
    sched = ScheduleGPipe(stage, n_microbatches=1, loss_fn=lambda out, t: out.sum() + 0 * t.sum())

    def step() -> None:
        if me == 0:
            sched.step(x)
        else:
            sched.step(target=tgt, losses=[])

    for _ in range(5):
        step()
    ts = []
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        ts.append(slowest(time.perf_counter() - t0))
    return statistics.median(ts)


def _measure(rank: int, world: int, repeats: int) -> dict[str, Any]:
    pairs = [dist.new_group([2 * i, 2 * i + 1]) for i in range(world // 2)] if world > 2 else [None]
    pair, me = pairs[rank // 2], rank % 2
    cpu = torch.device("cpu")
    # every pair at once (as the profile times them); then, with 4 ranks, the first pair alone
    res: dict[str, Any] = {"pipeline": pipeline_overheads(cpu, me, repeats, pair)}
    dist.barrier()
    if world > 2:
        res["pipeline_alone"] = pipeline_overheads(cpu, me, repeats, pair) if rank < 2 else None
        dist.barrier()
    res["loss_sync"] = _loss_sync(repeats)
    res["step"] = _pipeline_step(pair, me, repeats)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=40, help="adjacent pairs / timed calls per measurement (median)")
    args = ap.parse_args()
    wall0, cpu0 = time.perf_counter(), machine_cpu_s()
    got = {world: on_gloo_ranks(world, _measure, args.repeats) for world in (2, 4)}
    slicing = time_concurrent(4) / time_concurrent(2)
    ref = got[2]["pipeline"][pipeline_key(*REFERENCE_CASE)]
    print(f"gloo on {os.cpu_count()} cores, medians of {args.repeats}")
    print(f"1. pipeline schedule overhead per micro-batch slot, us (x: against {REFERENCE_CASE[0]} "
          f"m={REFERENCE_CASE[1]} on 2 ranks, what profiles charged every plan before they measured each case)")
    print(f"   {'schedule':>16} {'m':>3} {'2 ranks':>9} {'x':>6} {'4: one pair':>12} {'x':>6} {'4: both pairs':>14}"
          f" {'x':>6}")
    for case in PIPELINE_CASES:
        key = pipeline_key(*case)
        two, alone, both = got[2]["pipeline"][key], got[4]["pipeline_alone"][key], got[4]["pipeline"][key]
        print(f"   {case[0]:>16} {case[1]:>3} {two * 1e6:>9.0f} {two / ref:>6.2f} {alone * 1e6:>12.0f} "
              f"{alone / ref:>6.2f} {both * 1e6:>14.0f} {both / ref:>6.2f}")
    print("2. loss sync (all-reduce of one float over every rank), us")
    print(f"   {'ranks':>5} {'isolated':>9} {'under load':>11} {'1 KiB isolated':>15} {'load/1KiB':>10}")
    for world in (2, 4):
        s = got[world]["loss_sync"]
        print(f"   {world:>5} {s['isolated'] * 1e6:>9.0f} {s['loaded'] * 1e6:>11.0f} {s['1KiB'] * 1e6:>15.0f} "
              f"{s['loaded'] / s['1KiB']:>10.2f}")
    two, four = got[2]["step"], got[4]["step"]
    print(f"3. two-stage GPipe step, one micro-batch: 2 ranks {two * 1e3:.2f} ms, 4 ranks (two pipelines) "
          f"{four * 1e3:.2f} ms: x{four / two:.2f} (shared cores: x1.00; time-slicing factor 4 vs 2 processes: "
          f"x{slicing:.2f})")
    print(f"benchmark: {time.perf_counter() - wall0:.1f} s wall, {machine_cpu_s() - cpu0:.1f} s CPU (whole machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
