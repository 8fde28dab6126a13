"""From curves to the allocation problem, and the baselines the benchmark compares with.

Equal share: every job gets ``share = N // J`` nodes (N all nodes, J jobs; clipped to the job's node range).  In a
cluster of several pools a job's equal-share throughput ``E_j`` is the pool-size-weighted mean of its throughput on
``share`` nodes of each pool: what it gets on average when equal shares are dealt out without regard to device type.

Baselines (all from the same curves, i.e. the same plans):
- ``first_come_exclusive``: in file order each job takes as many nodes as it asks for (``max_devices``, default the
  pool) from the pool with the most free nodes; a job that finds fewer than its minimum waits (throughput 0).
- ``gavel``: heterogeneity-aware max-min fairness in the style of Gavel (Narayanan et al., "Heterogeneity-Aware
  Cluster Scheduling Policies for Deep Learning Workloads", OSDI 2020, section 4.1): every job keeps a fixed size
  (its equal share, as Gavel's jobs keep their requested worker count), and an LP picks the fraction of time
  ``X[j, p]`` it spends in each pool, maximising ``min_j sum_p X[j, p] T_j(p, share) / (w_j E_j)`` subject to
  ``sum_p X[j, p] <= 1`` and ``sum_j X[j, p] share_j <= N_p`` (then, at that minimum, the most total normalised
  throughput); its effective throughput is ``sum_p X[j, p] T_j``.
"""

from __future__ import annotations

from collections.abc import Mapping

from autopar.planner.cluster.allocate import Choice, Problem
from autopar.planner.cluster.curves import Curves, Point
from autopar.planner.cluster.jobs import Job, Pool

__all__ = ["build_problem", "equal_share_nodes", "first_come_counts", "first_come_exclusive", "gavel", "value_at",
           "weighted_total"]


def equal_share_nodes(jobs: list[Job], pools: list[Pool]) -> int:
    return max(1, sum(p.nodes for p in pools) // max(1, len(jobs)))


def value_at(points: list[Point], nodes: int) -> Point | None:
    """The cleaned curve's point for at most ``nodes`` nodes (None below its first point)."""
    best = None
    for p in points:
        if p.nodes <= nodes:
            best = p
    return best


def build_problem(jobs: list[Job], pools: list[Pool], curves: Curves,
                  current: Mapping[str, tuple[str, int]] | None = None) -> Problem:
    share = equal_share_nodes(jobs, pools)
    total = sum(p.nodes for p in pools)
    equal: dict[str, float] = {}
    equal_nodes: dict[str, int] = {}
    for j in jobs:
        mean = 0.0
        for pool in pools:
            rng = j.node_range(pool.devices_per_node, pool.nodes)
            n = min(max(share, rng.start), rng.stop - 1) if rng else share
            pt = value_at(curves[j.name][pool.name], n)
            mean += pool.nodes / total * (pt.samples_per_s if pt else 0.0)
        if mean <= 0:  # it cannot run on its share in any pool: its smallest plan anywhere is the reference
            firsts = [pts[0].samples_per_s for pts in curves[j.name].values() if pts]
            mean = max(firsts, default=0.0)
        equal[j.name] = mean
        equal_nodes[j.name] = share
    choices = {j.name: tuple(Choice(p.pool, p.nodes, p.samples_per_s) for pool in pools
                             for p in curves[j.name][pool.name]) for j in jobs}
    return Problem(choices=choices, capacity={p.name: p.nodes for p in pools}, equal=equal,
                   weight={j.name: j.weight for j in jobs}, equal_nodes=equal_nodes, current=dict(current or {}))


def weighted_total(problem: Problem, throughput: Mapping[str, float]) -> float:
    """``sum_j w_j T_j / E_j``: the goodput objective's throughput part (jobs missing from ``throughput`` count 0)."""
    return sum(problem.weight.get(j, 1.0) * throughput.get(j, 0.0) / problem.equal[j] for j in problem.choices)


def first_come_counts(jobs: list[Job], pools: list[Pool]) -> dict[str, tuple[str, int]]:
    """The nodes first-come-exclusive gives each job that gets any: (pool, count); it needs no curve."""
    free = {p.name: p.nodes for p in pools}
    out: dict[str, tuple[str, int]] = {}
    for j in jobs:
        pool = max(pools, key=lambda p: free[p.name])
        rng = j.node_range(pool.devices_per_node, pool.nodes)
        n = min(rng.stop - 1, free[pool.name]) if rng else 0
        if rng and n >= rng.start:
            out[j.name] = (pool.name, n)
            free[pool.name] -= n
    return out


def first_come_exclusive(jobs: list[Job], pools: list[Pool], curves: Curves) -> dict[str, Choice]:
    out: dict[str, Choice] = {}
    for name, (pool, n) in first_come_counts(jobs, pools).items():
        pt = value_at(curves[name][pool], n)
        if pt is not None:
            out[name] = Choice(pool, n, pt.samples_per_s)
    return out


def gavel(problem: Problem, pools: list[Pool]) -> dict[str, float]:
    """Each job's effective throughput under the Gavel-style LP (see the module docstring)."""
    from ortools.linear_solver import pywraplp

    lp = pywraplp.Solver.CreateSolver("GLOP")
    z = lp.NumVar(0.0, lp.infinity(), "z")
    x: dict[tuple[str, str], object] = {}
    size = problem.equal_nodes
    rate: dict[tuple[str, str], float] = {}
    for j, cs in problem.choices.items():
        for pool in pools:
            pts = [c for c in cs if c.pool == pool.name and c.nodes <= size[j]]
            if pts and size[j] <= pool.nodes:
                rate[j, pool.name] = max(c.samples_per_s for c in pts)
                x[j, pool.name] = lp.NumVar(0.0, 1.0, f"x_{j}_{pool.name}")
        lp.Add(sum(x[j, p.name] for p in pools if (j, p.name) in x) <= 1.0)
        w = problem.weight.get(j, 1.0) * problem.equal[j]
        lp.Add(z <= sum(x[j, p.name] * (rate[j, p.name] / w) for p in pools if (j, p.name) in x))
    for pool in pools:
        lp.Add(sum(x[j, pool.name] * size[j] for j in problem.choices if (j, pool.name) in x) <= pool.nodes)
    lp.Maximize(z)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        raise ValueError("the Gavel-style LP found no solution")
    lp.Add(z >= z.solution_value() * (1 - 1e-9))  # then the most total throughput at that minimum
    lp.Maximize(sum(x[k] * (rate[k] * problem.weight.get(k[0], 1.0) / problem.equal[k[0]]) for k in x))
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        raise ValueError("the Gavel-style LP found no solution")
    return {j: sum(x[j, p.name].solution_value() * rate[j, p.name] for p in pools if (j, p.name) in x)
            for j in problem.choices}
