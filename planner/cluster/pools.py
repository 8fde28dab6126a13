"""A pool's cluster profile at a node count, and the content hash that keys its curve points."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache

from autopar.planner.cluster.jobs import Pool
from autopar.profiles.builtin import resolve_profile
from autopar.profiles.schema import ClusterProfile, profile_to_dict

__all__ = ["pool_profile", "profile_hash", "replan_profile"]


@lru_cache(maxsize=64)
def _base(spec: str) -> ClusterProfile:
    """A pool's profile: a built-in name or YAML path, or ``SPEC#GROUP``, a group of a heterogeneous profile."""
    from autopar.profiles.hetero import load_cluster

    if "#" in spec:
        whole, _, group = spec.rpartition("#")
        prof = load_cluster(whole)
        if not hasattr(prof, "group"):
            raise ValueError(f"pool profile {spec!r}: {whole} is not a heterogeneous profile")
        return prof.group(group).profile  # type: ignore[union-attr]
    return resolve_profile(spec)


def replan_profile(pool: Pool) -> str:
    """What ``autopar replan --cluster`` takes for this pool: the group's own profile reference when it has one."""
    if "#" not in pool.profile:
        return pool.profile
    from autopar.profiles.hetero import load_cluster

    whole, _, group = pool.profile.rpartition("#")
    return load_cluster(whole).group(group).ref or pool.profile  # type: ignore[union-attr]


def pool_profile(pool: Pool, nodes: int | None = None) -> ClusterProfile:
    """``pool``'s profile (one node of it unless ``nodes`` is given)."""
    from autopar.profiles.builtin import with_nodes

    base = _base(pool.profile)
    return with_nodes(base, nodes or 1)


def profile_hash(profile: ClusterProfile) -> str:
    """SHA-256 of the profile's content at one node (its node count is a separate part of a curve point's key)."""
    data = profile_to_dict(dataclasses.replace(profile, nodes=1))
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
