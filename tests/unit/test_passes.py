"""Graph passes keep the IR valid and do what they say; the pipeline runs them in one order, verified."""

from __future__ import annotations

from dataclasses import replace

import pytest

from autopar import ir
from autopar.ir.errors import IRVerificationError
from autopar.ir.passes import (
    PIPELINE,
    Pass,
    PassOptions,
    apply_fused_bytes,
    decompose_attention,
    default_pipeline,
    run_passes,
)
from autopar.zoo import build


def test_decompose_attention_is_valid_and_exposes_scores() -> None:
    spec = build("gpt-tiny", batch=2, device="meta")
    g = ir.verify(ir.trace(spec.model, spec.example_inputs))
    d = ir.verify(decompose_attention(g, dropout_p=0.1))
    assert not any(n.op == "sdpa" for n in d.nodes)
    blocks = d.blocks()
    assert len(blocks) == len(g.blocks()) and len({b.structural_hash for b in blocks}) == 1
    probs = [n for n in d.nodes if n.op == "softmax"]
    assert len(probs) == len(blocks)
    b, heads, s = 2, spec.config.heads, spec.config.seq
    assert probs[0].out.shape == (b, heads, s, s)
    # the same matmul FLOPs as the fused op (scores + weighted sum), now as two batched matmuls
    assert d.matmul_flops() == pytest.approx(g.matmul_flops())
    assert decompose_attention(d) is d  # nothing left to decompose


def test_decompose_attention_rejects_bad_dropout() -> None:
    spec = build("gpt-tiny", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    with pytest.raises(ValueError, match="dropout_p"):
        decompose_attention(g, dropout_p=1.5)


def test_decompose_keeps_a_grouped_graph_grouped_and_an_ungrouped_one_flat() -> None:
    spec = build("gpt-tiny", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    d = decompose_attention(g)
    assert [(l.module_path, l.module_type, l.role) for l in d.layers] == \
        [(l.module_path, l.module_type, l.role) for l in g.layers]
    flat = ir.verify(decompose_attention(replace(g, layers=())))
    assert flat.layers == () and flat.nodes == d.nodes


# ---- the pipeline --------------------------------------------------------------------------------------------------
def test_pipeline_order_and_selection() -> None:
    assert PIPELINE == ("capture", "group", "decompose", "fuse")
    names = lambda ps: [p.name for p in ps]  # noqa: E731
    assert names(default_pipeline()) == ["group"]
    every = PassOptions(decompose_attention=True, attention_dropout_p=0.1, fused_kernels=True)
    assert names(default_pipeline(every)) == ["group", "decompose", "fuse"]
    assert names(default_pipeline(every, start="decompose", stop="decompose")) == ["decompose"]
    assert names(default_pipeline(PassOptions(fused_kernels=True), start="fuse")) == ["fuse"]
    assert default_pipeline(start="fuse") == ()  # fuse not selected: nothing to run
    with pytest.raises(ValueError, match="capture"):
        default_pipeline(start="capture")
    with pytest.raises(ValueError, match="comes after"):
        default_pipeline(start="fuse", stop="group")


def test_pass_options_are_validated() -> None:
    with pytest.raises(ValueError, match="attention_dropout_p"):
        PassOptions(decompose_attention=True, attention_dropout_p=1.0)
    with pytest.raises(ValueError, match="decompose_attention=True"):
        PassOptions(attention_dropout_p=0.1)


def test_trace_runs_the_pipeline_passes_in_order() -> None:
    spec = build("gpt-tiny", batch=2, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    every = PassOptions(decompose_attention=True, attention_dropout_p=0.1, fused_kernels=True)
    t = ir.trace(spec.model, spec.example_inputs, passes=every)
    by_hand = apply_fused_bytes(decompose_attention(g, dropout_p=0.1))
    assert t.nodes == by_hand.nodes and t.layers == by_hand.layers
    assert ir.trace(spec.model, spec.example_inputs, passes=PassOptions()).nodes == g.nodes


def test_run_passes_verifies_after_each_pass() -> None:
    spec = build("gpt-tiny", batch=1, device="meta")
    g = ir.trace(spec.model, spec.example_inputs)
    seen: list[str] = []
    spy = Pass("spy", lambda x: seen.append("spy") or x)
    broken = Pass("drop_first_node", lambda x: replace(x, nodes=x.nodes[1:]))
    with pytest.raises(IRVerificationError, match="after pass 'drop_first_node'"):
        run_passes(g, (spy, broken, spy))
    assert seen == ["spy"]  # stopped at the broken pass
    assert len(run_passes(g, (broken,), verify=False).nodes) == len(g.nodes) - 1
    assert run_passes(g, ()) is g
