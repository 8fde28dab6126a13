"""Fusion analysis on the zoo models, golden files of generated source, and the fx rewrite (interpreter) matching
eager loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from autopar import ir
from autopar.codegen.kernels.fx_rewrite import fuse_graph_module
from autopar.codegen.triton_gen import generate_source, render_kernels, spec_of
from autopar.ir.passes import FusionGroup, fused_bytes_saved, fusion_groups
from autopar.zoo import build

from golden_files import GOLDEN_DIR, check_golden

ZOO = ["gpt-tiny", "llama-tiny", "moe-tiny", "wrn-tiny", "mlp-tiny"]


pytestmark = pytest.mark.usefixtures("isolated_kernel_cache")


def _graph(name: str) -> ir.Graph:
    spec = build(name, batch=2, device="meta")
    return ir.trace(spec.model, spec.example_inputs, model_name=name)


@pytest.fixture(scope="module")
def graphs() -> dict[str, ir.Graph]:
    return {name: _graph(name) for name in ZOO}


def _kinds(groups: tuple[FusionGroup, ...]) -> dict[str, int]:
    out: dict[str, int] = {}
    for g in groups:
        out[g.kind] = out.get(g.kind, 0) + 1
    return out


@pytest.mark.parametrize("name", ZOO)
def test_groups_are_disjoint_and_well_formed(graphs: dict[str, ir.Graph], name: str) -> None:
    g = graphs[name]
    groups = fusion_groups(g)
    seen: set[str] = set()
    barrier = {"matmul", "attention", "conv", "embedding", "loss", "gather", "copy"}
    for grp in groups:
        assert not seen & set(grp.nodes), f"node in two groups: {seen & set(grp.nodes)}"
        seen |= set(grp.nodes)
        assert all(g.node(n).kind not in barrier for n in grp.nodes), grp
        idx = [g.index(n) for n in grp.nodes]
        assert idx == sorted(idx)
        assert grp.outputs and grp.bytes_fused <= grp.bytes_unfused or grp.kind == "bias_act"
        # every value used outside the group is written out
        inside = set(grp.nodes)
        outs = {o for o, _ in grp.outputs}
        for n in grp.nodes:
            if any(u not in inside for u in g.users.get(n, ())):
                assert n in outs


def test_expected_groups_gpt_and_llama(graphs: dict[str, ir.Graph]) -> None:
    gpt, llama = fusion_groups(graphs["gpt-tiny"]), fusion_groups(graphs["llama-tiny"])
    layers = 2
    assert _kinds(gpt) == {"add_norm": 2 * layers + 1, "bias_act": layers}
    first = gpt[0]
    assert first.ops == ("add", "layer_norm") and dict(first.attrs)["residual"] is True
    assert {o for o, _ in first.outputs} == {"add", "blocks_0_ln1"}  # the residual sum is written out
    assert all(dict(g.attrs)["act"] == "gelu" for g in gpt if g.kind == "bias_act")  # F.gelu: exact erf form
    k = _kinds(llama)
    assert k["add_norm"] == 2 * layers + 1 and k["swiglu"] == layers and k["pointwise"] == 4 * layers  # RoPE: 2 runs each for q and k
    rms = next(g for g in llama if g.kind == "add_norm" and dict(g.attrs).get("residual"))
    assert rms.ops == ("add", "pow", "mean", "add", "rsqrt", "mul", "mul")
    # the hand-written RMSNorm moves x, a squared copy, ... unfused; fused it reads x, r, w and writes sum, y
    meta = graphs["llama-tiny"].node(rms.nodes[0]).out
    assert rms.bytes_fused == pytest.approx(4 * meta.nbytes + 64 * 4)
    assert rms.bytes_saved > meta.nbytes * 5


def test_bytes_saved_per_node_sum_to_groups(graphs: dict[str, ir.Graph]) -> None:
    g = graphs["llama-tiny"]
    per_node = fused_bytes_saved(g)
    total = sum(x.bytes_saved for x in fusion_groups(g))
    assert sum(per_node.values()) == pytest.approx(total) and total > 0
    for name, saved in per_node.items():
        n = g.node(name)
        assert 0 <= saved <= n.bytes_read + n.bytes_written + 1e-6


def test_restricting_to_a_stage_keeps_values_it_exports(graphs: dict[str, ir.Graph]) -> None:
    g = graphs["gpt-tiny"]
    block = g.blocks()[0]
    names = [n.name for n in g.group_nodes(block)]
    groups = fusion_groups(g, names)
    assert all(set(x.nodes) <= set(names) for x in groups)
    # add_1 (residual stream, read by the next stage too) must be written
    grp = next(x for x in groups if "add_1" in x.nodes)
    assert "add_1" in {o for o, _ in grp.outputs}



@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_golden_block_kernels(graphs: dict[str, ir.Graph], name: str) -> None:
    g = graphs[name]
    nodes = [n.name for n in g.group_nodes(g.blocks()[0])]
    text = render_kernels(g, nodes)
    assert text.count("@triton.jit") >= 3
    check_golden(GOLDEN_DIR / f"{name.replace('-', '_')}_block.triton", text)
    compile(text, name, "exec")  # valid Python


def test_render_lists_every_kernel_once(graphs: dict[str, ir.Graph]) -> None:
    g = graphs["llama-tiny"]
    text = render_kernels(g)
    groups = fusion_groups(g)
    assert all((spec_of(x.kind, dict(x.attrs)) is not None) == x.has_kernel for x in groups)
    specs = {spec_of(x.kind, dict(x.attrs)) for x in groups if x.has_kernel}
    assert text.count("@triton.jit") == sum(generate_source(s).count("@triton.jit") for s in specs)
    assert "eager pointwise runs" in text


def _loss_and_grads(module: torch.nn.Module, params: dict[str, torch.Tensor], spec) -> tuple[float, dict]:
    for p in params.values():
        p.grad = None
    loss = spec.loss_fn(module(*spec.example_inputs), spec.example_target)
    loss.backward()
    return loss.item(), {k: p.grad.clone() for k, p in params.items()}


@pytest.mark.parametrize("name,kinds", [("gpt-tiny", {"add_norm", "bias_act"}),
                                        ("llama-tiny", {"add_norm", "swiglu"}),
                                        ("moe-tiny", {"add_norm", "bias_act", "softmax"})])
def test_fx_rewrite_matches_eager(name: str, kinds: set[str]) -> None:
    spec = build(name, batch=2, device="cpu", seq=16)
    gm = fx.symbolic_trace(spec.model)
    before = gm.code
    fused = fuse_graph_module(gm, enabled=True)
    assert gm.code == before, "the input GraphModule was modified"
    code = fused.code
    for kind in kinds:
        assert f"fused_{kind}" in code, kind
    params = dict(spec.model.named_parameters())
    loss0, g0 = _loss_and_grads(gm, params, spec)
    loss1, g1 = _loss_and_grads(fused, params, spec)
    assert loss1 == pytest.approx(loss0, rel=1e-5)
    for k in g0:
        torch.testing.assert_close(g1[k], g0[k], atol=1e-5, rtol=1e-4, msg=k)


def test_fx_rewrite_off_switch_and_dropout() -> None:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = torch.nn.Linear(8, 16)
            self.drop = torch.nn.Dropout(0.25)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.drop(torch.nn.functional.gelu(self.fc(x), approximate="tanh"))

    gm = fx.symbolic_trace(Net())
    assert fuse_graph_module(gm, enabled=False) is gm
    fused = fuse_graph_module(gm, enabled=True)
    assert "'gelu_tanh'" in fused.code and "_autopar_dropout_0" in fused.code
    x = torch.randn(4, 8)
    fused.eval()
    torch.testing.assert_close(fused(x), gm.eval()(x))
    fused.train()
    y = fused(x)
    ref = torch.nn.functional.gelu(gm.fc(x), approximate="tanh")
    kept = y != 0
    torch.testing.assert_close(y[kept], ref[kept] / 0.75, atol=1e-5, rtol=1e-5)
    with pytest.raises(TypeError, match="symbolic_trace"):
        fuse_graph_module(Net())  # type: ignore[arg-type]
