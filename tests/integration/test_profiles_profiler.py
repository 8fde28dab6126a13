"""The profiler, end to end on CPU: a quick 2-rank gloo run on tiny sizes, loaded back by the schema validator."""

from __future__ import annotations

import multiprocessing
import os

import pytest
import torch

from autopar.profiles import CostModel, load_profile
from autopar.profiles.profiler import default_message_sizes, run_profile_command
from autopar.profiles.schema import PIPELINE_CASES, pipeline_key


def test_default_message_sizes() -> None:
    full = default_message_sizes(quick=False)
    assert full[0] == 1024 and full[-1] == 64 * 2**20
    assert default_message_sizes(quick=True)[-1] == 16 * 2**20


@pytest.mark.multiprocess
def test_quick_profile_two_ranks(tmp_path) -> None:
    torch.set_num_threads(1)
    out = tmp_path / "machine.yaml"
    run_profile_command(
        out, ranks=2, quick=True, progress=False, threads_per_rank=1, matmul_sizes=(32, 64, 128),
        message_sizes=(1024, 16384, 262144), repeats=3, warmup=1, backend="gloo",
    )
    prof = load_profile(out)
    assert (prof.nodes, prof.devices_per_node) == (1, 2)
    assert set(prof.links) == {"intra_node"}
    assert {"float32", "bfloat16"} <= set(prof.device.peak_flops)
    cm = CostModel(prof)
    assert cm.collective_time("all_reduce", 2**20, 2) > cm.collective_time("all_reduce", 2**10, 2) > 0
    assert cm.matmul_time(m=128, n=128, k=128) > 0
    with pytest.raises(ValueError, match="inter_node"):
        cm.p2p_time(1024, intra_node=False)
    # the pipeline schedule's work per micro-batch and stage comes from two-stage schedules with their sends, per
    # schedule and micro-batch count: on gloo a stage waits for each activation and gradient, which a one-rank
    # schedule cannot show; and the loss sync is the one-float all-reduce after compute
    assert "two-stage schedules" in prof.device.sources["runtime_overhead"]
    assert {pipeline_key(*c) for c in PIPELINE_CASES} | {"loss_sync", "pipeline_resume"} <= \
        set(prof.device.runtime_overhead)
    # each case less the sends the simulator charges (clamped at 0: on a machine busy with other tests a case can
    # come out below the p2p table's latency, which was timed at another moment)
    cases = [cm.pipeline_overhead(*c) for c in PIPELINE_CASES]
    assert all(0 <= x < 0.1 for x in cases) and max(cases) > 0
    # a stage's compute resumed after each handover, per chunk slot, on top of every case (0 or more)
    resume = cm.runtime_overhead("pipeline_resume")
    assert 0 <= resume < 0.05
    assert cm.pipeline_overhead("1f1b", 8) == pytest.approx(cm.runtime_overhead("pipeline_microbatch") + resume)
    assert 0 < cm.loss_sync(2) < 0.1
    # gloo's collectives run on the ranks' own cores: overlapped with compute they take it; 2 one-thread ranks share
    # cores only on a one-core machine
    assert prof.device.overlap_slowdown == 1.0
    assert prof.device.shared_cores is None
    # CPU: non-matmul ops at their own measured rate (below the matmul peak on any CPU), causal attention per head dim
    assert 0 < prof.device.vector_flops < prof.device.peak_flops["float32"]
    curve = prof.device.causal_attention_efficiency
    assert {(q.head_dim, q.seq) for q in curve} == {(hd, s) for hd in (16, 64) for s in (32, 128, 512)}
    assert all(0 < q.efficiency <= 1 for q in curve)
    first = next(q for q in curve if (q.head_dim, q.seq) == (16, 32))
    assert cm.op_time(1e6, 0.0, "float32", "causal_attention", 32, 16) == pytest.approx(
        1e6 / (prof.device.peak_flops["float32"] * first.efficiency) + cm.op_overhead("attention"))


def _env_of_child(queue, name: str) -> None:  # noqa: ANN001 - a multiprocessing queue
    queue.put(os.environ.get(name))


@pytest.mark.multiprocess
def test_profiler_processes_fork_from_a_preloaded_server_with_the_callers_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The profiler's processes start from a fork server (which imported torch once), and run in the environment
    the caller has when it starts them, not the one the server started with."""
    from autopar.profiles.eager import process_context, with_env

    ctx = process_context()
    if "forkserver" not in multiprocessing.get_all_start_methods():
        assert ctx.get_start_method() == "spawn"
        return
    assert ctx.get_start_method() == "forkserver"
    queue = ctx.Queue()
    for value in ("first", "second"):  # the server is running by the second start: the variable is set after it
        monkeypatch.setenv("AUTOPAR_TEST_PROFILER_ENV", value)
        proc = ctx.Process(target=with_env, args=(dict(os.environ), _env_of_child, queue, "AUTOPAR_TEST_PROFILER_ENV"))
        proc.start()
        got = queue.get(timeout=120)
        proc.join()
        assert got == value and proc.exitcode == 0


@pytest.mark.multiprocess
def test_time_slicing_runs_the_miniature_step_or_a_models_own() -> None:
    """``time_concurrent``'s workload: the miniature training step, or a zoo model's training step (its op mix and
    working set, what the ranks of an oversubscribed node really switch between)."""
    from functools import partial

    from autopar.planner.calibrate import model_step
    from autopar.profiles.eager import time_concurrent

    assert time_concurrent(1, iters=20) > 0
    assert time_concurrent(2, workload=partial(model_step, "gpt-tiny", 16), iters=3) > 0
