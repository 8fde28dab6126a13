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
from autopar.planner.pool import available_cores, fork_available, map_ordered
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
    pooled: list[int] = []

    def spy(fn, state, args, workers):  # records that the pool path ran
        pooled.append(workers)
        return map_ordered(fn, state, args, workers)

    monkeypatch.setattr(search_mod, "map_ordered", spy)
    prof = load_builtin("dgx-h100", nodes=2)
    one = search_mod.search(tiny, prof, PlanOptions(global_batch=32, workers=1))
    assert pooled == []
    two = search_mod.search(tiny, prof, PlanOptions(global_batch=32, workers=2))
    assert pooled == ([2, 2] if fork_available() else [])
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
