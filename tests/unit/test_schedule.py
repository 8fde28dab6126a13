"""Pipeline schedule simulator: closed forms, an independent dependency-graph longest path, the Chrome trace."""

from __future__ import annotations

import json
import random
from collections import defaultdict, deque

import pytest

from autopar.planner.inter_op.schedule import SharedCores, chrome_trace, peak_in_flight, rank_order, simulate


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("pp,m", [(1, 1), (1, 4), (2, 1), (2, 5), (4, 4), (4, 8), (3, 7), (8, 3)])
def test_equal_stages_closed_form(schedule: str, pp: int, m: int) -> None:
    f, b = 1.5, 2.5
    r = simulate([f] * pp, [b] * pp, pp=pp, num_microbatches=m, schedule=schedule)  # type: ignore[arg-type]
    assert r.pipeline_s == pytest.approx((m + pp - 1) * (f + b))
    assert r.iteration_s == pytest.approx(r.pipeline_s)
    assert r.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1))
    assert r.bubble_s == pytest.approx((pp - 1) * (f + b))
    assert r.busy_s == pytest.approx([m * (f + b)] * pp)
    want = [m] * pp if schedule == "gpipe" else [min(pp - s, m) for s in range(pp)]
    assert list(r.peak_in_flight) == want


@pytest.mark.parametrize("pp,v,m", [(2, 2, 2), (2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 12), (3, 4, 6), (2, 3, 8)])
def test_interleaved_closed_form(pp: int, v: int, m: int) -> None:
    f, b = 1.0, 2.0  # whole rank per micro-batch; each chunk does 1/v of it
    r = simulate([f / v] * (pp * v), [b / v] * (pp * v), pp=pp, num_microbatches=m, schedule="interleaved_1f1b",
                 virtual_stages=v)
    # Narayanan et al. SC'21 sec. 2.2: bubble (pp - 1)(f + b) / v
    assert r.pipeline_s == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)
    assert r.bubble_s == pytest.approx((pp - 1) * (f + b) / v)
    # first rank: (pp-1)*2 + (v-1)*pp warm-up forwards, +1 in steady state (Korthikanti et al. 2022 sec. 4.2)
    assert r.peak_in_flight[0] == min((pp - 1) * 2 + (v - 1) * pp + 1, m * v)


