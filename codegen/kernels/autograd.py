"""``torch.autograd.Function`` wrappers of the generated kernels, and the functional API the rewritten programs call.

Each public ``fused_*`` function runs the Triton kernels when the tensors are on CUDA or the Triton interpreter is
forced (``TRITON_INTERPRET=1``), and the equivalent eager PyTorch (``eager_*``) otherwise, so a rewritten program stays
runnable anywhere.  Backward per kind:

==============  =================================================================================================
function        backward
==============  =================================================================================================
fused_add_norm  generated Triton kernel (dx, dr = dx + ds, dw/db from per-program fp32 partials); saves the
                normalized input (the sum when there is a residual), weight, and fp32 mean/rstd per row
fused_softmax   generated Triton kernel from the saved output ``y``
fused_dropout   the forward kernel on ``dy`` with the same Philox seed/offset (mask regenerated, never stored)
fused_bias_act  eager recomputation from the saved inputs (x, bias) under autograd
fused_swiglu    eager recomputation from the saved inputs (gate, up) under autograd
==============  =================================================================================================
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from autopar.codegen.kernels import launch
from autopar.codegen.triton_gen import ACTIVATIONS, KernelSpec

__all__ = ["fused_bias_act", "fused_swiglu", "fused_add_norm", "fused_softmax", "fused_dropout",
           "eager_bias_act", "eager_swiglu", "eager_add_norm", "eager_softmax", "use_triton"]


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton path can run on tensors like ``t`` (CUDA, or the interpreter on CPU)."""
    return t.is_cuda or (launch.interpreting() and t.device.type == "cpu")


# ---- eager references (also the recomputation used by backward) -------------------------------------------------
def eager_bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """``act(x + bias)`` in eager PyTorch."""
    h = x + bias if bias is not None else x
    if act == "gelu":
        return F.gelu(h)
    if act == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    if act == "silu":
        return F.silu(h)
    return F.relu(h)


def eager_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """``silu(g) * u`` in eager PyTorch."""
    return F.silu(g) * u


def eager_add_norm(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None, *, norm: str, eps: float) -> Any:
    """``(x + r, norm(x + r))`` (or ``norm(x)`` without ``r``) in eager PyTorch."""
    s = x + r if r is not None else x
    if norm == "layer_norm":
        y = F.layer_norm(s, s.shape[-1:], weight, bias, eps)
    else:
        y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps)
        y = y * weight if weight is not None else y
    return (s, y) if r is not None else y


def eager_softmax(x: torch.Tensor, *, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """Scaled, optionally causally masked (top-left aligned) softmax over the last dim in eager PyTorch."""
    if scale is not None:
        x = x * scale
    if causal:
        sq, sk = x.shape[-2], x.shape[-1]
        keep = torch.ones(sq, sk, dtype=torch.bool, device=x.device).tril()
        x = x.masked_fill(~keep, float("-inf"))
    return torch.softmax(x, dim=-1)


# ---- autograd functions ------------------------------------------------------------------------------------------
def _recompute_grads(fn: Any, inputs: tuple[torch.Tensor | None, ...], needs: tuple[bool, ...],
                     dy: torch.Tensor) -> list[torch.Tensor | None]:
    """Gradients of ``fn(*inputs)`` w.r.t. the inputs that need them, by eager recomputation."""
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_(n) if t is not None else None for t, n in zip(inputs, needs)]
        out = fn(*leaves)
        wanted = [t for t in leaves if t is not None and t.requires_grad]
        grads = iter(torch.autograd.grad(out, wanted, dy) if wanted else ())
    return [next(grads) if t is not None and t.requires_grad else None for t in leaves]


