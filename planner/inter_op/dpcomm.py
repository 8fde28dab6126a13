"""Data-parallel communication of one pipeline rank, as FSDP2 / ZeRO and DDP issue it, and its overlap with compute.

One formula for screening (:mod:`autopar.planner.inter_op.screen`, memoized collectives) and exact evaluation
(:mod:`autopar.planner.inter_op.evaluate`), so both rank candidates the same way.

**Units.** FSDP2 (``fully_shard`` per layer group, :mod:`autopar.codegen.runtime.data_parallel`) all-gathers and
reduce-scatters one *unit* (layer group) at a time, not the whole model: a rank with ``n`` groups holding ``P``
parameter elements issues ``n`` collectives of ``P / n`` elements each (equal units assumed).  Each collective pays
the ring latency ``alpha * (g - 1)`` of its whole group (:meth:`autopar.profiles.cost.CostModel.collective_time`),
so big groups with small per-rank shards become latency-bound (Thakur et al., "Optimization of Collective
Communication Operations in MPICH", IJHPCA 2005; NCCL's own tuning model, ``src/graph/tuning.cc``).

**Overlap** (prefetch depth 1, FSDP2's default: the next unit's all-gather is issued while the current unit
computes).  A step where ``x`` seconds of compute overlap ``c`` seconds of communication takes
``max(x + kappa * c, c)``: communication kernels take SMs and HBM bandwidth from the compute they overlap, which
slows down by ``kappa`` seconds per second of overlapped communication (the overlap coefficient of Galvatron,
Miao et al., VLDB 2023, sec. 4; ``DeviceProfile.overlap_slowdown``); a step longer than its compute is exposed
communication.  The first unit's all-gather of a forward and the last unit's reduce-scatter of a backward have no
compute to hide under.

Per micro-batch (FSDP2 reshards after every backward and reduce-scatters every micro-batch):

* forward, ZeRO >= 1: ``ag + (n - 1) * X(f, ag)`` extra, ``ag`` the unit all-gather (compute dtype), ``f = F / n``;
* backward, ZeRO 3: ``ag + (n - 1) * X(b, ag + rs) + rs``: the backward re-gathers, and the next unit's gather and
  the previous unit's reduce-scatter share the same links (their times add, *link sharing*);
  ZeRO 1/2 (parameters kept gathered from forward to backward): ``(n - 1) * X(b, rs) + rs``;

where ``X(x, c) = max(kappa * c, c - x)`` is the extra time of one overlapped step and ``rs`` is in the plan's
reduce dtype.  ZeRO 0 (replicated parameters, DDP-style bucketed all-reduce during the last micro-batch's backward):
``(n - 1) * X(b, ar) + ar`` once per iteration.  Without overlap (``overlap=False``, e.g. Megatron-LM 2021 or a
runtime that syncs after the backward) every collective is exposed; ZeRO 0 then issues one flattened all-reduce.

**Per-tensor, list-form collectives** (``per_unit > 1``: DeepSpeed's ZeRO-3 of 2021, one collective per parameter
tensor through ``torch.distributed``'s list API).  Besides each tensor's own ring latency, the list API moves every
byte through HBM once more and launches one copy kernel per rank of the group (sources: DeepSpeed 2021
``partition_parameters.py``, ``_allgather_param`` zero-fills a flat buffer and all-gathers into ``world_size`` views
of it, ``_reduce_scatter_gradient`` reduce-scatters ``world_size`` input views, and ``stage3.py``'s
``average_tensor`` divides the gradient in place first; PyTorch's ``ProcessGroupNCCL::allgather`` /
``reduce_scatter`` with tensor lists gather into / reduce from a new flat tensor and copy each of the ``g`` list
entries out / in with one ``copy_`` each).  So a gather of ``S`` bytes also writes ``S`` (the zero fill) and reads
and writes ``S`` (the copy out): ``3 S`` of HBM traffic; a reduce-scatter reads and writes ``S`` twice (divide,
copy in): ``4 S``.  The reduce-scatter's ``g`` copy kernels are issued before the collective can start, one
``launch_overhead_s`` each; the gather's follow it on its stream, and their issue overlaps the collective's own
ring steps (only what is left over, ``g * launch - t_gather``, adds).  The group's size ``g`` is the dp degree:
at thousands of ranks every reduce-scatter pays ``g`` launches, whatever its size.

**FSDP2's eager work** (ZeRO >= 1): its hooks run on the host around every unit's forward and backward of every
micro-batch (pre/post forward and backward hooks, the all-gather's copy-in and copy-out, the reduce-scatter's
copy-in, DTensor wrapping of the sharded parameters and gradients), ``fsdp_unit`` per unit and ``fsdp_tensor`` per
parameter tensor (:meth:`autopar.profiles.cost.CostModel.fsdp_eager`; measured by ``autopar profile``, 0 on GPU
profiles, where this host work runs ahead of the kernels).  It is compute on the rank's timeline (``eager_s``), not
hidden under communication.  ZeRO 3's second gather is charged the same per-unit cost (not measured apart).  Its
copies move bytes as well (``torch.distributed.fsdp._fully_shard._fsdp_collectives``): a gather copies the shards
in (``2 S / g``) and the gathered unit out into its parameters (``2 S``), a reduce-scatter concatenates the unit's
gradients into its input (``2 S``) and adds its shard (``2 S / g``), each micro-batch.

**ZeRO 0's bucket work** (:func:`bucket_host_s`): the runtime (``codegen.runtime.data_parallel``, like DDP without
``gradient_as_bucket_view``) copies each bucket's gradients into one flat tensor (``torch.cat``), divides it in place
after the all-reduce and copies it back into the gradients (one multi-tensor copy): the gradients' bytes ``S`` read
and written three times (``6 S`` of memory traffic), three ops per bucket, plus the views that flatten and unflatten
each parameter tensor.  That is compute on the rank's timeline too (``eager_s``): on this VM's CPU ranks gpt-tiny's
28 gradient tensors (0.44 MB) cost ~0.45 ms of its 6 ms dp=2 step (measured with one ``copy_`` per tensor), which an
earlier model left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from autopar.profiles.cost import CostModel, GroupSpan

__all__ = ["DpComm", "bucket_host_s", "dp_comm", "dp_span", "overlap_step"]

Collective = Callable[[str, float], float]
"""``(kind, nbytes) -> seconds`` on the rank's data-parallel group."""


