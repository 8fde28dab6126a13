"""Check the cost model against published large-scale measurements.

Two independent sources, both Megatron-LM on DGX A100 80GB clusters:

- ``profiles/published/megatron_sc21_table1.json`` (a copy of the project's ``shared/calibration`` file): Narayanan et
al. SC'21 Table 1, throughput of 10 GPT
  configurations on 32 to 3072 GPUs (2021 software, full recomputation).
- ``profiles/published/megatron_korthikanti2022.json``: Korthikanti et al. 2022 (arXiv:2205.05198), the time of one
  22B transformer layer (Table 4) and end-to-end iteration times of four models on 8 to 512 GPUs (Table 5).

The built-in A100 profile's kernel rates come from isolated-kernel benchmarks; ``sustained_fraction`` scales them to
what a training step sustains. :func:`fit_sustained_fraction` derives it from the *per-layer* measurement alone
(Table 4); the iteration-level numbers of both sources are held out and only checked (:func:`calibrate_case`,
:func:`check_iteration`). ``tests/test_calibration.py`` recomputes the fit and compares it with the profile file.

Every check costs the published configuration exactly (every choice pinned) and lets the planner search freely too.
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
from autopar.ir.passes import PassOptions
from autopar.ir.plan import Plan
from autopar.planner.intra_op import IntraOpOptions, solve_graph
from autopar.planner.options import PlanOptions
from autopar.planner.search import search
from autopar.profiles.builtin import load_builtin
from autopar.profiles.cost import CostModel
from autopar.profiles.schema import ClusterProfile

__all__ = ["CalibrationRow", "IterationRow", "LayerFit", "megatron_flops", "load_cases", "load_published",
           "calibrate_case", "check_iteration", "fit_sustained_fraction", "layer_times", "DEFAULT_CASES",
           "PUBLISHED"]

_PUBLISHED_DIR = Path(str(resources.files("autopar.profiles") / "published"))  # shipped as package data
DEFAULT_CASES = _PUBLISHED_DIR / "megatron_sc21_table1.json"
PUBLISHED = _PUBLISHED_DIR / "megatron_korthikanti2022.json"
_GPU_PROFILE = {"A100-SXM4-80GB": "dgx-a100-80gb"}
_DTYPE = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_DROPOUT = 0.1  # Megatron-LM trains GPT with hidden and attention dropout 0.1


def megatron_flops(B: int, s: int, l: int, h: int, V: int) -> float:
    """FLOPs per iteration as Narayanan et al. SC'21 count them (with the recompute forward):
    ``96*B*s*l*h^2*(1 + s/(6h) + V/(16*l*h))``."""
    return 96.0 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))


def load_cases(path: Path | str = DEFAULT_CASES) -> list[dict[str, Any]]:
    return list(json.loads(Path(path).read_text())["cases"])


def load_published(path: Path | str = PUBLISHED) -> dict[str, Any]:
    return dict(json.loads(Path(path).read_text()))


def _graph(model: dict[str, Any], layers: int | None = None) -> ir.Graph:
    """The GPT Megatron-LM trained: dropout 0.1, attention scores materialized (fused scale-mask-softmax, no flash
    attention in 2021-22)."""
    return _traced_gpt(layers or model["layers"], model["hidden"], model["heads"], model["seq"], model["vocab"])


@functools.lru_cache(maxsize=4)
def _traced_gpt(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> ir.Graph:
    """Traced once per process: the published tables cost one model under several plans and clusters (a trace of
    GPT-3 175B takes ~8 CPU-s), and the planner only reads a graph."""
    from autopar.zoo.gpt import GPT, GPTConfig

    cfg = GPTConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab, dropout=_DROPOUT)
    with torch.device("meta"):
        net = GPT(cfg)
    tokens = torch.empty((1, seq), dtype=torch.long, device="meta")
    passes = PassOptions(decompose_attention=True, attention_dropout_p=_DROPOUT)
    return ir.trace(net, (tokens,), model_name=f"gpt-l{layers}-h{hidden}", passes=passes)


def _pinned(graph: ir.Graph, profile: ClusterProfile, *, tp: int, pp: int, dp: int, micro_batch: int,
            recompute: str, virtual_stages: int, global_batch: int, dtype: str, time_limit_s: float,
            search_free: bool) -> tuple[Plan, Plan | None]:
    """The published configuration costed with every choice pinned (no ZeRO; 1F1B, interleaved when it has virtual
    stages), and the planner's own plan when ``search_free``."""
    v = virtual_stages
    pins = {"tp": tp, "pp": pp, "dp": dp, "micro_batch": micro_batch, "recompute": recompute, "zero": 0,
            "schedule": "interleaved_1f1b" if v > 1 else "1f1b", "virtual_stages": v}
    # Megatron-LM (2021-22) all-reduced gradients after the backward pass, without overlap, and in fp16 for fp16
    # training (its fp32 gradient accumulation/all-reduce was the bf16 default, off for fp16)
    opts = PlanOptions(global_batch=global_batch, pins=pins, dtype=dtype, top_k=0,  # type: ignore[arg-type]
                       intra_op_time_limit_s=time_limit_s, overlap_grad_sync=False,
                       reduce_dtype=dtype)  # type: ignore[arg-type]
    published = search(graph, profile, opts).best
    free = None
    if search_free:
        free = search(graph, profile, dataclasses.replace(opts, pins={})).best
    return published, free


