"""autopar profiles: what the hardware costs.

- :mod:`autopar.profiles.schema`: the cluster profile dataclasses, YAML load/save and validation.
- :mod:`autopar.profiles.builtin`: built-in profiles (DGX A100 80GB, DGX H100, HGX H200) and ``with_nodes``.
- :mod:`autopar.profiles.hetero`: heterogeneous clusters (node groups of several device types, built-in
  ``a100-h100``), ``load_cluster`` for either kind and ``pools`` (each group as a homogeneous profile).
- :mod:`autopar.profiles.cost`: the cost model (op, collective and p2p times).
- :mod:`autopar.profiles.fit`: alpha-beta least-squares fitting.
- :mod:`autopar.profiles.profiler`: ``autopar profile`` (measures this machine).
"""

from autopar.profiles.builtin import builtin_names, load_builtin, resolve_profile, with_nodes
from autopar.profiles.cost import CostModel, GroupSpan, collective_factor, group_span
from autopar.profiles.hetero import DevicePool, HeteroProfile, NodeGroup, load_cluster, pools
from autopar.profiles.schema import (
    COLLECTIVES,
    SCHEMA_VERSION,
    AlphaBeta,
    ClusterProfile,
    DeviceProfile,
    EfficiencyPoint,
    LinkProfile,
    ProfileError,
    dump_profile,
    load_profile,
    loads_profile,
    profile_from_dict,
    profile_to_dict,
    save_profile,
)

__all__ = [
    "COLLECTIVES",
    "SCHEMA_VERSION",
    "AlphaBeta",
    "ClusterProfile",
    "CostModel",
    "DevicePool",
    "DeviceProfile",
    "EfficiencyPoint",
    "GroupSpan",
    "HeteroProfile",
    "LinkProfile",
    "NodeGroup",
    "ProfileError",
    "builtin_names",
    "collective_factor",
    "dump_profile",
    "group_span",
    "load_builtin",
    "load_cluster",
    "load_profile",
    "loads_profile",
    "pools",
    "profile_from_dict",
    "profile_to_dict",
    "resolve_profile",
    "save_profile",
    "with_nodes",
]
