"""DTensor's eager cost of one tensor-parallel resharding, measured on the host (``runtime_overhead["redistribute"]``).

Under tensor parallelism every conversion of a value between placements (``Shard -> Replicate`` all-gathers,
``Partial -> Replicate`` all-reduces, ``Replicate -> Shard`` local slices) is a ``DTensor.redistribute`` call: the
transform planning, the functional collective's wrapping, the autograd function and its backward.  On CPU ranks
this is ~100-190 us per conversion and pass on this project's 2-core VM, against ~6 us for a plain tiny op, and a
sequence-sharded plan reshards ~30 times per step of a 2-layer model: milliseconds that neither the link table (the
bare ``c10d`` call) nor the per-op DTensor dispatch (``dtensor_op_overhead``) holds.

It is measured in a process of its own on a fake two-rank process group (``torch.testing``'s ``FakeStore``: every
collective returns at once), so that what is timed is DTensor's work alone: forward and backward of a tiny tensor
resharded, less the same tensor passed through unconverted, per pass (half a forward + backward), averaged over the
conversions above, in units of the same process's per-pass op cost (``launch_overhead_s``).  Costed by
:meth:`autopar.profiles.cost.CostModel.redistribute_overhead` for every conversion the tensor-parallel solver charges.
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

import torch

from autopar.profiles.eager import (
    _paired_extra,
    _training_op_overhead,
    in_own_process,
    measure_one_rank_overheads,
)

__all__ = ["measure_redistribute_overhead", "measure_runtime_overheads"]

log = logging.getLogger(__name__)


def _redistribute_worker(queue: Any, threads: int, repeats: int) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:  # a torch without its testing package: not measured
        queue.put(None)
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        queue.put(_measure(repeats))
    except Exception:  # noqa: BLE001 - DTensor cannot run the conversions here: not measured (the caller logs it)
        queue.put(None)
    finally:
        dist.destroy_process_group()


def _measure(repeats: int) -> float:
    """Per-pass extra of each conversion over the same tensor unconverted, averaged, in per-pass op costs."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    cpu, sync = torch.device("cpu"), (lambda: None)
    per_pass = _training_op_overhead(cpu, sync, repeats)
    mesh = DeviceMesh("cpu", [0, 1])
    extras = []
    for src, dst in ((Shard(0), Replicate()), (Partial(), Replicate()), (Replicate(), Shard(0))):
        leaf = torch.ones(8, 8, requires_grad=True)

        def converted(src: Any = src, dst: Any = dst, leaf: torch.Tensor = leaf) -> None:
            DTensor.from_local(leaf, mesh, [src]).redistribute(mesh, [dst]).to_local().sum().backward()

        def kept(src: Any = src, leaf: torch.Tensor = leaf) -> None:
            DTensor.from_local(leaf, mesh, [src]).to_local().sum().backward()

        extras.append(_paired_extra(converted, kept, sync, repeats) / 2)
    return statistics.mean(extras) / per_pass


def measure_redistribute_overhead(*, threads: int = 1, repeats: int = 5) -> float | None:
    """DTensor's eager work per resharding and pass, in units of the per-pass op cost (see the module docstring);
    None where torch has no fake process group to measure it on or DTensor cannot run the conversions there."""
    got = in_own_process(_redistribute_worker, threads, repeats, timeout=300.0)
    if got is None:
        log.warning("DTensor's resharding cost is not measured (no fake process group to time it on)")
    return got


def measure_runtime_overheads(*, threads: int = 1, repeats: int = 5) -> tuple[dict[str, float], dict[str, float]]:
    """The ``runtime_overhead`` and ``dtensor_op_overhead`` tables of a CPU profile: the runtime's eager work in a
    one-rank process group (:func:`autopar.profiles.eager.measure_one_rank_overheads`), DTensor's resharding
    (:func:`measure_redistribute_overhead`, ``redistribute``; left out where it cannot be measured) and the training
    loop's fixed work per step (:func:`autopar.profiles.loop.measure_step_overhead`, ``step``)."""
    from autopar.profiles.loop import measure_step_overhead

    runtime, sharded = measure_one_rank_overheads(threads=threads, repeats=repeats)
    if (redistribute := measure_redistribute_overhead(threads=threads, repeats=repeats)) is not None:
        runtime["redistribute"] = redistribute
    runtime["step"] = measure_step_overhead(threads=threads, repeats=repeats)
    return runtime, sharded
