"""``autopar profile`` -> ``autopar plan`` -> ``autopar run`` on this machine (2 CPU ranks, gpt-tiny): the planner's
plan runs under torchrun and the run logs loss and step time per step and measured vs predicted step time."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.cli import main

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

NUM = r"([-+\d.eE]+|nan|inf)"


def test_profile_plan_run_end_to_end(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    prof, plan_path = tmp_path / "prof.yaml", tmp_path / "plan.yaml"
    assert main(["profile", "--ranks", "2", "--quick", "--no-progress", "-o", str(prof)]) == 0
    assert main(["plan", "gpt-tiny", "--cluster", str(prof), "--global-batch", "8", "--dtype", "float32", "-q",
                 "-o", str(plan_path)]) == 0
    plan = ir.load_plan(plan_path)
    assert plan.world_size == 2 and plan.dtype == "float32" and plan.global_batch == 8
    capfd.readouterr()
    assert main(["run", str(plan_path), "--model", "gpt-tiny", "--steps", "3"]) == 0
    out = capfd.readouterr()
    text = out.out + out.err
    steps = re.findall(rf"step (\d+)\s+loss {NUM}\s+time {NUM} s", text)
    assert [int(s[0]) for s in steps] == [0, 1, 2], text[-3000:]
    losses, times = [float(s[1]) for s in steps], [float(s[2]) for s in steps]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert all(0 < t < 60 for t in times), times
    assert "fingerprint" not in text, text[-3000:]  # the worker found the graph the planner traced
    assert re.search(r"predicted s\s+measured s\s+ratio", text), text[-3000:]
    row = re.search(rf"^step\s+{NUM}\s+{NUM}\s+{NUM}$", text, re.M)
    assert row and float(row.group(1)) == pytest.approx(plan.time.total, rel=1e-3), text[-3000:]
    assert float(row.group(2)) > 0
    stage_rows = re.findall(rf"^stage (\d+)\s+{NUM}\s+{NUM}\s+{NUM}$", text, re.M)
    assert [int(r[0]) for r in stage_rows] == list(range(len(plan.stages)))
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in stage_rows), stage_rows


def test_run_rejects_a_plan_for_more_processes_than_one_node_starts(tmp_path: Path, capsys) -> None:
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=4, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    path = tmp_path / "plan.yaml"
    ir.dump_plan(make_plan(graph, dp=2, micro_batch=2), path)
    assert main(["run", str(path), "--model", "gpt-tiny", "--steps", "1", "--nproc", "1"]) == 2
    assert "needs 2 processes" in capsys.readouterr().err
