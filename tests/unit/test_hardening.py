"""Issue 13: plans are data (no import of the plan's model: without --trust-plan-model, fingerprint always checked),
bounded inputs, one-line errors with exit code 2 and an internal-error boundary, byte-identical plans."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from autopar import ir
from autopar.ir.plan import MeshPlan, OpSharding, Plan, StagePlan, dump_plan
from autopar.planner.cli import main

_MARKER_MODULE = textwrap.dedent('''
    import os
    import torch
    from torch import nn


    def make(batch=1, device="cpu"):
        open(os.environ["AUTOPAR_TEST_MARKER"], "w").close()   # proves the factory was called
        return nn.Linear(4, 4), (torch.randn(batch, 4, device=device),)
''')


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err, err
    assert err.startswith("autopar: error: ") and err.count("\n") == 1, err
    return err


def _plan(model: str, fingerprint: str = "0000", tp: int = 2) -> Plan:
    return Plan(model=model, graph_fingerprint=fingerprint, num_params=1, cluster="dgx-a100-80gb", nodes=1,
                devices_per_node=tp, global_batch=1, micro_batch=1, num_microbatches=1, mesh=MeshPlan(tp=tp),
                stages=(StagePlan(index=0, layer_start=0, layer_end=3),),
                op_shardings=(OpSharding(node="x", op="linear", strategy="column"),))


@pytest.fixture()
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "autopar_marker_model.py").write_text(_MARKER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("AUTOPAR_TEST_MARKER", str(tmp_path / "called"))
    return tmp_path / "called"


@pytest.mark.parametrize("cmd", [["show", "{p}", "--kernels"], ["explain", "{p}", "x"], ["replan", "{p}", "--nodes",
                                                                                              "1"]])
def test_plan_model_is_not_imported(capsys: pytest.CaptureFixture[str], tmp_path: Path, cmd: list[str],
                                    marker: Path) -> None:
    for model in ("os:abort", "autopar_marker_model:make"):
        p = tmp_path / "plan.yaml"
        dump_plan(_plan(model), p)
        err = _err(capsys, [c.format(p=p) for c in cmd])
        assert "--trust-plan-model" in err and "--model" in err, err
        assert not marker.exists()


def test_trust_plan_model_imports_it_and_checks_the_fingerprint(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                                marker: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("autopar_marker_model:make", fingerprint="feedface"), p)
    err = _err(capsys, ["show", str(p), "--kernels", "--trust-plan-model"])
    assert marker.exists() and "graph_fingerprint" in err and "another model" in err, err


def test_model_given_is_checked_against_the_fingerprint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("autopar_marker_model:make", fingerprint="feedface"), p)
    for cmd in (["explain", str(p), "x"], ["show", str(p), "--kernels"], ["replan", str(p), "--nodes", "1"]):
        err = _err(capsys, [*cmd, "--model", "gpt-tiny"])
        assert "graph_fingerprint" in err and "another model" in err, err


def test_plan_error_messages_are_bounded(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("x" * 100_000), p)
    err = _err(capsys, ["show", str(p), "--kernels"])
    assert len(err) < 1000, len(err)


def test_a_builtin_plan_model_needs_no_flag(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    spec = ir.trace(*_gpt_tiny())
    p = tmp_path / "plan.yaml"
    dump_plan(_plan("gpt-tiny", fingerprint=spec.fingerprint, tp=1), p)
    assert main(["show", str(p), "--kernels"]) == 0


def _gpt_tiny() -> tuple:
    from autopar.zoo import build

    spec = build("gpt-tiny", batch=1, device="meta")
    return spec.model, spec.example_inputs
