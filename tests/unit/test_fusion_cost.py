"""The cost model counts a fused group's bytes once (the ``fuse`` pass, ``autopar.ir.passes.apply_fused_bytes``), so
plans reflect fusion."""

from __future__ import annotations

import pytest

from autopar import ir
from autopar.ir.passes import apply_fused_bytes, fusion_groups
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.zoo import build


def _graph(name: str) -> ir.Graph:
    spec = build(name, batch=1, device="meta")
    return ir.verify(ir.trace(spec.model, spec.example_inputs, model_name=name))


@pytest.fixture(scope="module")
def gpt2() -> ir.Graph:
    return _graph("gpt2-small")


def _moved(g: ir.Graph) -> float:
    return sum(n.bytes_read + n.bytes_written for n in g.nodes)


def test_pass_reduces_only_fused_nodes_and_keeps_the_structure(gpt2: ir.Graph) -> None:
    fused = ir.verify(apply_fused_bytes(gpt2))
    assert fused.fingerprint == gpt2.fingerprint and fused.layers == gpt2.layers
    members = {m for lg in gpt2.layers for grp in fusion_groups(gpt2, [n.name for n in gpt2.group_nodes(lg)])
               if grp.has_kernel for m in grp.nodes}
    changed = set()
    for a, b in zip(gpt2.nodes, fused.nodes):
        assert (a.name, a.op, a.flops_fwd, a.flops_bwd) == (b.name, b.op, b.flops_fwd, b.flops_bwd)
        assert b.bytes_read <= a.bytes_read and b.bytes_written <= a.bytes_written
        if (a.bytes_read, a.bytes_written) != (b.bytes_read, b.bytes_written):
            changed.add(a.name)
    assert changed and changed <= members
    assert _moved(fused) < _moved(gpt2)
    # identical blocks keep identical costs, so the planner may still solve one block for all
    per_block = {round(sum(n.bytes_read + n.bytes_written for n in fused.group_nodes(b))) for b in fused.blocks()}
    assert len(per_block) == 1


def test_residual_add_and_layernorm_move_their_bytes_once(gpt2: ir.Graph) -> None:
    # x + attn -> LayerNorm: unfused reads x, a, writes s, reads s (+ w, b), writes y; fused reads x, a (+ w, b),
    # writes s, y -- one activation-sized read fewer
    block = gpt2.blocks()[0]
    grp = next(g for g in fusion_groups(gpt2, [n.name for n in gpt2.group_nodes(block)])
               if g.kind == "add_norm" and "add" in g.ops)
    act = gpt2.node(grp.nodes[0]).out.nbytes
    assert grp.bytes_saved == pytest.approx(act)
    fused = apply_fused_bytes(gpt2)
    before = sum(gpt2.node(n).bytes_read + gpt2.node(n).bytes_written for n in grp.nodes)
    after = sum(fused.node(n).bytes_read + fused.node(n).bytes_written for n in grp.nodes)
    assert before - after == pytest.approx(act)


def test_plan_is_faster_with_fused_kernels(gpt2: ir.Graph) -> None:
    prof = load_builtin("dgx-a100-80gb", nodes=1)
    on = search(gpt2, prof, PlanOptions(global_batch=64, top_k=0)).best
    off = search(gpt2, prof, PlanOptions(global_batch=64, top_k=0, fused_kernels=False)).best
    assert on.fused_kernels and not off.fused_kernels
    assert on.time.total < off.time.total
    assert on.time.compute < off.time.compute
