"""The Plan: what the planner decided and what codegen executes, as plain frozen dataclasses with a YAML form.

Placements use DTensor's notation on the ``tp`` mesh axis: ``R`` (replicated), ``S(d)`` (sharded on tensor dim d),
``P`` (partial sums awaiting a reduction); ``S(d)[k]`` shards a fused tensor made of ``k`` equal parts along ``d``
(a fused qkv weight) so that each rank holds its slice of every part.  Parameter placements are given per parameter
*pattern*: ``*`` stands for
the index of a repeated block (``blocks.*.attn.qkv.weight``), because identical blocks share one solution.

Mesh ranks are laid out with ``tp`` innermost, then ``cp`` (context parallelism), then ``dp``, then ``pp``
(rank = ((pp_i * dp + dp_i) * cp + cp_i) * tp + tp_i), the tp-cp-dp-pp order of Megatron-LM's rank generator, so a
``tp`` group is consecutive ranks, i.e. inside a node whenever ``tp`` divides the devices per node.  ``ep`` (expert
parallelism) is not an axis of its own: it divides ``dp``, and an ep group is ``ep`` consecutive dp indices
(ep_i = dp_i % ep) that share everything else.

YAML files carry ``schema_version``; :func:`load_plan` validates every field and names the first bad one.  Version 1
files (before ``ep`` and ``cp`` existed) still load, as ``ep = cp = 1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, NamedTuple

import yaml

from autopar.ir.errors import SchemaError
from autopar.ir.limits import MAX_BATCH, MAX_DEVICES_PER_NODE, MAX_NODES, check_bound, clip
from autopar.ir.placement import Placement, Recompute, Schedule
from autopar.ir.safe_yaml import YamlLimitError, load_yaml, write_atomic
from autopar.ir.serialize import from_data, to_data

__all__ = [
    "PLAN_SCHEMA_VERSION", "Schedule", "Recompute", "Placement", "MeshCoords", "MeshPlan", "ParamSharding",
    "OpSharding", "MemoryBreakdown",
    "TimeBreakdown", "StagePlan", "DeviceGroup", "SolverReport", "ProfileSource", "Plan", "dump_plan", "load_plan",
    "plan_to_yaml", "plan_from_yaml",
]

PLAN_SCHEMA_VERSION = 2
"""2: ``mesh.ep`` and ``mesh.cp``.  Version 1 plans load with both 1."""
_OLD_SCHEMA_VERSIONS = (1,)
DTYPES = ("float32", "bfloat16", "float16")
"""Training dtypes a plan may name (compute and gradient reduction)."""


def _check_placement(p: str, what: str) -> None:
    try:
        Placement.parse(p)
    except ValueError as e:
        raise ValueError(f"{what}: {e}") from None


class MeshCoords(NamedTuple):
    """A rank's place on the mesh axes, outermost first."""

    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True, kw_only=True, slots=True)
