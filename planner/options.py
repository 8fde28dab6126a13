"""Planner options and user pins (``--pin tp=8``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Mapping

from autopar.ir.limits import MAX_BATCH, check_bound, clip
from autopar.planner.pool import available_cores

if TYPE_CHECKING:
    from autopar.profiles.schema import ClusterProfile

__all__ = ["PlanOptions", "parse_pins", "PIN_KEYS"]

PIN_KEYS = ("pp", "dp", "ep", "cp", "tp", "zero", "micro_batch", "schedule", "recompute", "virtual_stages")
_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
_RECOMPUTE = ("none", "selective", "full")


@dataclass(kw_only=True, slots=True, frozen=True)
class PlanOptions:
    """What to search over and how hard."""

    global_batch: int
    """Samples per training iteration, over all data-parallel replicas."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    """Training compute dtype; half precision means mixed precision (fp32 master weights, 16 B/param with Adam)."""
    reduce_dtype: Literal["bfloat16", "float16", "float32"] = "float32"
    """Dtype of the data-parallel gradient reduction (FSDP2 ``MixedPrecisionPolicy.reduce_dtype``; the all-reduce of
    ZeRO 0).  fp32 by default: the common choice of FSDP and Megatron-LM users for bf16 training (torchtitan's
    ``mixed_precision_reduce``; Megatron-LM's fp32 gradient buffers), at twice the bytes of a bf16 reduction."""
    pins: Mapping[str, int | str] = field(default_factory=dict)
    """Fixed choices: any of pp, dp, ep, cp, tp, zero, micro_batch, schedule, recompute, virtual_stages (ep divides
    dp; cp is a mesh axis of its own: pp*dp*cp*tp = devices)."""
    top_k: int = 5
    """How many alternatives to keep besides the best plan."""
    max_tp: int | None = None
    """Largest tensor-parallel degree tried; default: two nodes' worth of devices (beyond a node only if cheaper)."""
    max_micro_batch: int = 64
    schedules: tuple[str, ...] = _SCHEDULES
    zero_levels: tuple[int, ...] = (0, 1, 2, 3)
    recompute_modes: tuple[str, ...] = _RECOMPUTE
    max_virtual_stages: int = 4
    intra_op_time_limit_s: float = 10.0
    """CP-SAT time limit per distinct layer-group solve."""
    seed: int = 0
    workers: int = field(default_factory=available_cores)
    """Processes for the independent intra-op solves and screening (forked where the OS can fork, else in-process);
    1 = all in this process. Default: the cores this process may run on. The plan is identical for any value."""
    fused_kernels: bool = True
    """Run fused groups (add+norm, bias+activation, SwiGLU, softmax, dropout) as generated Triton kernels
    (``autopar.codegen.kernels``) and cost them so: a fused group's bytes count once (the ``fuse`` pass,
    ``autopar.ir.passes.fuse.apply_fused_bytes``). The runtime fuses stages without tensor parallelism (tp = 1) on CUDA, or on the CPU when ``TRITON_INTERPRET=1``
    is forced; tp > 1 stages run eagerly and are costed unfused.  False: eager everywhere, unfused costs."""
    overlap_grad_sync: bool | None = None
    """Overlap the data-parallel gradient sync with the last micro-batch's backward (DDP/FSDP2 bucketing); False
    costs it after the backward, as frameworks without overlap (e.g. Megatron-LM in 2021) ran it.  None: for ZeRO 0,
    whichever the plan is predicted faster with (the plan records it and the runtime does it): on GPUs the buckets,
    on CPU ranks, where each gloo all-reduce costs ~0.4 ms of latency and its thread takes a core from the compute,
    one all-reduce after the backward."""

    expert_load: tuple[float, ...] = ()
    """Expected share of routed (token, expert) pairs per expert of a sparse MoE block (E numbers, e.g. measured
    with ``autopar.zoo.routing_histogram``); empty: uniform.  Expert parallelism waits for its busiest rank, so the
    imbalance is costed from it (``planner.inter_op.expert``)."""

    dp_collectives: Literal["unit", "tensor"] = "unit"
    """How the data-parallel axis issues its collectives.  ``unit``: one all-gather / reduce-scatter per FSDP unit
    (layer group), overlapped with compute: FSDP2, what the generated runtime runs.  ``tensor``: one per parameter
    tensor, and ZeRO-3 re-gathers for the recomputed forward: DeepSpeed ZeRO-3 as published in 2021 (used to cost
    published DeepSpeed runs; see ``planner.calibration``)."""

    def __post_init__(self) -> None:
        if self.dp_collectives not in ("unit", "tensor"):
            raise ValueError(f"dp_collectives must be 'unit' or 'tensor', got {self.dp_collectives!r}")
        check_bound("global_batch", self.global_batch, MAX_BATCH)
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for k, v in self.pins.items():
            _check_pin(k, v)
        if any(not (x >= 0) for x in self.expert_load) or (self.expert_load and sum(self.expert_load) <= 0):
            raise ValueError("expert_load must be non-negative shares with a positive sum")
        ep, dp = self.pins.get("ep"), self.pins.get("dp")
        if isinstance(ep, int) and isinstance(dp, int) and dp % ep:
            raise ValueError(f"pin ep={ep} must divide pin dp={dp}: experts are sharded over ranks that share data "
                             "parallelism")
        bad = [s for s in self.schedules if s not in _SCHEDULES]
        if bad:
            raise ValueError(f"unknown schedule(s) {bad}; choose from {_SCHEDULES}")
        bad_r = [r for r in self.recompute_modes if r not in _RECOMPUTE]
        if bad_r:
            raise ValueError(f"unknown recompute mode(s) {bad_r}; choose from {_RECOMPUTE}")
        if any(z not in (0, 1, 2, 3) for z in self.zero_levels):
            raise ValueError(f"zero levels must be in 0..3, got {self.zero_levels}")


def _check_pin(key: str, value: int | str) -> None:
    if key not in PIN_KEYS:
        raise ValueError(f"unknown pin {key!r}; pins are {', '.join(PIN_KEYS)}")
    if key == "schedule":
        if value not in _SCHEDULES:
            raise ValueError(f"pin schedule={value!r}: choose from {', '.join(_SCHEDULES)}")
    elif key == "recompute":
        if value not in _RECOMPUTE:
            raise ValueError(f"pin recompute={value!r}: choose from {', '.join(_RECOMPUTE)}")
    elif not isinstance(value, int) or isinstance(value, bool) or value < (0 if key == "zero" else 1):
        raise ValueError(f"pin {key}={clip(repr(value), 40)}: expected a positive integer (digits 0-9)")
    elif key == "zero" and value > 3:
        raise ValueError(f"pin zero={value}: ZeRO levels are 0, 1, 2, 3")


def parse_pins(items: list[str] | tuple[str, ...] | None) -> dict[str, int | str]:
    """Parse ``["tp=8", "schedule=1f1b"]`` (also comma-separated) into a validated dict."""
    pins: dict[str, int | str] = {}
    for item in items or ():
        for part in str(item).split(","):
            part = part.strip()
            if not part:
                continue
            if "=" not in part:
                raise ValueError(f"pin {part!r} must look like key=value, e.g. tp=8")
            k, v = (s.strip() for s in part.split("=", 1))
            value: int | str = int(v) if v.lstrip("-").isascii() and v.lstrip("-").isdigit() else v
            _check_pin(k, value)
            if k in pins and pins[k] != value:
                raise ValueError(f"pin {k} given twice ({k}={pins[k]} and {k}={value}); keep one")
            pins[k] = value
    return pins


def validate_pins(world: int, options: PlanOptions, profile: ClusterProfile) -> None:
    """Pins that no mesh of ``world`` devices (and the global batch) can satisfy, refused before any search."""
    prod = 1
    for k in ("pp", "dp", "cp", "tp"):
        v = options.pins.get(k)
        if v is not None:
            if world % int(v):
                raise ValueError(f"pin {k}={v} does not divide the {world} devices of {profile.nodes} x "
                                 f"{profile.devices_per_node}; choose a divisor of {world}")
            prod *= int(v)
    if all(k in options.pins for k in ("pp", "dp", "cp", "tp")) and prod != world:
        raise ValueError(f"pins pp*dp*cp*tp = {prod} but the cluster has {world} devices")
    if world % prod:
        raise ValueError(f"pinned degrees multiply to {prod}, which does not divide {world} devices")
    dp = options.pins.get("dp")
    if dp is not None and options.global_batch % int(dp):
        raise ValueError(f"pin dp={dp} does not divide global batch {options.global_batch}")
    mb = options.pins.get("micro_batch")
    if mb is not None and int(mb) * int(dp or 1) > options.global_batch:
        raise ValueError(f"pin micro_batch={mb} is larger than the global batch {options.global_batch}"
                         f"{f' / dp={dp}' if dp else ''}: a micro-batch is a slice of one replica's batch")
