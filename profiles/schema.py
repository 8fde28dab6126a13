"""Cluster profile schema: frozen dataclasses, YAML load/save, validation.

A :class:`ClusterProfile` describes ``nodes x devices_per_node`` identical devices (:class:`DeviceProfile`) and the
links between them per topology level (:class:`LinkProfile`, ``"intra_node"`` and optionally ``"inter_node"``).

Bandwidth convention (NCCL-tests "bus bandwidth", ``busbw``, bytes/s). With ``n`` ranks in the group and ``S`` bytes:

- all_reduce:      ``t = alpha + 2 (n-1)/n * S / busbw``   (S = per-rank buffer size)
- all_gather:      ``t = alpha + (n-1)/n * S / busbw``     (S = full, gathered output size)
- reduce_scatter:  ``t = alpha + (n-1)/n * S / busbw``     (S = full input size, before scattering)
- all_to_all:      ``t = alpha + (n-1)/n * S / busbw``     (S = per-rank buffer size)
- p2p:             ``t = alpha + S / busbw``               (S = bytes sent; ``busbw`` is the pair bandwidth)

Each collective of a link level is a small table of :class:`AlphaBeta` points keyed by group size. For the
``intra_node`` level ``group_size`` counts devices; for the ``inter_node`` level it counts *nodes*, and the numbers are
those measured on groups that use every device of each node (all NICs); see :mod:`autopar.profiles.cost` for how groups
using fewer devices per node are costed.

Matmul efficiency is a table of :class:`EfficiencyPoint` (problem FLOPs -> achieved fraction of peak) per dtype
(key ``"default"`` for all dtypes without their own table), interpolated as a power law between points (linear in
log-log space), clamped at the ends. Validation requires the implied time ``flops / efficiency`` to be
non-decreasing so that predicted times are monotone in problem size.

YAML files are validated on load; any problem raises :class:`ProfileError` naming the field path, e.g.
``links.inter_node.all_reduce[0].alpha_s: expected a positive number, got -1``. Unknown keys are rejected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from autopar.ir.limits import MAX_DEVICES_PER_NODE, MAX_NODES, clip
from autopar.ir.safe_yaml import YamlLimitError, load_yaml, write_atomic
from autopar.profiles.validate import (
    ProfileError,
    _fail,
    _int,
    _join,
    _keys,
    _Loader,
    _mapping,
    _num,
    _op_overhead,
    _str,
    _str_map,
)

__all__ = [
    "SCHEMA_VERSION",
    "COLLECTIVES",
    "PIPELINE_CASES",
    "pipeline_key",
    "LEVELS",
    "DTYPES",
    "ProfileError",
    "AlphaBeta",
    "EfficiencyPoint",
    "SeqEfficiencyPoint",
    "DeviceProfile",
    "LinkProfile",
    "ClusterProfile",
    "profile_from_dict",
    "profile_to_dict",
    "load_profile",
    "loads_profile",
    "dump_profile",
    "save_profile",
]

SCHEMA_VERSION = 1
COLLECTIVES: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")
LEVELS: tuple[str, ...] = ("intra_node", "inter_node")
OP_KINDS: tuple[str, ...] = ("matmul", "attention", "causal_attention", "pointwise", "reduction", "norm", "softmax",
                             "embedding", "conv", "view", "other")
"""The IR op kinds the cost model costs (``profiles.cost``), and a device's ``op_overhead`` keys."""
PIPELINE_CASES: tuple[tuple[str, int], ...] = (("gpipe", 1), ("gpipe", 2), ("gpipe", 8), ("1f1b", 2), ("1f1b", 8),
                                               ("interleaved_1f1b", 2), ("interleaved_1f1b", 8))
"""The (schedule, micro-batches) cases ``autopar profile`` times the pipeline schedule's overhead at (gloo)."""


def pipeline_key(schedule: str, microbatches: int) -> str:
    """The ``runtime_overhead`` key of the pipeline schedule's overhead per slot measured at one case."""
    return f"pipeline_{schedule}_{microbatches}"


RUNTIME_KINDS: tuple[str, ...] = ("optimizer_tensor", "optimizer_dtensor", "fsdp_unit", "fsdp_tensor", "redistribute",
                                  "step", "pipeline_microbatch", "pipeline_resume", "loss_sync",
                                  *map(pipeline_key, *zip(*PIPELINE_CASES)))
"""A device's ``runtime_overhead`` keys (see :class:`DeviceProfile`)."""
DTYPES: tuple[str, ...] = ("float32", "tf32", "float16", "bfloat16")
Level = Literal["intra_node", "inter_node"]


