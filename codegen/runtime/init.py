"""Parameter loading: meta clones, and filling each rank's shards from a real model or a seeded initialization.

The program is always built on the meta device (a clone of the caller's model whose parameters are meta tensors, so
the caller's model is never touched and nothing is allocated), sharded (tp DTensors, FSDP), moved with
``Module.to_empty`` and then filled shard by shard:

* ``init="copy"``: from the caller's model tensors (each rank copies only its local slices).
* ``init=<initializer>`` (e.g. ``autopar.zoo.init_weights``): every parameter is generated exactly as the
  initializer would on a full model built with
  ``device="cpu", seed=seed`` (the zoo's ``init_weights`` rules and generator stream).  The stream is replayed one
  module at a time: the full tensor of *one* parameter exists at a time (a generator draw cannot be skipped), its
  local shard is kept and the rest is freed, so the full model is never materialized on a rank.  Peak extra memory is
  the largest single parameter.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

__all__ = ["Initializer", "meta_clone", "alias_names", "seed_stream", "copy_stream", "copy_into", "LocalSlot",
           "fill_slot"]

log = logging.getLogger(__name__)


def meta_clone(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are meta tensors (ties preserved, nothing copied)."""
    memo: dict[int, object] = {}
    for _, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if id(t) in memo:
            continue
        meta = torch.empty_like(t, device="meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def alias_names(model: nn.Module) -> dict[str, list[str]]:
    """Canonical FQN (first name) -> every FQN of the same parameter or buffer (tied weights)."""
    by_id: dict[int, list[str]] = {}
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        by_id.setdefault(id(t), []).append(name)
    return {names[0]: names for names in by_id.values()}


def copy_stream(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(fqn, tensor) for every parameter and buffer of a real model, aliases included."""
    for name, t in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        if t.is_meta:
            raise ValueError(f"init='copy' needs a model with real weights but {name} is on the meta device; use "
                             "init='seed' to initialize a meta model shard by shard")
        yield name, t.detach()


class _ModuleStream:
    """Duck-typed stand-in for a model in ``autopar.zoo._init.init_weights``: ``modules()`` yields real, childless
    copies of the meta model's modules one at a time and reports each (initialized) copy to ``emit`` once the
    initializer asks for the next one."""

    def __init__(self, meta_model: nn.Module, dtype_device: torch.device,
                 emit: Callable[[str, nn.Module], None]) -> None:
        self.root = meta_model
        self.device = dtype_device
        self.emit = emit
        counts: dict[int, int] = {}
        for _, t in meta_model.named_parameters(remove_duplicate=False):
            counts[id(t)] = counts.get(id(t), 0) + 1
        self.shared = {k for k, c in counts.items() if c > 1}
        self.cache: dict[int, nn.Parameter] = {}

    def _real_copy(self, m: nn.Module) -> nn.Module:
        c = m.__class__.__new__(m.__class__)
        c.__dict__ = dict(m.__dict__)
        c._modules = {}
        c._parameters = {}
        for k, p in m._parameters.items():
            if p is None:
                c._parameters[k] = None
            elif id(p) in self.cache:
                c._parameters[k] = self.cache[id(p)]
            else:
                real = nn.Parameter(torch.empty_like(p, device=self.device), requires_grad=p.requires_grad)
                if id(p) in self.shared:
                    self.cache[id(p)] = real
                c._parameters[k] = real
        c._buffers = {k: (None if b is None else torch.empty_like(b, device=self.device))
                      for k, b in m._buffers.items()}
        if isinstance(c, nn.modules.batchnorm._BatchNorm):
            c.reset_running_stats()
        reset = getattr(c, "reset_buffers", None)
        if callable(reset) and c._buffers:
            reset()
        return c

    def modules(self) -> Iterator[nn.Module]:
        for path, m in self.root.named_modules():
            real = self._real_copy(m)
            yield real
            self.emit(path, real)


Initializer = Callable[[nn.Module, int], None]
"""``init(model, seed)`` fills a model's parameters deterministically from ``seed``, visiting them only through
``model.modules()`` (e.g. ``autopar.zoo.init_weights``), so it can run on a stream of one module at a time."""


def seed_stream(meta_model: nn.Module, seed: int, consume: Callable[[str, torch.Tensor], None],
                init_weights: Initializer) -> None:
    """Call ``consume(fqn, tensor)`` for every parameter and buffer, initialized as ``init_weights(model, seed)``
    would on a real copy of ``meta_model``; tensors are produced (and can be freed) one module at a time.

    Aliases (tied weights) are reported under each of their names."""
    aliases: dict[int, list[str]] = {}
    for name, t in meta_model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(t), []).append(name)
    done: set[str] = set()
    keep: list[nn.Parameter] = []

    def emit(path: str, real: nn.Module) -> None:
        meta_mod = meta_model.get_submodule(path)
        for k, p in real._parameters.items():
            if p is not None:
                for fqn in aliases[id(meta_mod._parameters[k])]:
                    if fqn not in done:
                        done.add(fqn)
                        consume(fqn, p.detach())
        for k, b in real._buffers.items():
            if b is not None:
                consume(f"{path}.{k}" if path else k, b)
        for p in real._parameters.values():
            if p is not None:  # free the storage but keep the object alive: init_weights tracks params by id()
                keep.append(p)
                p.data = torch.empty(0, dtype=p.dtype)

    # init_weights only calls model.modules(); the stream hands it one real module at a time.
    init_weights(_ModuleStream(meta_model, torch.device("cpu"), emit), seed)  # type: ignore[arg-type]


def copy_into(model: nn.Module, consume: Callable[[str, torch.Tensor], None]) -> None:
    """Call ``consume(fqn, tensor)`` for every parameter and buffer of a real model, aliases included."""
    for name, t in copy_stream(model):
        consume(name, t)


class LocalSlot:
    """Where one full tensor goes on this rank: the parameter/buffer and how to cut its local piece."""

    __slots__ = ("tensor", "chunks", "tp", "dp_rank", "dp", "fsdp", "ep", "ep_rank")

    def __init__(self, tensor: torch.Tensor, *, chunks: int = 1, tp: int = 1, fsdp: bool = False, dp_rank: int = 0,
                 dp: int = 1, ep: int = 1, ep_rank: int = 0) -> None:
        self.tensor = tensor
        self.chunks = chunks
        self.tp = tp
        self.fsdp = fsdp
        self.dp_rank = dp_rank
        self.dp = dp
        self.ep = ep  # a routed-expert weight: experts split in ep dim-0 blocks, this rank's is ep_rank
        self.ep_rank = ep_rank


@torch.no_grad()
def fill_slot(slot: LocalSlot, full: torch.Tensor, tp_rank: int) -> None:
    """Copy this rank's piece of ``full`` (the model-layout tensor) into ``slot.tensor``.

    Order of cuts = order in which the program sharded it: chunk-interleave (fused projections), the ep block of a
    routed-expert weight (the ep_rank-th dim-0 ``torch.chunk``), the tp placement (``Shard(d)``: the tp_rank-th
    ``torch.chunk``), then FSDP2's dim-0 ``torch.chunk`` over dp (for an expert weight: over its shard group)."""
    from autopar.codegen.runtime.tensor_parallel import permute_chunks

    t = slot.tensor
    if slot.chunks > 1:
        full = permute_chunks(full, slot.chunks, slot.tp)
    local = full
    if slot.ep > 1:
        local = torch.chunk(local, slot.ep, dim=0)[slot.ep_rank]
    placements = t.placements if isinstance(t, DTensor) else ()
    tp_pl = placements[-1] if placements else None
    if isinstance(tp_pl, Shard) and slot.tp > 1:
        local = torch.chunk(local, slot.tp, dim=tp_pl.dim)[tp_rank]
    if slot.fsdp and slot.dp > 1:
        parts = torch.chunk(local, slot.dp, dim=0)
        local = parts[slot.dp_rank] if slot.dp_rank < len(parts) else local[0:0]
    dst = t.to_local() if isinstance(t, DTensor) else t
    if tuple(dst.shape) != tuple(local.shape):
        raise AssertionError(f"local shard shape {tuple(dst.shape)} != expected {tuple(local.shape)}")
    dst.copy_(local.to(dtype=dst.dtype, device=dst.device))
