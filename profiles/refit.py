"""Fit a cluster profile's coefficients to measured training steps (``autopar calibrate``).

A fit does not invent new cost-model terms: it rescales the coefficients a :class:`~profiles.schema.ClusterProfile`
already has.  Every fitted coefficient is a positive *factor* on a time-like quantity of a base profile (one that
``autopar profile`` measured, or a built-in one), so that the factors are unitless and carry over to a profile of the
same machine with another rank count (:func:`apply_factors` on that profile):

=====================  ==================================================================================
factor                 what it multiplies (time of ...)
=====================  ==================================================================================
``matmul``             matmul-like ops (``peak_flops`` of every dtype divided by the factor)
``vector``             non-matmul ops' arithmetic (``vector_flops`` divided by the factor)
``memory``             memory traffic of every op and the optimizer step (``memory_bandwidth`` divided)
``overhead``           the fixed per-op cost of an eager training step (``launch_overhead_s`` multiplied; the
                       synchronizations of ``runtime_overhead`` measured in situ, ``loss_sync`` and
                       ``pipeline_*``, keep their seconds)
``dtensor``            an op's eager cost on tensor-parallel (DTensor) operands over a plain op's
                       (``sharded_op_overhead`` multiplied: a factor on the measured per-kind table
                       ``dtensor_op_overhead``, or, without one, 1 at the base: no extra dispatch)
``fsdp``               FSDP2's eager work per unit and parameter tensor (``runtime_overhead`` ``fsdp_unit`` and
                       ``fsdp_tensor`` multiplied)
``link.alpha``         the latency term of every collective, on every level and group size (not p2p; with
                       ``link_groups``, on the table points the fitted runs used only)
``link.beta``          the bandwidth term of every collective (``busbw`` divided by the factor; not p2p)
``<coll>.alpha``       the latency term of collective ``<coll>`` alone (on top of ``link.alpha``)
``<coll>.beta``        the bandwidth term of ``<coll>`` alone (on top of ``link.beta``)
``overlap``            not a factor but a shift: ``overlap_slowdown`` (compute seconds lost per second of
                       communication overlapped with it) becomes ``clamp(base + k - 1, 0, 1)``
=====================  ==================================================================================

The fit (:func:`fit_factors`) is plain numerics over an injected prediction function, so that this module knows
nothing about plans: given ``observe(factors) -> predicted vector`` and the ``measured`` vector, it minimises

    sum_i ((observe(k)_i - measured_i) / scale_i)^2  +  prior * sum_j (log k_j)^2

over ``x = log k`` by Levenberg-Marquardt with a forward-difference Jacobian (the planner's prediction is piecewise
smooth: a max over pipeline ranks, a max of compute and memory time).  A factor with no local effect (e.g. the
arithmetic rate of ops that are memory-bound at the base profile's rates) gets a secant slope from a 10x probe, so
that the fit can cross to the other side of such a max when the data ask for it.  The small ``prior`` keeps factors that the
data do not determine at 1 (the base profile's value) instead of letting them drift.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from autopar.profiles.schema import COLLECTIVES, AlphaBeta, ClusterProfile, LinkProfile

__all__ = [
    "DEVICE_FACTORS",
    "OVERLAP_FIELD",
    "FitResult",
    "apply_factors",
    "factor_names",
    "fit_factors",
    "measured_sync",
    "provenance",
]

log = logging.getLogger(__name__)

DEVICE_FACTORS: tuple[str, ...] = ("matmul", "vector", "memory", "overhead", "dtensor", "fsdp")
OVERLAP_FIELD = "overlap_slowdown"
"""The device field of the overlap coefficient (compute slowdown under communication), in [0, 1]."""
_LIMIT = math.log(1e4)  # factors stay within [1e-4, 1e4]
_PROBE = math.log(10.0)  # secant step for a factor with no local effect


def factor_names(collectives: Sequence[str] = COLLECTIVES, profile: ClusterProfile | None = None) -> list[str]:
    """Every factor name: the device factors, alpha and beta of each collective, and ``overlap`` when the schema
    (``profile``'s device) has an overlap field."""
    bad = [c for c in collectives if c not in COLLECTIVES]
    if bad:
        raise ValueError(f"unknown collective(s) {bad}; expected some of {', '.join(COLLECTIVES)}")
    names = list(DEVICE_FACTORS) + ["link.alpha", "link.beta"]
    names += [f"{c}.{t}" for c in collectives for t in ("alpha", "beta")]
    if profile is not None and hasattr(profile.device, OVERLAP_FIELD):
        names.append("overlap")
    return names


def _check(factors: Mapping[str, float], profile: ClusterProfile) -> None:
    known = set(factor_names(COLLECTIVES, profile))
    for k, v in factors.items():
        if k not in known:
            raise ValueError(f"unknown factor {k!r}; known: {', '.join(sorted(known))}")
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"factor {k} must be a positive finite number, got {v!r}")


