"""A synthetic cluster of CPU processes for the shared-cluster tests: ``nodes`` nodes of one CPU process each."""

from __future__ import annotations

from pathlib import Path

from autopar.profiles import AlphaBeta, ClusterProfile, DeviceProfile, EfficiencyPoint, LinkProfile, save_profile
from autopar.profiles.cost import COLLECTIVES

__all__ = ["cpu_ranks_profile"]


def cpu_ranks_profile(path: Path, nodes: int = 4) -> Path:
    """Write, at ``path``, a profile of ``nodes`` nodes of one CPU process each: slow compute, links fast enough that
    two ranks train a small MLP faster than one (so small zoo jobs gain from a second node)."""
    def link(level: str) -> LinkProfile:
        return LinkProfile(level=level, **{k: tuple(AlphaBeta(group_size=g, alpha_s=1e-5, busbw=1e10)  # type: ignore
                                                    for g in ((2,) if k == "p2p" else (2, 4))) for k in COLLECTIVES})

    dev = DeviceProfile(name="cpu-rank", memory_bytes=4 * 2**30, peak_flops={"float32": 2e8, "bfloat16": 2e8},
                        matmul_efficiency={"default": (EfficiencyPoint(flops=1e5, efficiency=0.5),
                                                       EfficiencyPoint(flops=1e8, efficiency=1.0))},
                        memory_bandwidth=1e10, launch_overhead_s=1e-6, vector_flops=1e9)
    save_profile(ClusterProfile(schema_version=1, name="cpu-ranks", source="synthetic: one CPU process per node",
                                nodes=nodes, devices_per_node=1, device=dev,
                                links={"intra_node": link("intra_node"), "inter_node": link("inter_node")}), path)
    return path
