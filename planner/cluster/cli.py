"""``autopar schedule``: allocate a shared cluster to many jobs from their plans (see :mod:`autopar.planner.cluster`).

This module is imported when the CLI starts, so it imports nothing heavy at the top (the fast-CLI rule)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "cmd_schedule"]


def add_parser(sub: Any) -> None:
    s = sub.add_parser("schedule", help="allocate a shared cluster to many training jobs from their plans",
                       description="Plan every job at each node count it may get (cached), then allocate whole nodes "
                       "with CP-SAT. Changes: --arrive JOB.yaml / --leave NAME re-allocate the schedule in --schedule, "
                       "moving as few jobs as the migration cost asks, and print each moved job's replan + resume.")
    s.add_argument("jobs", nargs="?", help="jobs YAML (name, model, global_batch, seq, weight, min/max_devices)")
    s.add_argument("--cluster", help="pools: profile[:nodes][,profile[:nodes]...], e.g. dgx-a100-80gb:32,dgx-h100:32")
    s.add_argument("--nodes", type=int, default=None, help="nodes of a single-profile --cluster")
    s.add_argument("--policy", choices=["goodput", "max-min", "equal"], default=None,
                   help="goodput (default): most weighted, per-job-normalised throughput; max-min: the worst-off "
                        "job's normalised throughput first; equal: an equal node share each")
    s.add_argument("--fairness", type=float, default=None,
                   help="every job keeps at least this fraction of its equal-share throughput (default 0.5)")
    s.add_argument("--migration-cost", type=float, default=None,
                   help="objective cost of moving a running job, in equal-share throughputs (default 0.1)")
    s.add_argument("--arrive", action="append", default=[], metavar="JOB.yaml",
                   help="re-allocate the --schedule with these jobs added")
    s.add_argument("--leave", action="append", default=[], metavar="NAME", help="re-allocate without this job")
    s.add_argument("--schedule", default="schedule.yaml",
                   help="schedule file: written, and read back for --arrive/--leave (default schedule.yaml)")
    s.add_argument("-o", "--output", default=None, help="write the new schedule here instead of --schedule")
    s.add_argument("--checkpoint-root", default="checkpoints",
                   help="each job's checkpoints are under ROOT/NAME (for the printed resume commands)")
    s.add_argument("--dtype", default=None, choices=["bfloat16", "float16", "float32"],
                   help="training dtype the jobs are planned in (default bfloat16, or the --schedule's)")
    s.add_argument("--time-limit", type=float, default=None, help="CP-SAT seconds per distinct layer solve (10)")
    s.add_argument("--no-fused-kernels", action="store_true",
                   help="plan to run eagerly: no generated Triton kernels, fused groups costed unfused")
    s.add_argument("-q", "--quiet", action="store_true", help="no planning progress on stderr")
    s.set_defaults(func=cmd_schedule)


def _inputs(args: argparse.Namespace) -> tuple[list, list, dict, Any]:
    """(jobs, pools, current allocation, previous schedule or None) from the arguments."""
    from autopar.planner.cluster.jobs import load_jobs, parse_pools
    from autopar.planner.cluster.state import load_schedule

    if not (args.arrive or args.leave):
        if not args.jobs or not args.cluster:
            raise ValueError("give a jobs YAML and --cluster (or --arrive/--leave to change an existing --schedule)")
        return load_jobs(args.jobs), parse_pools(args.cluster, args.nodes), {}, None
    if args.cluster or args.nodes:
        raise ValueError("--arrive/--leave keep the schedule's cluster; drop --cluster/--nodes")
    old = load_schedule(args.schedule)
    jobs = [p.job for p in old.placed]
    names = {j.name for j in jobs}
    for name in args.leave:
        if name not in names:
            raise ValueError(f"--leave {name}: no such job in {args.schedule} ({', '.join(sorted(names))})")
    jobs = [j for j in jobs if j.name not in set(args.leave)]
    for path in [args.jobs, *args.arrive] if args.jobs else args.arrive:
        for j in load_jobs(path):
            if j.name in {k.name for k in jobs}:
                raise ValueError(f"job {j.name} from {path} is already scheduled; give it another name")
            jobs.append(j)
    if not jobs:
        raise ValueError("no job is left to schedule")
    current = {k: v for k, v in old.current().items() if k not in set(args.leave)}
    return jobs, list(old.pools), current, old


def cmd_schedule(args: argparse.Namespace) -> int:
    import time

    from autopar.planner.cluster.allocate import allocate
    from autopar.planner.cluster.curves import build_curves
    from autopar.planner.cluster.problem import build_problem, equal_share_nodes

    t0, c0 = time.perf_counter(), _cpu()
    jobs, pools, current, old = _inputs(args)
    policy = args.policy or (old.policy if old else "goodput")
    fairness = args.fairness if args.fairness is not None else old.fairness if old else 0.5
    mu = args.migration_cost if args.migration_cost is not None else old.migration_cost if old else 0.1
    popts = dict(old.plan_options) if old else {}
    popts = {"dtype": args.dtype or popts.get("dtype", "bfloat16"),
             "fused_kernels": popts.get("fused_kernels", True) and not args.no_fused_kernels,
             "time_limit": args.time_limit or popts.get("time_limit", 10.0)}
    share = equal_share_nodes(jobs, pools)
    extra = {j.name: {p.name: [share] + ([current[j.name][1]] if current.get(j.name, ("",))[0] == p.name else [])
                      for p in pools} for j in jobs}
    say = None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    curves, stats = build_curves(jobs, pools, fairness=fairness if policy != "equal" else 0.0, extra=extra, dtype=popts["dtype"], time_limit=popts["time_limit"],
                                 fused_kernels=popts["fused_kernels"], progress=say)
    problem = build_problem(jobs, pools, curves, current)
    alloc = allocate(problem, policy, fairness=fairness, migration_cost=mu)
    out = Path(args.output or args.schedule)
    sched = _write(out, jobs, pools, curves, problem, alloc, policy, fairness, mu, popts)
    print(_render(sched, problem, policy), end="")
    if old is not None:
        _print_moves(old, sched, pools, out, Path(args.schedule).parent, args.checkpoint_root)
    print(f"wrote {out} ({len(jobs)} jobs; {stats['planned']} curve points planned, {stats['cached']} from the cache; "
          f"{_cpu() - c0:.1f} CPU-s with the search's workers, {time.perf_counter() - t0:.1f} s)")
    return 0


def _cpu() -> float:
    import os

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _write(out: Path, jobs: list, pools: list, curves: dict, problem: Any, alloc: dict, policy: str,
           fairness: float, mu: float, popts: dict) -> Any:
    from autopar.ir.plan import dump_plan, plan_from_yaml
    from autopar.planner.cluster.pools import replan_profile
    from autopar.planner.cluster.state import Placed, Schedule, dump_schedule, plan_file
    from autopar.planner.profile_ref import with_source

    dpn = {p.name: p.devices_per_node for p in pools}
    pools_by = {p.name: p for p in pools}
    placed = []
    for j in jobs:
        c = alloc[j.name]
        pt = next(p for p in curves[j.name][c.pool] if p.nodes == c.nodes)
        path = plan_file(out, j.name, c.pool, pt.plan_nodes)
        path.parent.mkdir(parents=True, exist_ok=True)
        if pt.plan_yaml:  # recording the profile file it was made on, as `autopar plan` does
            dump_plan(with_source(plan_from_yaml(pt.plan_yaml), replan_profile(pools_by[c.pool])), path)
        placed.append(Placed(job=j, pool=c.pool, nodes=pt.plan_nodes, devices=pt.plan_nodes * dpn[c.pool],
                             plan=str(path.relative_to(out.parent)), summary=pt.summary,
                             samples_per_s=c.samples_per_s, equal_samples_per_s=problem.equal[j.name]))
    sched = Schedule(pools=tuple(pools), policy=policy, fairness=fairness, migration_cost=mu, placed=tuple(placed),
                     plan_options=popts)
    dump_schedule(sched, out)
    return sched


def _render(sched: Any, problem: Any, policy: str) -> str:
    from autopar.planner.cluster.problem import weighted_total
    from autopar.planner.tables import fmt_sig, render, table

    rows = [(p.job.name, p.job.model, p.pool, f"{p.nodes} ({p.devices})", p.summary, fmt_sig(p.samples_per_s),
             fmt_sig(p.equal_samples_per_s), f"{p.samples_per_s / p.equal_samples_per_s:.2f}x")
            for p in sched.placed]
    used = {pool.name: sum(p.nodes for p in sched.placed if p.pool == pool.name) for pool in sched.pools}
    free = ", ".join(f"{pool.name} {used[pool.name]}/{pool.nodes}" for pool in sched.pools)
    total = weighted_total(problem, {p.job.name: p.samples_per_s for p in sched.placed})
    title = f"schedule ({policy}): weighted normalised throughput {total:.2f} for {len(rows)} jobs; nodes used {free}"
    cols = ["job", "model", "pool", ("nodes (devices)", "right"), "plan", ("samples/s", "right"),
            ("equal share", "right"), ("speed-up", "right")]
    return render(table(title, cols, rows))


def _print_moves(old: Any, new: Any, pools: list, out: Path, old_dir: Path, ckpt_root: str) -> None:
    from autopar.planner.cluster.state import move_commands

    before = {p.job.name: p for p in old.placed}
    by_pool = {p.name: p for p in pools}
    moved = [p for p in new.placed if p.job.name in before and (before[p.job.name].pool, before[p.job.name].nodes)
             != (p.pool, p.nodes)]
    started = [p for p in new.placed if p.job.name not in before]
    for p in started:
        print(f"start {p.job.name}: autopar run {out.parent / p.plan} --model {p.job.model} --checkpoint-dir "
              f"{ckpt_root.rstrip('/')}/{p.job.name} --steps N")
    if not moved:
        print("no running job moves")
    for p in moved:
        b = before[p.job.name]
        print(f"move {p.job.name}: {b.nodes} x {b.pool} -> {p.nodes} x {p.pool} (stop it; its checkpoint reshards):")
        for cmd in move_commands(b, p, by_pool[p.pool], old_dir, out.parent, ckpt_root):
            print(f"  {cmd}")
