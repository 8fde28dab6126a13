"""What a CPU training step's synchronizations cost, measured as the runtime meets them (gloo ranks).

Two of the runtime's per-step costs depend on how the ranks wait for each other, which no alpha-beta point of an
isolated collective describes on ranks that share cores:

- the pipeline schedule's work per micro-batch slot (``torch.distributed.pipelining``'s bookkeeping and its waits
  for each activation and gradient), which on gloo grows with the number of micro-batches and differs between
  schedules: per slot, ~200-350 us for GPipe with one micro-batch against ~500-650 us for 1F1B with eight,
  ~750-950 us for GPipe with eight and ~0.9-1.7 ms per chunk slot for interleaved 1F1B, two ranks on this project's
  2-core VM (``benchmarks/cpu_sync_costs.py``).
  :func:`pipeline_overheads` times each case of :data:`autopar.profiles.schema.PIPELINE_CASES` on every rank pair
  at once (a pp=2 x dp=2 plan runs two pipelines at once);
- the training loop's loss sync, an all-reduce of one float over every rank after the step's compute
  (:func:`loss_sync_under_load`): gloo takes another path for one element than for the profile's 1 KiB..16 MiB
  points, and ranks that arrive from compute wait for each other to be scheduled.  Here: 0.4-0.7 ms on 2 ranks and
  1.3-2.6 ms on 4, where the all-reduce table's latency, fitted over 1 KiB..16 MiB, says 0.4-0.6 and 5-5.5 ms.

With the schedules, :func:`resume_penalty` times what a stage's compute loses when it resumes after each wait for
its neighbour (``pipeline_resume``, per chunk slot), which the schedules' tiny probe cannot show.

Both are stored in ``DeviceProfile.runtime_overhead`` (``pipeline_<schedule>_<m>``, ``loss_sync``) and costed by
:meth:`autopar.profiles.cost.CostModel.pipeline_overhead` and :meth:`~autopar.profiles.cost.CostModel.loss_sync`.
"""

from __future__ import annotations

import os
import statistics
import time
from typing import Any

import torch

from autopar.profiles.eager import _time_calls, pipeline_overhead_two_ranks
from autopar.profiles.schema import PIPELINE_CASES, pipeline_key

__all__ = ["REFERENCE_CASE", "handover_speedup", "loss_sync_under_load", "per_call_s", "pipeline_overheads",
           "resume_penalty", "slowest"]

REFERENCE_CASE = ("1f1b", 8)
"""The case ``runtime_overhead["pipeline_microbatch"]`` holds (the one case profiles measured before the table)."""


def pipeline_overheads(device: torch.device, rank: int, repeats: int, group: Any = None,
                       p2p_s: float = 0.0) -> dict[str, float]:
    """Seconds per micro-batch slot of each two-stage schedule of :data:`PIPELINE_CASES` on the pair of ranks
    ``group`` (``rank`` 0 or 1 within it; every pair of the world runs at once), keyed by :func:`pipeline_key`
    (:func:`autopar.profiles.eager.pipeline_overhead_two_ranks`, less the sends the simulator charges at
    ``p2p_s`` each), and ``pipeline_resume`` (:func:`resume_penalty`).  Both ranks of every pair call it; rank 0's
    numbers are the pair's."""
    out = {pipeline_key(kind, m): pipeline_overhead_two_ranks(device, rank, repeats, group, m, p2p_s, kind)
           for kind, m in PIPELINE_CASES}
    return {**out, "pipeline_resume": resume_penalty(device, rank, min(repeats, 15), group)}


