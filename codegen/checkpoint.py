"""Training checkpoints that survive a change of plan: save under one mesh, load under another.

State is saved with ``torch.distributed.checkpoint`` (DCP).  DCP stores every tensor as its *global* tensor cut into
the chunks the ranks own, with the chunk offsets in ``.metadata``; a load asks for whatever chunks the new layout
needs and reads only the overlapping pieces, so a checkpoint written under ``dp=4`` (FSDP2 shards) loads under
``dp=2, tp=2`` (FSDP2 x DTensor) or ``pp=1`` unchanged.  Each rank writes only what it owns (its stages' parameters,
its FSDP/TP shards); replicated tensors are written once (DCP deduplicates them).

Keys are the original model's fully qualified names whatever the plan: the parameters and persistent buffers of a
:class:`autopar.codegen.runtime.program.ParallelProgram`'s stage modules (``groups.3.blocks.1.attn.qkv.weight``) are
registered, for the duration of a save or load, on a throw-away *view* module under their model FQN
(``blocks.1.attn.qkv.weight``), and ``torch.distributed.checkpoint.state_dict.get_state_dict / set_state_dict``
are run on that view.  They map optimizer state to FQNs and, with ``flatten_optimizer_state_dict``, key even the
param-group hyperparameters by FQN (``param_groups.<fqn>.lr``), so ranks holding different pipeline stages never
write conflicting entries.

One layout is not a pure re-cut of the global tensor: a fused projection that the runtime stores chunk-interleaved
for tensor parallelism (``autopar.codegen.runtime.tensor_parallel.permute_chunks``; the stored global tensor depends on
``tp``).  Those parameters and their optimizer states are saved gathered and un-permuted (model layout) and
re-permuted for the loading plan's ``tp``.

Layout on disk: ``root/step_00000012/`` (DCP files + ``.metadata`` + ``autopar.json``) and ``root/latest`` naming
the newest complete step.  A step directory is written as ``root/.tmp-step_00000012-<token>`` (a name unique to the
save) and renamed when every rank has finished, and ``latest`` is replaced atomically, so a crash mid-save leaves
the previous checkpoint current.

Trust (:mod:`autopar.codegen.checkpoint_guard`): loads read ``.metadata`` with a restricted unpickler and non-tensor
entries with ``weights_only=True``, so a crafted checkpoint is refused instead of running code; ``latest`` must name
a ``step_N`` directory inside the root; a root owned by another user or writable by group/others is refused;
saves write directories 0700 and files 0600; :class:`Checkpointer` holds an exclusive lock on the root.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.codegen.checkpoint_dir import (
    CheckpointLock,
    CheckpointOptions,
    UnsafeCheckpointError,
    _steps,
    check_private,
    confine,
    latest_checkpoint,
    make_private,
)
from autopar.codegen.checkpoint_guard import SafeLoadPlanner, SafeReader, read_metadata
from autopar.codegen.runtime.tensor_parallel import permute_chunks, unpermute_chunks

__all__ = ["CheckpointOptions", "Checkpointer", "save_checkpoint", "load_checkpoint", "latest_checkpoint",
           "step_dir", "named_state"]

log = logging.getLogger(__name__)

_OPTS = StateDictOptions(flatten_optimizer_state_dict=True)
_LATEST = "latest"
_META = "autopar.json"
Source = Union[nn.Module, Any, Iterable[tuple[str, nn.Module]]]
"""A ParallelProgram, a plain module, or (fqn prefix, module) pairs whose parameters make up the model."""


# ---------------------------------------------------------------------------------------------------------------
# What is saved: (fqn, tensor) pairs in model naming, and chunk-interleaved layouts


def _persistent_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for mname, m in module.named_modules():
        for k, b in m._buffers.items():
            if b is not None and k not in m._non_persistent_buffers_set:
                yield (f"{mname}.{k}" if mname else k), b


def named_state(source: Source) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, torch.Tensor]]]:
    """This rank's (model FQN, parameter) and (model FQN, persistent buffer) pairs, each tensor once."""
    if hasattr(source, "stages") and hasattr(source, "named_parameters") and not isinstance(source, nn.Module):
        # the program knows which buffers the original model persists (fx stage modules mark every copy
        # persistent, so reading the stage modules would save e.g. RoPE tables)
        return list(source.named_parameters()), list(source.named_buffers(persistent_only=True))
    if isinstance(source, nn.Module):
        return list(source.named_parameters()), list(_persistent_buffers(source))
    params_l: list[tuple[str, nn.Parameter]] = []
    bufs_l: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for prefix, mod in source:
        for n, p in mod.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                params_l.append((f"{prefix}{n}", p))
        bufs_l.extend((f"{prefix}{n}", b) for n, b in _persistent_buffers(mod))
    return params_l, bufs_l


