"""Published training runs beyond Megatron's own tables: sharded data parallelism (ZeRO-3, FSDP2) at scale.

Two stored sources (``profiles/published/``):

- ``megatron_sc21_table2_zero3.json``: Narayanan et al. SC'21 Table 2, GPT-175B and GPT-530B on 384-2240 A100s,
  DeepSpeed ZeRO-3 without model parallelism against Megatron-LM PTD-P (TFLOP/s per GPU, the paper's FLOP formula).
  All rows held out.
- ``torchtitan_fsdp.json``: torchtitan FSDP2 runs of Llama 3 8B/70B on 64 A100s and Llama 3.1 8B on 8 and 128
  H100s (tokens/s per GPU).  Each row says whether it fits a profile coefficient (``role: fit``) or only checks it
  (``held_out``): :func:`fit_h100_sustained_fraction` uses only the one fit row (Llama 3.1 8B on 8 H100s).

Every run is costed with the published configuration pinned (:func:`check_run`) and, optionally, searched freely on
the same cluster; a pinned plan that the memory model rejects is still costed (on a device with the memory limit
lifted) and flagged, so a memory-model error does not hide a time prediction.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

from autopar import ir
from autopar.ir.plan import Plan
from autopar.planner.calibration import _graph as _gpt_graph
from autopar.planner.calibration import megatron_flops
from autopar.planner.options import PlanOptions
from autopar.planner.search import PlanInfeasibleError, search
from autopar.profiles.builtin import load_builtin
from autopar.profiles.schema import ClusterProfile

__all__ = ["RunRow", "ZERO3_RUNS", "TORCHTITAN_RUNS", "load_runs", "check_run", "run_profile", "llama_flops_per_token",
           "fit_h100_sustained_fraction"]

_DIR = Path(str(resources.files("autopar.profiles") / "published"))
ZERO3_RUNS = _DIR / "megatron_sc21_table2_zero3.json"
TORCHTITAN_RUNS = _DIR / "torchtitan_fsdp.json"
_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_HBM2E_500W_BANDWIDTH = 2.4e12 * 0.85
"""torchtitan's H100s: 2.4 TB/s HBM2e (benchmarks/llama3_h100_202412_torchtitan.md), 85% achievable as in the
built-in profiles."""


def load_runs(path: Path | str) -> list[dict[str, Any]]:
    return list(json.loads(Path(path).read_text())["cases"])


def run_profile(case: dict[str, Any], base: ClusterProfile | None = None) -> ClusterProfile:
    """The built-in profile of the run's hardware, sized to its node count (``base`` replaces the built-in one,
    e.g. with a coefficient being fitted).  The 500 W HBM2e H100s of torchtitan's runs are the DGX H100 profile
    with their memory size and bandwidth; what the power cap costs is left to ``sustained_fraction``."""
    cl = case["cluster"]
    gpu = cl["gpu"]
    name = "dgx-a100-80gb" if gpu.startswith("A100") else "dgx-h100"
    nodes = max(1, cl["gpus"] // cl["gpus_per_node"])
    prof = load_builtin(name, nodes=nodes) if base is None else dataclasses.replace(base, nodes=nodes)
    if "HBM2e" in gpu:
        prof = dataclasses.replace(prof, device=dataclasses.replace(
            prof.device, memory_bytes=int(cl["memory_gib"] * 2**30), memory_bandwidth=_HBM2E_500W_BANDWIDTH))
    return prof


def _llama_graph(m: dict[str, Any]) -> ir.Graph:
    return _traced_llama(*(m[k] for k in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq")))


@functools.lru_cache(maxsize=4)
def _traced_llama(layers: int, hidden: int, heads: int, kv_heads: int, ffn: int, vocab: int, seq: int) -> ir.Graph:
    """Traced once per process, as :func:`autopar.planner.calibration._traced_gpt`."""
    from autopar.zoo.llama import Llama, LlamaConfig

    cfg = LlamaConfig(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab, seq=seq)
    with torch.device("meta"):
        net = Llama(cfg)
    tokens = torch.empty((1, seq), dtype=torch.long, device="meta")
    return ir.trace(net, (tokens,), model_name=f"llama-l{layers}-h{hidden}")


def llama_flops_per_token(m: dict[str, Any]) -> float:
    """torchtitan's model FLOPs per token: ``6 N + 12 l h s`` (N without the input embedding)."""
    h, kv = m["hidden"], m["hidden"] // m["heads"] * m["kv_heads"]
    per_layer = 2 * h * h + 2 * h * kv + 3 * h * m["ffn"]
    n = m["layers"] * per_layer + m["vocab"] * h
    return 6.0 * n + 12.0 * m["layers"] * h * m["seq"]


