"""Triton source generation: one readable ``@triton.jit`` forward kernel (and, where stated, a backward kernel) per
fusion-group kind.

A :class:`KernelSpec` describes *what* a fused group computes, independent of node names and tensor sizes, so every
identical group (the same fusion in each of a model's blocks) maps to one piece of source and one compiled kernel.
:func:`generate_source` turns a spec into the text of a Python module; the text is deterministic (golden files
pin it) and depends only on the spec.  The groups themselves come from the IR's fusion analysis
(:mod:`autopar.ir.passes.fuse`): :func:`spec_of` maps a group (or an fx pattern match) to its spec and
:func:`render_kernels` lists the source of every distinct kernel of a graph.

Kernel shapes (all masked, so any size works -- ragged rows and ``numel`` not a multiple of the block):

* flat elementwise kernels (``bias_act``, ``swiglu``, ``dropout``): a 1-D grid over ``numel`` in blocks of
  :data:`FLAT_BLOCK` elements; a bias broadcasts over the last dimension (index ``offs % N``);
* row kernels (``add_norm``, ``softmax``): one program per row of length ``N``, ``BLOCK = next_power_of_2(N)``;
  the norm backward loops over rows (``range(pid, M, nprog)``) to accumulate the weight/bias gradients in registers
  and writes one fp32 partial per program, which the launcher sums.

Every load is upcast to fp32 (``.to(tl.float32)``), the math runs in fp32 and stores cast to the output's dtype, so
fp16/bf16 inputs accumulate in fp32 (and the Triton interpreter, which mishandles bf16 arithmetic, sees only fp32).

Backward strategy per kind (also in :mod:`autopar.codegen.kernels`):

================  ===========================================================================================
kind              backward
================  ===========================================================================================
``add_norm``      generated kernel ``*_bwd`` (dx, optional residual grad, per-program dw/db partials)
``softmax``       generated kernel ``*_bwd``: ``dx = scale * y * (dy - sum(dy * y))`` from the saved output
``dropout``       the forward kernel again on ``dy`` with the same seed/offset (the Philox mask is regenerated)
``bias_act``      eager recomputation of the group from its saved inputs (PyTorch autograd)
``swiglu``        eager recomputation of the group from its saved inputs (PyTorch autograd)
================  ===========================================================================================
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterable, Literal

from autopar.ir.graph import Graph
from autopar.ir.passes.fuse import FusionGroup, fusion_groups
from autopar.ir.passes.patterns import KERNEL_KINDS

__all__ = ["KernelSpec", "generate_source", "source_hash", "spec_of", "render_kernels", "FLAT_BLOCK", "ACTIVATIONS",
           "KINDS"]

#: elements per program of the flat elementwise kernels
FLAT_BLOCK = 1024
#: activations the ``bias_act`` kernel knows (``gelu`` is the exact erf form of ``F.gelu``; ``gelu_tanh`` is
#: ``F.gelu(approximate="tanh")``)
ACTIVATIONS = ("gelu", "gelu_tanh", "silu", "relu")
#: fusion-group kinds that have a generated kernel (the IR's vocabulary, :data:`autopar.ir.passes.KERNEL_KINDS`)
KINDS = KERNEL_KINDS

Kind = Literal["bias_act", "swiglu", "add_norm", "softmax", "dropout"]


@dataclass(kw_only=True, slots=True, frozen=True)
class KernelSpec:
    """What one fused group computes (no sizes, no names)."""

    kind: Kind
    """Group kind, one of :data:`KINDS`."""
    act: str = ""
    """``bias_act`` only: the activation, one of :data:`ACTIVATIONS`."""
    bias: bool = False
    """``bias_act`` only: add a bias broadcast over the last dimension before the activation."""
    norm: str = ""
    """``add_norm`` only: ``layer_norm`` or ``rms_norm``."""
    residual: bool = False
    """``add_norm`` only: normalize ``x + r`` and also write the sum (the residual stream)."""
    weight: bool = True
    """``add_norm`` only: multiply by a learned weight."""
    norm_bias: bool = False
    """``add_norm`` with ``layer_norm`` only: add a learned bias."""
    scale: bool = False
    """``softmax`` only: multiply the input by a runtime scale first."""
    causal: bool = False
    """``softmax`` only: mask columns after the row's query position (top-left aligned, as ``torch.tril`` and
    ``scaled_dot_product_attention(is_causal=True)``)."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"KernelSpec.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "bias_act" and self.act not in ACTIVATIONS:
            raise ValueError(f"KernelSpec.act must be one of {ACTIVATIONS} for bias_act, got {self.act!r}")
        if self.kind == "add_norm" and self.norm not in ("layer_norm", "rms_norm"):
            raise ValueError(f"KernelSpec.norm must be 'layer_norm' or 'rms_norm' for add_norm, got {self.norm!r}")
        if self.norm_bias and self.norm != "layer_norm":
            raise ValueError("KernelSpec.norm_bias is only meaningful for layer_norm")

    @property
    def name(self) -> str:
        """Kernel base name, e.g. ``bias_gelu``, ``add_rms_norm``, ``scale_causal_softmax``."""
        if self.kind == "bias_act":
            return f"bias_{self.act}" if self.bias else self.act
        if self.kind == "add_norm":
            return f"add_{self.norm}" if self.residual else self.norm
        if self.kind == "softmax":
            return "_".join([*(["scale"] if self.scale else []), *(["causal"] if self.causal else []), "softmax"])
        return self.kind

    @property
    def has_backward_kernel(self) -> bool:
        """True when backward runs generated Triton code (norms, softmax, dropout); False: eager recomputation."""
        return self.kind in ("add_norm", "softmax", "dropout")


