"""Which cluster profile a plan was made on, found again: for ``autopar replan`` and ``explain``.

A plan names its profile (``Plan.cluster``); when the profile was a file (measured by ``autopar profile`` or fitted by
``autopar calibrate``) the plan also records its path and content hash (``Plan.cluster_source``). Resolution order:
``--cluster`` if given; the recorded file if it still holds the same bytes (at its recorded path, or beside the plan
file, for a plan and profile moved together); the built-in profile of that name. Anything else is an error that says
what to pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from autopar.ir.plan import Plan, ProfileSource
from autopar.profiles.builtin import builtin_names, load_builtin, with_nodes
from autopar.profiles.hetero import BUILTIN_HETERO, HeteroProfile, load_cluster
from autopar.profiles.schema import ClusterProfile

__all__ = ["file_sha256", "plan_profile", "with_source"]


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _is_builtin(spec: str) -> bool:
    try:
        load_builtin(spec)
    except ValueError:
        return False
    return True


def with_source(plan: Plan, cluster: str | Path | None) -> Plan:
    """``plan`` recording ``cluster`` (the ``--cluster`` it was made with) when that is a profile file."""
    if cluster is None or _is_builtin(str(cluster)) or not Path(cluster).is_file():
        return plan
    path = Path(cluster).resolve()
    return dataclasses.replace(plan, cluster_source=ProfileSource(path=str(path), sha256=file_sha256(path)))


def plan_profile(plan: Plan, *, plan_path: str | Path | None = None, override: str | Path | None = None,
                 nodes: int | None = None) -> ClusterProfile | HeteroProfile:
    """The profile ``plan`` was made on (or ``override``), resized to ``nodes`` if given (see the module docstring);
    a heterogeneous one (:mod:`autopar.profiles.hetero`) is not resized.

    Raises ValueError naming the file and what to pass when it cannot be found or has changed."""
    if override is not None:
        return load_cluster(override, nodes)
    src = plan.cluster_source
    if src is not None:
        places = [Path(src.path)]
        if plan_path is not None:
            places.append(Path(plan_path).resolve().parent / Path(src.path).name)
        changed = []
        for p in places:
            if p.is_file():
                if file_sha256(p) == src.sha256:
                    prof = load_cluster(p)
                    return with_nodes(prof, nodes) if nodes and isinstance(prof, ClusterProfile) else prof
                changed.append(str(p))
        if changed:
            raise ValueError(f"the plan's cluster profile {changed[0]} has changed since the plan was made (its "
                             f"SHA-256 is no longer {src.sha256[:16]}...); pass --cluster {changed[0]} to use it as "
                             "it is now, or the file the plan was made with")
        raise ValueError(f"the plan's cluster profile {src.path} ({plan.cluster}) is gone; pass --cluster PROFILE "
                         "(a YAML from `autopar profile`, or a built-in: " + ", ".join(builtin_names()) + ")")
    if plan.cluster.lower() in BUILTIN_HETERO:
        return load_cluster(plan.cluster)
    if _is_builtin(plan.cluster):
        return load_builtin(plan.cluster, nodes)
    raise ValueError(f"the plan was made on cluster profile {plan.cluster!r}, which is not built in, and it does not "
                     "record the profile's file (plans made before it did); pass --cluster PROFILE.yaml")
