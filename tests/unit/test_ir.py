"""Tier (a): the graph IR — tracing, FLOP/param accounting, layer grouping, verification, errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from autopar import ir
from autopar.ir.ops import KINDS, OP_RULES, canonical_op, op_cost
from autopar.zoo import build, get_config


def megatron_train_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """Narayanan et al. SC'21: fwd+bwd matmul FLOPs without recomputation, 72*B*s*l*h^2*(1 + s/6h + V/12lh)."""
    return 72.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))


def sc21_params(l: int, h: int, V: int, s: int) -> int:
    """SC'21 Eq. 2: P = 12*l*h^2*(1 + 13/(12h) + (V+s)/(12*l*h)), i.e. 12lh^2 + 13lh + (V+s)h; plus the final
    LayerNorm (2h) that the equation folds away."""
    return 12 * l * h * h + 13 * l * h + (V + s) * h + 2 * h


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt2-small", "megatron-1.7b", "megatron-18.4b", "megatron-145.6b"])
def test_gpt_flops_and_params(name: str) -> None:
    cfg = get_config(name)
    B = 2
    spec = build(name, batch=B, device="meta")
    g = ir.verify(ir.trace(spec.model, spec.example_inputs))
    s, l, h, V = cfg.seq, cfg.layers, cfg.hidden, cfg.vocab
    assert g.matmul_flops() == pytest.approx(megatron_train_flops(B, s, l, h, V), rel=0.02)
    assert g.num_params == sum(p.numel() for p in spec.model.parameters())
    assert g.num_params == sc21_params(l, h, V, s)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny", "gpt2-small", "llama3-8b"])
def test_repeated_blocks_found(name: str) -> None:
    cfg = get_config(name)
    spec = build(name, batch=1, device="meta")
    g = ir.verify(ir.trace(spec.model, spec.example_inputs))
    blocks = g.blocks()
    assert len(blocks) == cfg.layers
    assert len({b.structural_hash for b in blocks}) == 1
    assert [b.module_path.rsplit(".", 1)[-1] for b in blocks] == [str(i) for i in range(cfg.layers)]
    roles = [x.role for x in g.layers]
    assert roles == ["prefix"] + ["block"] * cfg.layers + ["suffix"]


def test_fx_and_export_agree_on_costs() -> None:
    spec = build("llama-tiny", batch=2, device="meta")
    g_fx = ir.verify(ir.trace(spec.model, spec.example_inputs, frontend="fx"))
    g_ex = ir.verify(ir.trace(spec.model, spec.example_inputs, frontend="export"))
    assert g_fx.frontend == "fx" and g_ex.frontend == "export"
    assert g_fx.matmul_flops() == pytest.approx(g_ex.matmul_flops())
    assert g_fx.num_params == g_ex.num_params
    assert len(g_fx.blocks()) == len(g_ex.blocks()) == get_config("llama-tiny").layers
    assert {n.op for n in g_fx.nodes if n.kind == "matmul"} <= {"linear", "matmul"}
    assert sum(n.op == "sdpa" for n in g_fx.nodes) == sum(n.op == "sdpa" for n in g_ex.nodes)


def test_trace_does_not_touch_weights_or_model() -> None:
    spec = build("gpt-tiny", batch=2, device="cpu")
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    g = ir.trace(spec.model, spec.example_inputs)
    after = spec.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert g.num_params == sum(p.numel() for p in spec.model.parameters())


def test_input_kinds_real_meta_spec_agree() -> None:
    spec = build("gpt-tiny", batch=2, device="cpu")
    x = spec.example_inputs[0]
    g_real = ir.trace(spec.model, (x,))
    g_meta = ir.trace(spec.model, (x.to("meta"),))
    g_spec = ir.trace(spec.model, (ir.TensorSpec(tuple(x.shape), torch.long),))
    assert g_real.fingerprint == g_meta.fingerprint == g_spec.fingerprint