class MeshPlan:
    """The device mesh: ``pp * dp * cp * tp`` devices, ``tp`` innermost, then ``cp``, ``dp``, ``pp``."""

    pp: int = 1
    """Pipeline-parallel degree (number of stage groups)."""
    dp: int = 1
    """Data-parallel degree (replicas, or FSDP shards under ZeRO)."""
    ep: int = 1
    """Expert-parallel degree: experts are sharded over ``ep`` ranks of the dp axis (divides ``dp``; does not change
    the number of devices)."""
    cp: int = 1
    """Context-parallel degree: the sequence is split over ``cp`` ranks (its own mesh axis, between dp and tp)."""
    tp: int = 1
    """Tensor-parallel (intra-op) degree."""

    def __post_init__(self) -> None:
        for k in ("pp", "dp", "ep", "cp", "tp"):
            check_bound(f"mesh.{k}", getattr(self, k), MAX_NODES * MAX_DEVICES_PER_NODE)
        if self.dp % self.ep:
            raise ValueError(f"mesh.ep={self.ep} must divide mesh.dp={self.dp} (experts are sharded over ranks "
                             "that share data parallelism)")

    @property
    def replicas(self) -> int:
        """Ranks holding the same parameters, over which gradients are averaged: dp x cp."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def rank(self, *, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank at these coordinates (keywords, so that adding an axis never shifts a positional call)."""
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> MeshCoords:
        """(pp, dp, cp, tp) coordinates of a global rank."""
        return MeshCoords(rank // (self.dp * self.cp * self.tp), (rank // (self.cp * self.tp)) % self.dp,
                          (rank // self.tp) % self.cp, rank % self.tp)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParamSharding:
    """Placement of the parameters matching ``pattern`` on the tp axis."""

    pattern: str
    """Parameter FQN; ``*`` matches one block index (``blocks.*.mlp.fc1.weight``)."""
    placement: str
    """``R`` or ``S(d)``."""

    def __post_init__(self) -> None:
        _check_placement(self.placement, self.pattern)
        if self.placement == "P":
            raise ValueError(f"{self.pattern}: a parameter cannot be partial (P)")

    def matches(self, fqn: str) -> bool:
        rx = "^" + re.escape(self.pattern).replace(r"\*", r"\d+") + "$"
        return re.match(rx, fqn) is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class OpSharding:
    """The strategy chosen for one op (for repeated blocks: the op in the first block of its kind)."""

    node: str
    """Node name in the graph."""
    op: str
    strategy: str
    """Human-readable strategy name (``replicate``, ``column``, ``row``, ``seq``, ``S(0)``...)."""
    inputs: tuple[str, ...] = ()
    """Placement each input is consumed in."""
    output: str = "R"
    """Placement of the output as produced (``P`` before a reduction)."""
    compute_s: float = 0.0
    """Predicted forward+backward compute time of this op per micro-batch on one device."""
    comm_s: float = 0.0
    """Predicted resharding/reduction time charged to this op's inputs per micro-batch."""
    comm: str = ""
    """Collectives inserted, e.g. ``all_reduce`` or ``all_gather+reduce_scatter``."""

    def __post_init__(self) -> None:
        for p in (*self.inputs, self.output):
            _check_placement(p, self.node)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemoryBreakdown:
    """Predicted peak memory of one device, in bytes."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    activations: float = 0.0
    other: float = 0.0
    """Communication buffers, fragmentation reserve, framework overhead."""
    capacity: float = 0.0

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer + self.activations + self.other


@dataclass(frozen=True, kw_only=True, slots=True)
class TimeBreakdown:
    """Predicted time of one training iteration (one global batch), in seconds."""

    compute: float = 0.0
    exposed_comm: float = 0.0
    """Communication not hidden behind compute (tp collectives, data-parallel gathers/reductions, p2p)."""
    bubble: float = 0.0
    """Pipeline idle time."""
    optimizer: float = 0.0
    contention: float = 0.0
    """Compute time lost while it overlaps data-parallel communication (SM/HBM contention)."""
    dp_exposed: float = 0.0
    """The data-parallel part of ``exposed_comm`` (first gathers, last reductions, comm-bound steps), with the
    gradient all-reduce of parameters tied across pipeline stages."""
    dp_collectives: float = 0.0
    """All data-parallel collective time of the iteration, hidden or not (not part of ``total``)."""
    matmul: float = 0.0
    """The part of ``compute`` spent in matmul-like ops (GEMMs, attention, convolutions) on the busiest pipeline
    rank, as ``autopar calibrate`` measures it apart (not added to ``total``)."""

    @property
    def total(self) -> float:
        return self.compute + self.exposed_comm + self.bubble + self.optimizer + self.contention


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlan:
    """One pipeline stage: a contiguous range of layer groups."""

    index: int
    layer_start: int
    """First layer group (index into ``Graph.layers``)."""
    layer_end: int
    """One past the last layer group."""
    modules: tuple[str, ...] = ()
    """Module paths of the stage's blocks (the prefix/suffix groups are named ``<prefix>``/``<suffix>``)."""
    recompute: Recompute = Recompute.NONE
    fwd_s: float = 0.0
    """Forward time of one micro-batch on this stage (including tp communication)."""
    bwd_s: float = 0.0
    memory: MemoryBreakdown = field(default_factory=MemoryBreakdown)
    device_group: str = ""
    """The device group (of ``Plan.device_groups``) this stage runs on; '' in a plan on one device type (and then
    omitted from the YAML)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "recompute", Recompute(self.recompute))
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"stage {self.index}: empty or negative layer range [{self.layer_start}, "
                             f"{self.layer_end})")


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceGroup:
    """Nodes of one device type in a plan on a heterogeneous cluster, in rank order: the first group's nodes hold the
    first ranks (pipeline ranks are outermost, so each pipeline rank lies in one group)."""

    name: str
    """The group's name in the cluster profile."""
    device: str
    """Its device model, e.g. 'NVIDIA H100 80GB HBM3'."""
    nodes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class ProfileSource:
    """Where a plan's cluster profile came from when it was a file (a measured or fitted profile), so that
    ``autopar replan`` and ``explain`` find it again: its path and the SHA-256 of its content."""

    path: str
    """Absolute path of the profile YAML when the plan was made."""
    sha256: str
    """SHA-256 (hex) of the file's bytes: a file at ``path`` with other content is another profile."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SolverReport:
    """How the search went."""

    status: Literal["optimal", "feasible", "timeout", "infeasible", "given"] = "optimal"
    objective_s: float = 0.0
    best_bound_s: float = 0.0
    gap: float = 0.0
    """Relative optimality gap of the intra-op solve (0 when proven optimal)."""
    wall_s: float = 0.0
    """Search wall time: shown by ``autopar plan`` and kept in its side report (``PLAN.search.json``), never written
    into the plan's YAML, so the same search gives byte-identical plans (older files carrying it still load)."""
    candidates: int = 0
    """Mesh/micro-batch/schedule candidates evaluated."""
    seed: int = 0
    workers: int = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """A complete hybrid-parallel training plan."""

    schema_version: int = PLAN_SCHEMA_VERSION
    model: str
    graph_fingerprint: str
    num_params: int
    cluster: str
    """Name of the cluster profile the plan was costed on."""
    cluster_source: ProfileSource | None = None
    """The profile file, when the profile was not a built-in one (omitted from the YAML when None)."""
    nodes: int
    devices_per_node: int
    global_batch: int
    micro_batch: int
    """Samples per micro-batch per data-parallel replica."""
    num_microbatches: int
    mesh: MeshPlan
    schedule: Schedule = Schedule.ONE_F_ONE_B
    virtual_stages: int = 1
    """Model chunks per pipeline rank (interleaved 1F1B); 1 otherwise."""
    zero: int = 0
    """ZeRO/FSDP level on the dp axis: 0 replicate, 1 optimizer states, 2 + gradients, 3 + parameters."""
    dtype: str = "float32"
    """Training compute dtype (mixed precision keeps fp32 master weights when this is half precision)."""
    reduce_dtype: str = "float32"
    """Dtype gradients are reduced (all-reduce / reduce-scatter) in over the dp axis; FSDP2's
    ``MixedPrecisionPolicy.reduce_dtype``.  fp32 by default, as torchtitan and Megatron-LM (bf16) run it."""
    stages: tuple[StagePlan, ...]
    param_shardings: tuple[ParamSharding, ...] = ()
    op_shardings: tuple[OpSharding, ...] = ()
    time: TimeBreakdown = field(default_factory=TimeBreakdown)
    samples_per_s: float = 0.0
    tflops_per_device: float = 0.0
    mfu: float = 0.0
    fused_kernels: bool = True
    """Use generated Triton kernels for fused groups where the device supports them."""
    overlap_grad_sync: bool = True
    """ZeRO 0 with replicas: all-reduce each layer group's gradients as soon as they are final, overlapping the
    backward (False: one all-reduce after it); the planner picks whichever it predicts faster."""
    pins: tuple[str, ...] = ()
    """User constraints the plan was made under (``tp=8``...)."""
    solver: SolverReport = field(default_factory=SolverReport)
    notes: tuple[str, ...] = ()
    device_groups: tuple[DeviceGroup, ...] = ()
    """Heterogeneous cluster: its node groups in rank order, each stage naming its own (omitted when empty)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "schedule", Schedule(self.schedule))
        if self.schema_version != PLAN_SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not supported (expected "
                             f"{PLAN_SCHEMA_VERSION})")
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero}")
        check_bound("nodes", self.nodes, MAX_NODES)
        check_bound("devices_per_node", self.devices_per_node, MAX_DEVICES_PER_NODE)
        for k in ("global_batch", "micro_batch", "num_microbatches"):
            check_bound(k, getattr(self, k), MAX_BATCH)
        check_bound("virtual_stages", self.virtual_stages, 1024)
        check_bound("num_params", self.num_params, 1 << 50, lo=0)
        for k in ("dtype", "reduce_dtype"):
            if getattr(self, k) not in DTYPES:
                raise ValueError(f"{k} must be one of {', '.join(DTYPES)}, got {clip(repr(getattr(self, k)))}")
        if not self.stages or self.stages[0].layer_start != 0:
            raise ValueError("stages must start at layer group 0 (the prefix: embeddings etc.), got "
                             f"{self.stages[0].layer_start if self.stages else 'no stages'}")
        if self.mesh.world_size != self.nodes * self.devices_per_node:
            raise ValueError(f"mesh pp*dp*cp*tp = {self.mesh.world_size} does not equal nodes*devices_per_node = "
                             f"{self.nodes * self.devices_per_node}")
        if self.micro_batch * self.num_microbatches * self.mesh.dp != self.global_batch:
            raise ValueError(f"micro_batch*num_microbatches*dp = {self.micro_batch}*{self.num_microbatches}*"
                             f"{self.mesh.dp} does not equal global_batch {self.global_batch}")
        if len(self.stages) != self.mesh.pp * self.virtual_stages:
            raise ValueError(f"{len(self.stages)} stages for pp={self.mesh.pp} x virtual_stages="
                             f"{self.virtual_stages}")
        for i, s in enumerate(self.stages):
            if s.index != i:
                raise ValueError(f"stages.{i}.index is {s.index}")
            if i and s.layer_start != self.stages[i - 1].layer_end:
                raise ValueError(f"stages.{i} starts at layer {s.layer_start}, not where stage {i - 1} ends")
        _check_device_groups(self)
        if self.schedule != "interleaved_1f1b" and self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule interleaved_1f1b")
        if self.schedule == "interleaved_1f1b" and self.num_microbatches % self.mesh.pp:
            raise ValueError(f"interleaved 1F1B needs num_microbatches ({self.num_microbatches}) divisible by pp "
                             f"({self.mesh.pp})")

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    def placement_of(self, fqn: str) -> str:
        """tp placement of parameter ``fqn`` (``R`` when no pattern matches)."""
        for ps in self.param_shardings:
            if ps.matches(fqn):
                return ps.placement
        return "R"

    def check_compatible(self, *, fingerprint: str | None = None, world_size: int | None = None) -> None:
        """Raise SchemaError if the plan was made for another model or another number of devices."""
        if fingerprint is not None and fingerprint != self.graph_fingerprint:
            raise SchemaError("graph_fingerprint", f"the plan was made for another model ({self.model}, "
                              f"fingerprint {self.graph_fingerprint}); this model's is {fingerprint}. Re-plan with "
                              "`autopar plan`", doc="plan")
        if world_size is not None and world_size != self.world_size:
            raise SchemaError("mesh", f"the plan needs {self.world_size} devices but {world_size} are running; "
                              "re-plan with `autopar replan PLAN --nodes N`", doc="plan")


def _check_device_groups(plan: Plan) -> None:
    """Stages name the group their pipeline rank lies in (see :class:`DeviceGroup`), or none of them any."""
    if not plan.device_groups:
        if any(s.device_group for s in plan.stages):
            raise ValueError("stages name device groups but the plan has no device_groups")
        return
    if sum(g.nodes for g in plan.device_groups) != plan.nodes or len({g.name for g in plan.device_groups}) != len(
            plan.device_groups):
        raise ValueError(f"device_groups must have unique names and {plan.nodes} nodes in all")
    per_rank = plan.world_size // plan.mesh.pp
    owner: list[str] = []
    for g in plan.device_groups:
        devices = g.nodes * plan.devices_per_node
        if devices % per_rank:
            raise ValueError(f"device group {g.name!r} ({devices} devices) does not hold whole pipeline ranks of "
                             f"{per_rank} devices")
        owner += [g.name] * (devices // per_rank)
    for s in plan.stages:
        if s.device_group != owner[s.index % plan.mesh.pp]:
            raise ValueError(f"stages.{s.index}.device_group is {clip(repr(s.device_group))}, but its pipeline rank "
                             f"runs on group {owner[s.index % plan.mesh.pp]!r}")


def plan_to_yaml(plan: Plan) -> str:
    data = to_data(plan)
    data["solver"].pop("wall_s", None)  # machine-dependent: the side report has it (byte-identical plans)
    if data.get("cluster_source") is None:  # plans on built-in profiles read as before the field existed
        data.pop("cluster_source", None)
    if not plan.device_groups:  # plans on one device type read as before heterogeneous clusters
        data.pop("device_groups", None)
        for st in data["stages"]:
            st.pop("device_group", None)
    return yaml.safe_dump(data, sort_keys=False, width=120)


def plan_from_yaml(text: str) -> Plan:
    try:
        data: Any = load_yaml(text)
    except yaml.YAMLError as e:
        raise SchemaError("", f"not valid YAML ({clip(str(e).splitlines()[0])})", doc="plan") from None
    except YamlLimitError as e:
        raise SchemaError("", f"the YAML {e}", doc="plan") from None
    except RecursionError:
        raise SchemaError("", "YAML nested too deeply to be a plan", doc="plan") from None
    if isinstance(data, dict) and type(data.get("schema_version")) is int and data["schema_version"] in _OLD_SCHEMA_VERSIONS:
        data = _upgrade(data)
    if isinstance(data, dict) and "schema_version" in data and data["schema_version"] != PLAN_SCHEMA_VERSION:
        raise SchemaError("schema_version", f"version {clip(repr(data['schema_version']))} is not supported (this "
                          f"autopar reads version {PLAN_SCHEMA_VERSION})", doc="plan")
    return from_data(Plan, data, doc="plan")


def _upgrade(data: dict) -> dict:
    """A version-1 plan as version 2: its mesh had no ``ep``/``cp`` (both 1); it may not name them."""
    mesh = data.get("mesh")
    if isinstance(mesh, dict):
        for k in ("ep", "cp"):
            if k in mesh:
                raise SchemaError(f"mesh.{k}", f"schema_version {data['schema_version']} plans have no mesh.{k} "
                                  f"(it came with version 2)", doc="plan")
    return {**data, "schema_version": PLAN_SCHEMA_VERSION}


def dump_plan(plan: Plan, path: str | Path) -> None:
    """Write the plan's YAML atomically (a temporary file renamed over ``path``)."""
    write_atomic(path, plan_to_yaml(plan))


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan file; every error names the file and the field."""
    p = Path(path)
    if not p.is_file():
        raise SchemaError("", f"no such file: {clip(p)}", doc="plan")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise SchemaError("", f"{clip(p)} is not UTF-8 text (byte {e.start}): not a plan file", doc="plan") from None
    except OSError as e:
        raise SchemaError("", f"cannot read {clip(p)}: {e.strerror}", doc="plan") from None
    try:
        return plan_from_yaml(text)
    except SchemaError as e:
        raise SchemaError(e.field, f"{e.problem} (in {clip(p)})", doc="plan") from None
