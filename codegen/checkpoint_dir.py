"""A checkpoint directory without torch: where its newest complete checkpoint is, who may use it, and the lock
that keeps one run at a time in it (:mod:`autopar.codegen.checkpoint` saves and loads; this module is what
``autopar run`` checks in the launcher before any process starts, so it imports no torch).

Directories: :func:`resolve_latest` confines the ``latest`` marker to ``root/step_<digits>`` (no ``..``, no absolute
path, no symlink out of the root); :func:`check_private` refuses a directory owned by another user or writable by
group/others (anyone who can write there can plant a checkpoint); :func:`make_private` writes directories 0700 and
files 0600.  :class:`CheckpointLock` is an exclusive ``fcntl.flock`` on ``root/.lock``: a second run on the same
directory fails at once instead of silently interleaving its saves with the first one's.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from typing_extensions import Self

from autopar.ir.errors import AutoparError

__all__ = ["LOCK_ENV", "STEP_RE", "CheckpointLock", "CheckpointLockedError", "CheckpointOptions",
           "UnsafeCheckpointError", "check_private", "confine", "latest_checkpoint", "make_private", "resolve_latest"]

LOCK_ENV = "AUTOPAR_CHECKPOINT_LOCK"
"""Set by a launcher that holds the lock of this (resolved) checkpoint directory for its workers."""
STEP_RE = re.compile(r"step_(\d{8,})")
_MARKER_MAX = 256


class UnsafeCheckpointError(AutoparError, ValueError):
    """A checkpoint or checkpoint directory that autopar refuses to read (it could run code or escape the root)."""


class CheckpointLockedError(AutoparError, RuntimeError):
    """Another run holds the checkpoint directory's lock."""


def _clip(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointOptions:
    """When and where a training loop checkpoints."""

    root: str
    """Directory holding ``step_*`` checkpoints and the ``latest`` marker (shared by all ranks)."""
    every: int = 100
    """Save after every ``every``-th step (steps counted from 1); 0 disables periodic saves."""
    keep: int = 2
    """Complete checkpoints to keep (older ones are deleted after a successful save); 0 keeps all."""

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("checkpoint root must be a directory path")
        if self.every < 0:
            raise ValueError(f"every must be >= 0, got {self.every}")
        if self.keep < 0:
            raise ValueError(f"keep must be >= 0, got {self.keep}")


# ---------------------------------------------------------------------------------------------------------------
# Directories


def resolve_latest(root: Path) -> Path | None:
    """The step directory the ``latest`` marker names, confined to ``root``; None when there is no marker.

    Raises :class:`UnsafeCheckpointError` when the marker names anything but ``step_<digits>`` directly under
    ``root`` (``../outside/step_5``, ``/abs/step_5``, a symlink leaving the root)."""
    marker = root / "latest"
    if not marker.is_file():
        return None
    with open(marker, "rb") as f:
        raw = f.read(_MARKER_MAX + 1)
    name = raw.decode("utf-8", errors="replace").strip()
    if len(raw) > _MARKER_MAX or not STEP_RE.fullmatch(name):
        raise UnsafeCheckpointError(f"{marker} names {_clip(name)!r}, not a step_<number> directory of {root}: "
                                    "refused (the marker must not point outside the checkpoint directory)")
    d = root / name
    if d.is_symlink() or (d.exists() and d.resolve().parent != root.resolve()):
        raise UnsafeCheckpointError(f"{d} leads outside the checkpoint directory {root}: refused")
    return d


def confine(root: Path, path: Path) -> Path:
    """``path`` if it resolves to a step directory directly under ``root``; raises otherwise."""
    real = path.resolve()
    if real.parent != root.resolve() or not STEP_RE.fullmatch(real.name):
        raise UnsafeCheckpointError(f"{path} is not a step directory inside the checkpoint directory {root}: "
                                    "refused")
    return real


def check_private(path: Path) -> None:
    """Refuse a checkpoint directory owned by another user or writable by group/others (POSIX only)."""
    if os.name != "posix" or not path.exists():
        return
    st = path.stat()
    if st.st_uid != os.getuid():
        raise UnsafeCheckpointError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.getuid()}): a "
                                    "checkpoint is code-equivalent, so autopar reads only its user's own; copy it "
                                    "into a directory you own after checking where it came from")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCheckpointError(f"{path} is writable by group/others (mode {stat.S_IMODE(st.st_mode):o}): "
                                    f"anyone could plant a checkpoint there; `chmod go-w {path}` (autopar writes "
                                    "0700) or use another directory")


def make_private(path: Path) -> None:
    """chmod a directory tree autopar wrote: directories 0700, files 0600 (POSIX only; best effort on others)."""
    if os.name != "posix":
        return
    os.chmod(path, 0o700)
    for dirpath, dirs, files in os.walk(path):
        for d in dirs:
            os.chmod(os.path.join(dirpath, d), 0o700)
        for f in files:
            os.chmod(os.path.join(dirpath, f), 0o600)


# ---------------------------------------------------------------------------------------------------------------
# One run per directory


_HELD: dict[str, list[int]] = {}
"""Locks this process holds: resolved root -> [descriptor, holders] (objects of one process share the lock)."""


class CheckpointLock:
    """Exclusive, non-blocking ``flock`` on ``root/.lock``, held until :meth:`release` or process exit.

    ``acquire`` raises :class:`CheckpointLockedError` at once when another process holds it; objects of the same
    process share it.  When the launcher already holds it for this directory (``$AUTOPAR_CHECKPOINT_LOCK``),
    acquiring in its workers is a no-op."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._key: str | None = None

    @property
    def held(self) -> bool:
        return self._key is not None

    def acquire(self) -> Self:
        key = str(self.root.resolve())
        if self._key is not None or os.environ.get(LOCK_ENV) == key:
            return self
        if key in _HELD:
            _HELD[key][1] += 1
            self._key = key
            return self
        import fcntl

        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 64, 0).decode(errors="replace").strip()
            os.close(fd)
            raise CheckpointLockedError(f"checkpoint directory {self.root} is in use by another run"
                                        f"{' (pid ' + holder + ')' if holder.isdigit() else ''}; wait for it to "
                                        "finish or use another --checkpoint-dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        _HELD[key] = [fd, 1]
        self._key = key
        return self

    def release(self) -> None:
        if self._key is None:
            return
        held = _HELD[self._key]
        held[1] -= 1
        if held[1] == 0:
            os.close(held[0])  # closing the descriptor drops the flock
            del _HELD[self._key]
        self._key = None

    def __enter__(self) -> Self:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def latest_checkpoint(root: str | Path) -> tuple[Path, int] | None:
    """(step directory, step) of the newest complete checkpoint under ``root``, or None.

    Trusts the ``latest`` marker when it points to a complete directory, else scans ``step_*`` directories
    (numerically).  A marker naming anything outside ``root`` raises UnsafeCheckpointError."""
    root = Path(root)
    d = resolve_latest(root)
    if d is not None and (d / ".metadata").is_file():
        return d, int(d.name[len("step_"):])
    steps = _steps(root, complete=True)
    return (steps[-1][1], steps[-1][0]) if steps else None


def _steps(root: Path, *, complete: bool) -> list[tuple[int, Path]]:
    """(step, directory) of ``root/step_<digits>`` real directories, in numeric order."""
    if not root.is_dir():
        return []
    out = []
    for d in root.iterdir():
        m = STEP_RE.fullmatch(d.name)
        if m and not d.is_symlink() and d.is_dir() and (not complete or (d / ".metadata").is_file()):
            out.append((int(m.group(1)), d))
    return sorted(out)
