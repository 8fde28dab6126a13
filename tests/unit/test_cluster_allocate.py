"""The shared-cluster allocator on small synthetic curves: CP-SAT agrees with brute force, the fairness fraction
holds, arrivals and departures move as few jobs as the migration cost asks, and the jobs file is validated."""

from __future__ import annotations

import itertools
import random

import pytest

from autopar.ir.errors import SchemaError
from autopar.planner.cluster.allocate import Choice, InfeasibleAllocation, Problem, allocate, objective
from autopar.planner.cluster.curves import Point, counts_to_plan, monotone
from autopar.planner.cluster.jobs import Job, Pool, parse_jobs, parse_pools
from autopar.planner.cluster.pools import pool_profile
from autopar.planner.cluster.problem import build_problem, first_come_exclusive, gavel, weighted_total


def _curve(rng: random.Random, pools: dict[str, int]) -> tuple[Choice, ...]:
    """A concave-ish random scaling curve per pool (powers of two up to the pool)."""
    out = []
    for pool, cap in pools.items():
        speed, alpha = rng.uniform(0.5, 3.0), rng.uniform(0.3, 1.0)
        n = 1
        while n <= cap:
            out.append(Choice(pool, n, speed * n ** alpha))
            n *= 2
    return tuple(out)


def _problem(rng: random.Random, jobs: int, pools: dict[str, int], current: dict | None = None) -> Problem:
    choices = {f"j{i}": _curve(rng, pools) for i in range(jobs)}
    share = max(1, sum(pools.values()) // jobs)
    equal = {j: sum(max((c.samples_per_s for c in cs if c.pool == p and c.nodes <= share), default=0.0) * n
                    for p, n in pools.items()) / sum(pools.values()) for j, cs in choices.items()}
    return Problem(choices=choices, capacity=pools, equal=equal, equal_nodes={j: share for j in choices},
                   weight={j: rng.choice([1.0, 2.0]) for j in choices}, current=current or {})


def _brute(p: Problem, fairness: float, mu: float) -> float | None:
    best = None
    names = list(p.choices)
    for combo in itertools.product(*(p.choices[j] for j in names)):
        use: dict[str, int] = {}
        for c in combo:
            use[c.pool] = use.get(c.pool, 0) + c.nodes
        if any(use[k] > p.capacity[k] for k in use):
            continue
        if any(c.samples_per_s < fairness * p.equal[j] for j, c in zip(names, combo)):
            continue
        v = objective(p, dict(zip(names, combo)), mu)
        best = v if best is None or v > best else best
    return best


@pytest.mark.parametrize("seed", range(12))
def test_cpsat_agrees_with_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    pools = {"a": rng.choice([4, 6, 8]), "h": rng.choice([0, 2, 4])}
    pools = {k: v for k, v in pools.items() if v}
    p = _problem(rng, rng.choice([2, 3, 4]), pools)
    if seed % 3 == 0:  # some jobs running now: moving them costs
        p = Problem(choices=p.choices, capacity=p.capacity, equal=p.equal, weight=p.weight,
                    equal_nodes=p.equal_nodes, current={j: (cs[0].pool, cs[0].nodes) for j, cs in p.choices.items()})
    fair, mu = rng.choice([0.0, 0.5, 0.8]), rng.choice([0.0, 0.3])
    want = _brute(p, fair, mu)
    if want is None:
        with pytest.raises(InfeasibleAllocation):
            allocate(p, fairness=fair, migration_cost=mu)
        return
    got = allocate(p, fairness=fair, migration_cost=mu)
    assert set(got) == set(p.choices)
    for pool, cap in p.capacity.items():
        assert sum(c.nodes for c in got.values() if c.pool == pool) <= cap
    assert objective(p, got, mu) == pytest.approx(want, abs=2e-3)


def test_fairness_fraction_is_kept_and_binds() -> None:
    # job a scales linearly, b barely: goodput alone gives a nearly everything; fairness 0.9 keeps b near its share
    a = tuple(Choice("x", n, 10.0 * n) for n in (1, 2, 4, 6, 7))
    b = tuple(Choice("x", n, 10.0 + 0.5 * n) for n in (1, 2, 4, 6, 7))
    p = Problem(choices={"a": a, "b": b}, capacity={"x": 8}, equal={"a": 40.0, "b": 12.0},
                equal_nodes={"a": 4, "b": 4})
    free = allocate(p, fairness=0.0)
    assert free["b"].nodes == 1 and free["a"].nodes == 7
    fair = allocate(p, fairness=0.95)
    assert fair["b"].samples_per_s >= 0.95 * 12.0
    assert fair["b"].nodes == 4
    with pytest.raises(InfeasibleAllocation):  # on 5 nodes a needs 4 nodes for 0.95 of its equal share, b needs 4
        allocate(Problem(choices=p.choices, capacity={"x": 5}, equal=p.equal, equal_nodes=p.equal_nodes),
                 fairness=0.95)


def test_max_min_and_equal_policies() -> None:
    a = tuple(Choice("x", n, 10.0 * n) for n in (1, 2, 4, 6))
    b = tuple(Choice("x", n, 10.0 + 0.5 * n) for n in (1, 2, 4, 6))
    p = Problem(choices={"a": a, "b": b}, capacity={"x": 8}, equal={"a": 40.0, "b": 12.0},
                equal_nodes={"a": 4, "b": 4})
    eq = allocate(p, "equal")
    assert eq["a"].nodes == 4 and eq["b"].nodes == 4
    mm = allocate(p, "max-min")
    # b's best normalised value is 13/12 at 6 nodes, but then a gets 2 (0.5): max-min keeps both >= 1 (4 + 4)
    assert min(mm["a"].samples_per_s / 40, mm["b"].samples_per_s / 12) == pytest.approx(1.0)
    gp = allocate(p, "goodput", fairness=0.0)
    assert weighted_total(p, {j: c.samples_per_s for j, c in gp.items()}) > \
        weighted_total(p, {j: c.samples_per_s for j, c in eq.items()})


def test_migration_cost_keeps_jobs_in_place() -> None:
    # three running jobs; one leaves. With no migration cost the others grab its nodes (both move), with a cost
    # above the small gain of growing, nobody moves
    cs = tuple(Choice("x", n, 10.0 * n ** 0.5) for n in (1, 2, 3, 4, 5, 6))
    before = {"a": ("x", 2), "b": ("x", 2)}
    p = Problem(choices={"a": cs, "b": cs}, capacity={"x": 6}, equal={"a": 17.32, "b": 17.32},
                equal_nodes={"a": 3, "b": 3}, current=before)
    greedy = allocate(p, migration_cost=0.0)
    assert {c.nodes for c in greedy.values()} == {3}
    lazy = allocate(p, migration_cost=0.5)
    assert {j: (c.pool, c.nodes) for j, c in lazy.items()} == before
    one = allocate(p, migration_cost=0.1)  # gaining (sqrt(6)-sqrt(2)) * 10 / 17.32 = 0.6 for one move: exactly one
    assert sum((c.pool, c.nodes) != before[j] for j, c in one.items()) == 1


def test_arrival_moves_only_what_it_must() -> None:
    cs = tuple(Choice("x", n, 10.0 * n ** 0.9) for n in (1, 2, 4))
    small = tuple(Choice("x", n, 10.0) for n in (1, 2, 4))  # does not scale
    before = {"a": ("x", 4), "b": ("x", 2), "c": ("x", 1)}
    p = Problem(choices={"a": cs, "b": cs, "c": small, "new": cs}, capacity={"x": 8},
                equal={j: 17.0 for j in ("a", "b", "c", "new")}, equal_nodes={j: 2 for j in ("a", "b", "c", "new")},
                current=before)
    got = allocate(p, migration_cost=1.0, fairness=0.0)
    moved = [j for j in before if (got[j].pool, got[j].nodes) != before[j]]
    assert got["new"].nodes >= 1 and len(moved) == 0  # one free node: the newcomer takes it, nobody moves
    p2 = Problem(choices=p.choices, capacity={"x": 7}, equal=p.equal, equal_nodes=p.equal_nodes, current=before)
    got2 = allocate(p2, migration_cost=1.0, fairness=0.0)
    moved2 = [j for j in before if (got2[j].pool, got2[j].nodes) != before[j]]
    assert len(moved2) == 1  # the cluster is full: exactly one job gives up nodes


def test_monotone_cleanup_and_counts() -> None:
    pts = [Point("x", 1, 5.0, 1), Point("x", 2, 0.0, 2, note="no mesh"), Point("x", 4, 4.0, 4), Point("x", 8, 9, 8)]
    got = monotone(pts)
    assert [(p.nodes, p.samples_per_s, p.plan_nodes) for p in got] == [(1, 5.0, 1), (2, 5.0, 1), (4, 5.0, 1),
                                                                       (8, 9, 8)]
    job = Job(name="j", model="gpt-tiny", global_batch=8, min_devices=16, max_devices=80)
    assert counts_to_plan(job, Pool(name="p", profile="dgx-h100", nodes=64, devices_per_node=8), [3, 99]) == \
        [2, 3, 4, 8, 10]


def test_baselines_on_a_two_pool_cluster() -> None:
    pools = [Pool(name="a100", profile="dgx-a100-80gb", nodes=4, devices_per_node=8),
             Pool(name="h100", profile="dgx-h100", nodes=4, devices_per_node=8)]
    jobs = [Job(name="fast", model="gpt-tiny", global_batch=8, max_devices=32),
            Job(name="slow", model="gpt-tiny", global_batch=8, max_devices=32)]
    # "fast" gains 3x from H100s, "slow" 1.1x: goodput sends fast to the H100 pool; Gavel's max-min time-shares so
    # that both get their equal share (fast 80, slow 42) and no more
    curves = {"fast": {"a100": [Point("a100", n, 10.0 * n, n) for n in (1, 2, 4)],
                       "h100": [Point("h100", n, 30.0 * n, n) for n in (1, 2, 4)]},
              "slow": {"a100": [Point("a100", n, 10.0 * n, n) for n in (1, 2, 4)],
                       "h100": [Point("h100", n, 11.0 * n, n) for n in (1, 2, 4)]}}
    p = build_problem(jobs, pools, curves)
    assert p.equal["fast"] == pytest.approx(0.5 * 40 + 0.5 * 120) and p.equal_nodes["fast"] == 4
    got = allocate(p)
    assert got["fast"].pool == "h100" and got["slow"].pool == "a100"
    g = gavel(p, pools)
    assert g["fast"] / p.equal["fast"] == pytest.approx(1.0, abs=1e-6)
    assert g["slow"] / p.equal["slow"] == pytest.approx(1.0, abs=1e-6)
    assert weighted_total(p, g) < weighted_total(p, {j: c.samples_per_s for j, c in got.items()})
    fce = first_come_exclusive(jobs, pools, curves)
    assert fce["fast"].pool == "a100" and fce["slow"].pool == "h100"  # first fit, blind to affinity


def test_jobs_file_is_validated() -> None:
    jobs = parse_jobs({"jobs": [{"name": "a", "model": "gpt-tiny", "global_batch": 8, "priority": 2},
                                {"name": "b", "model": "pkg.mod:make", "global_batch": 4, "seq": 64}]})
    assert jobs[0].weight == 2 and jobs[1].seq == 64
    bad = [[], [{"name": "a", "model": "gpt-tiny"}], [{"name": "a", "model": "x", "global_batch": 0}],
           [{"name": "a", "model": "gpt-tiny", "global_batch": 8, "gpus": 3}],
           [{"name": "a", "model": "gpt-tiny", "global_batch": 8}] * 2,
           [{"name": "a b", "model": "gpt-tiny", "global_batch": 8}],
           [{"name": "a", "model": "gpt-tiny", "global_batch": 8, "min_devices": 16, "max_devices": 8}],
           [{"name": "a", "model": "gpt-tiny", "global_batch": 8, "weight": -1}]]
    for data in bad:
        with pytest.raises(SchemaError):
            parse_jobs(data)


def test_pools_from_a_list_or_a_heterogeneous_profile() -> None:
    a, h = parse_pools("dgx-a100-80gb:32,dgx-h100:32")
    assert (a.name, a.nodes, h.name, h.nodes) == ("dgx-a100-80gb", 32, "dgx-h100", 32)
    groups = parse_pools("a100-h100")  # the built-in heterogeneous profile: one pool per node group
    assert [(p.name, p.nodes) for p in groups] == [("a100", 16), ("h100", 16)]
    prof = pool_profile(groups[1], 4)
    assert "H100" in prof.device.name and prof.nodes == 4
    with pytest.raises(ValueError):
        parse_pools("a100-h100:8")
