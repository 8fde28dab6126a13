"""Tier (a): single-process checkpoint behaviour: exact round trip of a plain module + AdamW, the ``latest`` marker,
atomic step directories, pruning, and clear errors for a missing or mismatched checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from autopar.codegen.checkpoint import (
    Checkpointer,
    CheckpointOptions,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    step_dir,
)


def _trained(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        model(torch.randn(5, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def test_round_trip_is_exact_and_latest_is_tracked(tmp_path: Path) -> None:
    model, opt = _trained(0)
    ck = Checkpointer(CheckpointOptions(root=str(tmp_path), every=2, keep=2))
    assert ck.resume(model, opt) == 0
    assert ck.maybe_save(model, opt, 1) is None
    for s in (2, 4, 6):
        assert ck.maybe_save(model, opt, s) == step_dir(tmp_path, s)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000004", "step_00000006"]
    assert latest_checkpoint(tmp_path) == (step_dir(tmp_path, 6), 6)
    other, other_opt = _trained(1)
    assert Checkpointer(CheckpointOptions(root=str(tmp_path))).resume(other, other_opt) == 6
    for (k, a), b in zip(model.state_dict().items(), other.state_dict().values()):
        assert torch.equal(a, b), k
    for p, q in zip(model.parameters(), other.parameters()):
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], other_opt.state[q][k]), k


def test_marker_fallback_and_incomplete_dirs(tmp_path: Path) -> None:
    model, opt = _trained(0)
    save_checkpoint(model, opt, 3, tmp_path)
    (tmp_path / ".tmp-step_00000005").mkdir()          # a save that crashed: ignored
    (tmp_path / "step_00000009").mkdir()               # no .metadata: ignored
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == (step_dir(tmp_path, 3), 3)
    assert latest_checkpoint(tmp_path / "nothing") is None


def test_errors_are_actionable(tmp_path: Path) -> None:
    model, opt = _trained(0)
    with pytest.raises(FileNotFoundError, match="no checkpoint in .*start without --resume"):
        load_checkpoint(model, opt, tmp_path)
    save_checkpoint(model, opt, 1, tmp_path)
    wrong = nn.Sequential(nn.Linear(4, 3))
    with pytest.raises(ValueError, match=r"does not fit this model: Size mismatch .*8, 4.*3, 4.*another model\?$"):
        load_checkpoint(wrong, None, tmp_path)
    with pytest.raises(ValueError, match="every must be >= 0"):
        CheckpointOptions(root=str(tmp_path), every=-1)
