"""Arithmetic rates ``autopar profile`` measures on one device: square matmuls (the peak and efficiency table per
dtype), causal flash attention per head dimension and sequence length, and the non-matmul ops' rate."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from autopar.profiles.eager import _sync_fn, _time_calls

__all__ = ["VECTOR_OPS", "attention_curve", "time_matmul", "vector_rate"]


def time_matmul(n: int, dtype: torch.dtype, device: torch.device, repeats: int, budget_s: float = 0.05) -> float:
    """Median seconds of one ``[n,n] @ [n,n]`` matmul (calls batched to at least ``budget_s``)."""
    sync = _sync_fn(device)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    torch.matmul(a, b)
    sync()
    t0 = time.perf_counter()
    torch.matmul(a, b)
    sync()
    single = max(time.perf_counter() - t0, 1e-7)
    inner = max(1, min(1000, int(budget_s / single)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            torch.matmul(a, b)
        sync()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def attention_curve(device: torch.device, sync: Callable[[], None], repeats: int, peak: float, overhead_s: float,
                    quick: bool) -> list[dict[str, float]]:
    """The ``causal_attention_efficiency`` table: causal SDPA forward + backward timed per head dimension and key
    length (CPU: float32, head dims 16 and 64, lengths 32-512; GPU: bfloat16, head dims 64 and 128, lengths
    512-16384), with batch x heads sized for a fixed amount of work per call.  Efficiency is what the cost model
    needs to reproduce the time: the FLOPs the kernel performs (half the score matrix, forward once and backward
    twice) over ``peak`` times the time less the three passes' fixed cost ``overhead_s`` (the measured per-op cost
    of attention, which the cost model adds back)."""
    import torch.nn.functional as F  # noqa: N812

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    dims = (64, 128) if cuda else (16, 64)
    seqs = ((512, 2048, 8192) if quick else (512, 1024, 2048, 4096, 8192, 16384)) if cuda else (32, 128, 512)
    work = 2.0 ** (36 if cuda else 22)  # causal forward FLOPs per call
    out = []
    for hd in dims:
        for s in seqs:
            bh = max(1, round(work / (2.0 * s * s * hd)))
            q, k, v = (torch.randn(1, bh, s, hd, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

            def step() -> None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

            t = _time_calls(step, sync, repeats, 1, warmup=2)
            flops = 3 * 2.0 * bh * s * s * hd  # forward once, backward twice, each half of 4*bh*s*s*hd
            eff = flops / (peak * max(t - 3 * overhead_s, 0.5 * t))
            out.append({"seq": s, "head_dim": hd, "efficiency": min(1.0, eff)})
    return out


VECTOR_OPS = ("layer_norm", "rms_norm", "softmax", "gelu", "silu", "sum", "mul")
"""The non-matmul ops whose arithmetic rate the profiler times on CPU (:func:`vector_rate`): the norms, softmax,
activations, reduction and product a transformer runs between its GEMMs."""


def vector_rate(device: torch.device, sync: Callable[[], None], repeats: int, overhead: float,
                numel: int = 1 << 16) -> tuple[float, dict[str, float]]:
    """FLOP/s of non-matmul ops, counted as the IR counts them (``ir.ops``: 5 FLOPs an element for a layer norm or
    softmax, 4 for an activation or RMS norm, 1 for a sum or product), each timed forward on ``numel`` float32
    elements (rows of 64; 256 KiB, cache-resident on a CPU core, so that arithmetic rather than memory is timed)
    less ``overhead`` (a bare op's fixed cost).  Returns the median over :data:`VECTOR_OPS` and each op's rate.

    On a CPU these ops run at a few GFLOP/s under that count (this VM: 2.3-7.5 GFLOP/s one thread, layer norm
    fastest, RMS norm slowest), a tenth or less of the matmul peak that stood for them before, so that the
    activations and norms of a small model were predicted several times too fast."""
    import torch.nn.functional as F  # noqa: N812

    x = torch.randn(numel // 64, 64, device=device)
    w, b = torch.ones(64, device=device), torch.zeros(64, device=device)
    ops: dict[str, tuple[Callable[[], Any], float]] = {
        "layer_norm": (lambda: F.layer_norm(x, (64,), w, b), 5.0),
        "softmax": (lambda: torch.softmax(x, -1), 5.0),
        "gelu": (lambda: F.gelu(x), 4.0),
        "silu": (lambda: F.silu(x), 4.0),
        "sum": (lambda: x.sum(-1), 1.0),
        "mul": (lambda: x * x, 1.0),
    }
    if hasattr(F, "rms_norm"):  # torch >= 2.4
        ops["rms_norm"] = (lambda: F.rms_norm(x, (64,), w), 4.0)
    rates = {}
    with torch.no_grad():
        for name, (fn, per_elem) in ops.items():
            t = _time_calls(fn, sync, repeats, 5, warmup=3)
            rates[name] = per_elem * numel / max(t - overhead, 0.5 * t)
    return statistics.median(rates.values()), rates