def dp_span(cost: CostModel, dp: int, tp: int) -> GroupSpan:
    """A stage's data-parallel group (ranks ``tp`` apart), with its tp ranks' dp groups communicating at once."""
    return cost.span(dp, tp, stage=dp * tp)


@dataclass(frozen=True, slots=True)
class DpComm:
    """Data-parallel time of one rank per iteration, beyond its compute (with the gradient all-reduce of parameters
    tied across pipeline stages, ``inter_op.evaluate``)."""

    exposed_s: float
    """Collective time with no compute under it (first gathers, last reduce-scatters, comm-bound steps)."""
    contention_s: float
    """Compute time lost to overlapped communication (``kappa`` times the overlapped collective time)."""
    collective_s: float
    """Sum of all data-parallel collective times of the iteration (hidden or not), for reports."""
    eager_s: float = 0.0
    """Host work of the iteration that is compute on the rank's timeline: FSDP2's hooks (ZeRO >= 1), ZeRO 0's
    bucket copies (:func:`bucket_host_s`)."""
    overlapped: bool = True
    """ZeRO 0: the gradient all-reduce goes out in buckets during the backward (False: one after it)."""

    @property
    def total_s(self) -> float:
        return self.exposed_s + self.contention_s + self.eager_s


def overlap_step(x: float, c: float, kappa: float) -> tuple[float, float]:
    """(exposed, contention) extra seconds of a step where ``x`` s of compute overlap ``c`` s of communication:
    the step takes ``max(x + kappa * c, c)``."""
    if c - x >= kappa * c:
        return c - x, 0.0
    return 0.0, kappa * c


def _chain(x: float, c: float, steps: int, kappa: float) -> tuple[float, float]:
    e, k = overlap_step(x, c, kappa)
    return e * steps, k * steps


def bucket_host_s(cost: CostModel, nbytes: float, tensors: float, buckets: int) -> float:
    """Seconds of ZeRO 0's work around its gradient all-reduces on one rank (see the module docstring): ``nbytes``
    of gradients in ``tensors`` parameter tensors, synchronized in ``buckets`` flat buckets.  Per bucket a ``cat``,
    an in-place division and a multi-tensor copy back, each reading and writing the bucket; per tensor three views
    (flattened for the ``cat``, split and shaped for the copy back)."""
    if nbytes <= 0:
        return 0.0
    k = max(buckets, 1)
    ops = (cost.op_time(0.0, 2 * nbytes / k, "float32", "other")
           + 2 * cost.op_time(0.0, 2 * nbytes / k, "float32", "pointwise"))
    return k * ops + 3 * max(tensors, 0.0) * cost.op_overhead("view")