def test_interleaved_beats_1f1b_and_validates() -> None:
    plain = simulate([1.0] * 4, [2.0] * 4, pp=4, num_microbatches=8, schedule="1f1b")
    inter = simulate([0.5] * 8, [1.0] * 8, pp=4, num_microbatches=8, schedule="interleaved_1f1b", virtual_stages=2)
    assert inter.bubble_fraction < plain.bubble_fraction
    with pytest.raises(ValueError, match="divisible"):
        simulate([1.0] * 8, [1.0] * 8, pp=4, num_microbatches=6, schedule="interleaved_1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="interleaved_1f1b"):
        simulate([1.0] * 8, [1.0] * 8, pp=4, num_microbatches=8, schedule="1f1b", virtual_stages=2)
    with pytest.raises(ValueError, match="entries"):
        simulate([1.0] * 3, [1.0] * 4, pp=4, num_microbatches=8)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_slowest_stage_dominates(schedule: str) -> None:
    fwd, bwd, m = [1.0, 3.0, 1.0, 1.0], [2.0, 6.0, 2.0, 2.0], 32
    r = simulate(fwd, bwd, pp=4, num_microbatches=m, schedule=schedule)  # type: ignore[arg-type]
    assert max(r.busy_s) == r.busy_s[1] == pytest.approx(m * 9.0)
    # the slow stage runs back to back once filled: period 9 per micro-batch, plus fill and drain
    assert m * 9.0 <= r.pipeline_s <= m * 9.0 + sum(fwd) + sum(bwd)
    balanced = simulate([1.5] * 4, [3.0] * 4, pp=4, num_microbatches=m, schedule=schedule)  # type: ignore[arg-type]
    assert balanced.pipeline_s < r.pipeline_s  # same total work, balanced is faster


def test_p2p_on_critical_path() -> None:
    pp, m, f, b, c = 4, 6, 1.0, 2.0, 0.25
    g = simulate([f] * pp, [b] * pp, pp=pp, num_microbatches=m, schedule="gpipe", p2p=c)
    # forward fill crosses pp-1 links, backward drain crosses them again
    assert g.pipeline_s == pytest.approx((m + pp - 1) * (f + b) + 2 * (pp - 1) * c)
    o = simulate([f] * pp, [b] * pp, pp=pp, num_microbatches=m, schedule="1f1b", p2p=c)
    assert o.pipeline_s >= (m + pp - 1) * (f + b) + 2 * (pp - 1) * c - 1e-12


def test_dp_sync_overlap_and_optimizer() -> None:
    pp, m, f, b = 2, 4, 1.0, 2.0
    hidden = simulate([f] * pp, [b] * pp, pp=pp, num_microbatches=m, dp_sync=1.5, optimizer_s=0.5)
    assert hidden.exposed_sync_s == (0.0, 0.0)
    assert hidden.iteration_s == pytest.approx(hidden.pipeline_s + 0.5)
    exposed = simulate([f] * pp, [b] * pp, pp=pp, num_microbatches=m, dp_sync=[5.0, 1.0], optimizer_s=0.5)
    assert exposed.exposed_sync_s == pytest.approx((3.0, 0.0))  # window = one backward of the last micro-batch
    # rank 0 finishes last anyway (it drains the pipeline), so its exposed sync lands on the iteration
    assert exposed.iteration_s == pytest.approx(exposed.pipeline_s + 3.0 + 0.5)


# ---- independent check: dependency-graph longest path, with 1F1B orders from a different rule ----------------------

def _order_by_inflight_rule(pp: int, rank: int, m: int) -> list[tuple[str, int, int]]:
    """PipeDream-Flush as a rule: run a forward while fewer than pp - rank micro-batches are in flight."""
    order, nf, nb = [], 0, 0
    while nb < m:
        if nf < m and nf - nb < pp - rank:
            order.append(("F", nf, 0))
            nf += 1
        else:
            order.append(("B", nb, 0))
            nb += 1
    return order


def _longest_path(orders, fwd, bwd, p2p, pp) -> float:
    """Finish time = longest path in the DAG of rank-order edges and data edges (Kahn's topological sort)."""
    last = len(fwd) - 1
    dur, preds = {}, defaultdict(list)
    for r, order in enumerate(orders):
        for n, (kind, mb, c) in enumerate(order):
            k = c * pp + r
            node = (kind, mb, k)
            dur[node] = fwd[k] if kind == "F" else bwd[k]
            if n:
                prev = order[n - 1]
                preds[node].append(((prev[0], prev[1], prev[2] * pp + r), 0.0))
            if kind == "F" and k > 0:
                preds[node].append((("F", mb, k - 1), p2p[k - 1]))
            if kind == "B":
                preds[node].append((("F", mb, k), 0.0))
                if k < last:
                    preds[node].append((("B", mb, k + 1), p2p[k]))
    succ, indeg = defaultdict(list), {n: len(preds[n]) for n in dur}
    for n, ps in preds.items():
        for p, _ in ps:
            succ[p].append(n)
    end, queue = {}, deque(n for n, d in indeg.items() if d == 0)
    while queue:
        n = queue.popleft()
        end[n] = dur[n] + max([0.0] + [end[p] + lat for p, lat in preds[n]])
        for s in succ[n]:
            indeg[s] -= 1
            if indeg[s] == 0:
                queue.append(s)
    assert len(end) == len(dur), "cycle"
    return max(end.values())


def test_1f1b_order_matches_inflight_rule() -> None:
    for pp in range(1, 6):
        for m in range(1, 9):
            for r in range(pp):
                assert rank_order("1f1b", rank=r, pp=pp, num_microbatches=m) == _order_by_inflight_rule(pp, r, m)


@pytest.mark.parametrize("seed", range(6))
def test_random_instances_match_longest_path(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(8):
        schedule = rng.choice(["gpipe", "1f1b", "interleaved_1f1b"])
        pp = rng.randint(1, 4)
        v = rng.randint(2, 3) if schedule == "interleaved_1f1b" else 1
        m = pp * rng.randint(1, 3) if v > 1 else rng.randint(1, 6)
        n = pp * v
        fwd = [rng.uniform(0.1, 2.0) for _ in range(n)]
        bwd = [rng.uniform(0.1, 4.0) for _ in range(n)]
        p2p = [rng.uniform(0.0, 0.5) for _ in range(n - 1)]
        res = simulate(fwd, bwd, pp=pp, num_microbatches=m, schedule=schedule, virtual_stages=v, p2p=p2p)
        orders = ([_order_by_inflight_rule(pp, r, m) for r in range(pp)] if schedule == "1f1b" else
                  [rank_order(schedule, rank=r, pp=pp, num_microbatches=m, virtual_stages=v) for r in range(pp)])
        assert res.pipeline_s == pytest.approx(_longest_path(orders, fwd, bwd, p2p, pp))
        for r in range(pp):  # every rank runs each (micro-batch, chunk) forward and backward exactly once
            ops = [(e.kind, e.microbatch, e.chunk) for e in res.events if e.rank == r]
            assert sorted(ops) == sorted((k, i, c) for k in "FB" for i in range(m) for c in range(v))


def test_peak_in_flight_weighted() -> None:
    order = rank_order("interleaved_1f1b", rank=0, pp=2, num_microbatches=4, virtual_stages=2)
    assert peak_in_flight(order) == 5  # (2-1)*2 + (2-1)*2 + 1
    assert peak_in_flight(order, weights=[1.0, 0.0]) <= peak_in_flight(order)


@pytest.mark.parametrize("schedule,v,m", [("1f1b", 1, 5), ("gpipe", 1, 3), ("interleaved_1f1b", 2, 6)])
def test_chrome_trace(schedule: str, v: int, m: int) -> None:
    pp = 3
    res = simulate([0.001] * (pp * v), [0.002] * (pp * v), pp=pp, num_microbatches=m, schedule=schedule,
                   virtual_stages=v, p2p=0.0001, dp_sync=0.01, optimizer_s=0.003)  # type: ignore[arg-type]
    names = [f"s{k}" for k in range(pp * v)]
    trace = json.loads(json.dumps(chrome_trace(res, stage_names=names)))
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 0]
    assert len(xs) == len(res.events) == 2 * m * v * pp
    assert {e["name"][0] for e in xs} == {"F", "B"}
    for r in range(pp):
        evs = sorted((e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == r), key=lambda e: e["ts"])
        for a, b in zip(evs, evs[1:]):
            assert a["ts"] + a["dur"] <= b["ts"] + 1e-6, (a, b)
        assert all(e["dur"] >= 0 and isinstance(e["pid"], int) for e in evs)
    assert any(e["name"] == "optimizer step" for e in trace["traceEvents"])
    with pytest.raises(ValueError, match="stage_names"):
        chrome_trace(res, stage_names=["x"])


def _two_stages_on_two_cores(**kw: tuple[float, ...]) -> SharedCores:
    """pp=2, each stage a group of 2 ranks, all 4 on one node of 2 cores (op times: all 4 computing)."""
    return SharedCores(cores=2.0, ranks_per_node=4, stage_ranks=(((0, 2),), ((0, 2),)), **kw)


def test_shared_cores_one_stage_alone_runs_at_the_cores_it_is_left() -> None:
    # one micro-batch: the stages never compute at once, so every op runs twice as fast as its all-ranks time
    r = simulate([1.0, 1.5], [2.0, 3.0], pp=2, num_microbatches=1, schedule="gpipe", shared=_two_stages_on_two_cores())
    ends = {(e.rank, e.kind): (e.start, e.end) for e in r.events}
    assert ends[(0, "F")] == pytest.approx((0.0, 0.5))
    assert ends[(1, "F")] == pytest.approx((0.5, 1.25))
    assert ends[(1, "B")] == pytest.approx((1.25, 2.75))
    assert ends[(0, "B")] == pytest.approx((2.75, 3.75))
    assert r.pipeline_s == pytest.approx(3.75)


def test_shared_cores_overlapping_stages_and_communication_get_no_speedup() -> None:
    plain = simulate([1.0, 1.0], [2.0, 2.0], pp=2, num_microbatches=4, schedule="gpipe")
    shared = simulate([1.0, 1.0], [2.0, 2.0], pp=2, num_microbatches=4, schedule="gpipe",
                      shared=_two_stages_on_two_cores())
    # alone at twice the speed: the fill (stage 0's first forward), GPipe's turn (stage 1's last forward and first
    # backward) and the drain (stage 0's last backward); the rest overlaps
    assert plain.pipeline_s == pytest.approx(15.0)
    assert shared.pipeline_s == pytest.approx(15.0 - 0.5 - (0.5 + 1.0) - 1.0)
    # ops that are all communication are not sped up: the plain timeline again
    comm = simulate([1.0, 1.0], [2.0, 2.0], pp=2, num_microbatches=4, schedule="gpipe",
                    shared=_two_stages_on_two_cores(comm_fwd=(1.0, 1.0), comm_bwd=(2.0, 2.0)))
    assert comm.pipeline_s == pytest.approx(plain.pipeline_s)
    # no more ranks than cores: the shared model is not used at all
    roomy = SharedCores(cores=4.0, ranks_per_node=4, stage_ranks=(((0, 2),), ((0, 2),)))
    again = simulate([1.0, 1.0], [2.0, 2.0], pp=2, num_microbatches=4, schedule="gpipe", shared=roomy)
    assert again.events == plain.events


@pytest.mark.parametrize("seed", range(6))
def test_shared_cores_never_slower_and_at_most_the_full_speedup(seed: int) -> None:
    rng = random.Random(seed)
    pp = rng.choice([2, 3, 4])
    schedule = rng.choice(["gpipe", "1f1b"])
    m = rng.randint(1, 6)
    fwd, bwd = [rng.uniform(0.1, 2) for _ in range(pp)], [rng.uniform(0.1, 3) for _ in range(pp)]
    p2p = [rng.uniform(0, 0.3) for _ in range(pp - 1)]
    plain = simulate(fwd, bwd, pp=pp, num_microbatches=m, schedule=schedule, p2p=p2p)  # type: ignore[arg-type]
    sh = SharedCores(cores=1.0, ranks_per_node=pp, stage_ranks=tuple(((0, 1),) for _ in range(pp)))
    shared = simulate(fwd, bwd, pp=pp, num_microbatches=m, schedule=schedule, p2p=p2p,  # type: ignore[arg-type]
                      shared=sh)
    assert shared.pipeline_s <= plain.pipeline_s + 1e-9
    # each op takes between its all-ranks time over pp (alone on the node) and its all-ranks time
    for e, f in zip(shared.events, plain.events):
        d = (fwd if e.kind == "F" else bwd)[e.stage]
        assert d / pp - 1e-9 <= e.end - e.start <= d + 1e-9
        assert (e.rank, e.kind, e.microbatch) == (f.rank, f.kind, f.microbatch)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 9, 16])
