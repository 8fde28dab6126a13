"""The inputs of ``autopar schedule``: the jobs (``jobs.yaml``) and the cluster's pools of nodes.

``jobs.yaml`` is a list of jobs, or a mapping with a ``jobs:`` list::

    jobs:
      - name: chat            # unique; letters, digits, '-', '_', '.'
        model: llama3-8b      # a built-in model, or package.module:factory
        global_batch: 256
        seq: 4096             # optional (language models)
        weight: 2             # optional, default 1 (``priority`` is accepted as another word for it)
        min_devices: 8        # optional, default: one node
        max_devices: 256      # optional, default: the whole cluster

The cluster is one or more pools of identical nodes: ``dgx-a100-80gb:32,dgx-h100:32`` (profile[:nodes], a profile being
a built-in name or a profile YAML), or one profile with ``--nodes``, or a heterogeneous profile (node groups of
different device types, :mod:`autopar.profiles.hetero`, e.g. the built-in ``a100-h100``): one pool per group.  A job
runs inside one pool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autopar.ir.errors import SchemaError
from autopar.ir.limits import MAX_BATCH, MAX_NODES, MAX_SEQ, check_bound, clip
from autopar.ir.safe_yaml import load_yaml

__all__ = ["MAX_JOBS", "Job", "Pool", "load_jobs", "parse_jobs", "parse_pools"]

MAX_JOBS = 256
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_MODEL = re.compile(r"^[A-Za-z0-9_.-]+(:[A-Za-z_][A-Za-z0-9_]*)?$")
_KEYS = {"name", "model", "global_batch", "seq", "weight", "priority", "min_devices", "max_devices"}


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One training job to place on the cluster."""

    name: str
    model: str
    """A built-in model (``autopar models``) or ``package.module:factory``."""
    global_batch: int
    seq: int | None = None
    weight: float = 1.0
    """Its share of the objective: throughput normalised to the job's equal share, times ``weight``."""
    min_devices: int | None = None
    """Fewest devices it may get (default: one node)."""
    max_devices: int | None = None
    """Most devices it may use (default: the whole cluster)."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"job name {clip(repr(self.name))} must be 1-64 letters, digits, '-', '_' or '.'")
        if not isinstance(self.model, str) or not _MODEL.match(self.model):
            raise ValueError(f"job {self.name}: model {clip(repr(self.model))} is not a built-in model name or "
                             "package.module:factory")
        for k, limit in (("global_batch", MAX_BATCH), ("seq", MAX_SEQ), ("min_devices", 1 << 24),
                         ("max_devices", 1 << 24)):
            v = getattr(self, k)
            if v is None and k != "global_batch":
                continue
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"job {self.name}: {k} must be an integer, got {clip(repr(v))}")  # noqa: TRY004
            check_bound(f"job {self.name}: {k}", v, limit)
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not 0 < self.weight <= 1e6:
            raise ValueError(f"job {self.name}: weight must be a number in (0, 1e6], got {clip(repr(self.weight))}")
        if self.min_devices and self.max_devices and self.min_devices > self.max_devices:
            raise ValueError(f"job {self.name}: min_devices {self.min_devices} > max_devices {self.max_devices}")

    def node_range(self, devices_per_node: int, nodes: int) -> range:
        """The node counts this job may get in a pool of ``nodes`` nodes of ``devices_per_node`` devices."""
        lo = max(1, -(-(self.min_devices or 1) // devices_per_node))
        hi = nodes if self.max_devices is None else min(nodes, self.max_devices // devices_per_node)
        return range(lo, hi + 1)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "model": self.model, "global_batch": self.global_batch}
        for k in ("seq", "min_devices", "max_devices"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.weight != 1.0:
            d["weight"] = self.weight
        return d


def _job(entry: Any, i: int) -> Job:
    if not isinstance(entry, dict):
        raise SchemaError(f"jobs.{i}", f"must be a mapping, got {type(entry).__name__}", doc="jobs file")
    unknown = set(entry) - _KEYS
    if unknown:
        raise SchemaError(f"jobs.{i}", f"unknown keys {sorted(map(str, unknown))}; allowed: {sorted(_KEYS)}",
                          doc="jobs file")
    for k in ("name", "model", "global_batch"):
        if k not in entry:
            raise SchemaError(f"jobs.{i}.{k}", "is required", doc="jobs file")
    if "weight" in entry and "priority" in entry:
        raise SchemaError(f"jobs.{i}", "give weight or priority (the same thing), not both", doc="jobs file")
    kw = {k: entry[k] for k in entry if k != "priority"}
    if "priority" in entry:
        kw["weight"] = entry["priority"]
    try:
        return Job(**kw)
    except ValueError as e:
        raise SchemaError(f"jobs.{i}", str(e), doc="jobs file") from None


def parse_jobs(data: Any) -> list[Job]:
    """Jobs from a parsed YAML document (a list, or a mapping with a ``jobs:`` list)."""
    if isinstance(data, dict):
        if set(data) - {"jobs"}:
            raise SchemaError("", f"unknown top-level keys {sorted(map(str, set(data) - {'jobs'}))}", doc="jobs file")
        data = data.get("jobs")
    if not isinstance(data, list) or not data:
        raise SchemaError("jobs", "must be a non-empty list of jobs", doc="jobs file")
    if len(data) > MAX_JOBS:
        raise SchemaError("jobs", f"{len(data)} jobs, more than the {MAX_JOBS} autopar schedules", doc="jobs file")
    jobs = [_job(e, i) for i, e in enumerate(data)]
    seen: set[str] = set()
    for j in jobs:
        if j.name in seen:
            raise SchemaError("jobs", f"two jobs are named {j.name!r}", doc="jobs file")
        seen.add(j.name)
    return jobs


def load_jobs(path: str | Path) -> list[Job]:
    return parse_jobs(load_yaml(Path(path).read_text()))


@dataclass(frozen=True, kw_only=True, slots=True)
class Pool:
    """``nodes`` identical nodes described by one cluster profile."""

    name: str
    """The pool's label (its profile's name, made unique)."""
    profile: str
    """A built-in profile name or a profile YAML path."""
    nodes: int
    devices_per_node: int


def parse_pools(spec: str, nodes: int | None = None) -> list[Pool]:
    """``profile[:nodes][,profile[:nodes]...]``; a single profile without ``:nodes`` takes ``nodes`` (or its own).

    A heterogeneous profile (:mod:`autopar.profiles.hetero`: node groups of different device types) gives one pool
    per group, its profile written ``SPEC#GROUP``."""
    from autopar.profiles.hetero import is_hetero, load_cluster

    parts = [p.strip() for p in str(spec).split(",") if p.strip()]
    if not parts:
        raise ValueError("--cluster is empty")
    if nodes is not None and len(parts) > 1:
        raise ValueError("--nodes applies to a single-profile --cluster; give each pool its nodes as profile:N")
    pools: list[Pool] = []
    for part in parts:
        prof_spec, _, n = part.rpartition(":") if re.search(r":\d+$", part) else (part, "", "")
        prof = load_cluster(prof_spec)
        if is_hetero(prof):
            if n or nodes is not None:
                raise ValueError(f"{clip(prof_spec)} is a heterogeneous profile: its groups fix their nodes")
            members = [(f"{prof_spec}#{g.name}", g.name, g.nodes, g.profile.devices_per_node)
                       for g in prof.groups]  # type: ignore[union-attr]
        else:
            count = int(n) if n else nodes if nodes is not None else prof.nodes
            members = [(prof_spec, prof.name, count, prof.devices_per_node)]  # type: ignore[union-attr]
        for ref, label, count, dpn in members:
            check_bound(f"nodes of pool {clip(label)}", count, MAX_NODES)
            name, k = label, 2
            while any(p.name == name for p in pools):
                name, k = f"{label}#{k}", k + 1
            pools.append(Pool(name=name, profile=ref, nodes=count, devices_per_node=dpn))
    return pools
