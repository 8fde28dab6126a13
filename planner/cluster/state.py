"""The schedule file ``autopar schedule`` writes (and reads back for ``--arrive`` / ``--leave``), and the commands that
move a job from one allocation to another.

A schedule file holds the cluster's pools, the policy and its settings, and per job: its spec (as in ``jobs.yaml``),
its pool and nodes, its plan (a plan YAML beside the schedule, ``<schedule>.plans/<job>.<pool>.<nodes>n.yaml``, usable
with ``autopar run``), the plan in one line, its predicted samples/s, and its equal-share samples/s.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from autopar.ir.errors import SchemaError
from autopar.ir.safe_yaml import load_yaml, write_atomic
from autopar.planner.cluster.jobs import Job, Pool, parse_jobs

__all__ = ["SCHEDULE_VERSION", "Placed", "Schedule", "dump_schedule", "load_schedule", "move_commands", "plan_file"]

SCHEDULE_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Placed:
    """One job's place in a schedule."""

    job: Job
    pool: str
    nodes: int
    devices: int
    plan: str
    """Path of its plan YAML (relative to the schedule file's directory)."""
    summary: str
    samples_per_s: float
    equal_samples_per_s: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Schedule:
    pools: tuple[Pool, ...]
    policy: str
    fairness: float
    migration_cost: float
    placed: tuple[Placed, ...]
    plan_options: dict = field(default_factory=dict)
    """What the curves were planned with (dtype, fused_kernels, time_limit): arrivals plan with the same."""

    def current(self) -> dict[str, tuple[str, int]]:
        return {p.job.name: (p.pool, p.nodes) for p in self.placed}


def plan_file(schedule_path: str | Path, job: str, pool: str, nodes: int) -> Path:
    """Where a job's plan for (pool, nodes) is written, beside the schedule file."""
    p = Path(schedule_path)
    safe_pool = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in pool)
    return p.with_name(p.stem + ".plans") / f"{job}.{safe_pool}.{nodes}n.yaml"


def dump_schedule(s: Schedule, path: str | Path) -> Path:
    data = {"schedule_version": SCHEDULE_VERSION,
            "cluster": [{"name": p.name, "profile": p.profile, "nodes": p.nodes, "devices_per_node": p.devices_per_node}
                        for p in s.pools],
            "policy": s.policy, "fairness": s.fairness, "migration_cost": s.migration_cost,
            "plan_options": dict(s.plan_options),
            "jobs": [dict(p.job.to_dict(), pool=p.pool, nodes=p.nodes, devices=p.devices, plan=p.plan,
                          plan_summary=p.summary, samples_per_s=round(p.samples_per_s, 6),
                          equal_share_samples_per_s=round(p.equal_samples_per_s, 6)) for p in s.placed]}
    return write_atomic(path, yaml.safe_dump(data, sort_keys=False, width=120))


_PLACED = ("pool", "nodes", "devices", "plan", "plan_summary", "samples_per_s", "equal_share_samples_per_s")


def load_schedule(path: str | Path) -> Schedule:
    data = load_yaml(Path(path).read_text())
    if not isinstance(data, dict) or data.get("schedule_version") != SCHEDULE_VERSION:
        raise SchemaError("schedule_version", f"{path} is not an autopar schedule (version {SCHEDULE_VERSION})",
                          doc="schedule")
    try:
        pools = tuple(Pool(name=str(p["name"]), profile=str(p["profile"]), nodes=int(p["nodes"]),
                           devices_per_node=int(p["devices_per_node"])) for p in data["cluster"])
        entries = data["jobs"]
        jobs = parse_jobs([{k: v for k, v in e.items() if k not in _PLACED} for e in entries])
        placed = tuple(Placed(job=j, pool=str(e["pool"]), nodes=int(e["nodes"]), devices=int(e["devices"]),
                              plan=str(e["plan"]), summary=str(e.get("plan_summary", "")),
                              samples_per_s=float(e["samples_per_s"]),
                              equal_samples_per_s=float(e["equal_share_samples_per_s"]))
                       for j, e in zip(jobs, entries))
        return Schedule(pools=pools, policy=str(data["policy"]), fairness=float(data["fairness"]),
                        migration_cost=float(data["migration_cost"]), placed=placed,
                        plan_options=_plan_options(data.get("plan_options", {})))
    except (KeyError, TypeError, AttributeError) as e:
        raise SchemaError("", f"{path}: missing or malformed field ({e})", doc="schedule") from None


def move_commands(old: Placed, new: Placed, pool: Pool, old_dir: Path, new_dir: Path, checkpoint_root: str,
                  steps: str = "N") -> list[str]:
    """The commands that move a running job: stop it (its last checkpoint stays), re-plan it for its new allocation,
    and resume it from the checkpoint, resharded onto the new plan (README: replan and resume)."""
    old_plan, new_plan = old_dir / old.plan, new_dir / new.plan
    ckpt = f"{checkpoint_root.rstrip('/')}/{new.job.name}"
    from autopar.planner.cluster.pools import replan_profile

    replan = ["autopar", "replan", str(old_plan), "--nodes", str(new.nodes), "--cluster", replan_profile(pool),
              "--model", new.job.model, "-o", str(new_plan)]
    run = ["autopar", "run", str(new_plan), "--model", new.job.model, "--resume", "--checkpoint-dir", ckpt,
           "--steps", steps]
    return [shlex.join(replan), shlex.join(run)]



def _plan_options(d: Any) -> dict:
    if not isinstance(d, dict) or set(d) - {"dtype", "fused_kernels", "time_limit"}:
        raise SchemaError("plan_options", "must map dtype, fused_kernels and time_limit", doc="schedule")
    return dict(d)