def test_the_pipeline_probe_takes_out_the_sends_the_simulator_charges(m: int) -> None:
    """The profile's pipeline-schedule probe (a two-stage 1F1B on gloo, its sends included) leaves out per micro-batch
    slot what the simulator adds for the sends, so that the cost model does not charge them twice."""
    from autopar.profiles.eager import probe_send_s, simulated_sends

    for f, b, d in ((1.0, 2.0, 0.01), (0.3, 0.6, 0.05), (1.0, 1.0, 0.2)):
        for kind, v in (("1f1b", 1), ("gpipe", 1), ("interleaved_1f1b", 2)):
            if m % 2 and v > 1:  # interleaved: m a multiple of pp
                continue
            fw, bw = [f / v] * 2 * v, [b / v] * 2 * v
            charged = (simulate(fw, bw, pp=2, num_microbatches=m, schedule=kind, virtual_stages=v, p2p=d).pipeline_s
                       - simulate(fw, bw, pp=2, num_microbatches=m, schedule=kind, virtual_stages=v).pipeline_s)
            assert simulated_sends(m, d, kind) * (m * v + 1) == pytest.approx(charged), (kind, m)
    table = {"tables": {"p2p": [{"group_size": 2, "alpha_s": 1e-4, "busbw": 6.4e8}]}}
    assert probe_send_s(table) == pytest.approx(1e-4 + 1e-7)
    assert probe_send_s(None) == 0.0
