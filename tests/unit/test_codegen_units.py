"""Single-process tests of the runtime's pieces: layer-group split, fused-chunk layout, seeded sharded init, plans."""

from __future__ import annotations

import pytest
import torch

from autopar import ir
from autopar.codegen.runtime.init import meta_clone, seed_stream
from autopar.codegen.runtime.split import StageModule, split_model
from autopar.codegen.runtime.tensor_parallel import permute_chunks, unpermute_chunks
from autopar.zoo import build, init_weights

from harness import make_plan


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_split_stages_chain_to_the_model_output(model: str) -> None:
    spec = build(model, batch=2, device="cpu", seq=16, seed=0)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx")
    split = split_model(spec.model, graph)
    bounds = [0, 2, 3, len(graph.layers)]
    values: object = spec.example_inputs
    for a, b in zip(bounds, bounds[1:]):
        stage = StageModule(split.groups[a:b], split.specs[a:b], split.live_at(a), split.live_at(b))
        out = stage(*values)  # type: ignore[misc]
        values = out if isinstance(out, tuple) else (out,)
    torch.testing.assert_close(values[0], spec.model(*spec.example_inputs), rtol=0, atol=0)  # type: ignore[index]


def test_llama_rope_tables_pass_through_middle_stages() -> None:
    spec = build("llama-tiny", batch=2, device="meta", seq=16)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx")
    split = split_model(meta_clone(spec.model), graph)
    after_prefix, after_block0 = split.live_at(1), split.live_at(2)
    assert len(after_prefix) == 3 and len(after_block0) == 3  # hidden state + RoPE cos/sin
    assert set(after_prefix) & set(after_block0) == {"to", "to_1"}  # the tables pass through unchanged
    assert split.live_at(len(graph.layers)) == (split.output,)


def test_split_never_mutates_the_callers_model() -> None:
    spec = build("gpt-tiny", batch=2, device="cpu", seed=0)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    meta = meta_clone(spec.model)
    assert all(p.is_meta for p in meta.parameters())
    assert meta.lm_head.weight is meta.wte.weight
    assert all(torch.equal(before[k], v) for k, v in spec.model.state_dict().items())


def test_chunk_layout_gives_each_rank_its_heads_of_q_k_and_v() -> None:
    w = torch.arange(12.0).reshape(12, 1)  # q = 0..3, k = 4..7, v = 8..11 with 2 heads of 2 rows
    stored = permute_chunks(w, 3, 2)
    rank0 = torch.chunk(stored, 2)[0].flatten().tolist()
    assert rank0 == [0, 1, 4, 5, 8, 9]
    assert torch.equal(unpermute_chunks(stored, 3, 2), w)


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
def test_seed_stream_equals_zoo_initialization(model: str) -> None:
    ref = build(model, batch=2, device="cpu", seed=7).model
    got: dict[str, torch.Tensor] = {}
    seed_stream(build(model, batch=2, device="meta").model, 7, lambda k, t: got.__setitem__(k, t.clone()), init_weights)
    want = dict(ref.named_parameters(remove_duplicate=False)) | dict(ref.named_buffers())
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k].detach()) for k in want)


def test_make_plan_roundtrips_and_covers_the_layers() -> None:
    spec = build("llama-tiny", batch=8, device="meta", seq=16)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx")
    plan = make_plan(graph, pp=2, dp=2, tp=2, zero=3, micro_batch=2, num_microbatches=2)
    assert ir.plan_from_yaml(ir.plan_to_yaml(plan)) == plan
    assert plan.stages[-1].layer_end == len(graph.layers)
    assert plan.placement_of("layers.1.attn.wq.weight") == "S(0)"
    assert plan.placement_of("layers.0.mlp.w_down.weight") == "S(1)"
    assert sum(op.comm == "all_reduce" for op in plan.op_shardings) == 2


def test_build_program_outside_a_process_group_says_how_to_launch() -> None:
    from autopar.codegen.runtime.program import build_program

    spec = build("gpt-tiny", batch=2, device="cpu", seed=0)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx")
    with pytest.raises(RuntimeError, match="torchrun"):
        build_program(make_plan(graph, dp=2, micro_batch=1), spec, graph=graph)


def test_an_exported_capture_is_reused_for_the_same_model_until_it_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second program of the same model at the same shapes skips torch.export (codegen.runtime.split.capture);
    each use gets its own GraphModule, and a model changed in place (here: eval mode) is exported again."""
    from autopar.codegen.runtime import split

    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.Linear(16, 4))
    x = torch.randn(2, 8)
    graph = ir.trace(model, x, frontend="export")
    calls = []
    real = torch.export.export
    monkeypatch.setattr(torch.export, "export", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = split.capture(model, graph, ((x,), {}))
    second = split.capture(model, graph, ((torch.randn(2, 8),), {}))
    assert len(calls) == 1 and first is not second
    assert [n.name for n in first.graph.nodes] == [n.name for n in second.graph.nodes]
    split.capture(model, graph, ((torch.randn(3, 8),), {}))  # another batch size
    model.eval()
    split.capture(model, graph, ((x,), {}))
    assert len(calls) == 3