# ---- per-layer fit ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerFit:
    """One transformer layer, predicted at ``sustained_fraction = 1`` vs measured (milliseconds)."""

    row: str
    compute_ms: float
    """Predicted forward + backward kernel time (+ recompute forward where the row recomputes)."""
    comm_ms: float
    """Predicted tp collectives of the layer."""
    measured_ms: float
    fraction: float
    """``compute / (measured - comm)``: the share of the isolated-kernel rates the measured layer sustained."""


def layer_times(profile: ClusterProfile, *, published: dict[str, Any] | None = None,
                time_limit_s: float = 5.0) -> dict[str, tuple[float, float]]:
    """(compute s, comm s) of one layer of the published per-layer experiment, per recompute mode."""
    pub = published or load_published()
    lay = pub["layer"]
    graph = _graph(lay["model"], layers=2)
    cost = CostModel(profile)
    sols = solve_graph(graph, tp=lay["tp"], cost=cost, tp_span=cost.span(lay["tp"]), dtype="float16",
                       micro_batch_scale=lay["micro_batch"], options=IntraOpOptions(time_limit_s=time_limit_s))
    s = next(s for s, g in zip(sols, graph.layers) if g.role == "block")
    comm = s.fwd_comm_s + s.bwd_comm_s
    base = s.fwd_compute_s + s.bwd_compute_s
    return {"none": (base, comm), "selective": (base + s.recompute_fwd_s_selective, comm),
            # a full recompute re-runs the forward, its collectives included
            "full": (base + s.fwd_compute_s, comm + s.fwd_comm_s)}


def fit_sustained_fraction(profile_name: str = "dgx-a100-80gb", *, published: dict[str, Any] | None = None
                           ) -> tuple[float, list[LayerFit]]:
    """``sustained_fraction`` for ``profile_name`` from the published per-layer times, and how every row of that
    table compares.  The fit uses the ``fit_rows`` (those with sequence parallelism, the layout the intra-op solver
    picks for this layer): ``sum(predicted kernel time) / sum(measured - predicted collectives)``.  The profile's own
    ``sustained_fraction`` is ignored (set to 1)."""
    pub = published or load_published()
    prof = load_builtin(profile_name)
    prof = dataclasses.replace(prof, device=dataclasses.replace(prof.device, sustained_fraction=1.0))
    times = layer_times(prof, published=pub)
    fits = []
    for row, r in pub["layer"]["rows_ms"].items():
        compute, comm = times[r["recompute"]]
        measured = (r["fwd"] + r["bwd"]) / 1e3
        fits.append(LayerFit(row, compute * 1e3, comm * 1e3, measured * 1e3, compute / (measured - comm)))
    use = [f for f in fits if f.row in pub["layer"]["fit_rows"]]
    return sum(f.compute_ms for f in use) / sum(f.measured_ms - f.comm_ms for f in use), fits


# ---- iteration-level checks (held out) ----------------------------------------------------------------------------
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


def calibrate_case(case: dict[str, Any], *, search_free: bool = True, time_limit_s: float = 5.0) -> CalibrationRow:
    """One SC'21 Table 1 row: predicted TFLOP/s per GPU of the published plan under the paper's FLOP formula."""
    m, cl, pl = case["model"], case["cluster"], case["plan"]
    graph = _graph(m)
    profile = load_builtin(_GPU_PROFILE[cl["gpu"]], nodes=cl["gpus"] // cl["gpus_per_node"])
    gb = case["global_batch"]
    published, free = _pinned(graph, profile, tp=pl["tp"], pp=pl["pp"], dp=pl["dp"], micro_batch=pl["micro_batch"],
                              recompute=pl["recompute"], virtual_stages=pl.get("virtual_stages") or 1,
                              global_batch=gb, dtype=_DTYPE[pl["precision"]], time_limit_s=time_limit_s,
                              search_free=search_free)
    flops = megatron_flops(gb, m["seq"], m["layers"], m["hidden"], m["vocab"])
    pred = flops / published.time.total / cl["gpus"] / 1e12
    free_tflops = flops / free.time.total / cl["gpus"] / 1e12 if free is not None else float("nan")
    return CalibrationRow(case["id"], cl["gpus"], case["measured"]["tflops_per_gpu"], pred, free_tflops,
                          published, free)


@dataclass(frozen=True)
class IterationRow:
    case: str
    recompute: str
    gpus: int
    measured_s: float
    predicted_s: float
    planner_s: float
    published_plan: Plan
    planner_plan: Plan | None

    @property
    def ratio(self) -> float:
        """Predicted throughput over measured (``measured_s / predicted_s``): > 1 is optimistic."""
        return self.measured_s / self.predicted_s


def check_iteration(case: dict[str, Any], recompute: str, *, search_free: bool = True,
                    time_limit_s: float = 5.0, published: dict[str, Any] | None = None) -> IterationRow:
    """One Korthikanti et al. Table 5 entry: predicted iteration time of the published configuration."""
    pub = published or load_published()
    gpn = pub["gpus_per_node"]
    graph = _graph(case["model"])
    profile = load_builtin(_GPU_PROFILE[pub["gpu"]], nodes=max(1, case["gpus"] // gpn))
    plan, free = _pinned(graph, profile, tp=case["tp"], pp=case["pp"], dp=case["gpus"] // (case["tp"] * case["pp"]),
                         micro_batch=case["micro_batch"], recompute=recompute, virtual_stages=case["virtual_stages"],
                         global_batch=case["global_batch"], dtype="float16", time_limit_s=time_limit_s,
                         search_free=search_free)
    return IterationRow(case["id"], recompute, case["gpus"], case["seconds"][recompute], plan.time.total,
                        free.time.total if free is not None else float("nan"), plan, free)