# ---- shared snippets ---------------------------------------------------------------------------------------------
_HEADER = '''"""Generated by autopar codegen.triton_gen for fusion kind {kind!r} ({name}). Do not edit."""
import triton
import triton.language as tl

'''

_FLAT_PROLOGUE = """    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
"""

_ROW_PROLOGUE = """    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
"""


def _act_lines(act: str) -> list[str]:
    """fp32 ``y`` from fp32 ``x`` for one activation."""
    if act == "gelu":
        # exact GELU, Hendrycks & Gimpel 2016: x * Phi(x) = 0.5 x (1 + erf(x / sqrt(2)))
        return ["    y = 0.5 * x * (1.0 + tl.erf(x * 0.7071067811865476))"]
    if act == "gelu_tanh":
        # tanh approximation (Hendrycks & Gimpel 2016, Eq. 2); tanh(z) = 2 sigmoid(2z) - 1
        return ["    z = 0.7978845608028654 * (x + 0.044715 * x * x * x)",
                "    y = 0.5 * x * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))"]
    if act == "silu":
        return ["    y = x * tl.sigmoid(x)"]
    assert act == "relu", act
    return ["    y = tl.maximum(x, 0.0)"]


def _kernel(name: str, args: list[str], doc: str, body: list[str]) -> str:
    return "\n".join(["@triton.jit", f"def {name}({', '.join(args)}):", f'    """{doc}"""', *body]) + "\n"


# ---- elementwise kinds -------------------------------------------------------------------------------------------
def _bias_act(spec: KernelSpec) -> str:
    args = ["X", *(["B"] if spec.bias else []), "Y", "numel", "N", "BLOCK: tl.constexpr"]
    body = [_FLAT_PROLOGUE.rstrip("\n"),
            "    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)"]
    if spec.bias:
        body.append("    x = x + tl.load(B + offs % N, mask=mask, other=0.0).to(tl.float32)")
    body += _act_lines(spec.act)
    body.append("    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)")
    doc = f"y = {spec.act}(x{' + b' if spec.bias else ''}) over a flat view; b broadcasts over the last dim (N)."
    return _kernel(f"{spec.name}_fwd", args, doc, body)


