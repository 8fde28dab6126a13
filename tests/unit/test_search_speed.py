"""Search speed without changed answers (issue #17): the worker count does not change the plan, the closed-form
in-flight count equals the scanned one, the memoized screening equals a fresh one, and the traced-graph cache
returns the graph it stored and misses when its key changes."""

from __future__ import annotations

import importlib
import itertools
from dataclasses import replace
from pathlib import Path

import pytest

from autopar import ir
from autopar.ir.plan import plan_to_yaml
from autopar.ir.trace_cache import cached_graph
from autopar.planner.inter_op.schedule import peak_in_flight, peak_in_flight_count, rank_order
from autopar.planner.options import PlanOptions
from autopar.planner.pool import Pool, available_cores, fork_available, map_ordered
from autopar.profiles.builtin import load_builtin
from autopar.zoo import build

search_mod = importlib.import_module("autopar.planner.search")


@pytest.fixture(scope="module")
def tiny() -> ir.Graph:
    spec = build("gpt-tiny", batch=1, device="meta")
    return ir.trace(spec.model, spec.example_inputs, model_name="gpt-tiny")


def _texts(result: search_mod.SearchResult) -> list[str]:
    return [plan_to_yaml(replace(p, solver=replace(p.solver, wall_s=0.0))) for p in (result.best, *result.alternatives)]


def test_plan_bytes_identical_for_any_worker_count(tiny: ir.Graph, monkeypatch: pytest.MonkeyPatch) -> None:
    pooled: list[str] = []
    real_map = Pool.map

    def spy(self, fn, args):  # records which phases ran on the workers
        if self.parallel and len(args) > 1:
            pooled.append(fn.__name__)
        return real_map(self, fn, args)

    monkeypatch.setattr(Pool, "map", spy)
    prof = load_builtin("dgx-h100", nodes=2)
    one = search_mod.search(tiny, prof, PlanOptions(global_batch=32, workers=1))
    assert pooled == []
    two = search_mod.search(tiny, prof, PlanOptions(global_batch=32, workers=2))
    if fork_available():  # the fastest shardings, the lean ones that can help (when two or more), screening, exact
        assert pooled[0] == "_solve_task" and [p for p in pooled if p != "_solve_task"] == ["_screen_task",
                                                                                             "_build_task"]
    else:
        assert pooled == []
    assert one.screened == two.screened
    assert _texts(one) == _texts(two)


def test_workers_option() -> None:
    assert PlanOptions(global_batch=8).workers == available_cores() >= 1
    with pytest.raises(ValueError, match="workers"):
        PlanOptions(global_batch=8, workers=0)


def _square(state: int, x: int) -> int:
    return state + x * x


def test_map_ordered_keeps_argument_order() -> None:
    args = list(range(7))
    assert map_ordered(_square, 100, args, 2) == map_ordered(_square, 100, args, 1) == [100 + x * x for x in args]


def test_peak_in_flight_count_matches_the_op_order() -> None:
    for pp, m, v in itertools.product((1, 2, 3, 4, 8), (1, 2, 3, 4, 8, 12, 16), (1, 2, 3)):
        for sched in ("gpipe", "1f1b", "interleaved_1f1b"):
            if (sched != "interleaved_1f1b" and v != 1) or (sched == "interleaved_1f1b" and m % pp):
                continue
            for r in range(pp):
                order = rank_order(sched, rank=r, pp=pp, num_microbatches=m, virtual_stages=v)  # type: ignore
                assert peak_in_flight_count(sched, rank=r, pp=pp, num_microbatches=m,  # type: ignore[arg-type]
                                            virtual_stages=v) == peak_in_flight(order), (sched, pp, m, v, r)


