"""Generated Triton kernels vs eager PyTorch under TRITON_INTERPRET=1 (forward and gradients), the on-disk cache,
and a PTX compile for a CUDA target that needs no GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autopar.codegen.kernels import cache as kcache
from autopar.codegen.kernels import (
    cache_dir,
    eager_add_norm,
    eager_bias_act,
    eager_softmax,
    eager_swiglu,
    fused_add_norm,
    fused_bias_act,
    fused_dropout,
    fused_softmax,
    fused_swiglu,
    load_kernels,
)
from autopar.codegen.triton_gen import KernelSpec, generate_source, source_hash

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# (atol, rtol) of the fused low-precision result against eager fp32 on the same (rounded) inputs
TOL = {torch.float32: (2e-5, 1e-4), torch.float16: (1e-2, 1e-2), torch.bfloat16: (6e-2, 5e-2)}
ROW_SHAPES = [(4, 33), (2, 3, 100), (3, 257)]       # ragged rows: none a power of two
FLAT_SHAPES = [(5, 33), (3, 700), (2, 2, 257)]        # numel not a multiple of the 1024 block


pytestmark = pytest.mark.usefixtures("isolated_kernel_cache")


def _leaf(shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(shape) * scale).to(dtype).requires_grad_()


def _ref(ts: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    return [t.detach().float().requires_grad_() if t is not None else None for t in ts]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    scale = max(ref.abs().max().item(), 1.0)
    torch.testing.assert_close(out.float(), ref.float(), atol=atol * scale, rtol=rtol, msg=what)


def _grads_match(outs: tuple[torch.Tensor, ...], refs: tuple[torch.Tensor, ...], leaves: list, ref_leaves: list,
                 dtype: torch.dtype) -> None:
    gens = [torch.randn(o.shape) for o in outs]
    torch.autograd.backward([o for o in outs], [g.to(o.dtype) for g, o in zip(gens, outs)])
    torch.autograd.backward([r for r in refs], [g.to(torch.float32).to(o.dtype).float() for g, o in
                                                zip(gens, outs)])
    for i, (a, b) in enumerate(zip(leaves, ref_leaves)):
        if a is not None:
            _check(a.grad, b.grad, dtype, f"grad of input {i}")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FLAT_SHAPES)
@pytest.mark.parametrize("act", ["gelu", "gelu_tanh", "silu", "relu"])
def test_bias_act(act: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, b = _leaf(shape, dtype), _leaf(shape[-1:], dtype)
    rx, rb = _ref([x, b])
    y, ry = fused_bias_act(x, b, act), eager_bias_act(rx, rb, act)
    assert y.dtype == dtype and y.shape == x.shape
    _check(y, ry, dtype, "forward")
    _grads_match((y,), (ry,), [x, b], [rx, rb], dtype)


def test_act_without_bias() -> None:
    x = _leaf((3, 50), torch.float32)
    torch.testing.assert_close(fused_bias_act(x, None, "silu"), eager_bias_act(x, None, "silu"))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", FLAT_SHAPES)
def test_swiglu(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    g, u = _leaf(shape, dtype), _leaf(shape, dtype)
    rg, ru = _ref([g, u])
    y, ry = fused_swiglu(g, u), eager_swiglu(rg, ru)
    _check(y, ry, dtype, "forward")
    _grads_match((y,), (ry,), [g, u], [rg, ru], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ROW_SHAPES)
@pytest.mark.parametrize("norm,residual", [("layer_norm", True), ("layer_norm", False), ("rms_norm", True),
                                           ("rms_norm", False)])
def test_add_norm(norm: str, residual: bool, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    n = shape[-1]
    x, w = _leaf(shape, dtype, 2.0), _leaf((n,), dtype)
    r = _leaf(shape, dtype) if residual else None
    b = _leaf((n,), dtype) if norm == "layer_norm" else None
    leaves = [x, r, w, b]
    refs = _ref(leaves)
    out = fused_add_norm(x, r, w, b, norm=norm, eps=1e-5)
    ref = eager_add_norm(*refs, norm=norm, eps=1e-5)
    outs, ref_outs = (out, ref) if residual else ((out,), (ref,))
    for o, ro in zip(outs, ref_outs):
        assert o.dtype == dtype
        _check(o, ro, dtype, "forward")
    _grads_match(tuple(outs), tuple(ref_outs), leaves, refs, dtype)


def test_add_norm_broadcast_residual_and_no_weight() -> None:
    x, r = _leaf((2, 5, 40), torch.float32), _leaf((5, 40), torch.float32)
    s, y = fused_add_norm(x, r, None, None, norm="layer_norm")
    rs, ry = eager_add_norm(x, r, None, None, norm="layer_norm", eps=1e-5)
    torch.testing.assert_close((s, y), (rs, ry), atol=1e-5, rtol=1e-4)
    (y.sum() + (s * s).sum()).backward()
    gx, gr = x.grad.clone(), r.grad.clone()
    x.grad = r.grad = None
    (ry.sum() + (rs * rs).sum()).backward()
    torch.testing.assert_close((gx, gr), (x.grad, r.grad), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 3, 7, 33), (1, 2, 100, 100), (5, 257)])
@pytest.mark.parametrize("scale,causal", [(None, False), (0.125, False), (0.3, True)])
def test_softmax(scale: float | None, causal: bool, shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = _leaf(shape, dtype, 3.0)
    (rx,) = _ref([x])
    y, ry = fused_softmax(x, scale=scale, causal=causal), eager_softmax(rx, scale=scale, causal=causal)
    _check(y, ry, dtype, "forward")
    if causal:
        assert (y.float().triu(1) == 0).all()
    _grads_match((y,), (ry,), [x], [rx], dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dropout_masks_agree_and_keep_rate(dtype: torch.dtype) -> None:
    p, n = 0.3, 20_000
    x = (torch.rand(n) + 0.5).to(dtype).requires_grad_()
    y = fused_dropout(x, p, True, seed=1234)
    keep = y != 0
    # kept entries are scaled by 1/(1-p); the keep rate is within 5 standard deviations of 1-p
    torch.testing.assert_close(y[keep].float(), (x[keep].float() / (1 - p)).to(dtype).float(), atol=1e-2,
                               rtol=1e-3)
    sd = (p * (1 - p) / n) ** 0.5
    assert abs(keep.float().mean().item() - (1 - p)) < 5 * sd
    y.backward(torch.ones(n, dtype=dtype))
    assert torch.equal(x.grad != 0, keep), "backward regenerated a different mask"
    torch.testing.assert_close(x.grad[keep].float(), torch.full((int(keep.sum()),), 1 / (1 - p)), atol=1e-2,
                               rtol=1e-3)
    # same seed, same mask; other seed or offset, other mask
    assert torch.equal(fused_dropout(x.detach(), p, True, seed=1234) != 0, keep)
    assert not torch.equal(fused_dropout(x.detach(), p, True, seed=99) != 0, keep)
    assert not torch.equal(fused_dropout(x.detach(), p, True, seed=1234, offset=n) != 0, keep)
    assert fused_dropout(x, p, False) is x


def test_eager_fallback_without_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    x = torch.randn(3, 20)
    torch.testing.assert_close(fused_softmax(x), torch.softmax(x, -1))


def test_cache_writes_content_addressed_file(tmp_path) -> None:
    spec = KernelSpec(kind="bias_act", act="gelu", bias=True)
    src = generate_source(spec)
    mod = load_kernels(spec, cache=tmp_path)
    path = tmp_path / f"bias_gelu_{source_hash(src)}.py"
    assert path.read_text() == src and mod.__file__ == str(path)
    assert load_kernels(spec, cache=tmp_path) is mod
    assert cache_dir() == kcache.cache_dir(os.environ[kcache.ENV_CACHE])


def test_spec_validation() -> None:
    with pytest.raises(ValueError, match="act"):
        KernelSpec(kind="bias_act", act="tanhh")
    with pytest.raises(ValueError, match="norm"):
        KernelSpec(kind="add_norm", norm="batch_norm")
    with pytest.raises(ValueError, match="kind"):
        KernelSpec(kind="conv")  # type: ignore[arg-type]


_PTX_SCRIPT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from autopar.codegen.kernels import load_kernels
from autopar.codegen.triton_gen import KernelSpec
out = {}
for spec, kernel, sig, const in json.loads(sys.argv[1]):
    fn = getattr(load_kernels(KernelSpec(**spec)), kernel)
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
    out[kernel] = triton.compile(src, target=GPUTarget("cuda", 80, 32)).asm["ptx"]
print(json.dumps(out))
"""