def _chunk_layouts(source: Source) -> tuple[dict[str, int], int]:
    """({fqn: chunks} of chunk-interleaved parameters, tp) of a ParallelProgram; ({}, 1) otherwise."""
    chunks = getattr(source, "chunks", None)
    if chunks is None:
        chunks = getattr(source, "_chunks", {})  # ParallelProgram keeps it private for now
    plan = getattr(source, "plan", None)
    tp = plan.mesh.tp if plan is not None else 1
    return ({k: c for k, c in dict(chunks).items() if c > 1} if tp > 1 else {}), tp


class _View(nn.Module):
    """A module tree whose ``named_parameters()`` are exactly the given tensors under their model FQNs."""

    def __init__(self, params: list[tuple[str, nn.Parameter]], buffers: list[tuple[str, torch.Tensor]]) -> None:
        super().__init__()
        for fqn, p in params:
            mod, leaf = self._owner(fqn)
            mod._parameters[leaf] = p
        for fqn, b in buffers:
            mod, leaf = self._owner(fqn)
            mod._buffers[leaf] = b

    def _owner(self, fqn: str) -> tuple[nn.Module, str]:
        *path, leaf = fqn.split(".")
        mod: nn.Module = self
        for part in path:
            if part not in mod._modules:
                mod._modules[part] = nn.Module()
            mod = mod._modules[part]  # type: ignore[assignment]
        return mod, leaf


def _is_param_state(key: str, fqns: dict[str, int]) -> str | None:
    """The chunked parameter FQN a flattened state-dict key belongs to (model ``fqn`` or ``state.fqn.exp_avg``)."""
    if key in fqns:
        return key
    if key.startswith("state."):
        rest = key[len("state."):]
        fqn = rest.rsplit(".", 1)[0]
        if fqn in fqns:
            return fqn
    return None


# ---------------------------------------------------------------------------------------------------------------
# Save / load


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def step_dir(root: str | Path, step: int) -> Path:
    """``root/step_00000012``."""
    return Path(root) / f"step_{step:08d}"


def _state(source: Source, optimizer: torch.optim.Optimizer | None) -> tuple[_View, dict[str, Any]]:
    params, bufs = named_state(source)
    view = _View(params, bufs)
    optims = (optimizer,) if optimizer is not None else ()
    model_sd, optim_sd = get_state_dict(view, optims, options=_OPTS)
    return view, {"model": model_sd, "optim": optim_sd if optimizer is not None else {}}


