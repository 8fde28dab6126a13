"""Heterogeneous cluster profiles: node groups of different device types and the link between the groups.

A :class:`HeteroProfile` is an ordered tuple of :class:`NodeGroup` s, each ``nodes`` identical nodes described by a
homogeneous :class:`~profiles.schema.ClusterProfile` (a built-in profile named by ``profile:``, a YAML file named by
path, or an inline ``cluster:`` mapping), plus ``inter_group``: the point-to-point link between a device of one
group and a device of another (one :class:`~profiles.schema.AlphaBeta` point, ``t = alpha + S / busbw``).  Groups are
in rank order: the first group's nodes hold the first global ranks.

YAML form (validated like every profile; unknown keys rejected, errors name the field)::

    schema_version: 1
    name: a100-h100
    source: "..."
    groups:
      - {name: a100, profile: dgx-a100-80gb, nodes: 16}
      - {name: h100, profile: dgx-h100, nodes: 16}
    inter_group: {alpha_s: 5.0e-6, busbw: 23.0e9, source: "..."}

A file without ``groups`` is a plain single-type profile and loads exactly as before (:func:`load_cluster` returns
the :class:`ClusterProfile`).  :func:`pools` gives a scheduler each group as a homogeneous profile of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from autopar.ir.limits import MAX_NODES, clip
from autopar.ir.safe_yaml import YamlLimitError, load_yaml
from autopar.profiles.builtin import BUILTIN_PROFILES, load_builtin, resolve_profile, with_nodes
from autopar.profiles.schema import (
    SCHEMA_VERSION,
    AlphaBeta,
    ClusterProfile,
    ProfileError,
    _alpha_beta,
    _fail,
    _int,
    _keys,
    _Loader,
    _mapping,
    _str,
    profile_from_dict,
)

__all__ = ["BUILTIN_HETERO", "NodeGroup", "HeteroProfile", "DevicePool", "hetero_from_dict", "loads_cluster",
           "load_cluster", "is_hetero", "pools"]

BUILTIN_HETERO: dict[str, str] = {"a100-h100": "a100-h100.yaml"}
"""Built-in heterogeneous profiles (YAML in ``profiles/builtin/``)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class NodeGroup:
    """``nodes`` identical nodes of one device type."""

    name: str
    """Group name (unique in the profile), e.g. 'a100'; plans tag their stages with it."""
    profile: ClusterProfile
    """The group as a homogeneous profile, already sized to ``nodes``."""
    ref: str = ""
    """The ``profile:`` reference it was loaded from (built-in name or path; '' when inline)."""

    @property
    def nodes(self) -> int:
        return self.profile.nodes

    @property
    def world_size(self) -> int:
        return self.profile.world_size


@dataclass(kw_only=True, slots=True, frozen=True)
class HeteroProfile:
    """A cluster of node groups of different device types (see the module docstring)."""

    schema_version: int
    name: str
    source: str
    groups: tuple[NodeGroup, ...]
    """In rank order."""
    inter_group: AlphaBeta
    """Point-to-point link between devices of different groups (``group_size`` 2)."""

    @property
    def nodes(self) -> int:
        return sum(g.nodes for g in self.groups)

    @property
    def world_size(self) -> int:
        return sum(g.world_size for g in self.groups)

    @property
    def devices_per_node(self) -> int | None:
        """Devices per node when every group has the same number, else None."""
        dpns = {g.profile.devices_per_node for g in self.groups}
        return dpns.pop() if len(dpns) == 1 else None

    def group(self, name: str) -> NodeGroup:
        for g in self.groups:
            if g.name == name:
                return g
        names = ", ".join(x.name for x in self.groups)
        raise KeyError(f"profile {self.name!r} has no group {name!r} (groups: {names})")

    def p2p_time(self, nbytes: float) -> float:
        """Time to send ``nbytes`` from a device of one group to a device of another."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be non-negative, got {nbytes}")
        return self.inter_group.alpha_s + nbytes / self.inter_group.busbw


class DevicePool(NamedTuple):
    """One device type's share of a cluster, for a scheduler: plan jobs on ``profile`` (or ``with_nodes`` of it)."""

    name: str
    profile: ClusterProfile
    """Homogeneous profile of the pool, sized to ``nodes``."""
    nodes: int


def is_hetero(profile: object) -> bool:
    return isinstance(profile, HeteroProfile)


def pools(profile: ClusterProfile | HeteroProfile) -> list[DevicePool]:
    """The cluster's pools of identical nodes: one per group of a heterogeneous profile, one for a plain profile."""
    if isinstance(profile, HeteroProfile):
        return [DevicePool(g.name, g.profile, g.nodes) for g in profile.groups]
    return [DevicePool(profile.name, profile, profile.nodes)]


def _group_profile(d: dict[str, Any], path: str, base: Path | None) -> tuple[ClusterProfile, str]:
    if ("profile" in d) == ("cluster" in d):
        raise _fail(path, "give exactly one of 'profile' (a built-in name or YAML path) and 'cluster' (inline)")
    if "cluster" in d:
        try:
            return profile_from_dict(d["cluster"]), ""
        except ProfileError as e:
            raise ProfileError(f"{path}.cluster.{e}") from None
    ref = _str(d["profile"], f"{path}.profile")
    if isinstance(ref, str) and ref.lower() in BUILTIN_HETERO:
        raise _fail(f"{path}.profile", "a group must be a single-type profile, not a heterogeneous one")
    try:
        if base is not None and not _is_builtin(ref) and not Path(ref).is_absolute():
            return resolve_profile(base / ref), ref
        return resolve_profile(ref), ref
    except (ValueError, ProfileError) as e:
        raise _fail(f"{path}.profile", str(e)) from None


