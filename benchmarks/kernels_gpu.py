"""Fused Triton kernels vs eager PyTorch vs ``torch.compile`` on GPT-2-small and Llama-3-8B block shapes (CUDA only).

For each fusion group of one transformer block -- GPT-2 small (h=768, seq 1024, batch 8): residual add + LayerNorm,
bias + GELU, scale + causal softmax (the non-flash attention path), dropout; Llama 3 8B (h=4096, ffn 14336,
seq 2048, batch 1): residual add + RMSNorm, SwiGLU -- it prints the median forward time of each implementation
(``triton.testing.do_bench``) and the fused kernel's achieved memory bandwidth (the bytes it must move: inputs read
once, outputs written once) as a fraction of the device's copy bandwidth, measured here with a large
``Tensor.copy_`` (read + write).

Usage::

    python benchmarks/kernels_gpu.py [--dtype bf16|fp16|fp32] [--no-compile]

Without CUDA it prints that it was skipped and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Callable

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass(frozen=True)
class Case:
    """One fusion group at one model's block shape."""

    model: str
    group: str
    fused: Callable[[], object]
    eager: Callable[[], object]
    nbytes: int
    """Bytes the fused kernel must move (each input read once, each output written once)."""


def _nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def build_cases(dtype: torch.dtype) -> list[Case]:
    from autopar.codegen.kernels import (
        eager_add_norm,
        eager_bias_act,
        eager_softmax,
        eager_swiglu,
        fused_add_norm,
        fused_bias_act,
        fused_dropout,
        fused_softmax,
        fused_swiglu,
    )

    dev = "cuda"

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dtype)

    cases: list[Case] = []
    # GPT-2 small: h=768, 12 heads, seq 1024, batch 8
    m, h, heads, s = 8 * 1024, 768, 12, 1024
    x, r, w, b = t(m, h), t(m, h), t(h), t(h)
    cases.append(Case("gpt2-small", "add + LayerNorm", lambda: fused_add_norm(x, r, w, b, norm="layer_norm"),
                      lambda: eager_add_norm(x, r, w, b, norm="layer_norm", eps=1e-5), _nbytes(x, r, w, b, x, x)))
    hf, bf = t(m, 4 * h), t(4 * h)
    cases.append(Case("gpt2-small", "bias + GELU", lambda: fused_bias_act(hf, bf, "gelu"),
                      lambda: eager_bias_act(hf, bf, "gelu"), _nbytes(hf, bf, hf)))
    sc = t(8, heads, s, s)
    scale = (h // heads) ** -0.5
    cases.append(Case("gpt2-small", "scale + causal softmax", lambda: fused_softmax(sc, scale=scale, causal=True),
                      lambda: eager_softmax(sc, scale=scale, causal=True), _nbytes(sc, sc)))
    cases.append(Case("gpt2-small", "dropout p=0.1", lambda: fused_dropout(x, 0.1, True, seed=1),
                      lambda: torch.nn.functional.dropout(x, 0.1, True), _nbytes(x, x)))
    # Llama 3 8B: h=4096, ffn 14336, seq 2048, batch 1
    m, h, f = 2048, 4096, 14336
    x2, r2, w2 = t(m, h), t(m, h), t(h)
    cases.append(Case("llama3-8b", "add + RMSNorm", lambda: fused_add_norm(x2, r2, w2, norm="rms_norm"),
                      lambda: eager_add_norm(x2, r2, w2, None, norm="rms_norm", eps=1e-5),
                      _nbytes(x2, r2, w2, x2, x2)))
    g, u = t(m, f), t(m, f)
    cases.append(Case("llama3-8b", "SwiGLU", lambda: fused_swiglu(g, u), lambda: eager_swiglu(g, u),
                      _nbytes(g, u, g)))
    return cases


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Bytes/s of a large device-to-device ``copy_`` (counts the read and the write)."""
    import triton.testing
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def _bench(fn: Callable[[], object]) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, return_mode="median"))


def _compiled(fn: Callable[[], object]) -> Callable[[], object] | None:
    try:
        c = torch.compile(fn)
        c()
        return c
    except Exception as e:  # noqa: BLE001 - torch.compile may be unavailable (no compiler toolchain)
        print(f"  torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:80]}); column left blank")
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile column")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_gpu: CUDA is not available; benchmark skipped.")
        return 0
    dtype = DTYPES[args.dtype]
    bw = copy_bandwidth()
    print(f"device: {torch.cuda.get_device_name()}   dtype: {args.dtype}   copy bandwidth: {bw / 1e9:.0f} GB/s")
    head = f"{'model':<11} {'group':<24} {'fused ms':>9} {'eager ms':>9} {'compile ms':>11} {'speedup':>8} " \
           f"{'fused GB/s':>10} {'of copy':>8}"
    print(head)
    print("-" * len(head))
    for case in build_cases(dtype):
        fused_ms, eager_ms = _bench(case.fused), _bench(case.eager)
        comp = None if args.no_compile else _compiled(case.eager)
        comp_ms = f"{_bench(comp):11.3f}" if comp is not None else f"{'-':>11}"
        achieved = case.nbytes / (fused_ms * 1e-3)
        print(f"{case.model:<11} {case.group:<24} {fused_ms:9.3f} {eager_ms:9.3f} {comp_ms} "
              f"{eager_ms / fused_ms:7.2f}x {achieved / 1e9:10.0f} {achieved / bw:8.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
