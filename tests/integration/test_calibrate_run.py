"""``autopar calibrate`` end to end on 2 CPU ranks: a dp=2 plan runs under the attribution hook, the profile is
fitted to it, and ``autopar plan --cluster fitted.yaml`` re-plans with the result.  (Whether the fit predicts *other*
plans within 20% is the benchmark's question, benchmarks/calibrate_cpu.py; here: the loop's mechanics on real runs,
and that a held-out pipeline plan is predicted closer than by the base profile.)"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.calibrate import measure_plan, plan_graph, predict
from autopar.planner.cli import main
from autopar.profiles import load_builtin, load_profile, save_profile

pytestmark = pytest.mark.multiprocess  # starts gloo ranks


def test_calibrate_fits_a_dp_run_and_replans(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TORCH_GLOO_LAZY_INIT", "1")
    # a base profile far from this machine (an A100 node cut to 2 devices), so the fit has work to do
    base, plan, fitted = tmp_path / "base.yaml", tmp_path / "plan.yaml", tmp_path / "fitted.yaml"
    save_profile(dataclasses.replace(load_builtin("dgx-a100-80gb"), devices_per_node=2, name="a100x2"), base)
    assert main(["plan", "mlp-tiny", "--cluster", str(base), "--global-batch", "8", "--dtype", "float32", "-q",
                 "--workers", "1", "--pin", "pp=1,dp=2,tp=1,zero=0", "-o", str(plan)]) == 0
    capfd.readouterr()
    assert main(["calibrate", str(plan), "--model", "mlp-tiny", "--cluster", str(base), "-o", str(fitted),
                 "--steps", "10", "--warmup", "2", "--profiled", "3"]) == 0
    text = capfd.readouterr().out
    assert "pred before" in text and "stage 0" in text and "fitted factors:" in text, text[-3000:]
    prof = load_profile(fitted)
    assert prof.name == "a100x2-calibrated" and "calibrated by autopar calibrate" in prof.source
    side = json.loads((tmp_path / "fitted.yaml.calibration.json").read_text())
    run = side["runs"][0]
    assert len(run["ranks"]) == 2 and run["step_s"] > 0
    for r in run["ranks"]:  # the attribution accounts for the whole step, and dp ranks all-reduce gradients
        parts = r["compute"] + r["comm"] + r["p2p"] + r["idle"] + r["optimizer"]
        assert parts == pytest.approx(r["step"], rel=1e-6) and r["step"] == pytest.approx(run["step_s"])
        assert r["comm"] > 0 and r["optimizer"] > 0 and r["p2p"] == 0
    # an A100 is far faster than a CPU rank: the fitted compute factors slow it down
    assert side["factors"]["overhead"] > 1 or side["factors"]["matmul"] > 1
    # held out: a pipeline plan the fit never saw is predicted closer to its measured time than by the base profile
    held = tmp_path / "pp2.yaml"
    assert main(["plan", "mlp-tiny", "--cluster", str(fitted), "--global-batch", "8", "--dtype", "float32", "-q",
                 "--workers", "1", "--pin", "pp=2,dp=1,tp=1", "-o", str(held)]) == 0
    hp = ir.load_plan(held)
    m = measure_plan(held, "mlp-tiny", steps=8, warmup=2, profiled=2)
    graph = plan_graph(hp, "mlp-tiny", None)
    before, after = (predict(graph, p, hp).time.total for p in (load_profile(base), prof))
    assert abs(math.log(m.step_s / after)) < abs(math.log(m.step_s / before)), (m.step_s, before, after)
    assert main(["plan", "mlp-tiny", "--cluster", str(fitted), "--global-batch", "8", "--dtype", "float32", "-q",
                 "--workers", "1"]) == 0
    assert "a100x2-calibrated" in capfd.readouterr().out