def _is_builtin(ref: str) -> bool:
    try:
        load_builtin(ref)
    except ValueError:
        return False
    return True


def hetero_from_dict(data: Any, *, base: Path | None = None) -> HeteroProfile:
    """Validate a heterogeneous profile mapping; ``base``: the folder relative ``profile:`` paths start from."""
    d = _mapping(data, "<profile>")
    _keys(d, "", {"schema_version", "name", "groups", "inter_group"}, {"source"})
    if d["schema_version"] != SCHEMA_VERSION:
        raise _fail("schema_version", f"unsupported version {d['schema_version']!r} (this autopar reads "
                                      f"{SCHEMA_VERSION})")
    raw = d["groups"]
    if not isinstance(raw, list) or not raw:
        raise _fail("groups", "expected a non-empty list of {name, profile|cluster, nodes}")
    groups: list[NodeGroup] = []
    for i, x in enumerate(raw):
        p = f"groups[{i}]"
        g = _mapping(x, p)
        _keys(g, p, {"name", "nodes"}, {"profile", "cluster"})
        name = _str(g["name"], f"{p}.name")
        if not name or any(n.name == name for n in groups):
            raise _fail(f"{p}.name", f"group names must be non-empty and unique, got {clip(repr(name))}")
        nodes = _int(g["nodes"], f"{p}.nodes", maximum=MAX_NODES)
        prof, ref = _group_profile(dict(g), p, base)
        try:
            prof = with_nodes(prof, nodes)
        except (ValueError, ProfileError) as e:
            raise _fail(f"{p}.nodes", str(e)) from None
        groups.append(NodeGroup(name=name, profile=prof, ref=ref))
    if sum(g.nodes for g in groups) > MAX_NODES:
        raise _fail("groups", f"{sum(g.nodes for g in groups)} nodes in all is beyond autopar's limit of {MAX_NODES:,}")
    link = _alpha_beta({"group_size": 2, **_mapping(d["inter_group"], "inter_group")}, "inter_group", "inter_node",
                       "p2p")
    return HeteroProfile(schema_version=SCHEMA_VERSION, name=_str(d["name"], "name"),
                         source=_str(d.get("source", ""), "source"), groups=tuple(groups), inter_group=link)


def loads_cluster(text: str, *, origin: str = "<string>", base: Path | None = None
                  ) -> ClusterProfile | HeteroProfile:
    """A profile from YAML text: heterogeneous when it has ``groups``, else a plain :class:`ClusterProfile`."""
    try:
        data = load_yaml(text, loader=_Loader, max_nodes=100_000)
    except yaml.YAMLError as e:
        raise ProfileError(f"{origin}: not valid YAML: {clip(str(e).splitlines()[0])}") from None
    except YamlLimitError as e:
        raise ProfileError(f"{origin}: the YAML {e}") from None
    except RecursionError:
        raise ProfileError(f"{origin}: YAML nested too deeply to be a profile") from None
    if isinstance(data, dict) and "groups" in data:
        try:
            return hetero_from_dict(data, base=base)
        except ProfileError as e:
            raise ProfileError(f"{origin}: {e}") from None
    return profile_from_dict(data)


@cache
def _builtin(name: str) -> HeteroProfile:
    text = resources.files("autopar.profiles").joinpath("builtin", BUILTIN_HETERO[name]).read_text()
    prof = loads_cluster(text, origin=f"builtin:{name}")
    assert isinstance(prof, HeteroProfile)
    return prof


def load_cluster(spec: str | Path, nodes: int | None = None) -> ClusterProfile | HeteroProfile:
    """A built-in name or YAML path, homogeneous or heterogeneous. ``nodes`` resizes a homogeneous profile; a
    heterogeneous one fixes each group's nodes, so ``nodes`` must then be None or its total."""
    s = str(spec)
    if s.lower() in BUILTIN_HETERO:
        prof: ClusterProfile | HeteroProfile = _builtin(s.lower())
    elif s.lower() in BUILTIN_PROFILES or _is_builtin(s) or not Path(s).is_file():
        return resolve_profile(s, nodes)  # built-in, or the plain loader's "no such profile file"
    else:
        p = Path(s)
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError) as e:
            raise ProfileError(f"{p}: cannot read it as a profile ({clip(e, 120)})") from None
        try:
            prof = loads_cluster(text, origin=str(p), base=p.parent)
        except ProfileError as e:
            raise ProfileError(f"{e} (in {p})") from None
    if isinstance(prof, HeteroProfile):
        if nodes is not None and nodes != prof.nodes:
            raise ValueError(f"{prof.name} is a heterogeneous profile of {prof.nodes} nodes in groups "
                             f"({', '.join(f'{g.name}: {g.nodes}' for g in prof.groups)}); --nodes cannot resize it: "
                             "edit the groups' nodes in a copy of the profile")
        return prof
    return prof if nodes is None else with_nodes(prof, nodes)
