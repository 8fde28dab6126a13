"""Built-in cluster profiles (YAML files in ``profiles/builtin/``, every number with its source)."""

from __future__ import annotations

import dataclasses
from functools import lru_cache
from importlib import resources
from pathlib import Path

from autopar.ir.limits import MAX_NODES
from autopar.profiles.schema import ClusterProfile, ProfileError, load_profile, loads_profile

__all__ = ["BUILTIN_PROFILES", "builtin_names", "load_builtin", "with_nodes", "resolve_profile"]

BUILTIN_PROFILES: dict[str, str] = {
    "dgx-a100-80gb": "dgx-a100-80gb.yaml",
    "dgx-h100": "dgx-h100.yaml",
    "h200": "h200.yaml",
}
_ALIASES = {"a100": "dgx-a100-80gb", "dgx-a100": "dgx-a100-80gb", "h100": "dgx-h100", "hgx-h200": "h200"}


def builtin_names() -> list[str]:
    """Names accepted by :func:`load_builtin` (aliases excluded)."""
    return sorted(BUILTIN_PROFILES)


@lru_cache(maxsize=None)
def _load(name: str) -> ClusterProfile:
    text = resources.files("autopar.profiles").joinpath("builtin", BUILTIN_PROFILES[name]).read_text()
    return loads_profile(text, origin=f"builtin:{name}")


def load_builtin(name: str, nodes: int | None = None) -> ClusterProfile:
    """The built-in profile ``name`` (one node unless ``nodes`` is given)."""
    key = _ALIASES.get(name.lower(), name.lower())
    if key not in BUILTIN_PROFILES:
        raise ValueError(f"unknown built-in profile {name!r}; choose one of {', '.join(builtin_names())}")
    prof = _load(key)
    return prof if nodes is None else with_nodes(prof, nodes)


def with_nodes(profile: ClusterProfile, nodes: int) -> ClusterProfile:
    """A copy of ``profile`` with ``nodes`` nodes; per-node hardware and links stay the same."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
    if nodes > MAX_NODES:
        raise ValueError(f"nodes {nodes} is beyond autopar's limit of {MAX_NODES:,}; check the value")
    if nodes > 1 and "inter_node" not in profile.links:
        raise ProfileError(
            f"links.inter_node: profile {profile.name!r} has no inter-node link level, so it cannot be scaled to "
            f"{nodes} nodes; add an inter_node section (e.g. copied from a built-in profile)"
        )
    return dataclasses.replace(profile, nodes=nodes)


def resolve_profile(spec: str | Path, nodes: int | None = None) -> ClusterProfile:
    """A built-in name or a path to a YAML profile, optionally resized to ``nodes`` nodes."""
    s = str(spec)
    key = _ALIASES.get(s.lower(), s.lower())
    prof = _load(key) if key in BUILTIN_PROFILES else load_profile(s)
    return prof if nodes is None else with_nodes(prof, nodes)
