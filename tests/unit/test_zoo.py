"""Tests for the built-in model zoo (autopar.zoo): sizes, parameter counts, numerics on CPU, tracing, registry."""

from __future__ import annotations

import dataclasses
import sys
import textwrap
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from autopar.zoo import GPTConfig, LlamaConfig, ModelSpec, MoEConfig, build, get_config, list_models
from autopar.zoo.llama import GQAttention, rope_tables
from autopar.zoo.moe import MoELayer

TINY = ["gpt-tiny", "llama-tiny", "moe-tiny", "wrn-tiny", "vit-tiny", "mlp-tiny"]
GPT_NAMES = [n for n in list_models() if get_config(n).__class__ is GPTConfig]
LLAMA_NAMES = [n for n in list_models() if get_config(n).__class__ is LlamaConfig]
SC21_NAMES = [n for n in list_models() if n.startswith("megatron-")]


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def sc21_eq2(cfg: GPTConfig) -> Fraction:
    """Narayanan et al. SC'21 Eq. (2), evaluated exactly: 12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))."""
    n, h = cfg.layers, cfg.hidden
    return 12 * n * h * h * (1 + Fraction(13, 12 * h) + Fraction(cfg.vocab + cfg.seq, 12 * n * h))


# --- registry ---------------------------------------------------------------------------------------------------------
def test_list_models_covers_the_brief() -> None:
    names = set(list_models())
    expected = {"gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl", "gpt3-1.3b", "gpt3-2.7b", "gpt3-6.7b",
                "gpt3-13b", "gpt3-175b", "gpt-tiny", "llama3-8b", "llama3-70b", "llama3-405b", "llama-tiny",
                "moe-tiny", "moe-8x1b", "wrn-50-2", "wrn-tiny", "mlp-tiny", "mlp-large"}
    assert expected <= names
    assert len(SC21_NAMES) == 10


@pytest.mark.parametrize("name", list_models())
def test_every_model_builds_on_meta(name: str) -> None:
    spec = build(name, batch=2)
    assert isinstance(spec, ModelSpec) and spec.name == name
    assert spec.family in ("gpt", "llama", "moe", "sparse_moe", "wrn", "vit", "mlp")
    assert all(p.is_meta for p in spec.model.parameters())
    assert all(t.is_meta and t.shape[0] == 2 for t in spec.example_inputs)
    assert spec.example_target is not None and spec.example_target.is_meta
    assert dataclasses.is_dataclass(spec.config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(spec.config, dataclasses.fields(spec.config)[0].name, 1)
    if hasattr(spec.config, "param_count"):
        assert n_params(spec.model) == spec.config.param_count()


def test_meta_forward_shapes_gpt3_175b() -> None:
    spec = build("gpt3-175b", batch=1, seq=16)
    out = spec.model(*spec.example_inputs)
    assert out.shape == (1, 16, 50257) and out.is_meta
    assert spec.loss_fn(out, spec.example_target).shape == ()


def test_unknown_name_error() -> None:
    with pytest.raises(ValueError) as info:
        build("gpt2-smal")
    msg = str(info.value)
    assert "\n" not in msg
    assert msg.startswith("unknown model 'gpt2-smal'")
    assert "did you mean 'gpt2-small'" in msg
    assert "llama3-8b" in msg and "'package.module:factory'" in msg
    with pytest.raises(ValueError, match="unknown model"):
        get_config("nope")


def test_seq_override_and_dtype() -> None:
    spec = build("gpt2-small", batch=3, seq=2048, dtype=torch.bfloat16)
    assert spec.model.wpe.weight.shape == (2048, 768) and spec.model.wpe.weight.dtype == torch.bfloat16
    assert spec.example_inputs[0].shape == (3, 2048) and spec.config.seq == 2048
    assert build("llama-tiny", seq=16).model.rope_cos.shape == (16, 8)
    with pytest.raises(ValueError, match="seq does not apply"):
        build("wrn-tiny", seq=16)
    with pytest.raises(ValueError, match="batch"):
        build("gpt-tiny", batch=0)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible by heads"):
        GPTConfig(layers=2, hidden=65, heads=4, seq=8, vocab=8)
    with pytest.raises(ValueError, match="kv_heads"):
        LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=3, ffn=8, vocab=8, seq=8)
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(layers=1, hidden=8, heads=2, seq=4, vocab=8, experts=1)
    with pytest.raises(ValueError, match="positive"):
        GPTConfig(layers=0, hidden=64, heads=4, seq=8, vocab=8)


# --- parameter counts -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", GPT_NAMES)
def test_gpt_param_count_matches_sc21_eq2(name: str) -> None:
    cfg = get_config(name)
    assert isinstance(cfg, GPTConfig) and cfg.tied
    model = build(name, batch=1).model
    assert cfg.sc21_param_count() == sc21_eq2(cfg)
    # Eq. (2) counts every weight except the final LayerNorm (2h), which the model has.
    assert n_params(model) == sc21_eq2(cfg) + 2 * cfg.hidden == cfg.param_count()


