"""Memory model: ZeRO model-state accounting, in-flight activations by schedule, Korthikanti et al. 2022 as check."""

from __future__ import annotations

import pytest

from autopar.ir.plan import MemoryBreakdown
from autopar.planner.inter_op.memory import (
    GiB,
    MemoryReserve,
    activation_bytes,
    fits,
    in_flight_microbatches,
    korthikanti_layer_activation_bytes,
    memory_breakdown,
    model_state_bytes,
    zero3_transient_bytes,
)


def test_model_state_runtime_layout() -> None:
    # Rajbhandari et al. SC'20, Figure 1 (7.5B parameters, Nd = 64): 120 GB replicated (+ 15 GB: autocast's cached
    # bf16 weights in the generated runtime) and ZeRO-3's 1.9 GB; its ZeRO-1/2 (FSDP2 without resharding after
    # forward) keep the unsharded bf16 parameters (15 GB) plus everything else sharded, where DeepSpeed's ZeRO-1/2
    # keep fp16 params (and grads) replicated
    psi, gb = 7.5e9, 1e9
    totals = [sum(model_state_bytes(psi, zero=z, dp=64, mixed_precision=True)) / gb for z in range(4)]
    assert totals == pytest.approx([120.0 + 15, 15 + 120 / 64, 15 + 120 / 64, 1.9], abs=0.03)
    assert model_state_bytes(1.0, zero=0, dp=8, mixed_precision=True) == (6.0, 4.0, 8.0)  # fp32 + autocast copy
    assert model_state_bytes(1.0, zero=0, dp=8, mixed_precision=False) == (4.0, 4.0, 8.0)
    assert model_state_bytes(8.0, zero=2, dp=8, mixed_precision=False, optimizer="sgd") == (36.0, 4.0, 4.0)
    assert model_state_bytes(8.0, zero=3, dp=1, mixed_precision=True) == (48.0, 32.0, 64.0)  # dp=1: no sharding
    with pytest.raises(ValueError, match="zero"):
        model_state_bytes(1.0, zero=4, dp=2, mixed_precision=True)
    with pytest.raises(ValueError, match="optimizer"):
        model_state_bytes(1.0, zero=0, dp=2, mixed_precision=True, optimizer="lion")  # type: ignore[arg-type]


def test_zero3_transient() -> None:
    assert zero3_transient_bytes(1e6, zero=2, dp=8, mixed_precision=True) == 0.0
    assert zero3_transient_bytes(1e6, zero=3, dp=1, mixed_precision=True) == 0.0
    # 2 gathered layers + grads in bf16, and the fp32 copy the reduce-scatter runs on
    assert zero3_transient_bytes(1e6, zero=3, dp=8, mixed_precision=True) == 10e6
    assert zero3_transient_bytes(1e6, zero=3, dp=8, mixed_precision=True, reduce_bytes=2) == 6e6


@pytest.mark.parametrize("pp,m", [(1, 1), (2, 1), (4, 2), (4, 8), (8, 16)])
def test_in_flight_by_schedule(pp: int, m: int) -> None:
    assert in_flight_microbatches("gpipe", pp=pp, num_microbatches=m) == tuple([float(m)] * pp)
    assert in_flight_microbatches("1f1b", pp=pp, num_microbatches=m) == tuple(float(min(pp - s, m))
                                                                              for s in range(pp))


@pytest.mark.parametrize("pp,v", [(2, 2), (4, 2), (4, 4), (8, 3)])
def test_in_flight_interleaved_first_stage(pp: int, v: int) -> None:
    got = in_flight_microbatches("interleaved_1f1b", pp=pp, num_microbatches=4 * pp, virtual_stages=v)
    # Korthikanti et al. 2022 sec. 4.2: the first stage holds pp * (1 + (pp - 1) / (pp * v)) micro-batches
    assert got[0] == pytest.approx(pp * (1 + (pp - 1) / (pp * v)))
    assert list(got) == sorted(got, reverse=True)


def test_korthikanti_formula_terms() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8  # GPT-3 175B layer, micro-batch 1, tp 8 (Korthikanti Table 3)
    sbh = s * b * h
    none1 = korthikanti_layer_activation_bytes(s, b, h, a)
    assert none1 == sbh * (34 + 5 * a * s / h)
    tp = korthikanti_layer_activation_bytes(s, b, h, a, t)
    assert tp == pytest.approx(sbh * (10 + 24 / t + 5 * a * s / (h * t)))
    tp_sp = korthikanti_layer_activation_bytes(s, b, h, a, t, sp=True)
    assert tp_sp == pytest.approx(none1 / t)  # sequence parallelism shards everything tp left replicated
    sel = korthikanti_layer_activation_bytes(s, b, h, a, t, sp=True, recompute="selective")
    assert sel == pytest.approx(sbh * 34 / t)
    assert korthikanti_layer_activation_bytes(s, b, h, a, recompute="full") == 2 * sbh
    # Korthikanti sec. 5: selective recompute cuts ~70% of this layer's activations (5as/h = 80 vs 34)
    assert 0.65 < 1 - sel / tp_sp < 0.75


