"""Graph passes keep the IR valid and do what they say."""

from __future__ import annotations

import pytest

from autopar import ir
from autopar.zoo import build
from autopar.ir.passes import decompose_attention


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