@dataclass(frozen=True)
class RunRow:
    case: str
    role: str
    gpus: int
    unit: str
    """'TFLOP/s/GPU' or 'tokens/s/GPU'."""
    measured: float
    predicted: float
    planner: float
    """The planner's own pick on the same cluster and batch, in ``unit`` (nan when not searched)."""
    published_plan: Plan
    planner_plan: Plan | None
    fits_memory: bool
    """Whether the memory model accepts the published plan on the real device."""

    @property
    def ratio(self) -> float:
        """Predicted over measured throughput (> 1 is optimistic)."""
        return self.predicted / self.measured


def _options(case: dict[str, Any], pins: dict[str, Any] | None, time_limit_s: float) -> PlanOptions:
    pl = case["plan"]
    return PlanOptions(global_batch=case["global_batch"], pins=pins or {}, dtype=_DTYPE[pl["precision"]],  # type: ignore
                       reduce_dtype=_DTYPE[pl["reduce_dtype"]], dp_collectives=pl["dp_collectives"],  # type: ignore
                       overlap_grad_sync=pl["overlap_grad_sync"], fused_kernels=pl.get("fused_kernels", True),
                       top_k=0, intra_op_time_limit_s=time_limit_s)


def check_run(case: dict[str, Any], *, search_free: bool = False, time_limit_s: float = 5.0,
              profile: ClusterProfile | None = None) -> RunRow:
    """Cost one published run with its configuration pinned (and search freely when ``search_free``)."""
    m, pl, cl = case["model"], case["plan"], case["cluster"]
    graph = _gpt_graph(m) if m["arch"] == "GPT" else _llama_graph(m)
    prof = run_profile(case, profile)
    v = pl.get("virtual_stages") or 1
    pins = {"tp": pl["tp"], "pp": pl["pp"], "dp": pl["dp"], "zero": pl["zero"], "micro_batch": pl["micro_batch"],
            "recompute": pl["recompute"], "schedule": "interleaved_1f1b" if v > 1 else "1f1b", "virtual_stages": v}
    opts = _options(case, pins, time_limit_s)
    fits = True
    try:
        plan = search(graph, prof, opts).best
    except PlanInfeasibleError:
        fits = False
        roomy = dataclasses.replace(prof, device=dataclasses.replace(prof.device, memory_bytes=2**42))
        plan = search(graph, roomy, opts).best
    free = None
    if search_free:
        # the planner costs what autopar's runtime runs: FSDP2 units, overlapped, fp32 reduce unless published
        free_opts = dataclasses.replace(opts, pins={}, dp_collectives="unit", overlap_grad_sync=True)
        free = search(graph, prof, free_opts).best
    gpus, gb = cl["gpus"], case["global_batch"]
    if "tflops_per_gpu" in case["measured"]:
        flops = megatron_flops(gb, m["seq"], m["layers"], m["hidden"], m["vocab"])
        unit, measured = "TFLOP/s/GPU", case["measured"]["tflops_per_gpu"]
        value = lambda p: flops / p.time.total / gpus / 1e12
    else:
        unit, measured = "tokens/s/GPU", case["measured"]["tokens_per_s_per_gpu"]
        value = lambda p: gb * m["seq"] / p.time.total / gpus
    return RunRow(case["id"], case.get("role", "held_out"), gpus, unit, measured, value(plan),
                  value(free) if free is not None else float("nan"), plan, free, fits)


def _bisect(value: Any, lo: float, hi: float, *, increasing: bool, iters: int = 14) -> float:
    """The root of ``value(x) = 0`` on ``[lo, hi]`` (clamped to the ends when there is none)."""
    f_lo, f_hi = value(lo), value(hi)
    if (f_lo > 0) == increasing and (f_hi > 0) == increasing:
        return lo
    if (f_lo > 0) != increasing and (f_hi > 0) != increasing:
        return hi
    for _ in range(iters):
        mid = (lo + hi) / 2
        if (value(mid) > 0) == increasing:
            hi = mid
        else:
            lo = mid
    return (lo + hi) / 2


def _fit_rows(gpu_prefix: str) -> list[dict[str, Any]]:
    return [c for c in load_runs(TORCHTITAN_RUNS) if c["role"] == "fit" and c["cluster"]["gpu"].startswith(gpu_prefix)]


def _log_ratio(rows: list[dict[str, Any]], profile: ClusterProfile) -> float:
    import math

    return sum(math.log(check_run(c, profile=profile).ratio) for c in rows)


def fit_h100_sustained_fraction(profile_name: str = "dgx-h100") -> tuple[float, list[str]]:
    """``sustained_fraction`` of the H100 profile from the 'fit' torchtitan H100 rows (others held out)."""
    base = load_builtin(profile_name)
    rows = _fit_rows("H100")

    def err(frac: float) -> float:
        prof = dataclasses.replace(base, device=dataclasses.replace(base.device, sustained_fraction=frac))
        return _log_ratio(rows, prof)

    return _bisect(err, 0.2, 1.0, increasing=True), [c["id"] for c in rows]
