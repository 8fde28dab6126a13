"""Where each rank's weights come from, and filling its shards (see :mod:`autopar.codegen.runtime.init` for how a
full tensor is cut into the local piece).

``init`` (of :func:`autopar.codegen.runtime.program.build_program`) is one of:

* ``"copy"``: the caller's model holds real weights; each rank copies its slices.
* a state dict (a mapping FQN -> tensor) or the path of a checkpoint: a ``.safetensors`` file, a Hugging Face model
  directory (``model.safetensors`` or the sharded ``model.safetensors.index.json``), or a ``torch.save`` file
  (``.pt``/``.pth``/``.bin``, read memory-mapped with ``weights_only=True``).  The model may be on the meta device.
  Tensors are read one at a time (safetensors reads only the tensor asked for).  Buffers a state dict does not hold
  (non-persistent ones such as RoPE's ``inv_freq``) come from the model when it is real, else from its own
  initialization; a missing *parameter* is an error, never silently initialized.
* ``"model"``: the model's own initialization, run shard-locally on a meta model: one module at a time is made real,
  initialized (Hugging Face ``_init_weights``, torchtitan ``init_states``, else ``reset_parameters``), its local
  shards kept and the rest freed.
* an :data:`~autopar.codegen.runtime.init.Initializer` function (e.g. ``autopar.zoo.init_weights``).
"""

from __future__ import annotations

import itertools
import json
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autopar import ir
from autopar.codegen.runtime.init import Initializer, LocalSlot, copy_into, fill_slot, meta_clone, seed_stream

__all__ = ["StateReader", "apply_model_init", "load_weights", "model_init", "open_state", "strip_group"]


class StateReader:
    """Tensors by name from a state dict or a checkpoint, read on demand."""

    def __init__(self, get: Callable[[str], torch.Tensor | None], names: set[str], where: str) -> None:
        self.get = get
        self.names = names
        self.where = where


def open_state(source: Mapping[str, torch.Tensor] | str | os.PathLike[str]) -> StateReader:
    """A :class:`StateReader` over a state dict or a checkpoint path (see the module docstring)."""
    if isinstance(source, Mapping):
        sd = _unwrap(source)
        return StateReader(sd.get, set(sd), "the state dict")
    path = Path(source)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
            files = {f: _safetensors(path / f) for f in sorted(set(weight_map.values()))}
            return StateReader(lambda k: files[weight_map[k]].get(k) if k in weight_map else None, set(weight_map),
                               str(path))
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return open_state(path / name)
        raise FileNotFoundError(f"{path}: no model.safetensors(.index.json) or pytorch_model.bin in the directory")
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if path.suffix == ".safetensors":
        reader = _safetensors(path)
        return StateReader(reader.get, reader.names, str(path))
    sd = _unwrap(torch.load(path, map_location="cpu", mmap=True, weights_only=True))
    return StateReader(sd.get, set(sd), str(path))


class _SafeTensors:
    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        self.file = safe_open(str(path), framework="pt", device="cpu")
        self.names = set(self.file.keys())

    def get(self, name: str) -> torch.Tensor | None:
        return self.file.get_tensor(name) if name in self.names else None


def _safetensors(path: Path) -> _SafeTensors:
    try:
        return _SafeTensors(path)
    except ImportError as e:
        raise ImportError(f"reading {path} needs the safetensors package (pip install safetensors)") from e


def _unwrap(sd: Any) -> dict[str, torch.Tensor]:
    """A state dict, also when saved as ``{"state_dict": ...}`` or ``{"model": ...}`` (training checkpoints)."""
    if isinstance(sd, Mapping) and len(sd) <= 3:
        for key in ("state_dict", "model"):
            if isinstance(sd.get(key), Mapping):
                return _unwrap(sd[key])
    if not isinstance(sd, Mapping) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise ValueError("a state dict must map parameter names to tensors")
    return dict(sd)


def model_init(root: nn.Module) -> Initializer:
    """The model's own initialization as an :data:`Initializer` over a stream of one real module at a time: Hugging
    Face models' ``_init_weights(module)`` (parameters and buffers such as RoPE tables and BatchNorm statistics),
    torchtitan modules' ``init_states()``, else ``reset_parameters()``.  The same calls in the same order on a real
    full model (:func:`apply_model_init`) give the same tensors."""
    hf = getattr(root, "_init_weights", None)

    def init(stream: Any, seed: int) -> None:
        torch.manual_seed(seed)
        for m in stream.modules():
            _init_one(m, hf)

    return init


def apply_model_init(model: nn.Module, seed: int) -> None:
    """:func:`model_init` on a real model, in place (what a single-process run of the same init computes)."""
    model_init(model)(model, seed)