def test_memoized_screening_equals_fresh(tiny: ir.Graph) -> None:
    from autopar.planner.inter_op.screen import Candidate, ScreenMemo, screen
    from autopar.profiles.cost import CostModel

    prof = load_builtin("dgx-h100", nodes=1)
    opts = PlanOptions(global_batch=16, workers=1)
    tables = search_mod._Tables(tiny, CostModel(prof), opts)
    memo = ScreenMemo()
    for tp, pp, zero, rc, sched in itertools.product((1, 2), (1, 2), (0, 3), ("none", "full"), ("1f1b", "gpipe")):
        c = Candidate(pp, 8 // (tp * pp), tp, 1, 4, sched, 1, zero, rc)
        kw = {"dtype": "bfloat16", "capacity": prof.device.memory_bytes, "p2p_intra": True}
        table = tables.get(tp, 1)
        assert screen(c, table, tables.cost, memo=memo, **kw) == screen(c, table, tables.cost, **kw)


def test_trace_cache_round_trip_and_miss(tiny: ir.Graph, tmp_path: Path) -> None:
    made: list[int] = []

    def make() -> ir.Graph:
        made.append(1)
        return tiny

    a = cached_graph({"zoo": "gpt-tiny"}, make, tmp_path)
    b = cached_graph({"zoo": "gpt-tiny"}, make, tmp_path)
    assert made == [1] and a == b == tiny and b.fingerprint == tiny.fingerprint
    cached_graph({"zoo": "gpt-tiny", "seq": 64}, make, tmp_path)  # another key: traced again
    assert made == [1, 1]
    for f in (tmp_path / "graphs").glob("*.pkl"):
        f.write_bytes(b"damaged")
    assert cached_graph({"zoo": "gpt-tiny"}, make, tmp_path) == tiny and made == [1, 1, 1]


def _screen_every_rank(c, table, cost, memo, capacity: float) -> tuple[float, float]:
    """(time, peak) of a candidate with every rank costed on its own (what screening did before it grouped ranks
    with equal numbers)."""
    from autopar.planner.inter_op.memory import memory_breakdown
    from autopar.planner.inter_op.screen import ADAM_STEP_BYTES, dp_time, in_flight, reserve_for

    _chunks, sum_times, p2p, ranks, _ = memo.ranks(table, c.recompute, c.pp, c.virtual_stages, cost, True)
    flights = in_flight(c.schedule, c.pp, c.num_microbatches, c.virtual_stages)
    worst, peak = 0.0, 0.0
    for r, (t, params, acts, extra, largest, fwd, units, _tensors, _lt) in enumerate(ranks):
        acts = acts * flights[r] + (extra if c.recompute == "full" else 0.0)
        peak = max(peak, memory_breakdown(param_elems=params, zero=c.zero, dp=c.dp, mixed_precision=True,
                                          activations=acts, capacity=capacity, largest_layer_elems=largest,
                                          reduce_bytes=4, reserve=reserve_for(cost)).total)
        comm = dp_time(cost, params=params, units=units, fwd_s=fwd, bwd_s=t - fwd, m=c.num_microbatches, dp=c.dp,
                       tp=c.tp, zero=c.zero, dtype="bfloat16", reduce_dtype="float32", overlap=True,
                       recompute=c.recompute, param_tensors=_tensors)
        opt = params * ADAM_STEP_BYTES / (c.dp if c.zero >= 1 else 1) / cost.profile.device.memory_bandwidth
        worst = max(worst, comm.total_s + opt)
    busiest = max(r[0] for r in ranks)
    if c.schedule == "interleaved_1f1b":
        pipe = c.num_microbatches * busiest + (c.pp - 1) * busiest / c.virtual_stages
    else:
        pipe = (c.num_microbatches - 1) * busiest + sum_times
    k = c.pp * c.virtual_stages
    return pipe + 2 * (k - 1) * p2p + worst, peak


def test_screening_ranks_with_equal_numbers_once(tiny: ir.Graph) -> None:
    """Screening costs each group of ranks with equal numbers once (the rank holding the most micro-batches for
    memory): the same time and peak, bit for bit, as costing every rank."""
    from autopar.planner.inter_op.screen import Candidate, ScreenMemo, screen
    from autopar.profiles.cost import CostModel

    prof = load_builtin("dgx-h100", nodes=4)
    tables = search_mod._Tables(tiny, CostModel(prof), PlanOptions(global_batch=64, workers=1))
    memo, grouped = ScreenMemo(), 0
    for pp, sched, v, zero, rc in itertools.product((2, 4), ("gpipe", "1f1b", "interleaved_1f1b"), (1, 2), (0, 1, 3),
                                                    ("none", "full")):
        if (sched == "interleaved_1f1b") != (v > 1):
            continue
        c = Candidate(pp, 16 // pp, 2, 1, 8, sched, v, zero, rc)
        table = tables.get(2, 1)
        got = screen(c, table, tables.cost, dtype="bfloat16", capacity=1e9, p2p_intra=True, memo=memo)
        if got is None:
            continue
        grouped += len(memo.ranks(table, rc, pp, v, tables.cost, True)[4]) < pp
        assert (got.time_s, got.peak_mem) == _screen_every_rank(c, table, tables.cost, memo, 1e9)
    assert grouped  # some candidates did have ranks with equal numbers


def test_layer_table_sums_equal_the_per_parameter_ones(tiny: ir.Graph) -> None:
    from autopar.planner.inter_op.screen import _largest_local, _local_elems, _local_sum, _param_sizes
    from autopar.profiles.cost import CostModel

    tables = search_mod._Tables(tiny, CostModel(load_builtin("dgx-h100", nodes=1)), PlanOptions(global_batch=8))
    table = tables.get(2, 1, True)  # the memory-lean sharding: weights sharded
    placements = {p: pl for s in table.solutions for p, pl in s.param_placements.items()}
    assert any(pl != "R" for pl in placements.values())
    for g, sizes in zip(tiny.layers, _param_sizes(tiny)):
        assert _local_sum(sizes, placements, 2) == _local_elems(tiny, g.params, placements, 2)
        assert _largest_local(sizes, placements, 2) == max(
            (_local_elems(tiny, (n,), placements, 2) for n in g.params), default=0.0)


def test_screen_tasks_cover_every_unit_once(tiny: ir.Graph) -> None:
    from autopar.planner.inter_op.screen import ScreenMemo
    from autopar.profiles.cost import CostModel

    prof = load_builtin("dgx-h100", nodes=2)
    for pins, workers in (({}, 2), ({"tp": 2}, 2), ({"tp": 2}, 3)):
        opts = PlanOptions(global_batch=32, workers=1, pins=pins)
        tables = search_mod._Tables(tiny, CostModel(prof), opts)
        s = search_mod._Screening(tiny, prof, opts, tables, ScreenMemo())
        units, keys = search_mod._units(s)
        for k in keys:
            tables.get(*k)
        tasks = search_mod._screen_tasks(s, units, keys, workers)
        assert sorted(i for idx, _ in tasks for i in idx) == list(range(len(units)))
        assert len(tasks) >= min(workers, len(units))
        for idx, (us, sent) in tasks:
            assert us == [units[i] for i in idx] and len({tp for tp, _, _ in us}) == 1
            assert all(k[0] == us[0][0] for k in sent) and all(t is None or t.solutions == () for t in sent.values())
    one = search_mod.search(tiny, prof, PlanOptions(global_batch=32, workers=1, pins={"tp": 2}))
    three = search_mod.search(tiny, prof, PlanOptions(global_batch=32, workers=3, pins={"tp": 2}))
    assert _texts(one) == _texts(three)


def _upward_partition(time, mem, act, out_bytes, pp, v, cap, link, flight):
    """The stage DP scanning every start upwards with strict improvement (the partitioner before its downward scan
    with early stops): (bottleneck, cuts of the memory tie-break)."""
    import math
    from itertools import accumulate

    n, K, inf = len(time), pp * v, math.inf
    pt, pm, pa = ([0.0, *accumulate(x)] for x in (time, mem, act))

    def dp(bound):
        best = [[inf] * (n + 1) for _ in range(K + 1)]
        arg = [[-1] * (n + 1) for _ in range(K + 1)]
        best[0][0] = 0.0
        for k in range(1, K + 1):
            s = k - 1
            for j in range(k, n - (K - k) + 1):
                lk = link * out_bytes[j - 1] if s < K - 1 else 0.0
                for i in range(s, j):
                    b = best[s][i]
                    m = pm[j] - pm[i] + flight(s) * (pa[j] - pa[i])
                    t = pt[j] - pt[i] + lk
                    if b == inf or m > cap / v or (bound is not None and t > bound):
                        continue
                    val = max(b, t) if bound is None else max(b, m)
                    if val < best[k][j]:
                        best[k][j], arg[k][j] = val, i
        return best[K][n], arg

    t_star, _ = dp(None)
    if t_star == inf:
        return inf, ()
    _, arg = dp(t_star * (1 + 1e-9) + 1e-15)
    cuts, j = [], n
    for k in range(K, 0, -1):
        cuts.append((arg[k][j], j))
        j = arg[k][j]
    return t_star, tuple(reversed(cuts))


def test_stage_partition_equals_the_upward_scan() -> None:
    import random

    from autopar.planner.inter_op.partition import partition_stages

    rng = random.Random(7)
    feasible = 0
    for _ in range(1500):
        n, pp, v = rng.randint(1, 14), rng.randint(1, 4), rng.randint(1, 2)
        time = [float(rng.randint(0, 3)) if rng.random() < 0.6 else rng.random() for _ in range(n)]
        mem, act = [float(rng.randint(0, 4)) for _ in range(n)], [rng.choice([0.0, 0.5, 1.0]) for _ in range(n)]
        out_bytes = [float(rng.randint(0, 3)) for _ in range(n)]
        cap, link = rng.choice([6.0, 12.0, 1e9]), rng.choice([0.0, 0.5])

        def flight(k: int, pp: int = pp) -> float:
            return float(pp - k % pp)

        got = partition_stages(time, mem, act, out_bytes, pp=pp, capacity=cap, virtual_stages=v,
                               p2p=lambda b, k, link=link: b * link, in_flight=flight)
        t_star, cuts = _upward_partition(time, mem, act, out_bytes, pp, v, cap, link, flight)
        if n < pp * v:
            assert not got.feasible
            continue
        assert got.feasible == (cuts != ())
        if got.feasible:
            feasible += 1
            assert got.boundaries == cuts and got.bottleneck_s <= t_star * (1 + 1e-9) + 1e-15
    assert feasible > 300


def test_lean_solve_skipped_only_when_it_cannot_be_leaner() -> None:
    """The memory-lean solve is skipped when the fastest sharding already comes within the margin of every parameter
    sharded; solved anyway, such a lean table is never leaner by that margin (so it would not have been a
    candidate). GPT-2 small on H100s has both cases."""
    from autopar.planner.inter_op.screen import param_floor
    from autopar.profiles.cost import CostModel

    spec = build("gpt2-small", batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, model_name="gpt2-small")
    tables = search_mod._Tables(graph, CostModel(load_builtin("dgx-h100", nodes=1)), PlanOptions(global_batch=64))
    skipped = helped = 0
    for tp, mb in itertools.product((2, 4), (1, 8)):
        fast, lean = tables.get(tp, mb), tables.get(tp, mb, True)
        assert fast is not None and lean is not None and sum(lean.params) >= param_floor(graph, tp)
        if not tables.lean_may_help(tp, mb):
            skipped += 1
            assert not sum(lean.params) < sum(fast.params) * search_mod._LEANER
            assert [lean_ for lean_, _ in tables.variants(tp, mb)] == [False]
        else:
            helped += sum(lean.params) < sum(fast.params) * search_mod._LEANER
    assert skipped and helped
