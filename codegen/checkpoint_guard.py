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

The directory side (the ``latest`` marker confined to the root, private directories, the one-run lock) is in
:mod:`autopar.codegen.checkpoint_dir`, without torch, and its names are re-exported here.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, set_element
from torch.distributed.checkpoint.metadata import Metadata

from autopar.codegen.checkpoint_dir import (
    LOCK_ENV,
    STEP_RE,
    CheckpointLock,
    CheckpointLockedError,
    UnsafeCheckpointError,
    _clip,
    check_private,
    confine,
    make_private,
    resolve_latest,
)

__all__ = ["LOCK_ENV", "STEP_RE", "CheckpointLock", "CheckpointLockedError", "SafeLoadPlanner", "SafeReader",
           "UnsafeCheckpointError", "check_private", "confine", "make_private", "read_metadata", "resolve_latest"]

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
