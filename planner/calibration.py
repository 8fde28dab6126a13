"""Check the cost model against published large-scale measurements (``shared/calibration/``).

Each case gives a model, a cluster, the plan that was run and the measured throughput.  We cost that exact plan
(every choice pinned) with a built-in profile, convert the predicted iteration time into TFLOP/s per device with the
*source's own* FLOP formula, and compare; then we let the planner search freely and report what it predicts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

import ir
from ir.passes import decompose_attention
from ir.plan import Plan
from planner.options import PlanOptions
from planner.search import search
from profiles.builtin import load_builtin

__all__ = ["CalibrationRow", "megatron_flops", "load_cases", "calibrate_case", "DEFAULT_CASES"]

DEFAULT_CASES = Path(__file__).resolve().parents[2] / "shared" / "calibration" / "megatron_sc21_table1.json"
_GPU_PROFILE = {"A100-SXM4-80GB": "dgx-a100-80gb"}
_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


def megatron_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """FLOPs per iteration as Narayanan et al. SC'21 count them (with the recompute forward):
    ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))``."""
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


@dataclass(frozen=True)
class CalibrationRow:
    case: str
    gpus: int
    published_tflops: float
    predicted_tflops: float
    planner_tflops: float
    published_plan: Plan
    planner_plan: Plan | None

    @property
    def ratio(self) -> float:
        return self.predicted_tflops / self.published_tflops


def load_cases(path: Path | str = DEFAULT_CASES) -> list[dict[str, Any]]:
    return list(json.loads(Path(path).read_text())["cases"])


def _model_name(case: dict[str, Any]) -> str:
    """The zoo model with the case's layers and hidden size."""
    from examples.zoo import get_config, list_models

    m = case["model"]
    for name in list_models():
        cfg = get_config(name)
        if name.startswith("megatron-") and (cfg.layers, cfg.hidden) == (m["layers"], m["hidden"]):
            return name
    raise ValueError(f"no zoo model with {m['layers']} layers and hidden {m['hidden']} for case {case['id']}")


def calibrate_case(case: dict[str, Any], *, search_free: bool = True, time_limit_s: float = 5.0) -> CalibrationRow:
    from examples.zoo import GPT, get_config

    m, cl, pl = case["model"], case["cluster"], case["plan"]
    name = _model_name(case)
    # the model as Megatron-LM trained it: hidden and attention dropout 0.1, attention scores materialized (fused
    # scale-mask-softmax, no flash attention in 2021)
    cfg = replace(get_config(name), seq=m["seq"], dropout=0.1)
    with torch.device("meta"):
        model = GPT(cfg)
    tokens = torch.empty((1, m["seq"]), dtype=torch.long, device="meta")
    graph = decompose_attention(ir.trace(model, (tokens,), model_name=name), dropout_p=0.1)
    nodes = cl["gpus"] // cl["gpus_per_node"]
    profile = load_builtin(_GPU_PROFILE[cl["gpu"]], nodes=nodes)
    v = pl.get("virtual_stages") or 1
    pins: dict[str, int | str] = {"tp": pl["tp"], "pp": pl["pp"], "dp": pl["dp"], "micro_batch": pl["micro_batch"],
                                  "recompute": pl["recompute"], "zero": 0,
                                  "schedule": "interleaved_1f1b" if v > 1 else "1f1b", "virtual_stages": v}
    dtype = _DTYPE[pl["precision"]]
    gb = case["global_batch"]
    flops = megatron_flops(gb, m["seq"], m["layers"], m["hidden"], m["vocab"])
    # Megatron-LM (2021) all-reduced gradients after the backward pass, without overlap
    opts = PlanOptions(global_batch=gb, pins=pins, dtype=dtype, top_k=0,  # type: ignore[arg-type]
                       intra_op_time_limit_s=time_limit_s, overlap_grad_sync=False)
    published = search(graph, profile, opts).best
    pred = flops / published.time.total / cl["gpus"] / 1e12
    planner_plan, planner_tflops = None, float("nan")
    if search_free:
        free = PlanOptions(global_batch=gb, dtype=dtype, top_k=0, intra_op_time_limit_s=time_limit_s,  # type: ignore
                           overlap_grad_sync=False)
        planner_plan = search(graph, profile, free).best
        planner_tflops = flops / planner_plan.time.total / cl["gpus"] / 1e12
    return CalibrationRow(case["id"], cl["gpus"], case["measured"]["tflops_per_gpu"], pred, planner_tflops,
                          published, planner_plan)