def test_sc21_sizes_round_to_paper_names() -> None:
    for name in SC21_NAMES:
        billions = float(name.removeprefix("megatron-").removesuffix("b"))
        assert round(get_config(name).sc21_param_count() / 1e9, 1) == pytest.approx(billions, abs=0.06), name


@pytest.mark.parametrize("name", LLAMA_NAMES)
def test_llama_param_count(name: str) -> None:
    cfg = get_config(name)
    h, d = cfg.hidden, cfg.hidden // cfg.heads
    per_layer = h * h + 2 * h * cfg.kv_heads * d + h * h + 3 * h * cfg.ffn + 2 * h  # wq, wk+wv, wo, SwiGLU, norms
    formula = cfg.layers * per_layer + 2 * cfg.vocab * h + h
    assert n_params(build(name, batch=1).model) == formula == cfg.param_count()


def test_known_published_param_counts() -> None:
    assert n_params(build("gpt2-small").model) == 124_439_808  # GPT-2 small, tied
    assert n_params(build("llama3-8b").model) == 8_030_261_248
    assert n_params(build("llama3-405b").model) == 405_853_388_800
    assert n_params(build("wrn-50-2").model) == 68_883_240  # torchvision wide_resnet50_2
    # ViT-B/16, L/16, H/14 at 224 with 1000 classes: as transformers' ViTForImageClassification of that config
    assert n_params(build("vit-b-16").model) == 86_567_656
    assert n_params(build("vit-l-16").model) == 304_326_632
    assert n_params(build("vit-h-14").model) == 632_045_800


@settings(max_examples=15, deadline=None)
@given(layers=st.integers(1, 3), heads=st.integers(1, 4), head_dim=st.integers(1, 8), seq=st.integers(1, 16),
       vocab=st.integers(1, 50), tied=st.booleans())
def test_gpt_param_count_property(layers: int, heads: int, head_dim: int, seq: int, vocab: int, tied: bool) -> None:
    from autopar.zoo import GPT

    cfg = GPTConfig(layers=layers, hidden=heads * head_dim, heads=heads, seq=seq, vocab=vocab, tied=tied)
    with torch.device("meta"):
        model = GPT(cfg)
    untied_extra = 0 if tied else vocab * cfg.hidden
    assert n_params(model) == cfg.param_count() == sc21_eq2(cfg) + 2 * cfg.hidden + untied_extra


def expected_output_shape(spec: ModelSpec, batch: int) -> tuple[int, ...]:
    cfg = spec.config
    if spec.family in ("gpt", "llama", "moe", "sparse_moe"):
        return (batch, cfg.seq, cfg.vocab)
    return (batch, cfg.classes) if spec.family in ("wrn", "vit") else (batch, cfg.out_features)


# --- CPU numerics -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_tiny_forward_backward_cpu(name: str) -> None:
    spec = build(name, batch=2, device="cpu")
    out = spec.model(*spec.example_inputs)
    assert tuple(out.shape) == expected_output_shape(spec, 2)
    target = spec.make_target(2, "cpu")
    assert target.shape == spec.example_target.shape
    loss = spec.loss_fn(out, target)
    assert loss.shape == () and torch.isfinite(loss)
    loss.backward()
    for pname, p in spec.model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname


def test_deterministic_init() -> None:
    a, b = build("gpt-tiny", device="cpu").model, build("gpt-tiny", device="cpu").model
    c = build("gpt-tiny", device="cpu", seed=1).model
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.wte.weight, c.wte.weight)
    fc1 = a.blocks[0].mlp.fc1
    assert torch.all(fc1.bias == 0) and 0.015 < float(fc1.weight.detach().std()) < 0.025
    assert torch.all(a.ln_f.weight == 1) and torch.all(a.ln_f.bias == 0)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_gpt_weights_tied(device: str) -> None:
    model = build("gpt-tiny", device=device).model
    assert model.lm_head.weight is model.wte.weight
    if device == "cpu":
        with torch.no_grad():
            model.wte.weight[0, 0] = 123.0
        assert float(model.lm_head.weight.detach()[0, 0]) == 123.0
    moe = build("moe-tiny", device=device).model
    assert moe.lm_head.weight is moe.wte.weight
    llama = build("llama-tiny", device=device).model
    assert llama.lm_head.weight is not llama.embed.weight


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "moe-tiny"])
def test_causal(name: str) -> None:
    spec = build(name, batch=1, device="cpu")
    idx = spec.example_inputs[0]
    changed = idx.clone()
    changed[0, -1] = (changed[0, -1] + 1) % spec.config.vocab
    with torch.no_grad():
        a, b = spec.model(idx), spec.model(changed)
    torch.testing.assert_close(a[:, :-1], b[:, :-1])
    assert not torch.allclose(a[:, -1], b[:, -1])


