"""A failed run ends in one line naming the rank and the cause (a full disk first), and ``--timeout`` stops a hung
run within a few seconds of the limit (issue 13; 2 gloo ranks, gpt-tiny)."""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.cli import main

pytestmark = pytest.mark.multiprocess


@pytest.fixture()
def plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    from autopar.zoo import build

    from harness import make_plan

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    spec = build("gpt-tiny", batch=2, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    path = tmp_path / "plan.yaml"
    ir.dump_plan(dataclasses.replace(make_plan(graph, dp=2, micro_batch=1, model="gpt-tiny"), fused_kernels=False),
                 path)
    return str(path)


def test_worker_failure_is_one_line_naming_rank_and_cause(plan: str, capfd: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", plan, "--model", "gpt-tiny", "--steps", "3", "--step-hook", "fault_hooks:disk_full",
               "--timeout", "240"])
    err = capfd.readouterr().err
    last = err.rstrip("\n").splitlines()[-1]
    assert rc == 2, err[-3000:]
    assert last.startswith("autopar: error: rank 1 failed: OSError: [Errno 28] No space left on device"), last


def test_the_first_rank_to_fail_is_named_not_the_peers_it_took_down(plan: str,
                                                                      capfd: pytest.CaptureFixture[str]) -> None:
    rc = main(["run", plan, "--model", "gpt-tiny", "--steps", "3", "--step-hook", "fault_hooks:crash",
               "--timeout", "240"])
    err = capfd.readouterr().err
    last = err.rstrip("\n").splitlines()[-1]
    assert rc == 2, err[-3000:]
    assert last.startswith("autopar: error: rank 1 failed: RuntimeError: injected fault after step 1"), last
    assert err.count("[rank1]: RuntimeError: injected fault after step 1") == 1, err[-4000:]  # its traceback, once


def test_timeout_is_exact_within_a_few_seconds(plan: str, capfd: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    rc = main(["run", plan, "--model", "gpt-tiny", "--steps", "3", "--step-hook", "fault_hooks:hang",
               "--timeout", "12"])
    took = time.monotonic() - t0
    err = capfd.readouterr().err
    assert rc == 124, err[-3000:]
    assert 12 <= took < 18, took
    assert "did not finish within 12 s" in err.splitlines()[-1], err[-2000:]