def _scale_table(points: tuple[AlphaBeta, ...], alpha: float, beta: float, note: str,
                 sizes: Collection[int] | None = None) -> tuple[AlphaBeta, ...]:
    if alpha == 1.0 and beta == 1.0:
        return points
    return tuple(p if sizes is not None and p.group_size not in sizes else
                 dataclasses.replace(p, alpha_s=p.alpha_s * alpha, busbw=p.busbw / beta,
                                     source=(p.source + "; " if p.source else "") + note) for p in points)


def measured_sync(kind: str) -> bool:
    """A ``runtime_overhead`` entry that times a synchronization as a training step meets it (the loss sync, the
    pipeline schedules with their sends, :mod:`autopar.profiles.syncs`): measured in situ, like a pipeline's p2p,
    so that the per-op ``overhead`` factor does not rescale it."""
    return kind == "loss_sync" or kind.startswith("pipeline_")


def apply_factors(profile: ClusterProfile, factors: Mapping[str, float], *, note: str = "",
                  link_groups: Collection[tuple[str, int]] | None = None) -> ClusterProfile:
    """``profile`` with its coefficients rescaled by ``factors`` (missing factors are 1); see the module docstring.

    ``note`` is appended to the ``sources`` of every changed field (provenance).  ``link_groups``: the ``(level,
    group_size)`` table points the link factors rescale, those of the collectives the fitted runs ran (what
    ``autopar calibrate`` records); the others keep their measurement, which a fit on other group sizes says nothing
    about (None: every point)."""
    _check(factors, profile)
    f = {k: float(v) for k, v in factors.items()}
    dev = profile.device
    tag = note or "rescaled by autopar calibrate"
    sources = dict(dev.sources)
    changes: dict[str, object] = {}
    if f.get("matmul", 1.0) != 1.0:
        changes["peak_flops"] = {k: v / f["matmul"] for k, v in dev.peak_flops.items()}
        sources["peak_flops"] = f"{sources.get('peak_flops', '')}; {tag} (matmul x{f['matmul']:.4g})".lstrip("; ")
    if f.get("vector", 1.0) != 1.0:
        base_vec = dev.vector_flops if dev.vector_flops is not None else dev.peak_flops.get(
            "float32", max(dev.peak_flops.values()))
        changes["vector_flops"] = base_vec / f["vector"]
        sources["vector_flops"] = f"{sources.get('vector_flops', '')}; {tag} (x{f['vector']:.4g})".lstrip("; ")
    if f.get("memory", 1.0) != 1.0:
        changes["memory_bandwidth"] = dev.memory_bandwidth / f["memory"]
        sources["memory_bandwidth"] = f"{sources.get('memory_bandwidth', '')}; {tag} (x{f['memory']:.4g})".lstrip("; ")
    if f.get("overhead", 1.0) != 1.0:
        base_o = dev.launch_overhead_s if dev.launch_overhead_s > 0 else 1e-6
        changes["launch_overhead_s"] = base_o * f["overhead"]
        sources["launch_overhead_s"] = (f"{sources.get('launch_overhead_s', '')}; {tag} "
                                        f"(x{f['overhead']:.4g})").lstrip("; ")
    if f.get("dtensor", 1.0) != 1.0:
        changes["sharded_op_overhead"] = dev.sharded_op_overhead * f["dtensor"]
        sources["sharded_op_overhead"] = f"{tag} (x{f['dtensor']:.4g})"
    if f.get("fsdp", 1.0) != 1.0 or (f.get("overhead", 1.0) != 1.0 and any(map(measured_sync, dev.runtime_overhead))):
        # the synchronizations measured as a step meets them keep their seconds under ``overhead``
        kept = 1.0 / f.get("overhead", 1.0)
        changes["runtime_overhead"] = {k: v * (f.get("fsdp", 1.0) if k.startswith("fsdp_") else
                                               kept if measured_sync(k) else 1.0)
                                       for k, v in dev.runtime_overhead.items()}
        if f.get("fsdp", 1.0) != 1.0:
            sources["runtime_overhead"] = (f"{sources.get('runtime_overhead', '')}; {tag} "
                                           f"(fsdp x{f['fsdp']:.4g})").lstrip("; ")
    if f.get("overlap", 1.0) != 1.0:
        value = min(1.0, max(0.0, getattr(dev, OVERLAP_FIELD) + f["overlap"] - 1.0))
        changes[OVERLAP_FIELD] = value
        sources[OVERLAP_FIELD] = f"{tag} ({value:.4g})"
    device = dataclasses.replace(dev, sources=sources, **changes) if changes else dev  # type: ignore[arg-type]
    links: dict[str, LinkProfile] = {}
    # link factors correct the collectives, whose fitted latency holds their algorithm's rounds and the wait for the
    # slowest rank; a pipeline's p2p keeps what the profile measured for it (p2p.alpha / p2p.beta when fitted)
    la, lb = f.get("link.alpha", 1.0), f.get("link.beta", 1.0)
    ka = {c: (la if c != "p2p" else 1.0) * f.get(f"{c}.alpha", 1.0) for c in COLLECTIVES}
    kb = {c: (lb if c != "p2p" else 1.0) * f.get(f"{c}.beta", 1.0) for c in COLLECTIVES}
    for level, link in profile.links.items():
        sizes = None if link_groups is None else {n for lv, n in link_groups if lv == level}
        tables = {c: _scale_table(link.table(c), ka[c], kb[c], f"{tag} (alpha x{ka[c]:.4g}, time/byte x{kb[c]:.4g})",
                                  sizes) for c in COLLECTIVES}
        links[level] = LinkProfile(level=link.level, **tables)  # type: ignore[arg-type]
    return dataclasses.replace(profile, device=device, links=links)