_PTX_CASES = [
    ({"kind": "bias_act", "act": "gelu", "bias": True}, "bias_gelu_fwd",
     {"X": "*fp16", "B": "*fp16", "Y": "*fp16", "numel": "i32", "N": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
    ({"kind": "add_norm", "norm": "layer_norm", "residual": True, "norm_bias": True}, "add_layer_norm_bwd",
     {"DY": "*bf16", "DS": "*bf16", "XN": "*bf16", "W": "*bf16", "MEAN": "*fp32", "RSTD": "*fp32", "DX": "*bf16",
      "DW": "*fp32", "DB": "*fp32", "M": "i32", "N": "i32", "BLOCK": "constexpr"}, {"BLOCK": 1024}),
    ({"kind": "dropout"}, "dropout_fwd",
     {"X": "*fp32", "Y": "*fp32", "numel": "i32", "p": "fp32", "seed": "i32", "offset": "i32",
      "BLOCK": "constexpr"}, {"BLOCK": 1024}),
]


def test_ptx_compile_for_cuda_target(tmp_path) -> None:
    """triton.compile for sm_80 needs no GPU.  It runs in a child process without TRITON_INTERPRET: in a process
    where the interpreter is on, @triton.jit makes interpreter functions, not compilable ones."""
    pytest.importorskip("triton")
    try:
        import triton.backends.nvidia.compiler  # noqa: F401
    except ImportError as e:  # pragma: no cover - only where the CUDA backend is not installed
        pytest.skip(f"Triton's CUDA backend is unavailable: {e}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(AUTOPAR_KERNEL_CACHE=str(tmp_path), TRITON_CACHE_DIR=str(tmp_path / "triton"),
               PYTHONPATH=os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _PTX_SCRIPT, json.dumps(_PTX_CASES)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ptx = json.loads(proc.stdout.strip().splitlines()[-1])
    for _, kernel, _, _ in _PTX_CASES:
        assert ".entry" in ptx[kernel] and kernel in ptx[kernel], kernel
        assert ".target sm_80" in ptx[kernel]
