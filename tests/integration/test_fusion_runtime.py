"""Tier (c): the distributed program runs its fused groups through the generated Triton kernels (here in the Triton
interpreter, ``TRITON_INTERPRET=1`` from conftest, inherited by the spawned ranks) and still matches the
single-process eager step; with ``plan.fused_kernels=False`` no kernel is launched.

One 2-rank spawn, tiny shapes: the interpreter runs every kernel program in Python."""

from __future__ import annotations

import functools
from dataclasses import replace
from typing import Any

import pytest

from harness import parity_worker, spawn

pytestmark = pytest.mark.multiprocess  # every test here starts gloo ranks
INTERPRETED_TRITON = True  # the ranks run the fused kernels (tests/conftest.py removes TRITON_INTERPRET elsewhere)

MODELS = ["gpt-tiny", "llama-tiny"]
RTOL = 1e-5
"""Loss and updated parameters (fp32), as in tests/test_codegen_parity.py."""
GRAD_RTOL = 1e-3
"""The update itself (the gradient at SGD lr 1), as in tests/test_codegen_parity.py."""
CONFIGS = [
    dict(name="dp2", dp=2, fused=True),
    dict(name="pp2", pp=2, num_microbatches=2, fused=True),
    dict(name="dp2-unfused", dp=2, fused=False),
]
_LAUNCHERS = ("bias_act_fwd", "swiglu_fwd", "dropout_fwd", "norm_fwd", "norm_bwd", "softmax_fwd", "softmax_bwd")


def _count_launches(counts: dict[str, int]) -> None:
    """Wrap the kernel launchers (looked up through the module by the autograd wrappers) to count calls."""
    from autopar.codegen.kernels import launch

    def counted(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    for name in _LAUNCHERS:
        setattr(launch, name, counted(name, getattr(launch, name)))


def _worker(rank: int, configs: list[dict[str, Any]], batch: int, seq: int) -> dict[str, dict[str, Any]]:
    """Per model and config: parity_worker's errors plus the kernel launches of that step on this rank."""
    import harness as testing

    counts: dict[str, int] = {}
    _count_launches(counts)
    make_plan = testing.make_plan
    out: dict[str, dict[str, Any]] = {}
    try:
        for model in MODELS:
            for cfg in configs:
                cfg = dict(cfg)
                fused = cfg.pop("fused")
                testing.make_plan = lambda *a, _f=fused, **k: replace(make_plan(*a, **k), fused_kernels=_f)
                before = sum(counts.values())
                res = parity_worker(rank, [cfg], model, batch, seq)
                out[f"{model}/{cfg['name']}"] = {**res[cfg["name"]], "launches": sum(counts.values()) - before}
    finally:
        testing.make_plan = make_plan
    out["_kinds"] = dict(counts)
    return out


@pytest.fixture(scope="module")
def results() -> list[dict[str, dict[str, Any]]]:
    return spawn(_worker, 2, CONFIGS, 4, 8)


def test_fused_program_matches_eager_single_process(results: list[dict[str, dict[str, Any]]]) -> None:
    res = results[0]
    names = {f"{m}/{c['name']}" for m in MODELS for c in CONFIGS}
    assert names <= set(res)
    bad = {k: v for k, v in res.items() if k in names and
           (v["loss"] > RTOL or v["param"] > RTOL or v["update"] > GRAD_RTOL)}
    assert not bad, f"parity violated: {bad}"


def test_fused_kernels_are_launched_on_every_rank(results: list[dict[str, dict[str, Any]]]) -> None:
    for rank, res in enumerate(results):
        for m in MODELS:
            for c in CONFIGS:
                n = res[f"{m}/{c['name']}"]["launches"]
                if c["fused"]:
                    assert n > 0, f"rank {rank} {m}/{c['name']}: no fused kernel launched"
                else:
                    assert n == 0, f"rank {rank} {m}/{c['name']}: {n} launches with fused_kernels=False"
    kinds = set(results[0]["_kinds"])
    # gpt: add+LayerNorm fwd/bwd and bias+GELU; llama: add+RMSNorm and SwiGLU
    assert {"norm_fwd", "norm_bwd", "bias_act_fwd", "swiglu_fwd"} <= kinds, kinds