def test_vit_attention_is_bidirectional() -> None:
    spec = build("vit-tiny", batch=1, device="cpu")
    x = spec.example_inputs[0]
    changed = x.clone()
    changed[..., -1, -1] += 1.0  # a pixel of the last patch: the class token (read by the head) attends to it
    with torch.no_grad():
        assert not torch.allclose(spec.model(x), spec.model(changed))
    with pytest.raises(ValueError, match="multiple of patch"):
        dataclasses.replace(spec.config, image=36)


def test_llama_gqa_and_rope() -> None:
    spec = build("llama-tiny", device="cpu")
    model, cfg = spec.model, spec.config
    assert "rope_cos" not in model.state_dict() and "rope_cos" in dict(model.named_buffers())
    cos, sin = rope_tables(cfg.seq, cfg.head_dim, cfg.rope_theta)
    torch.testing.assert_close(model.rope_cos, cos)
    torch.testing.assert_close(model.rope_sin, sin)
    attn: GQAttention = model.layers[0].attn
    x = torch.randn(2, 8, cfg.hidden)
    c, s = cos[:8], sin[:8]
    with torch.no_grad():
        got = attn(x, c, s)
        q = attn.wq(x).view(2, 8, cfg.heads, -1).transpose(1, 2)
        k = attn.wk(x).view(2, 8, cfg.kv_heads, -1).transpose(1, 2)
        v = attn.wv(x).view(2, 8, cfg.kv_heads, -1).transpose(1, 2)

        def rot(t: torch.Tensor) -> torch.Tensor:  # complex-number form of RoPE (half-split pairing)
            half = t.shape[-1] // 2
            z = torch.complex(t[..., :half], t[..., half:]) * torch.polar(torch.ones_like(c), torch.atan2(s, c))
            return torch.cat((z.real, z.imag), dim=-1)

        ref = F.scaled_dot_product_attention(rot(q), rot(k), v, is_causal=True, enable_gqa=True)
        ref = attn.wo(ref.transpose(1, 2).reshape(2, 8, cfg.hidden))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


def test_moe_dense_routing_matches_sparse_top2() -> None:
    torch.manual_seed(0)
    cfg = MoEConfig(layers=1, hidden=16, heads=2, seq=4, vocab=8, experts=4)
    layer = MoELayer(cfg)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        got = layer(x)
        probs = torch.softmax(layer.router(x), -1)
        ref = torch.zeros_like(x)
        for b in range(2):
            for t in range(5):
                w, i = probs[b, t].topk(2)
                w = w / w.sum()
                ref[b, t] = sum(w[j] * layer.experts[int(i[j])](x[b, t]) for j in range(2))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)


# --- tracing ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", TINY)
def test_fx_symbolic_trace(name: str) -> None:
    spec = build(name, batch=2, device="cpu")
    gm = torch.fx.symbolic_trace(spec.model)
    spec.model.eval()
    gm.eval()
    with torch.no_grad():
        torch.testing.assert_close(gm(*spec.example_inputs), spec.model(*spec.example_inputs))


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_torch_export_on_meta(name: str) -> None:
    spec = build(name, batch=2)
    ep = torch.export.export(spec.model, spec.example_inputs, strict=False)
    outs = [n for n in ep.graph.nodes if n.op == "output"][0].args[0]
    assert tuple(outs[0].meta["val"].shape) == (2, spec.config.seq, spec.config.vocab)


# --- user factories ---------------------------------------------------------------------------------------------------
FACTORY_MODULE = '''
import torch
from torch import nn
from autopar.zoo import build


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x)

    def example_inputs(self, batch, device):
        return (torch.zeros(batch, 4, device=device),)


def plain():
    return Net()


def with_inputs(batch, device):
    return nn.Linear(4, 2), torch.zeros(batch, 4)


def spec(**kwargs):
    return build("mlp-tiny", **kwargs)

NOT_CALLABLE = 3
'''


@pytest.fixture
def factory_module(tmp_path, monkeypatch) -> str:  # type: ignore[no-untyped-def]
    (tmp_path / "zoo_user_models.py").write_text(textwrap.dedent(FACTORY_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "zoo_user_models"
    sys.modules.pop("zoo_user_models", None)


def test_module_factory_loading(factory_module: str) -> None:
    s = build(f"{factory_module}:plain", batch=5)
    assert s.family == "custom" and s.config is None and s.model.fc.weight.is_meta
    assert s.example_inputs[0].shape == (5, 4) and s.example_inputs[0].is_meta
    s = build(f"{factory_module}:with_inputs", batch=3, device="cpu")
    assert s.model(*s.example_inputs).shape == (3, 2)
    s = build(f"{factory_module}:spec", batch=2)
    assert s.family == "mlp" and s.batch == 2
    with pytest.raises(ValueError, match="has no attribute"):
        build(f"{factory_module}:missing")
    with pytest.raises(ValueError, match="not callable"):
        build(f"{factory_module}:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import module"):
        build("no_such_pkg_xyz.mod:f")
