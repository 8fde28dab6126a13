"""Two runs resuming one checkpoint directory (issue 13): the second fails at once with a clear message, and the
first finishes with parameters bit-identical to a lone run resumed from a copy of the same checkpoint (2 gloo ranks,
gpt-tiny, dp=2)."""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.cli import main

pytestmark = pytest.mark.multiprocess


def _dp2_plan(path: Path) -> Path:
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=2, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    plan = make_plan(graph, dp=2, zero=0, micro_batch=2, model="gpt-tiny")
    ir.dump_plan(dataclasses.replace(plan, fused_kernels=False), path)
    return path


def test_second_resume_fails_at_once_and_the_first_is_undisturbed(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plan = str(_dp2_plan(tmp_path / "plan.yaml"))
    shared, lone = tmp_path / "shared", tmp_path / "lone"
    common = ["run", plan, "--model", "gpt-tiny", "--data", "step", "--timeout", "240"]
    assert main([*common, "--steps", "2", "--checkpoint-dir", str(shared)]) == 0
    shutil.copytree(shared, lone)
    capfd.readouterr()

    resume = [*common, "--steps", "4", "--resume"]
    first = subprocess.Popen([sys.executable, "-m", "autopar", *resume, "--checkpoint-dir", str(shared),
                              "--report", str(tmp_path / "first.json")],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while (shared / ".lock").read_text().strip() != str(first.pid):  # the first run holds the lock
            assert first.poll() is None, first.communicate()[0][-3000:]
            assert time.monotonic() < deadline
            time.sleep(0.2)
        t0 = time.perf_counter()
        rc = main([*resume, "--checkpoint-dir", str(shared), "--report", str(tmp_path / "second.json")])
        took = time.perf_counter() - t0
        err = capfd.readouterr().err
        assert rc == 2, err
        assert err.count("\n") == 1 and f"is in use by another run (pid {first.pid})" in err, err
        assert took < 10.0, took                      # fails at once: no torchrun started
        out = first.communicate(timeout=300)[0]
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 0, out[-4000:]
    assert not (tmp_path / "second.json").exists()

    assert main([*resume, "--checkpoint-dir", str(lone), "--report", str(tmp_path / "lone.json")]) == 0
    a = json.loads((tmp_path / "first.json").read_text())
    b = json.loads((tmp_path / "lone.json").read_text())
    assert a["start_step"] == b["start_step"] == 2 and len(a["losses"]) == 2
    assert a["param_sha256"] and a["param_sha256"] == b["param_sha256"]
    assert a["losses"] == b["losses"]
    assert sorted(p.name for p in shared.glob("step_*")) == ["step_00000002", "step_00000004"]