@dataclass(kw_only=True, slots=True, frozen=True)
class AlphaBeta:
    """One alpha-beta point of a collective at one group size."""

    group_size: int
    """Devices in the group (intra_node level) or nodes spanned (inter_node level); >= 2 (p2p: 2)."""
    alpha_s: float
    """Latency term in seconds (time of a zero-byte operation)."""
    busbw: float
    """Bus bandwidth in bytes/s, NCCL-tests convention (see module docstring)."""
    source: str = ""
    """Where the numbers come from (datasheet, public measurement, or 'measured by autopar profile')."""
    groups: int = 1
    """Disjoint groups of this size run in step when measured (a point beside the size's ``groups: 1`` one)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class EfficiencyPoint:
    """Achieved fraction of peak FLOP/s for a matmul of a given size."""

    flops: float
    """Problem size in FLOPs (2*m*n*k, times batch)."""
    efficiency: float
    """Achieved FLOP/s divided by the dtype's peak, in (0, 1]."""


@dataclass(kw_only=True, slots=True, frozen=True)
class SeqEfficiencyPoint:
    """Achieved fraction of peak FLOP/s of a fused (flash) attention kernel at a sequence length."""

    seq: int
    """Key/value sequence length."""
    efficiency: float
    """Achieved FLOP/s (counting only the FLOPs the kernel performs: half the score matrix when causal) over the
    dtype's peak, in (0, 1]."""
    head_dim: int | None = None
    """Head dimension the point was measured at (``autopar profile`` measures a curve per head dimension: on a CPU
    core a 16-wide head runs at about half the rate of a 64-wide one at the same length); None: one curve for all
    (the built-in GPU curves, read at head dimension 128)."""


@dataclass(kw_only=True, slots=True, frozen=True)
class DeviceProfile:
    """One accelerator (or one CPU rank) of the cluster."""

    name: str
    """Device model name, e.g. 'NVIDIA A100-SXM4-80GB'."""
    memory_bytes: int
    """Memory capacity usable by one rank, in bytes."""
    peak_flops: dict[str, float]
    """Peak dense FLOP/s per dtype ('float32', 'tf32', 'float16', 'bfloat16')."""
    matmul_efficiency: dict[str, tuple[EfficiencyPoint, ...]]
    """Per dtype (or 'default') table of matmul efficiency against problem FLOPs, sorted by flops."""
    memory_bandwidth: float
    """Achievable memory bandwidth for pointwise kernels, bytes/s."""
    launch_overhead_s: float
    """Fixed per-kernel (per-op) overhead in seconds."""
    vector_flops: float | None = None
    """Peak FLOP/s for non-matmul (vector) ops; None means peak_flops['float32']."""
    sustained_fraction: float = 1.0
    """Fraction of the isolated-kernel rates above (matmul efficiency, vector FLOP/s, memory bandwidth) that kernels
    sustain inside a whole training step, in (0, 1]: a step runs hundreds of kernels back to back at full power draw,
    with launch gaps and cache/HBM interference that a single-kernel benchmark loop does not see.  1.0 means the rates
    were measured in situ (or no in-situ measurement exists)."""
    causal_attention_efficiency: tuple[SeqEfficiencyPoint, ...] = ()
    """Forward + backward efficiency of causal flash attention against sequence length, sorted by ``seq``; empty:
    causal attention is costed through the matmul table at half its FLOPs."""
    shared_cores: float | None = None
    """A CPU node with more ranks than cores, the rates here those of every rank at once: the cores' worth of compute
    its ranks time-slice, so that ranks that compute while others wait (a pipeline's fill and drain) get the cores
    those leave (:mod:`autopar.planner.inter_op.schedule`). None: the rates hold throughout (``autopar profile``)."""
    overlap_slowdown: float = 0.0
    """Compute seconds lost per second of communication overlapped with it, in [0, 1]: collective kernels take SMs
    and HBM bandwidth from the compute kernels they run beside (Galvatron's overlap coefficient, Miao et al.,
    VLDB 2023).  0 means overlapped communication is free."""
    sharded_op_overhead: float = 1.0
    """Per-op eager cost of an op on tensor-parallel (DTensor) operands, views included, in launch_overhead_s; with
    ``dtensor_op_overhead`` a factor on that table instead (1: as measured)."""
    dtensor_op_overhead: dict[str, float] = field(default_factory=dict)
    """Per op kind (``profiles.cost.OP_KINDS``): DTensor's extra eager cost of one op of that kind per pass on
    tensor-parallel operands (sharding propagation, wrapping the local result), in units of ``launch_overhead_s``.
    ``autopar profile`` measures it on CPU (each kind's chain on replicated DTensors of a one-rank mesh, less on plain
    tensors).  Empty: every op pays ``sharded_op_overhead - 1``; a kind missing from a measured table pays the
    table's mean."""
    op_overhead: dict[str, float] = field(default_factory=dict)
    """Per op kind (``profiles.cost.OP_KINDS``): the fixed eager cost of one op of that kind per pass (forward, or
    each backward kernel), in units of ``launch_overhead_s``.  A kind not listed costs 1 (views: 0).  On CPU an
    ``nn.Linear`` (module call, addmm, transposes, bias-gradient sum, two gradient accumulations) costs several
    times a scalar multiply; ``autopar profile`` measures each kind with a chain of tiny autograd ops."""
    runtime_overhead: dict[str, float] = field(default_factory=dict)
    """Eager costs of the training runtime beyond the model's ops, in ``launch_overhead_s`` units (missing: 0, as
    on GPUs, where this host work runs ahead of the kernels): ``optimizer_tensor``, one parameter tensor's optimizer
    step (AdamW's per-tensor path on plain tensors); ``optimizer_dtensor``, the same on DTensor parameters (tensor
    parallelism, FSDP), where each op of the step pays DTensor's dispatch; ``fsdp_unit`` and ``fsdp_tensor``, FSDP2's
    per-micro-batch work per unit and per parameter tensor (pre/post forward and backward hooks, all-gather
    copy-in/out, reduce-scatter copy-in, DTensor wrapping; collectives excluded); ``redistribute``, DTensor's work
    per tensor-parallel resharding and pass (collective excluded); ``step``, the loop's fixed work per step
    (:mod:`.loop`); ``pipeline_microbatch``, the schedule's work per stage and micro-batch, ``pipeline_<s>_<m>`` per
    case of :data:`PIPELINE_CASES`, ``pipeline_resume`` a stage's compute resumed after each wait for its neighbour
    (per chunk slot); ``loss_sync``, the loop's one-float all-reduce after compute (:mod:`.syncs`)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Field name -> where its number comes from."""


