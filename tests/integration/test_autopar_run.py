"""``autopar run`` refuses, in the launcher, a plan for more processes than it starts.  The whole path
``autopar profile`` -> ``plan`` -> ``run`` on this machine (loss and step time per step, measured vs predicted step
time per stage) is the README's sequence, run as written by tests/integration/test_readme.py, which checks that log."""

from __future__ import annotations

from pathlib import Path

from autopar import ir
from autopar.planner.cli import main


def test_run_rejects_a_plan_for_more_processes_than_one_node_starts(tmp_path: Path, capsys) -> None:
    from autopar.zoo import build

    from harness import make_plan

    spec = build("gpt-tiny", batch=4, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    path = tmp_path / "plan.yaml"
    ir.dump_plan(make_plan(graph, dp=2, micro_batch=2), path)
    assert main(["run", str(path), "--model", "gpt-tiny", "--steps", "1", "--nproc", "1"]) == 2
    assert "needs 2 processes" in capsys.readouterr().err
