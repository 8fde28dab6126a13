"""Throughput curves: a job's best plan, and its samples/s, at each node count it may get in each pool.

Each point is a real plan from :func:`autopar.planner.search.search`.  Points are cached on disk under
``$AUTOPAR_CACHE/schedule/`` keyed by the model's graph fingerprint, global batch, sequence, dtype, the pool's
profile (its content hash), the node count and the planner's source, so a later ``autopar schedule`` (an arrival, a
departure, another policy) plans only what it has not planned before.

Which counts are planned: the powers of two in the job's node range, its equal share, its lower bound and any count it
holds now (``extra``); ascending, and once doubling the nodes gains under ``SATURATION`` the larger counts are not
planned (the job's batch or model no longer scales).  Monotone cleanup then makes every count's value the best plan
on at most that many nodes: a job given more nodes can always run the best smaller plan and leave the rest idle.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import Any

from autopar.ir.safe_yaml import write_atomic
from autopar.planner.cluster.jobs import Job, Pool

__all__ = ["SATURATION", "Curves", "Point", "build_curves", "counts_to_plan", "monotone"]

log = logging.getLogger(__name__)
SATURATION = 1.02
"""Doubling a job's nodes must raise its throughput by at least 2% for larger counts to be planned."""
_FORMAT = 1


@dataclass(frozen=True, slots=True)
class Point:
    """A job's best plan on ``nodes`` nodes of ``pool`` (after cleanup: on ``plan_nodes`` <= ``nodes`` of them)."""

    pool: str
    nodes: int
    samples_per_s: float
    plan_nodes: int
    plan_yaml: str | None = None
    """The plan (YAML text); None for a synthetic curve or a count with no plan."""
    note: str = ""
    """Why there is no plan at this count, when there is none."""
    summary: str = ""
    """The plan in one line (mesh, micro-batching, schedule, ZeRO)."""


Curves = dict[str, dict[str, list[Point]]]
"""job name -> pool name -> points, ascending in nodes."""


def monotone(points: Iterable[Point]) -> list[Point]:
    """``points`` sorted by nodes, each replaced by the best point at or below its count (see the module docstring)."""
    out: list[Point] = []
    best: Point | None = None
    for p in sorted(points, key=lambda p: p.nodes):
        if best is None or p.samples_per_s > best.samples_per_s:
            best = p
        out.append(p if best is p else replace(best, nodes=p.nodes, note=p.note))
    return [p for p in out if p.samples_per_s > 0]


def counts_to_plan(job: Job, pool: Pool, extra: Iterable[int] = ()) -> list[int]:
    """The node counts worth planning for ``job`` in ``pool`` (ascending; see the module docstring)."""
    rng = job.node_range(pool.devices_per_node, pool.nodes)
    if not rng:
        return []
    counts = {rng.start, rng.stop - 1} | {n for n in extra if n in rng}
    n = 1
    while n < rng.stop:
        if n >= rng.start:
            counts.add(n)
        n *= 2
    return sorted(counts)


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


@lru_cache(maxsize=1)
def _planner_digest() -> str:
    """SHA-256 over the planner's and the profiles' source, this subpackage left out (it makes no plan); taken once
    per process, when the code that plans was loaded, so files edited later do not re-key this process's points."""
    planner = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for root in (planner, planner.parent / "profiles"):
        for f in sorted(root.rglob("*.py")):
            if root is planner and f.relative_to(planner).parts[0] == "cluster":
                continue
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


class _Cache:
    """One JSON file per planned point (see the module docstring)."""

    def __init__(self, root: Path | None) -> None:
        from autopar.ir.trace_cache import cache_root

        self.root = Path(root or cache_root()) / "schedule"
        self.code = _planner_digest()

    def path(self, key: dict[str, Any]) -> Path:
        return self.root / f"{_digest(dict(key, format=_FORMAT, code=self.code))[:40]}.json"

    def get(self, key: dict[str, Any]) -> dict[str, Any] | None:
        p = self.path(key)
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) and data.get("key") == _digest(key) else None

    def put(self, key: dict[str, Any], value: dict[str, Any]) -> None:
        p = self.path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            write_atomic(p, json.dumps(dict(value, key=_digest(key))))
        except OSError as e:  # a read-only or full disk only costs the next call a re-plan
            log.warning("could not cache a curve point in %s: %s", p.parent, e)


def _plan_point(graph: Any, profile: Any, job: Job, dtype: str, time_limit: float, fused: bool,
                memo: dict) -> dict[str, Any]:
    from autopar.ir.plan import plan_to_yaml
    from autopar.planner.options import PlanOptions
    from autopar.planner.search import search

    opts = PlanOptions(global_batch=job.global_batch, dtype=dtype, top_k=0,  # type: ignore[arg-type]
                       intra_op_time_limit_s=time_limit, fused_kernels=fused)
    try:
        best = search(graph, profile, opts, memo=memo).best
    except ValueError as e:  # no mesh uses every device with this batch, or nothing fits in memory
        return {"samples_per_s": 0.0, "plan": None, "note": " ".join(str(e).split())[:300]}
    return {"samples_per_s": best.samples_per_s, "plan": plan_to_yaml(best), "note": "", "summary": summary(best)}


def summary(p: Any) -> str:
    """A plan in one line."""
    mesh = " ".join(f"{k}={getattr(p.mesh, k)}" for k in ("pp", "dp", "ep", "cp", "tp") if getattr(p.mesh, k) > 1)
    sched = f" {p.schedule}{'/v' + str(p.virtual_stages) if p.virtual_stages > 1 else ''}" if p.mesh.pp > 1 else ""
    return f"{mesh or 'single device'} mb={p.micro_batch}x{p.num_microbatches}{sched} zero={p.zero}"


