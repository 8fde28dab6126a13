"""Checkpoint trust boundary and concurrent use (issue 13): a crafted DCP checkpoint is refused before anything in it
runs, the ``latest`` marker cannot lead outside the checkpoint directory, directories of other users or writable by
others are refused, saves are private (0700/0600), one run holds a directory at a time, and pruning orders steps
numerically."""

from __future__ import annotations

import io
import os
import pickle
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
from autopar.codegen.checkpoint_guard import (
    CheckpointLock,
    CheckpointLockedError,
    SafeLoadPlanner,
    UnsafeCheckpointError,
)


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    return model, opt


class _RunsCommand:
    """Unpickling this runs ``touch <path>``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.path}",)


def test_crafted_metadata_is_refused_before_it_runs(tmp_path: Path) -> None:
    model, opt = _model()
    d = save_checkpoint(model, opt, 1, tmp_path / "ck")
    ran = tmp_path / "ran"
    (d / ".metadata").write_bytes(pickle.dumps(_RunsCommand(ran)))
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        load_checkpoint(model, opt, tmp_path / "ck")
    with pytest.raises(UnsafeCheckpointError):
        Checkpointer(CheckpointOptions(root=str(tmp_path / "ck"))).resume(model, opt)
    assert not ran.exists(), "the crafted .metadata ran a command"


def test_crafted_non_tensor_entry_is_refused_before_it_runs(tmp_path: Path) -> None:
    ran = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_RunsCommand(ran), buf)
    buf.seek(0)
    planner = SafeLoadPlanner()
    item = type("Item", (), {"dest_index": type("I", (), {"fqn": "step"})()})()
    with pytest.raises(UnsafeCheckpointError, match="not plain data"):
        planner.load_bytes(item, buf)
    assert not ran.exists()


def test_metadata_naming_a_file_outside_the_step_is_refused(tmp_path: Path) -> None:
    model, opt = _model()
    d = save_checkpoint(model, opt, 1, tmp_path / "ck")
    md = pickle.loads((d / ".metadata").read_bytes())  # our own file, written just now
    for info in md.storage_data.values():
        info.relative_path = "../../x.bin"
    evil = pickle.dumps(md)
    (d / ".metadata").write_bytes(evil)
    with pytest.raises(UnsafeCheckpointError, match="outside its step directory"):
        load_checkpoint(model, opt, d)


@pytest.mark.parametrize("target", ["../outside/step_00000003", "ABS", "step_00000003/../../outside/step_00000003"])
def test_latest_marker_outside_the_directory_is_refused(tmp_path: Path, target: str) -> None:
    model, opt = _model()
    outside = save_checkpoint(model, opt, 3, tmp_path / "outside")
    root = tmp_path / "ck"
    root.mkdir(mode=0o700)
    (root / "latest").write_text((str(outside) if target == "ABS" else target) + "\n")
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        latest_checkpoint(root)
    with pytest.raises(UnsafeCheckpointError):
        load_checkpoint(model, opt, root)


def test_symlinked_step_directory_is_refused(tmp_path: Path) -> None:
    model, opt = _model()
    outside = save_checkpoint(model, opt, 3, tmp_path / "outside")
    root = tmp_path / "ck"
    root.mkdir(mode=0o700)
    (root / "step_00000003").symlink_to(outside)
    (root / "latest").write_text("step_00000003\n")
    with pytest.raises(UnsafeCheckpointError, match="outside the checkpoint directory"):
        latest_checkpoint(root)
    with pytest.raises(UnsafeCheckpointError, match="not a step directory inside"):
        load_checkpoint(model, opt, root / "step_00000003")
    (root / "latest").unlink()
    assert latest_checkpoint(root) is None  # the scan skips symlinks too


@pytest.mark.skipif(os.name != "posix", reason="POSIX permissions")
def test_saves_are_private_and_foreign_directories_refused(tmp_path: Path) -> None:
    model, opt = _model()
    root = tmp_path / "ck"
    d = save_checkpoint(model, opt, 1, root)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert {stat.S_IMODE(f.stat().st_mode) for f in d.iterdir()} == {0o600}
    assert stat.S_IMODE((root / "latest").stat().st_mode) == 0o600
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeCheckpointError, match="writable by group/others"):
        load_checkpoint(model, opt, root)
    os.chmod(root, 0o700)
    assert load_checkpoint(model, opt, root) == 1
    if os.getuid() == 0:  # only root can give a directory away; elsewhere the mode check above stands alone
        os.chown(d, 12345, 12345)
        with pytest.raises(UnsafeCheckpointError, match="owned by uid 12345"):
            load_checkpoint(model, opt, root)


def test_failed_save_leaves_no_partial_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.checkpoint as dcp

    model, opt = _model()

    def full_disk(state: Any, checkpoint_id: str) -> None:
        Path(checkpoint_id).mkdir()
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        save_checkpoint(model, opt, 1, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == []


def test_pruning_orders_steps_numerically(tmp_path: Path) -> None:
    model, opt = _model()
    ck = Checkpointer(CheckpointOptions(root=str(tmp_path), every=1, keep=2))
    for s in (99_999_999, 100_000_000, 100_000_001):
        ck.maybe_save(model, opt, s)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_100000000", "step_100000001"]
    assert latest_checkpoint(tmp_path) == (step_dir(tmp_path, 100_000_001), 100_000_001)
    (tmp_path / "latest").unlink()
    assert latest_checkpoint(tmp_path) == (step_dir(tmp_path, 100_000_001), 100_000_001)


def test_stale_temporaries_are_removed_under_the_lock(tmp_path: Path) -> None:
    model, opt = _model()
    (tmp_path / ".tmp-step_00000005-1-deadbeef").mkdir()
    ck = Checkpointer(CheckpointOptions(root=str(tmp_path), every=1))
    ck.maybe_save(model, opt, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "latest", "step_00000001"]
    ck.close()


_HOLD = """
import sys, time
from autopar.codegen.checkpoint_guard import CheckpointLock
CheckpointLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(60)
"""


def test_second_process_fails_at_once_on_a_locked_directory(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        model, opt = _model()
        ck = Checkpointer(CheckpointOptions(root=str(tmp_path), every=1))
        t0 = time.perf_counter()
        with pytest.raises(CheckpointLockedError, match=rf"in use by another run \(pid {holder.pid}\)"):
            ck.resume(model, opt)
        with pytest.raises(CheckpointLockedError):
            ck.maybe_save(model, opt, 1)
        assert time.perf_counter() - t0 < 5.0
        assert not list(tmp_path.glob("step_*"))
    finally:
        holder.kill()
        holder.wait()
    with CheckpointLock(tmp_path) as lock:  # free again once the holder is gone
        assert lock.held
