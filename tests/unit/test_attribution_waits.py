"""The calibration hook names the waits the profiler would otherwise count as compute: the program's per-step loss
all-reduce (waiting for the slowest rank: idle), the pipeline schedule's p2p waits inside its forward/backward
actions (the bubble: p2p) and every blocking ``Work.wait()`` (in the category of what encloses it, or of the call it
follows).  Synthetic events; :func:`instrument` is checked to wrap and restore."""

from __future__ import annotations

import pytest

from autopar.planner.run.attribution import LOSS_SYNC, P2P_WAIT, WAIT, attribute, category, instrument


def test_named_waits_are_categorised() -> None:
    assert category(LOSS_SYNC) == "idle"
    assert category(P2P_WAIT) == "p2p"
    # a forward action of the schedule (uncategorised: compute) that waits 6 ms for its input; a loss sync of 2 ms
    events = [("PP:2F0", 0.000, 0.010, None), (P2P_WAIT, 0.001, 0.007, 0), ("aten::linear", 0.007, 0.009, 0),
              (LOSS_SYNC, 0.010, 0.012, None), ("c10d::allreduce_", 0.010, 0.0105, 3)]
    got = attribute(events, 0.012, 1)
    assert got["p2p"] == pytest.approx(0.006)
    assert got["idle"] == pytest.approx(0.002)
    assert got["comm"] == 0.0  # the all-reduce inside the loss sync is part of that wait
    assert got["compute"] == pytest.approx(0.004)


def test_work_waits_take_the_category_of_their_call() -> None:
    events = [("c10d::barrier", 0.000, 0.001, None), (WAIT, 0.001, 0.004, None),  # barrier wait: idle
              ("FSDP::all_gather_copy_out", 0.004, 0.010, None), (WAIT, 0.004, 0.007, 2),  # FSDP2's gather wait
              ("c10d::allreduce_", 0.010, 0.011, None), (WAIT, 0.011, 0.013, None),  # a synchronous collective
              ("aten::add", 0.013, 0.014, None), (WAIT, 0.014, 0.015, None)]  # a wait after compute: comm
    got = attribute(events, 0.015, 1)
    assert got["idle"] == pytest.approx(0.004)
    assert got["comm"] == pytest.approx(0.003 + 0.003 + 0.001)
    assert got["compute"] == pytest.approx(0.015 - 0.004 - 0.007)


def test_instrument_wraps_and_restores() -> None:
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from autopar.codegen.runtime.program import ParallelProgram

    work = dist.distributed_c10d.Work
    wait, reduce, work_wait = schedules._wait_batch_p2p, ParallelProgram._reduce_loss, work.wait
    undo = instrument()
    try:
        assert schedules._wait_batch_p2p is not wait and ParallelProgram._reduce_loss is not reduce
        assert work.wait is not work_wait
        schedules._wait_batch_p2p([])  # still waits (on nothing) through the original
    finally:
        undo()
    assert schedules._wait_batch_p2p is wait and ParallelProgram._reduce_loss is reduce and work.wait is work_wait


def test_fit_observes_collectives_without_the_wait_for_the_straggler() -> None:
    from autopar.planner.calibrate import RunMeasurement, measured_observation

    def rank(compute: float, comm: float) -> dict[str, float]:
        return {"compute": compute, "comm": comm, "p2p": 0.0, "idle": 0.0, "optimizer": 0.001,
                "matmul": compute / 2, "step": 0.012}

    ranks = [rank(0.010, 0.001), rank(0.006, 0.0055)]  # rank 1 waits 4.5 ms in the collective for rank 0
    dp = RunMeasurement(plan_path="x.yaml", model="m", mesh=(1, 2, 1), step_s=0.012, ranks=ranks)
    assert measured_observation(dp) == pytest.approx([0.006, 0.003, 0.001, 0.001, 0.012])  # busiest: rank 1
    pp = RunMeasurement(plan_path="x.yaml", model="m", mesh=(2, 1, 1), step_s=0.012, ranks=ranks)
    assert measured_observation(pp) == pytest.approx([0.006, 0.003, 0.0055, 0.001, 0.012])  # the busiest's