@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("pp,L,m", [(1, 4, 3), (2, 8, 4), (4, 16, 8), (8, 32, 8)])
def test_1f1b_first_stage_matches_korthikanti(recompute: str, pp: int, L: int, m: int) -> None:
    """Korthikanti sec. 4.2: under 1F1B the first stage holds pp micro-batches of its L/pp layers, so its activation
    memory is L * (per-layer formula) whatever pp is. This checks the in-flight accounting, not per-op bytes."""
    s, b, h, a, t = 2048, 1, 4096, 32, 4
    layer = korthikanti_layer_activation_bytes(s, b, h, a, t, sp=True, recompute=recompute)  # type: ignore[arg-type]
    layer_none = korthikanti_layer_activation_bytes(s, b, h, a, t, sp=True)
    kw = dict(schedule="1f1b", pp=pp, num_microbatches=m, largest_layer_act_none=layer_none)
    got = activation_bytes({recompute: L // pp * layer}, recompute, stage_index=0, **kw)  # type: ignore
    transient = layer_none if recompute == "full" else 0.0
    assert got == pytest.approx(L * layer + transient)
    last = activation_bytes({recompute: L // pp * layer}, recompute, stage_index=pp - 1, **kw)  # type: ignore
    assert last == pytest.approx(L // pp * layer + transient)  # the last stage holds one micro-batch


def test_interleaved_first_stage_matches_korthikanti() -> None:
    s, b, h, a, t, pp, v, L = 2048, 1, 4096, 32, 4, 4, 2, 32
    layer = korthikanti_layer_activation_bytes(s, b, h, a, t, sp=True)
    got = activation_bytes({"none": L // pp * layer}, "none", schedule="interleaved_1f1b", stage_index=0, pp=pp,
                           num_microbatches=8, virtual_stages=v)
    assert got == pytest.approx(L * layer * (1 + (pp - 1) / (pp * v)))


def test_gpipe_holds_all_microbatches() -> None:
    got = activation_bytes({"none": 10.0, "full": 1.0}, "none", schedule="gpipe", stage_index=1, pp=2,
                           num_microbatches=6)
    assert got == 60.0
    with pytest.raises(ValueError, match="selective"):
        activation_bytes({"none": 10.0}, "selective", schedule="gpipe", stage_index=0, pp=2, num_microbatches=6)


def test_breakdown_and_fits() -> None:
    reserve = MemoryReserve(fixed_bytes=1.0 * GiB, fragmentation=0.1)
    bd = memory_breakdown(param_elems=1e9, zero=1, dp=8, mixed_precision=True, activations=10 * GiB,
                          capacity=80 * GiB, reserve=reserve)
    # fp32 shard (0.5e9) + unsharded bf16 copy (2e9); fp32 grad shard; Adam m, v shard
    assert (bd.params, bd.grads, bd.optimizer) == (2.5e9, 0.5e9, 1e9)
    assert bd.other == pytest.approx(1.0 * GiB + 0.1 * 10 * GiB)
    assert bd.total == pytest.approx(4e9 + 10 * GiB + 2 * GiB)
    assert fits(bd)
    big = memory_breakdown(param_elems=5.3e9, zero=0, dp=8, mixed_precision=True, activations=0.0, capacity=80 * GiB)
    assert not fits(big)  # 18 bytes/param * 5.3e9 = 95.4e9 + 1.5 GiB reserve > 80 GiB = 85.9e9
    assert fits(memory_breakdown(param_elems=4.4e9, zero=0, dp=8, mixed_precision=True, activations=0.0,
                                 capacity=80 * GiB))  # 79.2e9 + 1.5 GiB
    z3 = memory_breakdown(param_elems=5.3e9, zero=3, dp=8, mixed_precision=True, activations=0.0, capacity=80 * GiB,
                          largest_layer_elems=2e8)
    # transient: 2e8 * (3 * 2 bytes + 4 bytes of fp32 reduce copy) = 2e9, plus its fragmentation
    assert fits(z3) and z3.other == pytest.approx(2e9 * 1.1 + 1.5 * GiB)
    with pytest.raises(ValueError, match="capacity"):
        fits(MemoryBreakdown(params=1.0))
    with pytest.raises(ValueError, match="fragmentation"):
        MemoryReserve(fragmentation=1.5)
