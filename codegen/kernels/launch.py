"""Launchers: compute the grid from the tensors' shapes, allocate outputs, and call the generated kernels.

Flat kernels get ``cdiv(numel, FLAT_BLOCK)`` programs; row kernels one program per row (``BLOCK =
next_power_of_2(N)``); the norm backward ``min(M, 4 x SMs)`` programs (4 under the interpreter, which runs programs
one after another) that each loop over rows and write one fp32 partial of dw/db.  Inputs are made contiguous; outputs
have the input's dtype, statistics are fp32.
"""

from __future__ import annotations

import os

import torch
import triton

from autopar.codegen.kernels.cache import load_kernels
from autopar.codegen.triton_gen import FLAT_BLOCK, KernelSpec

__all__ = ["bias_act_fwd", "swiglu_fwd", "dropout_fwd", "norm_fwd", "norm_bwd", "softmax_fwd", "softmax_bwd",
           "row_block", "interpreting"]


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def row_block(n: int) -> int:
    """Block size of a row kernel: the row length rounded up to a power of two."""
    return triton.next_power_of_2(max(int(n), 1))


def _warps(block: int) -> int:
    return int(min(max(block // 256, 1), 16))


def _flat_grid(numel: int) -> tuple[int]:
    return (max(triton.cdiv(numel, FLAT_BLOCK), 1),)


def bias_act_fwd(spec: KernelSpec, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``act(x + bias)`` with ``bias`` broadcast over the last dimension."""
    x = x.contiguous()
    y = torch.empty_like(x)
    k = load_kernels(spec).__dict__[f"{spec.name}_fwd"]
    args = (x, bias.contiguous()) if spec.bias else (x,)
    if x.numel():
        k[_flat_grid(x.numel())](*args, y, x.numel(), x.shape[-1] if x.dim() else 1, BLOCK=FLAT_BLOCK)
    return y


def swiglu_fwd(spec: KernelSpec, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u``, same shapes."""
    g, u = g.contiguous(), u.contiguous()
    y = torch.empty_like(g)
    if g.numel():
        load_kernels(spec).swiglu_fwd[_flat_grid(g.numel())](g, u, y, g.numel(), BLOCK=FLAT_BLOCK)
    return y


def dropout_fwd(spec: KernelSpec, x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
    """Inverted dropout with the Philox stream (seed, offset + element index)."""
    x = x.contiguous()
    y = torch.empty_like(x)
    if x.numel():
        load_kernels(spec).dropout_fwd[_flat_grid(x.numel())](x, y, x.numel(), float(p), int(seed), int(offset),
                                                             BLOCK=FLAT_BLOCK)
    return y


def _rows(t: torch.Tensor) -> tuple[int, int]:
    n = t.shape[-1] if t.dim() else 1
    return (t.numel() // n if n else 0), n


def norm_fwd(spec: KernelSpec, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor | None,
             b: torch.Tensor | None, eps: float
             ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(sum or None, normalized, mean or None, rstd) of the rows of ``x (+ r)``."""
    x = x.contiguous()
    m, n = _rows(x)
    y = torch.empty_like(x)
    s = torch.empty_like(x) if spec.residual else None
    mean = torch.empty(m, dtype=torch.float32, device=x.device) if spec.norm == "layer_norm" else None
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    args: list[object] = [x]
    if spec.residual:
        assert r is not None
        args.append(r.contiguous())
    if spec.weight:
        assert w is not None
        args.append(w.contiguous())
    if spec.norm_bias:
        assert b is not None
        args.append(b.contiguous())
    args += [t for t in (s, y, mean) if t is not None] + [rstd, n, float(eps)]
    block = row_block(n)
    if m:
        load_kernels(spec).__dict__[f"{spec.name}_fwd"][(m,)](*args, BLOCK=block, num_warps=_warps(block))
    return s, y, mean, rstd


def _bwd_programs(m: int, device: torch.device) -> int:
    if interpreting() or device.type != "cuda":
        return max(min(m, 4), 1)
    return max(min(m, 4 * torch.cuda.get_device_properties(device).multi_processor_count), 1)


def norm_bwd(spec: KernelSpec, dy: torch.Tensor, ds: torch.Tensor | None, xn: torch.Tensor,
             w: torch.Tensor | None, mean: torch.Tensor | None, rstd: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dw, db) of a norm whose normalized input was ``xn``; ``ds`` is the residual stream's own gradient."""
    dy = dy.contiguous()
    m, n = _rows(xn)
    dx = torch.empty_like(xn)
    nprog = _bwd_programs(m, xn.device)
    dw = torch.zeros(nprog, n, dtype=torch.float32, device=xn.device) if spec.weight else None
    db = torch.zeros(nprog, n, dtype=torch.float32, device=xn.device) if spec.norm_bias else None
    args: list[object] = [dy]
    if spec.residual:
        args.append(ds.contiguous() if ds is not None else torch.zeros_like(xn))
    args.append(xn)
    if spec.weight:
        args.append(w)
    args += [t for t in (mean,) if t is not None] + [rstd, dx] + [t for t in (dw, db) if t is not None] + [m, n]
    block = row_block(n)
    if m:
        load_kernels(spec).__dict__[f"{spec.name}_bwd"][(nprog,)](*args, BLOCK=block, num_warps=_warps(block))
    return dx, (dw.sum(0) if dw is not None else None), (db.sum(0) if db is not None else None)


def softmax_fwd(spec: KernelSpec, x: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax over the last dim; causal masking treats dim -2 as the query position."""
    x = x.contiguous()
    m, n = _rows(x)
    y = torch.empty_like(x)
    args: list[object] = [x, y, n]
    if spec.causal:
        if x.dim() < 2:
            raise ValueError(f"causal softmax needs a [..., Sq, Sk] input, got shape {tuple(x.shape)}")
        args.append(x.shape[-2])
    if spec.scale:
        args.append(float(scale))
    block = row_block(n)
    if m:
        load_kernels(spec).__dict__[f"{spec.name}_fwd"][(m,)](*args, BLOCK=block, num_warps=_warps(block))
    return y


def softmax_bwd(spec: KernelSpec, dy: torch.Tensor, y: torch.Tensor, scale: float) -> torch.Tensor:
    """Gradient of the (scaled, masked) softmax from its saved output."""
    dy = dy.contiguous()
    m, n = _rows(y)
    dx = torch.empty_like(y)
    args: list[object] = [dy, y, dx, n] + ([float(scale)] if spec.scale else [])
    block = row_block(n)
    if m:
        load_kernels(spec).__dict__[f"{spec.name}_bwd"][(m,)](*args, BLOCK=block, num_warps=_warps(block))
    return dx
