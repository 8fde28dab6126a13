"""The one-line ``auto_parallel``: planning without torchrun leaves the model alone; under torchrun on 4 CPU ranks the
README example measures this machine, plans, builds the program and trains."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar import ir
from autopar.planner import auto_parallel
from autopar.planner.run.torchrun import stop_process_tree
from autopar.profiles.schema import load_profile
from autopar.zoo import build

ROOT = Path(__file__).resolve().parents[2]
_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _hook_counts(model: torch.nn.Module) -> dict[str, int]:
    counts = {f"{name}.{h}": len(getattr(m, h)) for name, m in model.named_modules() for h in _HOOK_DICTS}
    counts.update({f"param {n}": len(getattr(p, "_backward_hooks", None) or {}) for n, p in model.named_parameters()})
    return counts


def test_outside_torchrun_returns_a_plan_and_leaves_the_model_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    spec = build("gpt-tiny", batch=8, device="cpu", seed=0)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    hooks, training = _hook_counts(spec.model), spec.model.training
    devices = {p.device for p in spec.model.parameters()}
    plan = auto_parallel(spec.model, example_inputs=spec.example_inputs, loss_fn=spec.loss_fn, global_batch=8,
                         cluster="dgx-a100-80gb", nodes=1, dtype="float32")
    assert isinstance(plan, ir.Plan)
    assert plan.world_size == 8 and plan.global_batch == 8 and plan.dtype == "float32"
    assert plan.mesh.pp * plan.mesh.dp * plan.mesh.tp == 8
    after = spec.model.state_dict()
    assert list(after) == list(before)
    for k, v in before.items():
        assert torch.equal(after[k], v), k
    assert _hook_counts(spec.model) == hooks
    assert spec.model.training == training and {p.device for p in spec.model.parameters()} == devices
    assert all(p.grad is None for p in spec.model.parameters())


def test_outside_torchrun_without_a_cluster_asks_for_one(monkeypatch: pytest.MonkeyPatch) -> None:
    for k in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    spec = build("mlp-tiny", batch=4, device="cpu", seed=0)
    with pytest.raises(ValueError, match="cluster="):
        auto_parallel(spec.model, example_inputs=spec.example_inputs, loss_fn=spec.loss_fn, global_batch=4)


@pytest.mark.multiprocess
def test_readme_example_under_torchrun_on_four_cpu_ranks(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(AUTOPAR_CACHE=str(cache), OMP_NUM_THREADS="1", TORCH_GLOO_LAZY_INIT="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           str(ROOT / "examples" / "auto_parallel_torchrun.py"), "--steps", "2"]
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        stop_process_tree(proc, grace_s=0)  # torchrun, its workers (each in its own session), their profiler
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun timed out:\n{out[-4000:]}") from None
    assert proc.returncode == 0, out[-4000:]
    steps = re.findall(r"step (\d+) loss ([-\d.e+naif]+) \(plan: pp=(\d+) dp=(\d+) tp=(\d+)\)", out)
    assert [int(s[0]) for s in steps] == [0, 1], out[-4000:]
    losses = [float(s[1]) for s in steps]
    assert all(math.isfinite(x) for x in losses) and losses[1] <= losses[0] * 1.05, losses
    assert all(int(pp) * int(dp) * int(tp) == 4 for _, _, pp, dp, tp in steps)
    profiles = list(cache.glob("profile-*-4.yaml"))  # this machine, measured once for 4 local ranks
    assert len(profiles) == 1, list(cache.iterdir())
    prof = load_profile(profiles[0])
    assert (prof.nodes, prof.devices_per_node) == (1, 4)
