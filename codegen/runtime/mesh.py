"""The device mesh of a plan: ``init_device_mesh`` with named axes (pp, dp, cp, tp), tp innermost."""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar import ir

__all__ = ["build_mesh", "default_device", "MESH_DIMS"]

log = logging.getLogger(__name__)

MESH_DIMS: tuple[str, str, str, str] = ("pp", "dp", "cp", "tp")


def default_device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def build_mesh(plan: ir.Plan, device: torch.device) -> DeviceMesh:
    """A 4-D mesh ``(pp, dp, cp, tp)`` over the initialized default process group.

    ``init_device_mesh`` lays ranks out row-major, so rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i, exactly
    :meth:`autopar.ir.MeshPlan.rank`: a tp group is consecutive ranks."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialized: run under torchrun (or call "
                           "dist.init_process_group) before building a parallel program")
    world = dist.get_world_size()
    if world != plan.mesh.world_size:
        raise ValueError(f"the plan needs {plan.mesh.world_size} processes (pp={plan.mesh.pp} x dp={plan.mesh.dp} "
                         f"x cp={plan.mesh.cp} x tp={plan.mesh.tp}) but {world} are running; launch with --nproc-per-node "
                         f"{plan.mesh.world_size} or re-plan")
    m = plan.mesh
    mesh = init_device_mesh(device.type, (m.pp, m.dp, m.cp, m.tp), mesh_dim_names=MESH_DIMS)
    coords = m.coords(dist.get_rank())
    got = tuple(mesh.get_local_rank(d) for d in MESH_DIMS)
    assert got == coords, f"mesh coordinates {got} differ from the plan's rank layout {coords}"
    return mesh
