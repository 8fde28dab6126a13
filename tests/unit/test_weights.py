"""Weight sources of the runtime (autopar.codegen.runtime.weights): state dicts and checkpoint files read by name,
and the model's own initialization module by module."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from autopar.codegen.runtime.init import meta_clone, seed_stream
from autopar.codegen.runtime.weights import apply_model_init, model_init, open_state


def _sd() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a.weight": torch.randn(4, 3, generator=g), "b.bias": torch.randn(5, generator=g)}


def test_state_dict_and_checkpoint_files_read_by_name(tmp_path) -> None:
    sd = _sd()
    save_file(sd, str(tmp_path / "w.safetensors"))
    torch.save({"state_dict": sd, "step": torch.tensor(3)}, tmp_path / "ckpt.pt")
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({"a.weight": sd["a.weight"]}, str(hf / "model-00001-of-00002.safetensors"))
    save_file({"b.bias": sd["b.bias"]}, str(hf / "model-00002-of-00002.safetensors"))
    (hf / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a.weight": "model-00001-of-00002.safetensors", "b.bias": "model-00002-of-00002.safetensors"}}))
    for src in (sd, tmp_path / "w.safetensors", str(tmp_path / "ckpt.pt"), hf):
        r = open_state(src)
        assert r.names == set(sd), src
        for k, v in sd.items():
            assert torch.equal(r.get(k), v), (src, k)
        assert r.get("missing") is None
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_state(tmp_path / "nope.safetensors")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        open_state(tmp_path / "empty")
    with pytest.raises(ValueError, match="names to tensors"):
        open_state({"a": 1})


def test_model_init_streamed_equals_whole_model() -> None:
    """The model's own initialization replayed one module at a time (what each rank runs on a meta model) gives the
    tensors the same calls give on the whole model."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Embedding(5, 8),
                                torch.nn.BatchNorm1d(8))
    whole = meta_clone(model).to_empty(device="cpu")
    apply_model_init(whole, 7)
    got: dict[str, torch.Tensor] = {}
    seed_stream(meta_clone(model), 7, lambda name, t: got.__setitem__(name, t.clone()), model_init(model))
    want = dict(whole.state_dict())
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    assert not torch.equal(want["0.weight"], torch.zeros_like(want["0.weight"]))