def _swiglu(spec: KernelSpec) -> str:
    body = [_FLAT_PROLOGUE.rstrip("\n"),
            "    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)",
            "    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)",
            "    y = g * tl.sigmoid(g) * u",
            "    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)"]
    doc = "SwiGLU gating (Shazeer 2020): y = silu(g) * u over a flat view."
    return _kernel("swiglu_fwd", ["G", "U", "Y", "numel", "BLOCK: tl.constexpr"], doc, body)


def _dropout(spec: KernelSpec) -> str:
    body = [_FLAT_PROLOGUE.rstrip("\n"),
            "    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)",
            "    # Philox counter = element index + offset: the backward pass regenerates the same mask",
            "    r = tl.rand(seed, (offs + offset).to(tl.int32))",
            "    y = tl.where(r >= p, x / (1.0 - p), 0.0)",
            "    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)"]
    doc = ("Inverted dropout: keep with probability 1-p and scale by 1/(1-p). Applied to dy with the same "
           "seed and offset it is also the backward kernel.")
    return _kernel("dropout_fwd", ["X", "Y", "numel", "p", "seed", "offset", "BLOCK: tl.constexpr"], doc, body)


# ---- row kinds ---------------------------------------------------------------------------------------------------
def _norm_stats(spec: KernelSpec) -> list[str]:
    if spec.norm == "layer_norm":
        # Ba et al. 2016: y = (x - mean) / sqrt(var + eps) * w + b, biased variance
        return ["    mean = tl.sum(x, axis=0) / N",
                "    xc = tl.where(mask, x - mean, 0.0)",
                "    var = tl.sum(xc * xc, axis=0) / N",
                "    rstd = 1.0 / tl.sqrt(var + eps)",
                "    xhat = xc * rstd"]
    # Zhang & Sennrich 2019: y = x / sqrt(mean(x^2) + eps) * w
    return ["    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)",
            "    xhat = x * rstd"]


def _norm_fwd(spec: KernelSpec) -> str:
    ln = spec.norm == "layer_norm"
    args = ["X", *(["R"] if spec.residual else []), *(["W"] if spec.weight else []),
            *(["B"] if spec.norm_bias else []), *(["S"] if spec.residual else []), "Y",
            *(["MEAN"] if ln else []), "RSTD", "N", "eps", "BLOCK: tl.constexpr"]
    body = [_ROW_PROLOGUE.rstrip("\n"),
            "    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)"]
    if spec.residual:
        body += ["    s = x + tl.load(R + row * N + cols, mask=mask, other=0.0).to(tl.float32)",
                 "    tl.store(S + row * N + cols, s.to(S.dtype.element_ty), mask=mask)",
                 "    # normalize the rounded sum, as the unfused add -> norm does (and as backward re-reads it)",
                 "    x = s.to(S.dtype.element_ty).to(tl.float32)"]
    body += _norm_stats(spec)
    body.append("    y = xhat")
    if spec.weight:
        body.append("    y = y * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)")
    if spec.norm_bias:
        body.append("    y = y + tl.load(B + cols, mask=mask, other=0.0).to(tl.float32)")
    if ln:
        body.append("    tl.store(MEAN + row, mean)")
    body += ["    tl.store(RSTD + row, rstd)",
             "    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)"]
    what = "x + r" if spec.residual else "x"
    doc = f"One row per program: {spec.norm} of {what} (fp32 statistics saved for backward)."
    return _kernel(f"{spec.name}_fwd", args, doc, body)


