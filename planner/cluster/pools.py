"""A pool's cluster profile at a node count, and the content hash that keys its curve points."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from functools import lru_cache

from autopar.planner.cluster.jobs import Pool
from autopar.profiles.builtin import resolve_profile
from autopar.profiles.schema import ClusterProfile, profile_to_dict

__all__ = ["pool_profile", "profile_hash"]


@lru_cache(maxsize=64)
def _base(spec: str) -> ClusterProfile:
    return resolve_profile(spec)


def pool_profile(pool: Pool, nodes: int | None = None) -> ClusterProfile:
    """``pool``'s profile (one node of it unless ``nodes`` is given)."""
    from autopar.profiles.builtin import with_nodes

    base = _base(pool.profile)
    return with_nodes(base, nodes or 1)


def profile_hash(profile: ClusterProfile) -> str:
    """SHA-256 of the profile's content at one node (its node count is a separate part of a curve point's key)."""
    data = profile_to_dict(dataclasses.replace(profile, nodes=1))
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()