def test_tied_weights_counted_once_with_alias() -> None:
    spec = build("gpt-tiny", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    wte = g.param_map["wte.weight"]
    assert "lm_head.weight" in wte.aliases
    readers = [n for n in g.nodes if "wte.weight" in n.params]
    assert {n.kind for n in readers} == {"embedding", "matmul"}


def test_node_fields() -> None:
    spec = build("gpt-tiny", batch=2, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    fc1 = next(n for n in g.nodes if n.module_path == "blocks.1.mlp.fc1")
    cfg = get_config("gpt-tiny")
    assert fc1.op == "linear" and fc1.kind == "matmul"
    assert fc1.out.shape == (2, cfg.seq, 4 * cfg.hidden)
    assert fc1.params == ("blocks.1.mlp.fc1.weight", "blocks.1.mlp.fc1.bias")
    assert fc1.flops_fwd == 2 * 2 * cfg.seq * cfg.hidden * 4 * cfg.hidden
    assert fc1.flops_bwd == 2 * fc1.flops_fwd
    assert fc1.bytes_written == fc1.out.nbytes
    assert fc1.bytes_read == 4 * (2 * cfg.seq * cfg.hidden + 4 * cfg.hidden * cfg.hidden + 4 * cfg.hidden)
    views = [n for n in g.nodes if n.kind == "view"]
    assert views and all(n.bytes_read == 0 and n.flops_fwd == 0 for n in views)


@pytest.mark.parametrize("name", ["moe-tiny", "wrn-tiny", "mlp-tiny"])
def test_other_families_trace(name: str) -> None:
    spec = build(name, batch=2, device="meta")
    g = ir.verify(ir.trace(spec.model, spec.example_inputs))
    assert g.num_params == sum(p.numel() for p in spec.model.parameters())
    assert g.matmul_flops() > 0
    assert not g.unknown_ops, g.unknown_ops


def test_unknown_op_costed_by_bytes_and_reported() -> None:
    class Odd(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.special.bessel_j0(x) + 1

    g = ir.verify(ir.trace(Odd(), (torch.randn(4, 8),)))
    node = next(n for n in g.nodes if n.kind == "unknown")
    assert g.unknown_ops and "bessel_j0" in g.unknown_ops[0]
    assert node.flops_fwd == 0 and node.bytes_read == node.bytes_written == 4 * 32


def test_data_dependent_control_flow_names_module() -> None:
    class Gate(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if x.sum() > 0:
                return self.lin(x)
            return x

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pre = torch.nn.Linear(8, 8)
            self.gate = Gate()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.gate(self.pre(x))

    for frontend in ("fx", "export"):  # each front end alone fails and names the module and the line
        with pytest.raises(ir.TraceError) as ei:
            ir.trace(Net(), (torch.randn(2, 8),), frontend=frontend)
        msg = str(ei.value)
        assert "module 'gate' (Gate)" in msg and frontend in msg, msg
        assert "if x.sum() > 0" in msg and "control flow" in msg
        assert not isinstance(ei.value, ir.ExampleInputError)
    # "auto" captures the rest and makes the gate an opaque region: one node, replicated, FLOPs estimated from its
    # parameters (2 per parameter per output row)
    g = ir.verify(ir.trace(Net(), (torch.randn(2, 8),)))
    assert [p for p, _ in g.opaque] == ["gate"] and "control flow" in g.opaque[0][1]
    node = next(n for n in g.nodes if n.op == "opaque")
    assert node.module_path == "gate" and node.outputs[0].shape == (2, 8)
    assert node.flops_fwd == 2 * (8 * 8 + 8) * 2 and node.flops_bwd == 2 * node.flops_fwd
    assert set(node.params) == {"gate.lin.weight", "gate.lin.bias"} and not g.unknown_ops


def test_wrong_input_shape_is_reported_as_input_error() -> None:
    spec = build("mlp-tiny", batch=2, device="meta")
    x = spec.example_inputs[0]
    bad = torch.empty(x.shape[0], x.shape[1] + 3, device="meta")
    with pytest.raises(ir.ExampleInputError) as ei:
        ir.trace(spec.model, (bad,))
    msg = str(ei.value)
    assert "example inputs do not fit" in msg
    assert f"float32[{x.shape[0]}, {x.shape[1] + 3}]" in msg
    assert "layers.0" in msg


def test_verify_catches_broken_graphs() -> None:
    spec = build("gpt-tiny", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    nodes = list(g.nodes)
    nodes[3], nodes[5] = nodes[5], nodes[3]
    with pytest.raises(ir.IRVerificationError, match="earlier node"):
        ir.verify(dataclasses.replace(g, nodes=tuple(nodes), layers=()))
    bad_layers = g.layers[:-1]
    with pytest.raises(ir.IRVerificationError, match="cover"):
        ir.verify(dataclasses.replace(g, layers=bad_layers))
    dup = g.nodes + (g.nodes[-1],)
    with pytest.raises(ir.IRVerificationError, match="duplicate"):
        ir.verify(dataclasses.replace(g, nodes=dup, layers=()))


def test_canonical_names_and_costs() -> None:
    assert canonical_op("addmm") == "matmul" and canonical_op("Linear") == "linear"
    assert canonical_op("add_") == "add" and canonical_op("_scaled_dot_product_flash_attention") == "sdpa"
    m = ir.TensorMeta
    kind, f, b, r, w = op_cost("sdpa", [m((2, 4, 16, 8), "float32")] * 3, [m((2, 4, 16, 8), "float32")], {})
    assert kind == "attention" and f == 2 * 2 * 4 * 16 * 16 * 16 and b == 2 * f
    kind, f, *_ = op_cost("conv", [m((1, 3, 8, 8), "float32"), m((16, 3, 3, 3), "float32")],
                          [m((1, 16, 8, 8), "float32")], {})
    assert kind == "conv" and f == 2 * 16 * 64 * 27


def test_op_kinds_are_a_str_enum_equal_to_the_plain_strings() -> None:
    # the vocabulary, in its order, as it was a tuple of strings: serialized kinds must not change
    assert [str(k) for k in KINDS] == ["matmul", "attention", "conv", "embedding", "norm", "softmax", "loss",
                                       "pointwise", "reduction", "copy", "gather", "creation", "view", "input",
                                       "unknown"]
    assert ir.OpKind.MATMUL == "matmul" and hash(ir.OpKind.MATMUL) == hash("matmul")
    assert {"matmul": 1}[ir.OpKind.MATMUL] == 1 and f"{ir.OpKind.VIEW}" == "view"
    assert all(isinstance(r.kind, ir.OpKind) for r in OP_RULES.values())
    spec = build("gpt-tiny", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    assert all(isinstance(n.kind, ir.OpKind) for n in g.nodes)
    assert json.dumps([n.kind for n in g.nodes]) == json.dumps([str(n.kind) for n in g.nodes])
    plain = dataclasses.replace(g, nodes=tuple(dataclasses.replace(n, kind=str(n.kind)) for n in g.nodes))
    hashes = lambda x: [(l.start, l.end, l.structural_hash) for l in x.layers]  # noqa: E731
    assert plain.fingerprint == g.fingerprint and hashes(ir.group_layers(plain)) == hashes(g)


def test_gpt3_175b_traces_on_meta() -> None:
    spec = build("gpt3-175b", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    cfg = get_config("gpt3-175b")
    assert len(g.blocks()) == cfg.layers == 96
    assert g.num_params == sum(p.numel() for p in spec.model.parameters())
    assert 174e9 < g.num_params < 176e9


def test_huggingface_model_through_export() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=32, use_cache=False)
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(cfg)
    g = ir.verify(ir.trace(model, (ir.TensorSpec((2, 16), torch.long),)))
    assert g.frontend == "export"
    assert g.num_params == sum(p.numel() for p in model.parameters())
    assert len(g.blocks()) == 2 and len({b.structural_hash for b in g.blocks()}) == 1
    assert g.blocks()[0].module_path == "transformer.h.0"
    # 2 blocks x (qkv, proj, fc, proj) + lm head; HF GPT-2 uses Conv1D (addmm)
    assert sum(n.kind == "matmul" for n in g.nodes) == 9