def _norm_bwd(spec: KernelSpec) -> str:
    ln = spec.norm == "layer_norm"
    args = ["DY", *(["DS"] if spec.residual else []), "XN", *(["W"] if spec.weight else []),
            *(["MEAN"] if ln else []), "RSTD", "DX", *(["DW"] if spec.weight else []),
            *(["DB"] if spec.norm_bias else []), "M", "N", "BLOCK: tl.constexpr"]
    body = ["    pid = tl.program_id(0)",
            "    nprog = tl.num_programs(0)",
            "    cols = tl.arange(0, BLOCK)",
            "    mask = cols < N"]
    body.append("    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)" if spec.weight else
                "    w = tl.where(mask, 1.0, 0.0)")
    if spec.weight:
        body.append("    dw = tl.zeros([BLOCK], dtype=tl.float32)")
    if spec.norm_bias:
        body.append("    db = tl.zeros([BLOCK], dtype=tl.float32)")
    body += ["    for r in range(pid, M, nprog):",
             "        base = tl.cast(r, tl.int64) * N",
             "        x = tl.load(XN + base + cols, mask=mask, other=0.0).to(tl.float32)",
             "        dy = tl.load(DY + base + cols, mask=mask, other=0.0).to(tl.float32)",
             "        rstd = tl.load(RSTD + r)"]
    if ln:
        body += ["        xhat = tl.where(mask, (x - tl.load(MEAN + r)) * rstd, 0.0)",
                 "        wdy = w * dy",
                 "        # d/dx of (x - mean) * rstd: project out the mean and the xhat direction",
                 "        c1 = tl.sum(xhat * wdy, axis=0) / N",
                 "        c2 = tl.sum(wdy, axis=0) / N",
                 "        dx = (wdy - (xhat * c1 + c2)) * rstd"]
    else:
        body += ["        xhat = x * rstd",
                 "        wdy = w * dy",
                 "        c1 = tl.sum(xhat * wdy, axis=0) / N",
                 "        dx = (wdy - xhat * c1) * rstd"]
    if spec.residual:
        body.append("        dx = dx + tl.load(DS + base + cols, mask=mask, other=0.0).to(tl.float32)")
    body.append("        tl.store(DX + base + cols, dx.to(DX.dtype.element_ty), mask=mask)")
    if spec.weight:
        body.append("        dw += dy * xhat")
    if spec.norm_bias:
        body.append("        db += dy")
    if spec.weight:
        body.append("    tl.store(DW + pid * N + cols, dw, mask=mask)")
    if spec.norm_bias:
        body.append("    tl.store(DB + pid * N + cols, db, mask=mask)")
    doc = ("Rows pid, pid+nprog, ...: dx" + (" (plus the residual stream's own gradient DS)" if spec.residual else "")
           + (" and per-program fp32 partial sums of dw/db, summed by the launcher." if spec.weight else "."))
    return _kernel(f"{spec.name}_bwd", args, doc, body)


def _softmax_fwd(spec: KernelSpec) -> str:
    args = ["X", "Y", "N", *(["SQ"] if spec.causal else []), *(["scale"] if spec.scale else []),
            "BLOCK: tl.constexpr"]
    body = [_ROW_PROLOGUE.rstrip("\n"),
            "    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)"]
    if spec.scale:
        body.append("    x = x * scale")
    keep = "mask & (cols <= row % SQ)" if spec.causal else "mask"
    if spec.causal:
        body.append("    # causal: row r is query position r % SQ and sees columns 0..r % SQ")
    body += [f"    x = tl.where({keep}, x, float('-inf'))",
             "    e = tl.exp(x - tl.max(x, axis=0))",
             "    y = e / tl.sum(e, axis=0)",
             "    tl.store(Y + row * N + cols, y.to(Y.dtype.element_ty), mask=mask)"]
    doc = "One row per program: numerically stable softmax (max subtracted) over the last dim, fp32."
    return _kernel(f"{spec.name}_fwd", args, doc, body)


