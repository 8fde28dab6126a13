"""Tier (c): a training step of a plan on gloo CPU ranks equals the single-process step (loss and SGD-updated
parameters, gathered), for a tiny GPT and a tiny Llama, over the acceptance matrix of meshes and ZeRO levels.

Each world size is one spawn running every configuration for both models (spawning costs seconds)."""

from __future__ import annotations

import pytest

from harness import parity_worker, spawn

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks

MODELS = ["gpt-tiny", "llama-tiny"]
RTOL = 1e-5
"""Acceptance: loss and updated parameters to 1e-5 relative (fp32)."""
GRAD_RTOL = 1e-3
"""The update itself (the gradient, SGD lr 1) differs by fp32 reduction order: up to ~1e-4 norm-wise on the norm
weights under tp (sums of many small terms, reordered by the all-reduce); a real bug (a missing reduction or
scaling) is O(1)."""

TWO_RANKS = [
    dict(name="dp2", dp=2),
    dict(name="dp2-mb2-sync-after", dp=2, num_microbatches=2, overlap_grad_sync=False),
    dict(name="tp2", tp=2),
    dict(name="pp2-1f1b", pp=2, num_microbatches=2),
    dict(name="pp2-gpipe-recompute-full", pp=2, num_microbatches=2, schedule="gpipe", recompute="full"),
    dict(name="pp2-interleaved", pp=2, num_microbatches=2, schedule="interleaved_1f1b", virtual_stages=2),
    dict(name="dp2-zero3", dp=2, zero=3),
    dict(name="dp2-zero1-mb2", dp=2, zero=1, num_microbatches=2),
    dict(name="tp2-seed-init-selective", tp=2, init="seed", recompute="selective"),
]
FOUR_RANKS = [
    dict(name="dp2-tp2", dp=2, tp=2),
    dict(name="pp2-tp2", pp=2, tp=2, num_microbatches=2),
    dict(name="pp2-dp2", pp=2, dp=2, num_microbatches=2),  # ZeRO 0's buckets during the last backward
    dict(name="pp2-dp2-sync-after", pp=2, dp=2, num_microbatches=2, overlap_grad_sync=False),
    dict(name="dp2-tp2-zero3", dp=2, tp=2, zero=3),
    dict(name="pp2-dp2-zero3-seed", pp=2, dp=2, zero=3, num_microbatches=2, init="seed"),
]


def _check(results: dict[str, dict[str, float]], configs: list[dict]) -> None:
    assert set(results) == {f"{m}/{c['name']}" for m in MODELS for c in configs}
    bad = {k: v for k, v in results.items() if v["loss"] > RTOL or v["param"] > RTOL or v["update"] > GRAD_RTOL}
    assert not bad, f"parity violated: {bad}"


@pytest.fixture(scope="module")
def two_rank_results() -> dict[str, dict[str, float]]:
    return spawn(parity_worker, 2, TWO_RANKS, MODELS, 8, 16)[0]


@pytest.fixture(scope="module")
def four_rank_results() -> dict[str, dict[str, float]]:
    return spawn(parity_worker, 4, FOUR_RANKS, MODELS, 8, 16)[0]


def test_parity_two_ranks(two_rank_results: dict[str, dict[str, float]]) -> None:
    _check(two_rank_results, TWO_RANKS)


def test_parity_four_ranks(four_rank_results: dict[str, dict[str, float]]) -> None:
    _check(four_rank_results, FOUR_RANKS)


def test_loss_is_the_same_value_everywhere(two_rank_results: dict[str, dict[str, float]]) -> None:
    losses = {k.split("/")[0]: set() for k in two_rank_results}
    for k, v in two_rank_results.items():
        losses[k.split("/")[0]].add(round(v["loss_value"], 5))
    assert all(len(v) == 1 for v in losses.values()), losses
