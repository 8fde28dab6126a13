"""The `autopar` command line: plan -> show (+trace) -> explain -> diff -> replan, on a built-in cluster."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from autopar.ir.plan import load_plan
from autopar.planner.cli import main


def test_plan_show_explain_diff_replan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert main(["plan", "gpt2-small", "--cluster", "dgx-a100-80gb", "--nodes", "1", "--global-batch", "32",
                 "-q", "-o", str(a)]) == 0
    out = capsys.readouterr().out
    assert "autopar plan: gpt2-small" in out and "iteration time" in out and f"wrote {a}" in out
    assert main(["plan", "gpt2-small", "--cluster", "dgx-a100-80gb", "--nodes", "1", "--global-batch", "32",
                 "--pin", "tp=2", "-q", "-o", str(b)]) == 0
    assert load_plan(b).mesh.tp == 2
    capsys.readouterr()

    trace = tmp_path / "t.json"
    assert main(["show", str(b), "--trace", str(trace)]) == 0
    out = capsys.readouterr().out
    assert "tensor-parallel parameter shardings" in out and "trace events" in out
    assert json.loads(trace.read_text())["traceEvents"]

    node = next(o.node for o in load_plan(b).op_shardings if o.op == "linear")
    assert main(["explain", str(b), node]) == 0
    out = capsys.readouterr().out
    assert "alternatives" in out and "* " in out and "replicate" in out

    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "mesh.tp" in out and "x the speed of A" in out

    c = tmp_path / "c.yaml"
    assert main(["replan", str(a), "--nodes", "2", "-o", str(c)]) == 0
    assert load_plan(c).nodes == 2 and load_plan(c).graph_fingerprint == load_plan(a).graph_fingerprint


def test_trace_and_models(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    assert "gpt3-175b" in capsys.readouterr().out
    assert main(["trace", "llama-tiny"]) == 0
    out = capsys.readouterr().out
    assert "2 blocks, 1 distinct" in out and "unknown ops" in out


def test_show_kernels(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = tmp_path / "p.yaml"
    assert main(["plan", "llama-tiny", "--cluster", "dgx-h100", "--nodes", "1", "--global-batch", "8", "-q",
                 "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["show", str(plan), "--kernels"]) == 0
    out = capsys.readouterr().out
    assert "@triton.jit" in out and "rms" in out.lower()