@dataclass(kw_only=True, slots=True, frozen=True)
class LinkProfile:
    """Alpha-beta tables of every collective on one topology level."""

    level: Level
    """'intra_node' (e.g. NVLink/NVSwitch, shared memory) or 'inter_node' (e.g. InfiniBand)."""
    all_reduce: tuple[AlphaBeta, ...]
    """All-reduce points sorted by group size."""
    all_gather: tuple[AlphaBeta, ...]
    """All-gather points sorted by group size."""
    reduce_scatter: tuple[AlphaBeta, ...]
    """Reduce-scatter points sorted by group size."""
    all_to_all: tuple[AlphaBeta, ...]
    """All-to-all points sorted by group size."""
    p2p: tuple[AlphaBeta, ...]
    """Point-to-point (send/recv between two ranks) points, group size 2."""

    def table(self, kind: str) -> tuple[AlphaBeta, ...]:
        """The alpha-beta table of collective ``kind``."""
        if kind not in COLLECTIVES:
            raise ValueError(f"unknown collective {kind!r}; expected one of {', '.join(COLLECTIVES)}")
        return getattr(self, kind)


@dataclass(kw_only=True, slots=True, frozen=True)
class ClusterProfile:
    """A homogeneous cluster: ``nodes`` x ``devices_per_node`` devices and their links."""

    schema_version: int
    """Version of this schema the file was written for (currently 1)."""
    name: str
    """Profile name, e.g. 'dgx-a100-80gb'."""
    source: str
    """Where the profile as a whole comes from."""
    nodes: int
    """Number of nodes."""
    devices_per_node: int
    """Devices (ranks) per node."""
    device: DeviceProfile
    """The device every rank runs on."""
    links: dict[str, LinkProfile]
    """Level ('intra_node', 'inter_node') -> link profile. 'inter_node' is required when nodes > 1."""

    @property
    def world_size(self) -> int:
        """Total number of devices."""
        return self.nodes * self.devices_per_node


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers


def _dtype(k: Any, path: str, extra: tuple[str, ...] = ()) -> str:
    if k not in DTYPES and k not in extra:
        raise _fail(path, f"unknown dtype key {k!r} (allowed: {', '.join(DTYPES + extra)})")
    return str(k)


