"""Trust boundary of training checkpoints: what a load may read, and who may write a checkpoint directory.

A DCP checkpoint is code-equivalent in stock PyTorch: ``FileSystemReader.read_metadata`` unpickles ``.metadata``
with plain :mod:`pickle`, and ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(weights_only=False)`` on every
non-tensor entry, so a crafted checkpoint runs arbitrary code on load.  autopar loads through :class:`SafeReader`
and :class:`SafeLoadPlanner` instead:

* ``.metadata`` is read with :class:`_MetadataUnpickler`, which resolves only DCP's own metadata classes, ``torch.Size``,
  torch dtypes/layouts and ``pathlib`` paths; any other global (``os.system``, ``builtins.eval``...) is refused
  *before* anything is called.  Every storage file the metadata names must be a plain file name inside the step
  directory.
* non-tensor entries are read with ``torch.load(weights_only=True)`` (tensors already are).

Directories: :func:`resolve_latest` confines the ``latest`` marker to ``root/step_<digits>`` (no ``..``, no absolute
path, no symlink out of the root); :func:`check_private` refuses a directory owned by another user or writable by
group/others (anyone who can write there can plant a checkpoint); :func:`make_private` writes directories 0700 and
files 0600.  :class:`CheckpointLock` is an exclusive ``fcntl.flock`` on ``root/.lock``: a second run on the same
directory fails at once instead of silently interleaving its saves with the first one's.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import stat
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element
from torch.distributed.checkpoint.metadata import Metadata
from typing_extensions import Self

from autopar.ir.errors import AutoparError

__all__ = ["LOCK_ENV", "STEP_RE", "CheckpointLock", "CheckpointLockedError", "SafeLoadPlanner", "SafeReader",
           "UnsafeCheckpointError", "check_private", "confine", "make_private", "read_metadata", "resolve_latest"]

LOCK_ENV = "AUTOPAR_CHECKPOINT_LOCK"
"""Set by a launcher that holds the lock of this (resolved) checkpoint directory for its workers."""
STEP_RE = re.compile(r"step_(\d{8,})")
_MARKER_MAX = 256


class UnsafeCheckpointError(AutoparError, ValueError):
    """A checkpoint or checkpoint directory that autopar refuses to read (it could run code or escape the root)."""


class CheckpointLockedError(AutoparError, RuntimeError):
    """Another run holds the checkpoint directory's lock."""


# ---------------------------------------------------------------------------------------------------------------
# .metadata without arbitrary unpickling

_DCP_MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}
_DCP_NAMES = {"Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata",
              "BytesStorageMetadata", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING", "_StorageInfo"}
_PATHS = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "Path")}


class _MetadataUnpickler(pickle.Unpickler):
    """Resolves only the globals a DCP ``.metadata`` is made of (all plain data holders)."""

    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_MODULES and name in _DCP_NAMES:
            return super().find_class(module, name)
        if (module, name) in _PATHS:
            return super().find_class(module, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout,
                                                                          torch.memory_format)):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":
            return super().find_class(module, name)
        raise UnsafeCheckpointError(f"checkpoint .metadata refers to {_clip(module)}.{_clip(name)}, which a DCP "
                                    "checkpoint never contains: refused before unpickling it (a crafted checkpoint "
                                    "can run code; load only checkpoints from a trusted place)")


def _clip(s: str, n: int = 80) -> str:
    return s if len(s) <= n else s[:n] + "..."


def read_metadata(path: Path) -> Metadata:
    """Unpickle ``path`` (a ``.metadata`` file) with the restricted unpickler and check what it names."""
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except UnsafeCheckpointError:
        raise
    except (pickle.UnpicklingError, EOFError, OSError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            ImportError, MemoryError, RecursionError) as e:
        raise UnsafeCheckpointError(f"{path} is not a DCP checkpoint metadata file ({type(e).__name__}: "
                                    f"{_clip(str(e), 200)})") from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{path} does not hold DCP Metadata (got {type(md).__name__})")
    for info in (md.storage_data or {}).values():
        rel = str(getattr(info, "relative_path", ""))
        if not rel or rel != PurePosixPath(rel).name or rel != PureWindowsPath(rel).name or rel in (".", ".."):
            raise UnsafeCheckpointError(f"{path} names storage file {_clip(rel)!r} outside its step directory")
    return md


class SafeReader(FileSystemReader):
    """``FileSystemReader`` whose ``.metadata`` goes through :func:`read_metadata` (never plain pickle)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        md = read_metadata(Path(self.path) / ".metadata")
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that reads non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsafeCheckpointError(f"checkpoint entry {_clip(read_item.dest_index.fqn)} is not plain data: "
                                        f"{_clip(str(e).splitlines()[0] if str(e) else '', 200)}") from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


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