class _Points:
    """Plans (or finds in the cache) single curve points; one table memo per job (search's ``memo``)."""

    def __init__(self, cache: _Cache, trace: Callable[[Job], Any], dtype: str, time_limit: float, fused: bool,
                 progress: Callable[[str], None] | None) -> None:
        self.cache, self.trace, self.progress = cache, trace, progress
        self.dtype, self.time_limit, self.fused = dtype, time_limit, fused
        self.stats = {"planned": 0, "cached": 0}
        self.graphs: dict[str, Any] = {}
        self.memos: dict[str, dict] = {}
        self.raw: dict[tuple[str, str], dict[int, Point]] = {}

    def get(self, job: Job, pool: Pool, n: int) -> Point:
        from autopar.planner.cluster.pools import pool_profile, profile_hash

        got = self.raw.setdefault((job.name, pool.name), {})
        if n in got:
            return got[n]
        if job.name not in self.graphs:
            self.graphs[job.name] = self.trace(job)
        graph = self.graphs[job.name]
        key = {"model": graph.fingerprint, "batch": job.global_batch, "seq": job.seq, "dtype": self.dtype,
               "profile": profile_hash(pool_profile(pool)), "time_limit": self.time_limit, "nodes": n}
        if not self.fused:
            key["fused_kernels"] = False
        hit = self.cache.get(key)
        if hit is None:
            if self.progress:
                self.progress(f"planning {job.name} on {n} x {pool.name}")
            hit = _plan_point(graph, pool_profile(pool, n), job, self.dtype, self.time_limit, self.fused,
                              self.memos.setdefault(job.name, {}))
            self.cache.put(key, hit)
            self.stats["planned"] += 1
        else:
            self.stats["cached"] += 1
        sps = float(hit["samples_per_s"])
        got[n] = Point(pool.name, n, sps, n, hit["plan"], "" if sps > 0 else str(hit.get("note", "")),
                       str(hit.get("summary", "")))
        return got[n]


def build_curves(jobs: list[Job], pools: list[Pool], *, fairness: float = 0.0,
                 extra: dict[str, dict[str, Iterable[int]]] | None = None, dtype: str = "bfloat16",
                 time_limit: float = 10.0, fused_kernels: bool = True, cache_dir: Path | None = None,
                 trace: Callable[[Job], Any] | None = None,
                 progress: Callable[[str], None] | None = None) -> tuple[Curves, dict[str, int]]:
    """Plan every job's curve in every pool; returns the cleaned curves and counts of planned / cached points.

    Only counts that can matter are planned (besides ``extra``, always planned): first each job's equal share
    ``s`` in every pool (its equal-share throughput ``E_j`` is their pool-weighted mean), then the counts below ``s``
    from the top down until one falls under ``fairness * E_j`` (the allocator may not give the job less; the
    cleaned curve only grows with the count), then the counts above ``s`` up to what the cluster has left when
    every other job holds its fewest fair nodes, stopping at saturation."""
    pts = _Points(_Cache(cache_dir), trace or _trace_job, dtype, time_limit, fused_kernels, progress)
    total = sum(p.nodes for p in pools)
    share = max(1, total // max(1, len(jobs)))
    want = {(j.name, p.name): counts_to_plan(j, p, (extra or {}).get(j.name, {}).get(p.name, ())) for j in jobs
            for p in pools}
    for j in jobs:
        for p in pools:
            for n in (extra or {}).get(j.name, {}).get(p.name, ()):
                if n in want[j.name, p.name]:
                    pts.get(j, p, n)
    fewest: dict[str, int] = {}
    for j in jobs:
        mid = {p.name: _clip(j, p, share) for p in pools}
        e = sum(p.nodes / total * pts.get(j, p, mid[p.name]).samples_per_s for p in pools if mid[p.name])
        fair = []
        for p in pools:
            for n in sorted((n for n in want[j.name, p.name] if n <= mid[p.name]), reverse=True):
                if pts.get(j, p, n).samples_per_s < fairness * e:
                    break
                fair.append(n)
        # the fewest nodes it may hold (no fair count at all: its smallest, which keeps the bound below safe)
        fewest[j.name] = min(fair) if fair else min((c[0] for c in want.values() if c), default=1)
    for j in jobs:
        room = total - sum(n for k, n in fewest.items() if k != j.name)
        for p in pools:
            fed = [q for q in pts.raw.get((j.name, p.name), {}).values() if q.samples_per_s > 0]
            fed.sort(key=lambda q: q.nodes)
            for n in (n for n in want[j.name, p.name] if n > (_clip(j, p, share) or 0) and n <= room):
                if len(fed) >= 2 and fed[-1].nodes >= 2 * fed[-2].nodes and \
                        fed[-1].samples_per_s < SATURATION * fed[-2].samples_per_s:
                    break  # a doubling gained under 2%: saturated (see the module docstring)
                q = pts.get(j, p, n)
                if q.samples_per_s > 0:
                    fed.append(q)
    curves: Curves = {j.name: {p.name: monotone(pts.raw.get((j.name, p.name), {}).values()) for p in pools}
                      for j in jobs}
    return curves, pts.stats


def _clip(job: Job, pool: Pool, n: int) -> int:
    """``n`` nodes clipped to the job's node range in ``pool`` (0 when the range is empty)."""
    rng = job.node_range(pool.devices_per_node, pool.nodes)
    return min(max(n, rng.start), rng.stop - 1) if rng else 0


def _trace_job(job: Job) -> Any:
    """The job's model traced at batch 1 on the meta device; a built-in model's graph comes from the traced-graph
    cache under the same key ``autopar plan`` uses, so either command's trace serves the other."""
    from autopar.planner.graphs import traced_graph

    return traced_graph(job.model, seq=job.seq)