def _alpha_beta(v: Any, path: str, level: str, kind: str) -> AlphaBeta:
    d = _mapping(v, path)
    _keys(d, path, {"group_size", "alpha_s", "busbw"}, {"source", "groups"})
    gs = _int(d["group_size"], _join(path, "group_size"), minimum=2 if level == "intra_node" or kind == "p2p" else 1)
    groups = _int(d.get("groups", 1), _join(path, "groups"), minimum=1)
    src = _str(d.get("source", ""), _join(path, "source"))
    return AlphaBeta(group_size=gs, alpha_s=_num(d["alpha_s"], _join(path, "alpha_s"), allow_zero=True),
                     busbw=_num(d["busbw"], _join(path, "busbw")), source=src, groups=groups)


def _table(v: Any, path: str, level: str, kind: str) -> tuple[AlphaBeta, ...]:
    if not isinstance(v, list) or not v:
        raise _fail(path, f"expected a non-empty list of {{group_size, alpha_s, busbw}}, got {v!r}")
    pts = tuple(_alpha_beta(x, f"{path}[{i}]", level, kind) for i, x in enumerate(v))
    keys = [(p.group_size, p.groups) for p in pts]
    if keys != sorted(set(keys)) or any(g > 1 and (n, 1) not in keys for n, g in keys):
        raise _fail(path, f"(group_size, groups) must increase strictly, with a groups-1 point per size; got {keys}")
    return pts


def _link(v: Any, path: str, level: str) -> LinkProfile:
    d = _mapping(v, path)
    _keys(d, path, set(COLLECTIVES), {"level"})
    if "level" in d and d["level"] != level:
        raise _fail(_join(path, "level"), f"expected {level!r} (the key it is stored under), got {d['level']!r}")
    tables = {k: _table(d[k], _join(path, k), level, k) for k in COLLECTIVES}
    return LinkProfile(level=level, **tables)  # type: ignore[arg-type]


def _efficiency(v: Any, path: str) -> tuple[EfficiencyPoint, ...]:
    if not isinstance(v, list) or not v:
        raise _fail(path, f"expected a non-empty list of {{flops, efficiency}}, got {v!r}")
    pts: list[EfficiencyPoint] = []
    for i, x in enumerate(v):
        p = f"{path}[{i}]"
        d = _mapping(x, p)
        _keys(d, p, {"flops", "efficiency"})
        eff = _num(d["efficiency"], _join(p, "efficiency"))
        if eff > 1.0:
            raise _fail(_join(p, "efficiency"), f"expected a number in (0, 1], got {eff!r}")
        pts.append(EfficiencyPoint(flops=_num(d["flops"], _join(p, "flops")), efficiency=eff))
    for i in range(1, len(pts)):
        a, b = pts[i - 1], pts[i]
        if b.flops <= a.flops:
            raise _fail(f"{path}[{i}].flops", "flops must be strictly increasing")
        if b.flops / b.efficiency < a.flops / a.efficiency * (1 - 1e-9):
            raise _fail(f"{path}[{i}].efficiency", "implied time flops/efficiency must not decrease with size")
    return tuple(pts)


def _seq_efficiency(v: Any, path: str) -> tuple[SeqEfficiencyPoint, ...]:
    if not isinstance(v, list):
        raise _fail(path, f"expected a list of {{seq, efficiency}}, got {v!r}")
    pts: list[SeqEfficiencyPoint] = []
    for i, x in enumerate(v):
        p = f"{path}[{i}]"
        d = _mapping(x, p)
        _keys(d, p, {"seq", "efficiency"}, {"head_dim"})
        eff = _num(d["efficiency"], _join(p, "efficiency"))
        if eff > 1.0:
            raise _fail(_join(p, "efficiency"), f"expected a number in (0, 1], got {eff!r}")
        hd = _int(d["head_dim"], _join(p, "head_dim")) if d.get("head_dim") is not None else None
        pts.append(SeqEfficiencyPoint(seq=_int(d["seq"], _join(p, "seq")), efficiency=eff, head_dim=hd))
    if len({q.head_dim is None for q in pts}) > 1:
        raise _fail(path, "either every point gives head_dim or none does")
    for hd in dict.fromkeys(q.head_dim for q in pts):  # one curve per head_dim, its points together and in order
        at = [i for i, q in enumerate(pts) if q.head_dim == hd]
        if at != list(range(at[0], at[-1] + 1)) or any(pts[i].seq >= pts[i + 1].seq for i in at[:-1]):
            raise _fail(path, "seq must be strictly increasing, the points of one head_dim contiguous")
    return tuple(pts)


