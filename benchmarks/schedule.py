"""Shared-cluster scheduling (issue 15): 8 mixed jobs on 64 DGX A100 nodes, and on 32 DGX A100 + 32 DGX H100 nodes.

Every policy and baseline is built from the same curves (each job's real plans at each node count):
- goodput: ``autopar schedule``'s CP-SAT allocation (weighted, per-job-normalised throughput; fairness 0.5);
- max-min: the same model, the worst-off job first;
- equal share, placed by affinity: every job on N/J nodes (``autopar schedule --policy equal``: the pool of each
  chosen by the goodput model, i.e. placed by device affinity; the "vs placed" column);
- equal share (device-blind): every job on N/J nodes dealt out without regard to device type, valued at its
  pool-weighted mean on N/J nodes (``E_j``, the normaliser), so its weighted total is the sum of the weights (on one
  pool the same as the placed one; the "vs equal" column);
- first-come-exclusive: in file order each job takes the nodes it asks for (its max_devices), later jobs wait;
- Gavel-style: heterogeneity-aware max-min fairness over fixed-size jobs (Narayanan et al., "Heterogeneity-Aware
  Cluster Scheduling Policies for Deep Learning Workloads", OSDI 2020): time fractions per device type from an LP.

The figure of merit is the total weighted normalised throughput ``sum_j w_j T_j / E_j`` (``E_j``: the job's
throughput under an equal share); the unweighted sum ``sum_j T_j / E_j`` is printed beside it.  Target: goodput
>= 1.2x equal share on the mixed set, where the equal share is the device-blind one: the issue sets a
heterogeneity-aware baseline (Gavel-style) apart from it, and an equal share placed by device affinity is already
heterogeneity-aware (on the mixed cluster it equals Gavel-style's total); the ratio to that one is printed beside
it.  On one device type the two equal shares are the same.  Schedule time:
what ``autopar schedule`` does (plan the curves, allocate), in CPU seconds (this process and the search's workers)
beside wall seconds, cold (an empty curve cache: every point planned) and warm (the same call again: all points from
the cache); target under 60 s for 8 jobs x 64 nodes.  The first-come baseline's node counts are planned after the
timed part (as real plans; the count of those extra points is printed).  Both clusters share one curve cache, so
the mixed cluster's cold call finds its A100 pool's points from the 64-node call (the printed cached count).

    OMP_NUM_THREADS=1 python benchmarks/schedule.py [--cache DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from autopar.planner.cluster.allocate import allocate
from autopar.planner.cluster.curves import build_curves
from autopar.planner.cluster.jobs import parse_jobs, parse_pools
from autopar.planner.cluster.problem import (
    build_problem,
    equal_share_nodes,
    first_come_counts,
    first_come_exclusive,
    gavel,
    weighted_total,
)

JOBS = [  # mixed GPT / Llama / MoE / ViT jobs, as users would submit them
    {"name": "gpt-1.3b", "model": "gpt3-1.3b", "global_batch": 512, "seq": 2048, "max_devices": 128},
    {"name": "gpt-6.7b", "model": "gpt3-6.7b", "global_batch": 512, "seq": 2048, "max_devices": 256, "weight": 2},
    {"name": "gpt-13b", "model": "gpt3-13b", "global_batch": 1024, "seq": 2048, "min_devices": 16,
     "max_devices": 256},
    {"name": "llama-8b", "model": "llama3-8b", "global_batch": 256, "seq": 4096, "max_devices": 128},
    {"name": "llama-70b", "model": "llama3-70b", "global_batch": 512, "seq": 4096, "min_devices": 64,
     "max_devices": 256, "weight": 2},
    {"name": "moe-8x1b", "model": "moe-8x1b", "global_batch": 256, "max_devices": 128},
    {"name": "vit-h", "model": "vit-h-14", "global_batch": 4096, "max_devices": 64},  # the ViT paper's batch
    {"name": "gpt2-xl", "model": "gpt2-xl", "global_batch": 256, "seq": 1024, "max_devices": 64},
]
CLUSTERS = {"64 x DGX A100": "dgx-a100-80gb:64", "32 x DGX A100 + 32 x DGX H100": "dgx-a100-80gb:32,dgx-h100:32"}
TARGET_RATIO, TARGET_S = 1.2, 60.0


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def schedule(jobs: list, pools: list, cache: Path) -> tuple[dict, dict, float, float]:
    """What ``autopar schedule jobs.yaml`` does (its curves: each job's equal share planned in every pool, then
    what can matter; the goodput allocation), timed; then, untimed, first-come-exclusive's node counts, so that
    baseline is judged on real plans too."""
    c0, w0 = _cpu(), time.perf_counter()
    share = equal_share_nodes(jobs, pools)
    extra = {j.name: {p.name: [share] for p in pools} for j in jobs}  # as planner/cluster/cli.py asks
    curves, stats = build_curves(jobs, pools, fairness=0.5, extra=extra, cache_dir=cache)
    problem = build_problem(jobs, pools, curves)
    alloc = allocate(problem, "goodput", fairness=0.5)
    cpu, wall = _cpu() - c0, time.perf_counter() - w0
    for j, (pool, n) in first_come_counts(jobs, pools).items():
        extra[j][pool] = [*extra[j][pool], n]
    full, fstats = build_curves(jobs, pools, fairness=0.5, extra=extra, cache_dir=cache)
    stats = dict(stats, baseline_only=fstats["planned"])
    return {"curves": full, "problem": problem, "goodput": alloc}, stats, cpu, wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default=None, help="curve cache directory (default: a fresh temporary one: cold)")
    args = ap.parse_args()
    jobs = parse_jobs(JOBS)
    cache = Path(args.cache or tempfile.mkdtemp(prefix="autopar-schedule-"))
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; curve cache {cache}")
    for label, spec in CLUSTERS.items():
        pools = parse_pools(spec)
        res, stats, cpu, wall = schedule(jobs, pools, cache)
        _, stats2, cpu2, wall2 = schedule(jobs, pools, cache)
        p, curves = res["problem"], res["curves"]
        tput = {
            "goodput (autopar schedule)": {j: c.samples_per_s for j, c in res["goodput"].items()},
            "max-min": {j: c.samples_per_s for j, c in allocate(p, "max-min", fairness=0.5).items()},
            "equal share (device-blind)": dict(p.equal),
            "equal share, placed by affinity": {j: c.samples_per_s for j, c in allocate(p, "equal").items()},
            "first-come-exclusive": {j: c.samples_per_s
                                     for j, c in first_come_exclusive(jobs, pools, curves).items()},
            "Gavel-style (OSDI'20)": gavel(p, pools),
        }
        equal = weighted_total(p, tput["equal share (device-blind)"])
        placed_eq = weighted_total(p, tput["equal share, placed by affinity"])
        print(f"\n== {label}: {len(jobs)} jobs, equal share {p.equal_nodes[jobs[0].name]} nodes each")
        print(f"{'policy':32s} {'weighted total':>14s} {'vs equal':>9s} {'vs placed':>9s} {'unweighted':>10s}   "
              "per job (x its equal-share throughput)")
        for name, t in tput.items():
            per = " ".join(f"{j}={t.get(j, 0.0) / p.equal[j]:.2f}" for j in p.choices)
            flat = sum(t.get(j, 0.0) / p.equal[j] for j in p.choices)
            w = weighted_total(p, t)
            print(f"{name:32s} {w:14.2f} {w / equal:8.2f}x {w / placed_eq:8.2f}x {flat:10.2f}   {per}")
        print("goodput allocation: " + ", ".join(f"{j} {c.nodes}x{c.pool}" for j, c in res["goodput"].items()))
        good = weighted_total(p, tput["goodput (autopar schedule)"])
        placed, ratio = good / placed_eq, good / equal
        print(f"goodput / equal share (device-blind) = {ratio:.2f}x (target >= {TARGET_RATIO}x): "
              f"{'met' if ratio >= TARGET_RATIO else 'NOT met'}; goodput / equal share placed by device affinity "
              f"= {placed:.2f}x (a heterogeneity-aware baseline, as Gavel-style is)")
        print(f"schedule time cold: {cpu:.1f} CPU-s, {wall:.1f} s wall ({stats['planned']} points planned, "
              f"{stats['cached']} cached; {stats['baseline_only']} more for first-come afterwards); "
              f"warm: {cpu2:.1f} CPU-s, {wall2:.1f} s wall ({stats2['cached']} cached); "
              f"target {TARGET_S:.0f} s: cold {'met' if cpu < TARGET_S else 'NOT met'} (CPU), "
              f"warm {'met' if cpu2 < TARGET_S else 'NOT met'}")
    print(f"\nload average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