@torch.no_grad()
def _init_one(m: nn.Module, hf: Callable[[nn.Module], None] | None) -> None:
    if hf is not None:
        hf(m)
    elif callable(getattr(m, "init_states", None)):
        # torchtitan's init_states recurses into children: initialize this module's own tensors only (a streamed
        # module has no children; a whole model's modules do, and each is visited in turn)
        saved = dict(m._modules)
        m._modules.clear()
        try:
            m.init_states()
        finally:
            m._modules.update(saved)
    elif callable(getattr(m, "reset_parameters", None)):
        m.reset_parameters()


def load_weights(stages: list[nn.Module], model: nn.Module, init: Any, seed: int, canon: dict[str, str],
                 chunks: dict[str, int], plan: ir.Plan, fsdp: bool, dp_rank: int, tp_rank: int,
                 constants: dict[str, torch.Tensor] | None = None,
                 experts: tuple[int, int, int, int] | None = None) -> None:
    """Fill every parameter and buffer of this rank's ``stages`` (already sharded and on their device) from
    ``init`` (see the module docstring).  ``experts``: (ep, ep rank, expert shard group size, rank in it) of the
    routed-expert weights that expert parallelism moved into ``_autopar_ep<k>`` region modules
    (:mod:`autopar.codegen.runtime.expert_parallel`)."""
    slots: dict[str, dict[int, LocalSlot]] = {}
    for s in stages:
        for name, t in itertools.chain(s.named_parameters(remove_duplicate=False),
                                       s.named_buffers(remove_duplicate=False)):
            fqn = canon.get(strip_group(name), strip_group(name))
            param = isinstance(t, nn.Parameter)
            if experts is not None and param and any(_REGION.fullmatch(part) for part in name.split(".")):
                ep, ep_rank, shards, shard_rank = experts
                slot = LocalSlot(t, fsdp=fsdp, dp_rank=shard_rank, dp=shards, ep=ep, ep_rank=ep_rank)
            else:  # FSDP shards over dp x cp
                slot = LocalSlot(t, chunks=chunks.get(fqn, 1), tp=plan.mesh.tp, fsdp=fsdp and param, dp_rank=dp_rank,
                                 dp=plan.mesh.dp * plan.mesh.cp)
            slots.setdefault(fqn, {})[id(t)] = slot
    filled: set[int] = set()

    def consume(fqn: str, full: torch.Tensor, buffers_only: bool = False) -> None:
        for key, slot in slots.get(canon.get(fqn, fqn), {}).items():
            if key not in filled and not (buffers_only and isinstance(slot.tensor, nn.Parameter)):
                fill_slot(slot, full, tp_rank)
                filled.add(key)

    def missing() -> list[str]:
        return [f for f, d in slots.items() if any(k not in filled for k in d)]

    for fqn, value in (constants or {}).items():
        consume(fqn, value)
    real = not any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))
    if isinstance(init, str) and init == "copy":
        what = "the source model"
        copy_into(model, consume)
    elif isinstance(init, str) and init == "model":
        what = "init='model'"
        seed_stream(meta_clone(model), seed, consume, model_init(model))
    elif callable(init):
        what = f"init={getattr(init, '__name__', '?')}"
        seed_stream(meta_clone(model), seed, consume, init)
    else:
        state = open_state(init)
        what = state.where
        aliases: dict[str, list[str]] = {}
        for a, c in canon.items():
            aliases.setdefault(c, []).append(a)
        for fqn in list(slots):
            name = next((n for n in [fqn, *aliases.get(fqn, [])] if n in state.names), None)
            if name is not None:
                value = state.get(name)
                assert value is not None
                consume(fqn, value)
        if missing():  # buffers a state dict leaves out: the model's own values
            if real:
                copy_into(model, lambda f, t: consume(f, t, buffers_only=True))
            else:
                seed_stream(meta_clone(model), seed, lambda f, t: consume(f, t, buffers_only=True),
                            model_init(model))
    left = missing()
    if left:
        raise ValueError(f"no value for {left[:5]}{' ...' if len(left) > 5 else ''} in {what}")


_REGION = re.compile(r"_autopar_ep\d+")  # expert_parallel.REGION_PREFIX: the ep region submodules of a group


def strip_group(name: str) -> str:
    """``groups.3.blocks.1.attn.qkv.weight`` -> ``blocks.1.attn.qkv.weight`` (FQN in the original model); an expert
    weight moved into an ep region (``groups.3._autopar_ep0.layers.1.mlp.experts.w_up``) keeps its model name too."""
    parts = name.split(".")
    if any(_REGION.fullmatch(p) for p in parts):
        parts = [p for p in parts if not _REGION.fullmatch(p)]
        name = ".".join(parts)
    return ".".join(parts[2:]) if parts[0] == "groups" else name