def _device(v: Any, path: str) -> DeviceProfile:
    d = _mapping(v, path)
    req = {"name", "memory_bytes", "peak_flops", "matmul_efficiency", "memory_bandwidth", "launch_overhead_s"}
    _keys(d, path, req, {"vector_flops", "sustained_fraction", "overlap_slowdown", "causal_attention_efficiency",
                         "sharded_op_overhead", "dtensor_op_overhead", "op_overhead", "runtime_overhead",
                         "shared_cores", "sources"})
    pf_path = _join(path, "peak_flops")
    peak = {_dtype(k, f"{pf_path}.{k}"): _num(x, f"{pf_path}.{k}") for k, x in _mapping(d["peak_flops"], pf_path).items()}
    if not peak:
        raise _fail(pf_path, "expected at least one dtype")
    me_path = _join(path, "matmul_efficiency")
    eff = {
        _dtype(k, f"{me_path}.{k}", ("default",)): _efficiency(x, f"{me_path}.{k}")
        for k, x in _mapping(d["matmul_efficiency"], me_path).items()
    }
    if not eff:
        raise _fail(me_path, "expected at least one table ('default' or a dtype)")
    vf = d.get("vector_flops")
    sf_path = _join(path, "sustained_fraction")
    sf = _num(d.get("sustained_fraction", 1.0), sf_path)
    if sf > 1.0:
        raise _fail(sf_path, f"must be in (0, 1], got {sf}")
    os_path = _join(path, "overlap_slowdown")
    slow = _num(d.get("overlap_slowdown", 0.0), os_path, allow_zero=True)
    if slow > 1.0:
        raise _fail(os_path, f"must be in [0, 1], got {slow}")
    return DeviceProfile(
        name=_str(d["name"], _join(path, "name")),
        memory_bytes=_int(d["memory_bytes"], _join(path, "memory_bytes")),
        peak_flops=peak,
        matmul_efficiency=eff,
        memory_bandwidth=_num(d["memory_bandwidth"], _join(path, "memory_bandwidth")),
        launch_overhead_s=_num(d["launch_overhead_s"], _join(path, "launch_overhead_s"), allow_zero=True),
        vector_flops=None if vf is None else _num(vf, _join(path, "vector_flops")),
        sustained_fraction=sf,
        overlap_slowdown=slow,
        shared_cores=None if d.get("shared_cores") is None else _num(d["shared_cores"], _join(path, "shared_cores")),
        sharded_op_overhead=_num(d.get("sharded_op_overhead", 1.0), _join(path, "sharded_op_overhead")),
        op_overhead=_op_overhead(d.get("op_overhead", {}), _join(path, "op_overhead"), OP_KINDS),
        dtensor_op_overhead=_op_overhead(d.get("dtensor_op_overhead", {}), _join(path, "dtensor_op_overhead"),
                                         OP_KINDS),
        runtime_overhead=_op_overhead(d.get("runtime_overhead", {}), _join(path, "runtime_overhead"), RUNTIME_KINDS),
        causal_attention_efficiency=_seq_efficiency(d.get("causal_attention_efficiency", []),
                                                    _join(path, "causal_attention_efficiency")),
        sources=_str_map(d.get("sources", {}), _join(path, "sources")),
    )


def profile_from_dict(data: Any) -> ClusterProfile:
    """Validate a plain mapping (as loaded from YAML) and build a :class:`ClusterProfile`."""
    d = _mapping(data, "<profile>")
    _keys(d, "", {"schema_version", "name", "nodes", "devices_per_node", "device", "links"}, {"source"})
    version = d["schema_version"]
    if version != SCHEMA_VERSION:
        raise _fail("schema_version", f"unsupported version {version!r} (this autopar reads {SCHEMA_VERSION})")
    nodes = _int(d["nodes"], "nodes", maximum=MAX_NODES)
    dpn = _int(d["devices_per_node"], "devices_per_node", maximum=MAX_DEVICES_PER_NODE)
    links_d = _mapping(d["links"], "links")
    for k in links_d:
        if k not in LEVELS:
            raise _fail(f"links.{k}", f"unknown link level (allowed: {', '.join(LEVELS)})")
    links = {k: _link(links_d[k], f"links.{k}", k) for k in LEVELS if k in links_d}
    if dpn > 1 and "intra_node" not in links:
        raise _fail("links.intra_node", f"missing required field (devices_per_node is {dpn})")
    if nodes > 1 and "inter_node" not in links:
        raise _fail("links.inter_node", f"missing required field (nodes is {nodes})")
    return ClusterProfile(
        schema_version=SCHEMA_VERSION,
        name=_str(d["name"], "name"),
        source=_str(d.get("source", ""), "source"),
        nodes=nodes,
        devices_per_node=dpn,
        device=_device(d["device"], "device"),
        links=links,
    )


