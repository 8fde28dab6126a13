"""Tier (c): checkpoint/resume through the product, ``autopar run`` and ``autopar replan`` (2 gloo ranks, gpt-tiny).

(a) A rank is killed after step 5 of 6 (``tests/faults.py`` through ``--step-hook``) under
    ``autopar run --max-restarts 1 --checkpoint-dir D --save-every 2``: torchrun restarts the group, the workers
    resume from step 4, and the final parameters equal an uninterrupted run's bit for bit (per-parameter SHA-256 of
    the gathered model-layout tensors in ``--report``).
(b) A run under a planned dp=2 plan saves at step 2; ``autopar replan --pin tp=2`` makes a tensor-parallel plan for
    the same 2 ranks, and ``autopar run plan2 --resume --steps 2`` loads the checkpoint into it (resharded: FSDP
    shards -> Megatron column/row shards) with parameters equal to the saved ones.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

from autopar import ir
from autopar.planner.cli import main

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

TIMEOUT = ["--timeout", "240"]


@pytest.fixture(autouse=True)
def _env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("FAULT_KILL_AT_STEP", raising=False)
    monkeypatch.delenv("FAULT_KILL_RANK", raising=False)


def _dp2_plan(path: Path) -> Path:
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=2, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    plan = make_plan(graph, dp=2, zero=3, micro_batch=2, model="gpt-tiny")
    ir.dump_plan(dataclasses.replace(plan, fused_kernels=False), path)  # eager: no interpreted Triton under pytest
    return path


def _report(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def test_killed_rank_resumes_through_autopar_run(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    plan = str(_dp2_plan(tmp_path / "plan.yaml"))
    common = ["run", plan, "--model", "gpt-tiny", "--steps", "6", "--data", "step", *TIMEOUT]
    assert main([*common, "--report", str(tmp_path / "ref.json")]) == 0
    ref = _report(tmp_path / "ref.json")
    capfd.readouterr()

    ckpt = tmp_path / "ckpt"
    monkeypatch.setenv("FAULT_KILL_AT_STEP", "5")
    monkeypatch.setenv("FAULT_KILL_RANK", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                      os.environ.get("PYTHONPATH", "")]))
    rc = main([*common, "--report", str(tmp_path / "killed.json"), "--checkpoint-dir", str(ckpt),
               "--save-every", "2", "--max-restarts", "1", "--step-hook", "faults:kill_rank"])
    out = capfd.readouterr()
    text = out.out + out.err
    assert rc == 0, text[-4000:]
    assert "fault injection: rank 1 exits after 5 steps" in text, text[-4000:]
    assert re.search(r"resumed from step 4 .*after torchrun restart 1", text), text[-4000:]
    steps = [int(s) for s in re.findall(r"^step (\d+)\s+loss", text, re.M)]
    assert steps == [0, 1, 2, 3, 4, 4, 5], steps      # step index 4 (the 5th) ran, died unsaved, and ran again
    killed = _report(tmp_path / "killed.json")
    assert killed["restart"] == 1 and killed["start_step"] == 4
    assert killed["losses"] == ref["losses"][4:], (ref["losses"], killed["losses"])
    assert len(ref["losses"]) == 6 and len(set(ref["losses"])) == 6       # a fresh batch every step
    assert ref["param_sha256"] and "wte.weight" in ref["param_sha256"]
    bad = [k for k in ref["param_sha256"] if ref["param_sha256"][k] != killed["param_sha256"].get(k)]
    assert not bad, f"the resumed run ends in another state than the uninterrupted one: {bad[:5]}"
    # saved after steps 2 and 4, then (restarted) 6; keep=2
    assert sorted(p.name for p in ckpt.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert (ckpt / "latest").read_text().strip() == "step_00000006"

    # the directory now holds a checkpoint: a fresh run refuses it, --resume at the end is a no-op load
    monkeypatch.delenv("FAULT_KILL_AT_STEP")
    assert main([*common, "--checkpoint-dir", str(ckpt)]) == 2
    assert "pass --resume" in capfd.readouterr().err


def _synthetic_profile(path: Path) -> Path:
    """A 1-node, 2-device profile (an H200's numbers on 2 devices): enough for the planner to plan 2 ranks."""
    from autopar.profiles.builtin import load_builtin
    from autopar.profiles.schema import save_profile

    prof = load_builtin("h200", nodes=1)
    save_profile(dataclasses.replace(prof, name="two-device-test", devices_per_node=2, nodes=1), path)
    return path


def test_replanned_mesh_loads_the_checkpoint(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    prof = str(_synthetic_profile(tmp_path / "prof.yaml"))
    plan, plan2, ckpt = tmp_path / "plan.yaml", tmp_path / "plan2.yaml", tmp_path / "ckpt"
    assert main(["plan", "gpt-tiny", "--cluster", prof, "--global-batch", "4", "--dtype", "float32", "-q",
                 "--pin", "pp=1,dp=2,tp=1", "--no-fused-kernels", "--time-limit", "2", "-o", str(plan)]) == 0
    assert ir.load_plan(plan).mesh == ir.MeshPlan(pp=1, dp=2, tp=1)
    assert main(["run", str(plan), "--model", "gpt-tiny", "--steps", "2", "--data", "step", "--checkpoint-dir",
                 str(ckpt), "--save-every", "2", "--report", str(tmp_path / "first.json"), *TIMEOUT]) == 0
    first = _report(tmp_path / "first.json")
    assert (ckpt / "latest").read_text().strip() == "step_00000002"
    capfd.readouterr()

    assert main(["replan", str(plan), "--nodes", "1", "--cluster", prof, "--pin", "tp=2", "-o", str(plan2)]) == 0
    assert "--resume --checkpoint-dir" in capfd.readouterr().out
    new = ir.load_plan(plan2)
    assert new.mesh == ir.MeshPlan(pp=1, dp=1, tp=2) and new.param_shardings, new.mesh
    assert not new.fused_kernels                      # replan keeps the old plan's choice

    assert main(["run", str(plan2), "--model", "gpt-tiny", "--steps", "2", "--resume", "--checkpoint-dir",
                 str(ckpt), "--report", str(tmp_path / "loaded.json"), *TIMEOUT]) == 0
    out = capfd.readouterr()
    text = out.out + out.err
    assert re.search(r"resumed from step 2 .*saved under mesh pp,dp,tp=\[1, 2, 1\], now \[1, 1, 2\]", text), \
        text[-4000:]
    loaded = _report(tmp_path / "loaded.json")
    assert loaded["start_step"] == 2 and loaded["losses"] == [] and loaded["mesh"] == [1, 1, 2]
    assert first["param_sha256"] and set(loaded["param_sha256"]) == set(first["param_sha256"])
    bad = [k for k, h in first["param_sha256"].items() if loaded["param_sha256"][k] != h]
    assert not bad, f"parameters loaded under tp=2 differ from the ones saved under dp=2: {bad[:5]}"


def test_run_checkpoint_option_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = str(_dp2_plan(tmp_path / "plan.yaml"))
    base = ["run", plan, "--model", "gpt-tiny", "--steps", "1"]
    assert main([*base, "--resume"]) == 2
    assert "need --checkpoint-dir" in capsys.readouterr().err
    assert main([*base, "--resume", "--checkpoint-dir", str(tmp_path / "empty")]) == 2
    assert "no checkpoint in" in capsys.readouterr().err
    assert main([*base, "--max-restarts", "-1"]) == 2
    assert "max_restarts must be >= 0" in capsys.readouterr().err
    assert main([*base, "--checkpoint-dir", str(tmp_path / "c"), "--save-every", "-2"]) == 2
    assert "every must be >= 0" in capsys.readouterr().err