@dataclass(kw_only=True, slots=True, frozen=True)
class FitResult:
    """The outcome of :func:`fit_factors`."""

    factors: dict[str, float]
    """Fitted factor per name (1.0: unchanged from the base profile)."""
    before: tuple[float, ...]
    """Predicted observations with all factors 1."""
    after: tuple[float, ...]
    """Predicted observations with the fitted factors."""
    measured: tuple[float, ...]
    cost_before: float
    """Weighted sum of squared residuals (without the prior) at factors 1."""
    cost_after: float
    iterations: int
    evaluations: int
    determined: dict[str, bool] = field(default_factory=dict)
    """Whether the data moved each factor (its Jacobian column was not ~0); undetermined ones stay at 1."""


def fit_factors(names: Sequence[str], observe: Callable[[dict[str, float]], Sequence[float]],
                measured: Sequence[float], scale: Sequence[float] | None = None, *, prior: float = 1e-3,
                iterations: int = 20, step: float = 0.02, tol: float = 1e-9) -> FitResult:
    """Least-squares factors ``k`` (one per name) with ``observe(k) ~ measured``; see the module docstring.

    ``scale``: residual ``i`` is divided by ``scale[i]`` (default: ``measured[i]``, i.e. relative residuals);
    ``step``: forward-difference step in ``log k``."""
    names = list(names)
    if len(set(names)) != len(names) or not names:
        raise ValueError(f"need distinct factor names, got {names}")
    y = np.asarray(measured, dtype=float)
    s = np.asarray(scale if scale is not None else measured, dtype=float)
    if y.ndim != 1 or s.shape != y.shape or not np.all(np.isfinite(y)) or np.any(s <= 0):
        raise ValueError("measured and scale must be equal-length finite vectors, scale > 0")
    n_eval = 0

    def pred(x: np.ndarray) -> np.ndarray:
        nonlocal n_eval
        n_eval += 1
        out = np.asarray(observe({k: float(math.exp(v)) for k, v in zip(names, x)}), dtype=float)
        if out.shape != y.shape or not np.all(np.isfinite(out)):
            raise ValueError(f"observe returned {out!r}; expected {y.size} finite numbers")
        return out

    def cost(p: np.ndarray, x: np.ndarray) -> float:
        r = (p - y) / s
        return float(r @ r + prior * (x @ x))

    x = np.zeros(len(names))
    p0 = p = pred(x)
    c = cost(p, x)
    lam, it = 1e-2, 0
    jac = np.zeros((y.size, len(names)))
    for it in range(1, iterations + 1):
        for j in range(len(names)):
            xj = x.copy()
            xj[j] += step
            jac[:, j] = (pred(xj) - p) / step / s
            if not np.any(np.abs(jac[:, j]) > 1e-9):  # flat here (the other side of a max): probe x10 further
                xj[j] = min(x[j] + _PROBE, _LIMIT)
                if xj[j] > x[j]:
                    jac[:, j] = (pred(xj) - p) / (xj[j] - x[j]) / s
        r = (p - y) / s
        g = jac.T @ r + prior * x
        h = jac.T @ jac + prior * np.eye(len(names))
        improved = False
        for _ in range(8):
            dx = -np.linalg.solve(h + lam * np.diag(np.diag(h) + 1e-12), g)
            xn = np.clip(x + dx, -_LIMIT, _LIMIT)
            pn = pred(xn)
            cn = cost(pn, xn)
            if cn < c:
                improved = True
                x, p, lam = xn, pn, max(lam / 5, 1e-6)
                done = c - cn < tol * max(c, 1e-30)
                c = cn
                break
            lam *= 5
        if not improved or done:
            break
    determined = {k: bool(np.any(np.abs(jac[:, j]) > 1e-6)) for j, k in enumerate(names)}
    res0, res1 = (p0 - y) / s, (p - y) / s
    log.info("fit: cost %.4g -> %.4g in %d iterations (%d evaluations)", res0 @ res0, res1 @ res1, it, n_eval)
    return FitResult(factors={k: float(math.exp(v)) for k, v in zip(names, x)}, before=tuple(p0.tolist()),
                     after=tuple(p.tolist()), measured=tuple(y.tolist()), cost_before=float(res0 @ res0),
                     cost_after=float(res1 @ res1), iterations=it, evaluations=n_eval, determined=determined)


def provenance(base: ClusterProfile, fit: FitResult, what: str,
               link_groups: Collection[tuple[str, int]] | None = None) -> ClusterProfile:
    """``apply_factors(base, fit.factors)`` named and sourced as a calibrated profile: ``what`` says which runs."""
    factors = dict(fit.factors)
    prof = apply_factors(base, factors, note=f"fitted by autopar calibrate to {what}", link_groups=link_groups)
    text = ", ".join(f"{k} x{v:.3g}" for k, v in sorted(factors.items()) if k != "overlap")
    if "overlap" in factors:
        text += f", {OVERLAP_FIELD} {getattr(prof.device, OVERLAP_FIELD):.3g}"
    return dataclasses.replace(
        prof, name=f"{base.name}-calibrated",
        source=f"{base.source}; calibrated by autopar calibrate to {what}: {text} (residual {fit.cost_before:.3g} "
               f"-> {fit.cost_after:.3g})")