def _ab_dict(p: AlphaBeta) -> dict[str, Any]:
    out: dict[str, Any] = {"group_size": p.group_size, "alpha_s": p.alpha_s, "busbw": p.busbw}
    if p.source:
        out["source"] = p.source
    return out | ({"groups": p.groups} if p.groups > 1 else {})


def profile_to_dict(profile: ClusterProfile) -> dict[str, Any]:
    """Plain-data form of ``profile`` (the inverse of :func:`profile_from_dict`)."""
    dev = profile.device
    device: dict[str, Any] = {
        "name": dev.name,
        "memory_bytes": dev.memory_bytes,
        "peak_flops": dict(dev.peak_flops),
        "matmul_efficiency": {
            k: [{"flops": p.flops, "efficiency": p.efficiency} for p in pts] for k, pts in dev.matmul_efficiency.items()
        },
        "memory_bandwidth": dev.memory_bandwidth,
        "launch_overhead_s": dev.launch_overhead_s,
    }
    for key in ("vector_flops", "shared_cores"):
        if getattr(dev, key) is not None:
            device[key] = getattr(dev, key)
    for key, default in (("sustained_fraction", 1.0), ("overlap_slowdown", 0.0), ("sharded_op_overhead", 1.0)):
        if getattr(dev, key) != default:
            device[key] = getattr(dev, key)
    if dev.op_overhead:
        device["op_overhead"] = dict(dev.op_overhead)
    if dev.dtensor_op_overhead:
        device["dtensor_op_overhead"] = dict(dev.dtensor_op_overhead)
    if dev.runtime_overhead:
        device["runtime_overhead"] = dict(dev.runtime_overhead)
    if dev.causal_attention_efficiency:
        device["causal_attention_efficiency"] = [
            {"seq": q.seq, "efficiency": q.efficiency, **({"head_dim": q.head_dim} if q.head_dim else {})}
            for q in dev.causal_attention_efficiency]
    if dev.sources:
        device["sources"] = dict(dev.sources)
    links = {
        lvl: {k: [_ab_dict(p) for p in link.table(k)] for k in COLLECTIVES} for lvl, link in profile.links.items()
    }
    return {
        "schema_version": profile.schema_version,
        "name": profile.name,
        "source": profile.source,
        "nodes": profile.nodes,
        "devices_per_node": profile.devices_per_node,
        "device": device,
        "links": links,
    }


def loads_profile(text: str, *, origin: str = "<string>") -> ClusterProfile:
    """Parse and validate a profile from YAML text."""
    try:
        data = load_yaml(text, loader=_Loader, max_nodes=100_000)  # a SafeLoader subclass; aliases expanded
    except yaml.YAMLError as e:
        raise ProfileError(f"{origin}: not valid YAML: {clip(str(e).splitlines()[0])}") from None
    except YamlLimitError as e:
        raise ProfileError(f"{origin}: the YAML {e}") from None
    except RecursionError:
        raise ProfileError(f"{origin}: YAML nested too deeply to be a profile") from None
    return profile_from_dict(data)


def load_profile(path: str | Path) -> ClusterProfile:
    """Read and validate a profile YAML file; raises :class:`ProfileError` naming the bad field."""
    p = Path(path)
    if not p.is_file():
        raise ProfileError(f"{p}: no such profile file")
    try:
        return loads_profile(p.read_text(encoding="utf-8"), origin=str(p))
    except ProfileError as e:
        raise ProfileError(f"{e} (in {p})") from None
    except (UnicodeDecodeError, OSError) as e:  # a binary file, a directory's permissions...
        raise ProfileError(f"{p}: cannot read it as a profile ({clip(e, 120)})") from None


def dump_profile(profile: ClusterProfile) -> str:
    """YAML text of ``profile``."""
    return yaml.safe_dump(profile_to_dict(profile), sort_keys=False, width=120)


def save_profile(profile: ClusterProfile, path: str | Path) -> Path:
    """Validate ``profile`` (by round-tripping it) and write it as YAML to ``path``."""
    text = dump_profile(profile)
    loads_profile(text, origin=str(path))
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(p, text)
    return p