def _softmax_bwd(spec: KernelSpec) -> str:
    args = ["DY", "Y", "DX", "N", *(["scale"] if spec.scale else []), "BLOCK: tl.constexpr"]
    body = [_ROW_PROLOGUE.rstrip("\n"),
            "    y = tl.load(Y + row * N + cols, mask=mask, other=0.0).to(tl.float32)",
            "    dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)",
            "    dx = y * (dy - tl.sum(dy * y, axis=0))"]
    if spec.scale:
        body.append("    dx = dx * scale")
    body.append("    tl.store(DX + row * N + cols, dx.to(DX.dtype.element_ty), mask=mask)")
    doc = "dx = y * (dy - sum(dy * y)) from the saved output y (masked entries have y = 0, so dx = 0)."
    return _kernel(f"{spec.name}_bwd", args, doc, body)


def generate_source(spec: KernelSpec) -> str:
    """The full text of a Python module defining ``<spec.name>_fwd`` (and ``<spec.name>_bwd`` for norms and
    softmax) as ``@triton.jit`` kernels."""
    parts = [_HEADER.format(kind=spec.kind, name=spec.name)]
    if spec.kind == "bias_act":
        parts.append(_bias_act(spec))
    elif spec.kind == "swiglu":
        parts.append(_swiglu(spec))
    elif spec.kind == "dropout":
        parts.append(_dropout(spec))
    elif spec.kind == "add_norm":
        parts += [_norm_fwd(spec), "\n", _norm_bwd(spec)]
    else:
        parts += [_softmax_fwd(spec), "\n", _softmax_bwd(spec)]
    return "".join(p if p.endswith("\n") else p + "\n" for p in parts)


def source_hash(source: str) -> str:
    """Content hash of a kernel module's source (16 hex digits), the on-disk cache key."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


# ---- fusion groups -> kernels ------------------------------------------------------------------------------------
def spec_of(kind: str, a: dict[str, Any]) -> KernelSpec | None:
    """Kernel spec of a fusion group or pattern-match kind with its attributes; None for ``pointwise`` groups (they
    run eagerly)."""
    if kind == "bias_act":
        return KernelSpec(kind="bias_act", act=a["act"], bias=bool(a.get("bias")))
    if kind == "swiglu":
        return KernelSpec(kind="swiglu")
    if kind == "add_norm":
        return KernelSpec(kind="add_norm", norm=a["norm"], residual=bool(a.get("residual")),
                          weight=bool(a.get("weight", True)), norm_bias=bool(a.get("norm_bias")))
    if kind == "softmax":
        return KernelSpec(kind="softmax", scale=a.get("scale") is not None)
    if kind == "dropout":
        return KernelSpec(kind="dropout")
    return None


def render_kernels(graph: Graph, nodes: Iterable[str] | None = None) -> str:
    """The generated Triton source for every distinct fused kernel of ``graph``, each under a comment listing the
    groups that use it (``autopar show plan.yaml --kernels``)."""
    groups = fusion_groups(graph, nodes)
    by_spec: dict[KernelSpec, list[FusionGroup]] = {}
    eager: list[FusionGroup] = []
    for g in groups:
        spec = spec_of(g.kind, dict(g.attrs))
        if spec is None:
            eager.append(g)
        else:
            by_spec.setdefault(spec, []).append(g)
    parts = [f"# {graph.model_name}: {len(groups)} fusion group(s), {len(by_spec)} distinct kernel(s)\n"]
    for spec, gs in by_spec.items():
        saved = sum(g.bytes_saved for g in gs)
        parts.append(f"\n# ==== {spec.name}: {len(gs)} group(s), {saved / 1e6:.3f} MB saved per step (fwd)\n")
        parts += [f"#   {' -> '.join(g.nodes)}\n" for g in gs]
        parts.append(generate_source(spec))
    if eager:
        parts.append(f"\n# ==== eager pointwise runs (no generated kernel): {len(eager)}\n")
        parts += [f"#   {' -> '.join(g.nodes)} ({', '.join(g.ops)})\n" for g in eager]
    return "".join(parts)