def dp_comm(cost: CostModel, *, params: float, units: int, fwd_s: float, bwd_s: float, num_microbatches: int,
            dp: int, tp: int, zero: int, param_item: float, reduce_item: float, overlap: bool = True,
            coll: Collective | None = None, per_unit: float = 1.0, recompute_regather: bool = False,
            list_form: bool | None = None, param_tensors: float = 0.0) -> DpComm:
    """Data-parallel communication cost of one rank per iteration (see the module docstring).

    ``params``: parameter elements the rank holds before dp sharding; ``units``: its FSDP units (layer groups);
    ``fwd_s``/``bwd_s``: its compute per micro-batch (backward including recomputation); ``param_item``/
    ``reduce_item``: bytes per element gathered (compute dtype) and reduced (reduce dtype).  ``coll``: a memoized
    ``(kind, nbytes) -> s`` on the dp group (default: ``cost.collective_time`` on :func:`dp_span`).
    ``per_unit``: collectives issued per unit and direction (1 for FSDP2's coalesced unit; the unit's parameter
    tensors for per-tensor implementations: each pays its own latency, the bytes are the same);
    ``recompute_regather``: ZeRO 3 gathers once more for the recomputed forward (implementations that release
    parameters after every forward, recomputed ones included); ``list_form``: the per-tensor collectives go through
    ``torch.distributed``'s list API (see the module docstring; default: whenever ``per_unit > 1``);
    ``param_tensors``: the rank's parameter tensors (FSDP2's per-tensor eager work)."""
    if dp <= 1 or params <= 0:
        return DpComm(0.0, 0.0, 0.0, overlapped=overlap)
    if units < 1 or num_microbatches < 1:
        raise ValueError(f"units and num_microbatches must be >= 1, got {units}, {num_microbatches}")
    if coll is None:
        span = dp_span(cost, dp, tp)

        def coll(kind: str, nbytes: float) -> float:
            return cost.collective_time(kind, nbytes, span=span)

    kappa = cost.profile.device.overlap_slowdown
    n, m = units, num_microbatches
    unit = params / n
    f, b = fwd_s / n, bwd_s / n
    if zero == 0:
        if not overlap:
            t = coll("all_reduce", params * reduce_item)
            return DpComm(t, 0.0, t, bucket_host_s(cost, params * reduce_item, param_tensors, 1), overlapped=False)
        ar = coll("all_reduce", unit * reduce_item)
        e, k = _chain(b, ar, n - 1, kappa)
        return DpComm(e + ar, k, n * ar, bucket_host_s(cost, params * reduce_item, param_tensors, n))
    k = max(per_unit, 1.0)
    ag1 = coll("all_gather", unit * param_item / k)
    ag = k * ag1
    rs = k * coll("reduce_scatter", unit * reduce_item / k)
    if per_unit > 1.0 if list_form is None else list_form:
        dev = cost.profile.device
        launches = dp * dev.launch_overhead_s
        ag += 3 * unit * param_item / dev.memory_bandwidth + k * max(launches - ag1, 0.0)
        rs += 4 * unit * reduce_item / dev.memory_bandwidth + k * launches
    gathers = (3 if recompute_regather else 2) if zero == 3 else 1
    per_mb = n * (gathers * ag + rs)
    eager = 0.0
    if per_unit <= 1.0:  # FSDP2's hooks and copies (DeepSpeed's list form pays its HBM passes above)
        dev = cost.profile.device
        copies = 2 * unit * (1 + 1 / dp) * (gathers * param_item + reduce_item) / dev.memory_bandwidth
        # a profile that measured FSDP2's work per unit (CPU) holds its copy launches; else one per copy kernel
        launches = 0.0 if "fsdp_unit" in dev.runtime_overhead else (2 * gathers + 2) * cost.op_overhead("pointwise")
        eager = m * (cost.fsdp_eager(n, param_tensors) + n * (copies / dev.sustained_fraction + launches))
    if not overlap:
        return DpComm(m * per_mb, 0.0, m * per_mb, eager)
    ef, kf = _chain(f, ag, n - 1, kappa)
    if zero == 3:
        ab = (gathers - 1) * ag
        eb, kb = _chain(b, ab + rs, n - 1, kappa)
        eb += ab
    else:
        eb, kb = _chain(b, rs, n - 1, kappa)
    return DpComm(m * (ag + ef + eb + rs), m * (kf + kb), m * per_mb, eager)
