"""Throughput curves: the search's table memo changes no plan (real plans); which node counts get planned, the
cleanup, and the disk cache (a synthetic planner, where planning is not the point)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autopar.ir.plan import plan_to_yaml
from autopar.planner.cluster import curves as C
from autopar.planner.cluster.jobs import Job, Pool
from autopar.planner.cluster.pools import pool_profile
from autopar.planner.options import PlanOptions
from autopar.planner.search import search


def test_the_table_memo_changes_no_plan() -> None:
    job = Job(name="t", model="gpt-tiny", global_batch=32)
    pool = Pool(name="h", profile="dgx-h100", nodes=4, devices_per_node=8)
    opts = PlanOptions(global_batch=32, top_k=0, intra_op_time_limit_s=2.0)
    graph = C._trace_job(job)
    memo: dict = {}
    shared = [search(graph, pool_profile(pool, n), opts, memo=memo).best for n in (1, 2)]
    assert len(memo) == 1  # one table set for both node counts
    alone = search(graph, pool_profile(pool, 2), opts).best
    assert plan_to_yaml(shared[1]) == plan_to_yaml(alone)


CURVE = {"lin": lambda n: 10.0 * n, "flat": lambda n: 10.0 * min(n, 4), "one": lambda n: 10.0,
         "one2": lambda n: 10.0, "dip": lambda n: {1: 10.0, 2: 8.0, 4: 12.0}.get(n, 0.0)}


@pytest.fixture
def planned(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int]]:
    calls: list[tuple[str, int]] = []

    def fake(graph, profile, job, dtype, time_limit, fused, memo):  # type: ignore[no-untyped-def]
        calls.append((job.name, profile.nodes))
        return {"samples_per_s": CURVE[job.name](profile.nodes), "plan": f"{job.name}@{profile.nodes}",
                "summary": "", "note": ""}

    monkeypatch.setattr(C, "_plan_point", fake)
    return calls


def _build(names: list[str], nodes: int, tmp_path, **kw):  # type: ignore[no-untyped-def]
    jobs = [Job(name=n, model="gpt-tiny", global_batch=8 + i) for i, n in enumerate(names)]
    pool = Pool(name="x", profile="dgx-h100", nodes=nodes, devices_per_node=8)
    return C.build_curves(jobs, [pool], cache_dir=tmp_path, trace=lambda j: SimpleNamespace(fingerprint=j.name),
                          **kw)


def test_only_counts_that_can_matter_are_planned(planned, tmp_path) -> None:
    curves, stats = _build(["lin", "flat", "one", "one2"], 32, tmp_path, fairness=0.5)
    by = {n: sorted(c for j, c in planned if j == n) for n in CURVE}
    # equal share 8; below it down to the first count under half its share's throughput; above it up to what the
    # others leave (32 - 2 - 1 - 1 = 28 for lin) unless a doubling stopped paying (flat: 4 -> 8 gains nothing)
    assert by["lin"] == [2, 4, 8, 16]
    assert by["flat"] == [1, 2, 4, 8]
    assert by["one"] == [1, 2, 4, 8]
    assert stats == {"planned": 16, "cached": 0}
    flat = curves["flat"]["x"]
    assert [(p.nodes, p.plan_nodes, p.samples_per_s) for p in flat] == [(1, 1, 10), (2, 2, 20), (4, 4, 40),
                                                                        (8, 4, 40)]
    again, stats2 = _build(["lin", "flat", "one", "one2"], 32, tmp_path, fairness=0.5)
    assert again == curves and stats2 == {"planned": 0, "cached": 16} and len(planned) == 16


def test_cleanup_gives_a_larger_count_the_best_smaller_plan(planned, tmp_path) -> None:
    curves, _ = _build(["dip"], 4, tmp_path)
    assert [(p.nodes, p.plan_nodes, p.samples_per_s, p.plan_yaml) for p in curves["dip"]["x"]] == [
        (1, 1, 10.0, "dip@1"), (2, 1, 10.0, "dip@1"), (4, 4, 12.0, "dip@4")]