class _BiasAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
        ctx.act = act
        ctx.save_for_backward(x, bias)
        return launch.bias_act_fwd(KernelSpec(kind="bias_act", act=act, bias=bias is not None), x, bias)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        x, bias = ctx.saved_tensors
        gx, gb = _recompute_grads(lambda a, b: eager_bias_act(a, b, ctx.act), (x, bias),
                                  tuple(ctx.needs_input_grad[:2]), dy)
        return gx, gb, None


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(g, u)
        return launch.swiglu_fwd(KernelSpec(kind="swiglu"), g, u)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        g, u = ctx.saved_tensors
        return tuple(_recompute_grads(eager_swiglu, (g, u), tuple(ctx.needs_input_grad[:2]), dy))


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor | None,
                b: torch.Tensor | None, eps: float, norm: str) -> Any:
        spec = KernelSpec(kind="add_norm", norm=norm, residual=r is not None, weight=w is not None,
                          norm_bias=b is not None)
        s, y, mean, rstd = launch.norm_fwd(spec, x, r, w, b, eps)
        ctx.spec = spec
        ctx.save_for_backward(s if s is not None else x, w, mean, rstd)
        return (s, y) if s is not None else y

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[Any, ...]:
        spec: KernelSpec = ctx.spec
        xn, w, mean, rstd = ctx.saved_tensors
        ds, dy = grads if spec.residual else (None, grads[0])
        if dy is None:
            dy = torch.zeros_like(xn)
        dx, dw, db = launch.norm_bwd(spec, dy, ds, xn, w, mean, rstd)
        dw = dw.to(w.dtype) if dw is not None and w is not None else None
        db = db.to(w.dtype if w is not None else xn.dtype) if db is not None else None
        return dx, (dx if spec.residual else None), dw, db, None, None


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, scale: float | None, causal: bool) -> torch.Tensor:
        spec = KernelSpec(kind="softmax", scale=scale is not None, causal=causal)
        y = launch.softmax_fwd(spec, x, 1.0 if scale is None else scale)
        ctx.spec, ctx.scale = spec, 1.0 if scale is None else scale
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        (y,) = ctx.saved_tensors
        return launch.softmax_bwd(ctx.spec, dy, y, ctx.scale), None, None


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, p: float, seed: int, offset: int) -> torch.Tensor:
        ctx.p, ctx.seed, ctx.offset = p, seed, offset
        return launch.dropout_fwd(KernelSpec(kind="dropout"), x, p, seed, offset)

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[Any, ...]:
        return launch.dropout_fwd(KernelSpec(kind="dropout"), dy, ctx.p, ctx.seed, ctx.offset), None, None, None


# ---- public functional API ---------------------------------------------------------------------------------------
def fused_bias_act(x: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    """``act(x + bias)``, bias over the last dim; ``act`` in ``gelu`` (erf), ``gelu_tanh``, ``silu``, ``relu``."""
    if act not in ACTIVATIONS:
        raise ValueError(f"fused_bias_act: act must be one of {ACTIVATIONS}, got {act!r}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != x.shape[-1]):
        raise ValueError(f"fused_bias_act: bias must have shape [{x.shape[-1]}], got {tuple(bias.shape)}")
    if not use_triton(x):
        return eager_bias_act(x, bias, act)
    return _BiasAct.apply(x, bias, act)


def fused_swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (broadcasting like eager)."""
    if not use_triton(gate):
        return eager_swiglu(gate, up)
    gate, up = torch.broadcast_tensors(gate, up)
    return _SwiGLU.apply(gate, up)


def fused_add_norm(x: torch.Tensor, r: torch.Tensor | None, weight: torch.Tensor | None,
                   bias: torch.Tensor | None = None, *, norm: str = "layer_norm", eps: float = 1e-5) -> Any:
    """``(x + r, norm(x + r))``, or ``norm(x)`` when ``r`` is None, over the last dim (``layer_norm`` or
    ``rms_norm``).  ``x`` and ``r`` broadcast against each other like eager ``+``."""
    if norm not in ("layer_norm", "rms_norm"):
        raise ValueError(f"fused_add_norm: norm must be 'layer_norm' or 'rms_norm', got {norm!r}")
    if bias is not None and norm != "layer_norm":
        raise ValueError("fused_add_norm: a bias is only supported for layer_norm")
    if not use_triton(x):
        return eager_add_norm(x, r, weight, bias, norm=norm, eps=eps)
    if r is not None:
        dt = torch.promote_types(x.dtype, r.dtype)
        x, r = torch.broadcast_tensors(x.to(dt), r.to(dt))
    return _AddNorm.apply(x, r, weight, bias, float(eps), norm)


def fused_softmax(x: torch.Tensor, *, scale: float | None = None, causal: bool = False) -> torch.Tensor:
    """``softmax(x * scale)`` over the last dim, with an optional causal mask over the last two dims."""
    if not use_triton(x):
        return eager_softmax(x, scale=scale, causal=causal)
    return _Softmax.apply(x, None if scale is None else float(scale), bool(causal))


def fused_dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, *, seed: int | None = None,
                  offset: int = 0) -> torch.Tensor:
    """Inverted dropout whose mask comes from Philox(seed, offset + index); ``seed`` defaults to a draw from torch's
    default CPU generator (so ``torch.manual_seed`` makes it reproducible)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"fused_dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    if not use_triton(x):
        return F.dropout(x, p, True)
    if seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (1,)).item())
    return _Dropout.apply(x, float(p), int(seed), int(offset))