@torch.no_grad()
def save_checkpoint(source: Source, optimizer: torch.optim.Optimizer | None, step: int, root: str | Path, *,
                    extra: dict[str, Any] | None = None) -> Path:
    """Save model (+ optimizer) state at ``step`` under ``root``; collective over every rank. Returns the step dir.

    ``extra`` is JSON-serializable metadata from rank 0 (e.g. the plan's name), kept in ``autopar.json``."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative integer, got {step!r}")
    root = Path(root)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{_token()}"
    if _rank() == 0:
        root.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_private(root)
    _barrier()
    _, state = _state(source, optimizer)
    chunks, tp = _chunk_layouts(source)
    for part in state.values():
        for key in list(part):
            fqn = _is_param_state(key, chunks)
            if fqn is not None and isinstance(part[key], DTensor):
                part[key] = unpermute_chunks(part[key].full_tensor(), chunks[fqn], tp)
    state["step"] = step
    try:
        dcp.save(state, checkpoint_id=str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # a full disk keeps no partial step (each rank removes what it can)
        raise
    _barrier()
    if _rank() == 0:
        meta = {"step": step, "world_size": dist.get_world_size() if dist.is_initialized() else 1, **(extra or {})}
        (tmp / _META).write_text(json.dumps(meta, indent=1, sort_keys=True))
        make_private(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        _write_latest(root, final.name)
    _barrier()
    log.info("saved checkpoint step %d to %s", step, final)
    return final


def _token() -> str:
    """A name part unique to this save, the same on every rank (rank 0 draws it)."""
    token = [f"{os.getpid()}-{os.urandom(4).hex()}"]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(token, src=0)
    return str(token[0])


def _write_latest(root: Path, name: str) -> None:
    tmp = root / f".{_LATEST}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(name + "\n")
    os.replace(tmp, root / _LATEST)


@torch.no_grad()
def load_checkpoint(source: Source, optimizer: torch.optim.Optimizer | None, directory: str | Path) -> int:
    """Load state saved by :func:`save_checkpoint` into ``source`` (+ ``optimizer``), resharding to the current
    layout; collective.  ``directory`` is a step directory or a root (its latest checkpoint).  Returns the step."""
    path = Path(directory)
    if not (path / ".metadata").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise FileNotFoundError(f"no checkpoint in {path} (expected a step directory with .metadata, or a root "
                                    f"with a '{_LATEST}' marker); start without --resume or point to a checkpoint")
        path = found[0]
    path = confine(path.parent, path)
    check_private(path.parent)
    check_private(path)
    read_metadata(path / ".metadata")  # refuses a crafted .metadata with a clear error (DCP would reword it)
    view, state = _state(source, optimizer)
    chunks, tp = _chunk_layouts(source)
    templates: dict[tuple[str, str], DTensor] = {}
    for name, part in state.items():
        for key in list(part):
            fqn = _is_param_state(key, chunks)
            if fqn is not None and isinstance(part[key], DTensor):
                templates[(name, key)] = part[key]
                part[key] = torch.empty(part[key].shape, dtype=part[key].dtype)
    state["step"] = -1
    try:
        dcp.load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
    except (Exception, CheckpointException) as e:  # CheckpointException derives from BaseException
        unsafe = _unsafe(e)
        if unsafe is not None:
            raise unsafe from None
        raise ValueError(f"checkpoint {path} does not fit this model: {_first_line(e)}; was it saved for another "
                         "model?") from e
    for (name, key), tmpl in templates.items():
        fqn = _is_param_state(key, chunks)
        assert fqn is not None
        full = permute_chunks(state[name][key], chunks[fqn], tp)
        state[name][key] = distribute_tensor(full.to(tmpl.device), tmpl.device_mesh, tmpl.placements,
                                             src_data_rank=None)
    optims = (optimizer,) if optimizer is not None else ()
    set_state_dict(view, optims, model_state_dict=state["model"],
                   optim_state_dict=state["optim"] if optimizer is not None else {}, options=_OPTS)
    step = int(state["step"])
    log.info("loaded checkpoint step %d from %s", step, path)
    return step


def _unsafe(e: BaseException) -> UnsafeCheckpointError | None:
    """The UnsafeCheckpointError behind a DCP failure (DCP wraps each rank's exception), if any."""
    if isinstance(e, UnsafeCheckpointError):
        return e
    for f in (getattr(e, "failures", None) or {}).values():
        f = f[0] if isinstance(f, tuple) else f
        if isinstance(f, UnsafeCheckpointError):
            return f
    return None


def _first_line(e: BaseException) -> str:
    failures = getattr(e, "failures", None)  # CheckpointException: {rank: the exception on that rank}
    if failures:
        first = next(iter(failures.values()))
        e = first[0] if isinstance(first, tuple) else first   # (exception, traceback frames)
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


# ---------------------------------------------------------------------------------------------------------------
# Periodic saving for training loops


class Checkpointer:
    """Resume-and-save helper for a training loop: ``start = ck.resume(prog, opt)`` then ``ck.maybe_save(prog, opt,
    step)`` after every step."""

    def __init__(self, options: CheckpointOptions) -> None:
        self.options = options
        self.lock = CheckpointLock(options.root)

    def _lock(self) -> None:
        """Rank 0 takes the root's exclusive lock (at once or CheckpointLockedError) and drops stale temporaries."""
        if _rank() != 0 or self.lock.held:
            return
        self.lock.acquire()
        check_private(Path(self.options.root))
        for d in Path(self.options.root).glob(".tmp-step_*"):  # under the lock, no other save is running
            shutil.rmtree(d, ignore_errors=True)

    def close(self) -> None:
        """Release the directory lock (also released when the process exits)."""
        self.lock.release()

    def resume(self, source: Source, optimizer: torch.optim.Optimizer | None) -> int:
        """Load the latest checkpoint if there is one; the number of steps already done (0 for a fresh start)."""
        self._lock()
        found = latest_checkpoint(self.options.root)
        if found is None:
            return 0
        return load_checkpoint(source, optimizer, found[0])

    def maybe_save(self, source: Source, optimizer: torch.optim.Optimizer | None, step: int, *,
                   force: bool = False, extra: dict[str, Any] | None = None) -> Path | None:
        """Save if ``step`` is a multiple of ``every`` (or ``force``); prune old checkpoints.  ``extra``: metadata
        for ``autopar.json`` (see :func:`save_checkpoint`)."""
        every = self.options.every
        if not force and (every == 0 or step % every):
            return None
        self._lock()
        path = save_checkpoint(source, optimizer, step, self.options.root, extra=extra)
        if _rank() == 0 and self.options.keep:
            done = _steps(Path(self.options.root), complete=False)  # numeric: step_100000000 after step_99999999
            for _, d in done[:-self.options.keep]:
                shutil.rmtree(d, ignore_errors=True)
        _barrier()
        return path