def resume_penalty(device: torch.device, rank: int, repeats: int, group: Any = None, iters: int = 12) -> float:
    """Seconds a pipeline stage's compute takes beyond its time run back to back, per chunk slot (a forward and a
    backward), when each pass resumes after waiting for the neighbour, as on gloo every stage waits for each
    activation and gradient.  On a 2-core VM gpt-tiny's and llama-tiny's halves, handed over between two ranks, lost
    0.13 ms per slot at batch 2 (~1 ms of compute, +13%), 0.55-0.75 ms at batch 8 (~2-2.6 ms, +25-35%) and 0.2-0.8
    ms at batch 32 (~7 ms): it grows with the stage's working set and then levels off, and a slot costs it whatever
    its op count, which the pipeline schedules' tiny probe (:func:`autopar.profiles.eager.pipeline_overhead_two_ranks`)
    has too little compute to show.

    The probe: two small transformer layers (d=64, seq 32, batch 4, ~2.5 ms forward + backward here; 0.13-0.34 ms
    per slot in five profiles, so stages with more activations than it are under-charged).  Rank 0 runs the
    forward, hands over to rank 1 (forward and backward), then runs the backward (the two-stage order of one
    micro-batch), against the same passes back to back on both ranks at once: the median over ``repeats`` adjacent
    pairs of ``iters`` slots each, both ranks' mean.
    Every pair of the world runs it at once; where the ranks outnumber the cores, the back-to-back passes (all ranks
    computing) run slower than in the handover (half of them computing) by what the schedule simulator's processor
    sharing already gives (:class:`autopar.planner.inter_op.schedule.SharedCores`), so that ratio is taken out first."""
    import torch.distributed as dist

    torch.manual_seed(0)
    net = torch.nn.Sequential(*[torch.nn.TransformerEncoderLayer(64, 4, 256, dropout=0.0, batch_first=True)
                                for _ in range(2)]).to(device)
    x = torch.randn(4, 32, 64, device=device)
    peer = 1 - rank if group is None else dist.get_global_rank(group, 1 - rank)
    token = torch.zeros(1, device=device)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 0
    sharing = handover_speedup(dist.get_world_size(), cpus / max(torch.get_num_threads(), 1))

    def chunk() -> None:
        net(x).sum().backward()

    def back_to_back() -> float:  # the median of ``iters`` single passes
        return _time_calls(chunk, lambda: None, iters, 1, warmup=0)

    def handed_over() -> float:
        busy = 0.0
        for _ in range(iters):
            if rank == 0:
                t0 = time.perf_counter()
                y = net(x).sum()
                busy += time.perf_counter() - t0
                dist.send(token, peer, group=group)
                dist.recv(token, peer, group=group)
                t0 = time.perf_counter()
                y.backward()
            else:
                dist.recv(token, peer, group=group)
                t0 = time.perf_counter()
                chunk()
            busy += time.perf_counter() - t0
            if rank == 1:
                dist.send(token, peer, group=group)
        return busy / iters

    back_to_back()
    handed_over()
    pairs = []
    for _ in range(max(repeats, 1)):
        dist.barrier(group=group)
        warm = back_to_back()
        dist.barrier(group=group)
        pairs.append(handed_over() - warm / sharing)
    mean = torch.tensor([statistics.median(pairs)], dtype=torch.float64)
    dist.all_reduce(mean, group=group)
    return max(mean.item() / 2, 0.0)


def handover_speedup(ranks: float, cores: float) -> float:
    """How many times faster a rank computes while half of the node's ``ranks`` do (a two-stage pipeline's
    handover) than while all of them do, on ``cores`` cores' worth of compute (processor sharing, as
    :class:`autopar.planner.inter_op.schedule.SharedCores` has it): 1 when the ranks have a core each."""
    if cores <= 0:
        return 1.0
    return max(1.0, ranks / cores) / max(1.0, ranks / 2 / cores)


def slowest(seconds: float, group: Any = None) -> float:
    """The largest of every rank's ``seconds`` in ``group`` (all its ranks call it)."""
    import torch.distributed as dist

    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.item()


def per_call_s(fn: Any, calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn`` after a barrier, the slowest rank's (every rank of
    the default group calls it)."""
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return slowest((time.perf_counter() - t0) / calls)


def loss_sync_under_load(repeats: int = 3, calls: int = 50, compute_s: float = 1e-3) -> float:
    """Seconds one all-reduce of one float over every rank adds to an iteration in which every rank first computes
    for about ``compute_s`` (matmuls), as a training step's loss sync follows its compute: the median over
    ``repeats`` windows of ``calls`` iterations (the slowest rank's) less the same windows without the all-reduce.
    Every rank of the default group calls it."""
    import torch.distributed as dist

    x, a = torch.ones(1), torch.randn(128, 128)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    reps = max(1, round(compute_s / max((time.perf_counter() - t0) / 10, 1e-7)))
    n = torch.tensor([reps], dtype=torch.float64)
    dist.all_reduce(n, op=dist.ReduceOp.MAX)  # every rank the same work

    def compute() -> None:
        for _ in range(int(n.item())):
            a @ a

    def loaded() -> None:
        compute()
        dist.all_reduce(x)

    for fn in (compute, loaded):  # warm-up
        for _ in range(5):
            fn()
    # adjacent pairs: the machine's speed, which moves over seconds, cancels in each difference
    pairs = [per_call_s(loaded, calls) - per_call_s(compute, calls) for _ in range(max(repeats, 1))]
    return max(statistics.median(pairs), 0.0)
