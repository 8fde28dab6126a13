"""Multi-node through ``autopar run``: two torchrun agents on this machine (``--nnodes 2``, c10d rendezvous, 2 processes
each, as on two machines) train a pp=2 x dp=2 plan of gpt-tiny made for 2 nodes x 2 devices, and every step's loss
equals the one of a single process training the same global batches (the README's two-node command, on localhost)."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from autopar import ir
from autopar.planner.cli import main

from harness import make_plan

pytestmark = pytest.mark.multiprocess

STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _plans(tmp: Path) -> tuple[Path, Path]:
    from autopar.zoo import build

    spec = build("gpt-tiny", batch=1, device="meta")
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx", model_name="gpt-tiny")
    multi = make_plan(graph, pp=2, dp=2, micro_batch=1, num_microbatches=2, model="gpt-tiny")
    multi = dataclasses.replace(multi, nodes=2, devices_per_node=2, fused_kernels=False)  # eager: no interpreted Triton
    single = dataclasses.replace(make_plan(graph, micro_batch=4, model="gpt-tiny"), fused_kernels=False)
    paths = tmp / "pp2dp2.yaml", tmp / "single.yaml"
    ir.dump_plan(multi, paths[0])
    ir.dump_plan(single, paths[1])
    return paths


def test_two_torchrun_agents_train_a_pp2_dp2_plan_like_one_process(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    multi, single = _plans(tmp_path)
    common = ["--model", "gpt-tiny", "--steps", str(STEPS), "--data", "step", "--timeout", "300"]
    assert main(["run", str(single), *common, "--report", str(tmp_path / "one.json")]) == 0

    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "autopar", "run", str(multi), *common, "--report", str(tmp_path / "two.json"),
           "--torchrun-args", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
           "--rdzv-id", "autopar-multinode-test"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_GLOO_LAZY_INIT="1")
    agents = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True) for _ in range(2)]
    logs = [a.communicate(timeout=400)[0] for a in agents]
    for a, log in zip(agents, logs, strict=True):
        assert a.returncode == 0, log[-4000:]
    text = "\n".join(logs)
    assert "--standalone" not in text

    one = json.loads((tmp_path / "one.json").read_text())
    two = json.loads((tmp_path / "two.json").read_text())
    assert two["mesh"] == [2, 2, 1] and len(two["losses"]) == STEPS == len(one["losses"])
    assert two["losses"] == pytest.approx(one["losses"], rel=1e-5), (one["losses"], two["losses"])
