"""Per-op sharding strategies on a tensor-parallel axis of size ``t``.

A placement is ``R`` (replicated), ``P`` (partial sums), ``S(d)`` (dim d split in ``t`` contiguous chunks) or, inside
the solver only, ``S(d)[k]``: dim d viewed as ``[k, n/k]`` with the inner factor split (an *interleaved* shard, what
DTensor calls ``_StridedShard``). The interleaved form is what lets a fused ``qkv`` projection whose output is laid out
``[3, heads, head_dim]`` be column-parallel with each rank owning whole heads (Megatron-LM's fused QKV); the public
placement of such a parameter is still ``S(0)`` and the split factor is reported next to it.

:func:`strategies_for` lists, for one node, every strategy it supports: the placement required for each input
(parameters included, ``None`` = any placement, e.g. the shape-only input of ``zeros_like``), the output placement,
the fraction of the work each device does, the placement of the gradient it returns for each input, and which
parameters' gradients need a tp all-reduce (a replicated weight applied to a sharded input gets partial gradients).
The first strategy is always ``replicate``. Enumeration never raises: unknown or odd ops fall back to replicate.

Gradient placement of a consumed input (Megatron's f/g operators, Shoeybi et al. 2019, generalised): an input
consumed ``S(d)`` gets an ``S(d)`` gradient; consumed ``P`` gets ``R``; consumed ``R`` by a strategy that splits the
work (column-parallel linear, broadcasting against a sharded tensor) gets a ``P`` gradient, otherwise ``R``.

:func:`saved_tensors` says what autograd keeps for backward (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", Sec. 4.1 counts the same tensors for a transformer layer).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Sequence

from autopar.ir.graph import Graph, Node, TensorMeta
from autopar.ir.placement import is_shard, parse_placement, public_placement, shard

__all__ = [
    "Strategy", "SavedTensor", "strategies_for", "saved_tensors", "reshape_pairs", "input_meta", "storage_key", "FLOAT_DTYPES",
]

log = logging.getLogger(__name__)

FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"})
_LINEAR_PW = frozenset({"neg", "cast", "identity", "clone", "contiguous", "copy", "alias", "detach"})
_SAVE_INPUT = frozenset({"gelu", "silu", "relu", "sigmoid", "tanh", "exp", "log", "sin", "cos", "erf", "softplus",
                         "mish", "hardswish", "elu", "leaky_relu", "log1p", "expm1", "pow", "square", "sqrt",
                         "abs", "clamp", "maximum", "minimum"})
_SAVE_OUTPUT = frozenset({"softmax", "log_softmax", "rsqrt", "reciprocal"})
_P_REDUCE = frozenset({"sum", "mean"})
_SCAN_OPS = frozenset({"topk", "sort", "argmax", "argmin", "cumsum", "max", "min", "amax", "amin", "logsumexp",
                       "var", "std", "norm", "prod", "any", "all"})


@dataclass(frozen=True, slots=True)
class Strategy:
    """One way to run a node on the tp axis."""

    name: str
    inputs: tuple[str | None, ...]
    """Placement each input (by position in ``Node.inputs``, parameters included) is consumed in; None = any."""
    output: str
    frac: float = 1.0
    """Fraction of the op's work (FLOPs and bytes) each device does."""
    grads: tuple[str | None, ...] = ()
    """Placement of the gradient returned for each input (None: no gradient flows, e.g. integer or parameter)."""
    grad_allreduce: tuple[str, ...] = ()
    """Parameters whose gradients are partial sums over the tp group (need an all-reduce in backward)."""


@dataclass(frozen=True, slots=True)
class SavedTensor:
    """A tensor autograd keeps for backward: an input (``pos`` >= 0), the output (``pos == -1``) or an extra
    (``pos == -2``: a mask or statistics, ``nbytes`` given, sharded like the output)."""

    pos: int
    key: str
    """Storage identity: saved tensors with the same key and placement are stored once."""
    meta: TensorMeta | None = None
    nbytes: float = 0.0
    """For extras: bytes at the traced shape (not scaled by the training dtype)."""


# ---- shape helpers ----------------------------------------------------------------------------------------------
def input_meta(graph: Graph, node: Node, i: int) -> TensorMeta | None:
    """Meta of ``node.inputs[i]`` (the selected output for ``getitem`` of a multi-output node)."""
    name = node.inputs[i]
    if name in graph.param_map:
        return graph.param_map[name].meta
    if not graph.has_node(name):
        return None
    src = graph.node(name)
    if not src.outputs:
        return None
    if len(src.outputs) > 1 and node.op == "getitem":
        idx = _int_arg(node)
        if idx is not None and -len(src.outputs) <= idx < len(src.outputs):
            return src.outputs[idx]
    return src.outputs[0]


def storage_key(graph: Graph, name: str) -> str:
    """Follow single-input, numel-preserving views up to the tensor that owns the storage."""
    seen = 0
    while graph.has_node(name) and seen < 64:
        n = graph.node(name)
        acts = n.activation_inputs
        if n.kind != "view" or len(acts) != 1 or not graph.has_node(acts[0]) or len(n.outputs) != 1:
            break
        src = graph.node(acts[0])
        if not src.outputs or len(src.outputs) > 1 or src.outputs[0].numel != n.out.numel:
            break
        name, seen = acts[0], seen + 1
    return name


def _int_arg(node: Node) -> int | None:
    args = node.attr("args")
    if isinstance(args, (tuple, list)) and len(args) == 1 and isinstance(args[0], int):
        return args[0]
    if isinstance(args, int):
        return args
    return None


def _dims(node: Node, rank: int) -> tuple[int, ...] | None:
    """Normalized ``dim`` attribute (or first positional arg) of a reduction/softmax/cat; None when absent."""
    d = node.attr("dim")
    if d is None:
        args = node.attr("args")
        if isinstance(args, (tuple, list)) and args:
            d = args[0]
    if d is None:
        return None
    ds = d if isinstance(d, (tuple, list)) else (d,)
    if not all(isinstance(x, int) for x in ds):
        return None
    return tuple(sorted({x % rank for x in ds})) if rank else ()


def _prefix_options(shape: Sequence[int], dims: range, o_values: set[int], t: int) -> dict[int, str]:
    """outer-product -> placement for every way to shard a dim in ``dims`` (a run whose products match)."""
    out: dict[int, str] = {}
    prefix = 1
    for d in dims:
        n = shape[d]
        for o in sorted(o_values):
            if o % prefix or not prefix <= o < prefix * n:
                continue
            k = o // prefix
            if n % k == 0 and (n // k) % t == 0 and o not in out:
                out[o] = shard(d, k)
        prefix *= n
    return out


def reshape_pairs(src: Sequence[int], dst: Sequence[int], t: int) -> list[tuple[str, str]]:
    """Placements that map onto each other through a reshape ``src -> dst`` (same numel).

    Dims are grouped into runs with equal products; inside a run, ``S(i)[k]`` on the source and ``S(j)[k']`` on the
    destination hold the same elements on every rank iff the products of everything outside the sharded factor
    agree (``prefix_i * k == prefix_j * k'``) and both sharded factors divide by ``t``.
    """
    if math.prod(src) != math.prod(dst):
        return []
    pairs: list[tuple[str, str]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        i0, j0 = i, j
        ps, pd = 1, 1
        if i < len(src):
            ps *= src[i]
            i += 1
        if j < len(dst):
            pd *= dst[j]
            j += 1
        while ps != pd:
            if ps < pd and i < len(src):
                ps *= src[i]
                i += 1
            elif j < len(dst):
                pd *= dst[j]
                j += 1
            else:
                return pairs
        while i < len(src) and src[i] == 1 and (j >= len(dst) or dst[j] != 1):
            i += 1
        while j < len(dst) and dst[j] == 1 and (i >= len(src) or src[i] != 1):
            j += 1
        o_src = _prefix_values(src, range(i0, i))
        o_dst = _prefix_values(dst, range(j0, j))
        os = o_src | o_dst
        a = _prefix_options(src, range(i0, i), os, t)
        b = _prefix_options(dst, range(j0, j), os, t)
        pairs += [(a[o], b[o]) for o in sorted(a) if o in b]
    return pairs


def _prefix_values(shape: Sequence[int], dims: range) -> set[int]:
    vals, p = {1}, 1
    for d in dims:
        p *= shape[d]
        vals.add(p)
    return vals


def _align(src: Sequence[int], dst: Sequence[int]) -> dict[int, int]:
    """Greedy order-preserving match of equal-size dims (indexing/slicing views); unmatched dims map nowhere."""
    m: dict[int, int] = {}
    j = 0
    for i, s in enumerate(src):
        if len(src) - i > len(dst) - j and (j >= len(dst) or s != dst[j]):
            continue  # dim removed by integer indexing
        while j < len(dst) and dst[j] != s and dst[j] == 1 and len(dst) - j > len(src) - i:
            j += 1  # dim inserted (None indexing)
        if j < len(dst):
            if dst[j] == s:
                m[i] = j
            j += 1
    return m


# ---- strategy construction ----------------------------------------------------------------------------------------
class _Ctx:
    """What the enumerators need about one node."""

    def __init__(self, graph: Graph, node: Node, t: int) -> None:
        self.graph, self.node, self.t = graph, node, t
        self.metas = [input_meta(graph, node, i) for i in range(len(node.inputs))]
        self.is_param = [x in node.params for x in node.inputs]
        self.out = node.outputs[0] if node.outputs else None

    def acts(self) -> list[int]:
        return [i for i, p in enumerate(self.is_param) if not p and self.metas[i] is not None]

    def params(self) -> list[int]:
        return [i for i, p in enumerate(self.is_param) if p]

    def ok(self, size: int) -> bool:
        return size > 0 and size % self.t == 0

    def is_float(self, i: int) -> bool:
        m = self.metas[i]
        return m is not None and m.dtype in FLOAT_DTYPES

    def mk(self, name: str, ins: dict[int, str | None], out: str, frac: float = 1.0, *, default: str | None = "R",
           grads: dict[int, str] | None = None, exempt: tuple[int, ...] = ()) -> Strategy:
        n = len(self.node.inputs)
        full = tuple(ins.get(i, default) for i in range(n))
        gl: list[str | None] = []
        for i, p in enumerate(full):
            if self.is_param[i] or p is None or not self.is_float(i):
                gl.append(None)
            elif grads and i in grads:
                gl.append(grads[i])
            elif p == "P":
                gl.append("R")
            elif p == "R":
                gl.append("P" if frac < 1 else "R")
            else:
                gl.append(p)
        ar = tuple(self.node.inputs[i] for i in self.params()
                   if full[i] == "R" and frac < 1 and i not in exempt and self.is_float(i))
        return Strategy(name, full, out, frac, tuple(gl), tuple(dict.fromkeys(ar)))


def strategies_for(graph: Graph, node: Node, t: int) -> tuple[Strategy, ...]:
    """All strategies of ``node`` on a tp axis of size ``t``; the first is ``replicate``. Never raises."""
    ctx = _Ctx(graph, node, t)
    rep = ctx.mk("replicate", {}, "R", default=None if node.kind in ("creation", "input") else "R")
    if t == 1 or not node.outputs:
        return (rep,)
    try:
        fn = _DISPATCH.get(node.op) or _KIND_DISPATCH.get(node.kind)
        extra = fn(ctx) if fn is not None else []
    except Exception as e:  # enumeration must never stop the planner; replicate is always valid
        log.debug("strategy enumeration failed for %s (%s): %s; replicating", node.name, node.op, e)
        extra = []
    seen = {(rep.inputs, rep.output)}
    out = [rep]
    for s in extra:
        if (s.inputs, s.output) not in seen:
            seen.add((s.inputs, s.output))
            out.append(s)
    return tuple(out)


def _free_source(ctx: _Ctx) -> list[Strategy]:
    """input/creation: every rank can produce any slice of the value locally."""
    assert ctx.out is not None
    return [ctx.mk(f"S({d})", {}, shard(d), 1.0 / ctx.t, default=None)
            for d, n in enumerate(ctx.out.shape) if ctx.ok(n)]


def _consumer_view_ks(ctx: _Ctx, dim: int) -> set[int]:
    ks = {1}
    assert ctx.out is not None
    for u in ctx.graph.users.get(ctx.node.name, ()):
        un = ctx.graph.node(u)
        if un.kind == "view" and un.outputs and len(un.outputs) == 1:
            for a, _ in reshape_pairs(ctx.out.shape, un.out.shape, ctx.t):
                d, k = parse_placement(a).dim, parse_placement(a).chunks
                if d == dim:
                    ks.add(k)
    return ks


def _producer_view_ks(ctx: _Ctx, i: int, dim: int) -> set[int]:
    ks = {1}
    name = ctx.node.inputs[i]
    if ctx.graph.has_node(name):
        p = ctx.graph.node(name)
        src = input_meta(ctx.graph, p, 0) if p.inputs else None
        if p.kind == "view" and src is not None and len(p.outputs) == 1:
            for _, b in reshape_pairs(src.shape, p.out.shape, ctx.t):
                d, k = parse_placement(b).dim, parse_placement(b).chunks
                if d == dim:
                    ks.add(k)
    return ks


def _linear(ctx: _Ctx) -> list[Strategy]:
    acts, params = ctx.acts(), [i for i in range(len(ctx.node.inputs)) if i not in ctx.acts()]
    if not acts or ctx.out is None:
        return []
    ix = acts[0]
    rest = [i for i in range(len(ctx.node.inputs)) if i != ix]
    if not rest:
        return []
    iw, ib = rest[0], (rest[1] if len(rest) > 1 else None)
    x, w = ctx.metas[ix], ctx.metas[iw]
    if x is None or w is None or len(w.shape) != 2:
        return []
    r = len(x.shape)
    n_out, k_in = w.shape
    res = []
    for k in sorted(_consumer_view_ks(ctx, r - 1)):
        if n_out % k == 0 and ctx.ok(n_out // k):
            ins = {ix: "R", iw: shard(0, k)} | ({ib: shard(0, k)} if ib is not None else {})
            res.append(ctx.mk("column" if k == 1 else f"column[k={k}]", ins, shard(r - 1, k), 1.0 / ctx.t))
    for k in sorted(_producer_view_ks(ctx, ix, r - 1)):
        if k_in % k == 0 and ctx.ok(k_in // k):
            ins = {ix: shard(r - 1, k), iw: shard(1, k)} | ({ib: "R"} if ib is not None else {})
            res.append(ctx.mk("row" if k == 1 else f"row[k={k}]", ins, "P", 1.0 / ctx.t,
                              exempt=(ib,) if ib is not None else ()))
    for d in range(r - 1):
        if ctx.ok(x.shape[d]):
            res.append(ctx.mk(f"split{d}", {ix: shard(d)}, shard(d), 1.0 / ctx.t))
    del params
    return res


def _matmul(ctx: _Ctx) -> list[Strategy]:
    tens = [i for i, m in enumerate(ctx.metas) if m is not None]
    if len(tens) != 2 or ctx.out is None:
        return []
    ia, ib = tens
    a, b, o = ctx.metas[ia], ctx.metas[ib], ctx.out
    assert a is not None and b is not None
    ra, rb, r = len(a.shape), len(b.shape), len(o.shape)
    if ra < 2 or rb < 2:
        return []
    f = 1.0 / ctx.t
    res = []
    for d in range(r - 2):
        if ctx.ok(o.shape[d]):
            da, db = d - (r - ra), d - (r - rb)
            pa = shard(da) if da >= 0 and a.shape[da] == o.shape[d] else "R"
            pb = shard(db) if db >= 0 and b.shape[db] == o.shape[d] else "R"
            res.append(ctx.mk(f"batch{d}", {ia: pa, ib: pb}, shard(d), f))
    if ctx.ok(a.shape[-2]):
        res.append(ctx.mk("split_m", {ia: shard(ra - 2), ib: "R"}, shard(r - 2), f))
    if ctx.ok(b.shape[-1]):
        res.append(ctx.mk("column", {ia: "R", ib: shard(rb - 1)}, shard(r - 1), f))
    if ctx.ok(a.shape[-1]):
        res.append(ctx.mk("row", {ia: shard(ra - 1), ib: shard(rb - 2)}, "P", f))
    return res


def _sdpa(ctx: _Ctx) -> list[Strategy]:
    acts = ctx.acts()
    if len(acts) < 3 or ctx.out is None:
        return []
    q, k, v = (ctx.metas[i] for i in acts[:3])
    assert q is not None and k is not None and v is not None
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        return []
    res = []
    for d, name in ((1, "heads"), (0, "batch")):
        if all(ctx.ok(m.shape[d]) for m in (q, k, v)):
            ins: dict[int, str | None] = {i: shard(d) for i in acts[:3]}
            for i in acts[3:]:  # attention mask: shard along with q when it has that dim, else replicate
                m = ctx.metas[i]
                ins[i] = shard(d) if m is not None and len(m.shape) == 4 and m.shape[d] == q.shape[d] else "R"
            res.append(ctx.mk(name, ins, shard(d), 1.0 / ctx.t))
    return res


def _embedding(ctx: _Ctx) -> list[Strategy]:
    params, acts = ctx.params(), ctx.acts()
    if len(params) != 1 or len(acts) != 1 or ctx.out is None:
        return []
    iw, ii = params[0], acts[0]
    w, idx = ctx.metas[iw], ctx.metas[ii]
    assert w is not None and idx is not None
    res = []
    if ctx.ok(w.shape[0]):
        res.append(ctx.mk("vocab", {iw: shard(0)}, "P", 1.0))
    if len(w.shape) == 2 and ctx.ok(w.shape[1]):
        res.append(ctx.mk("hidden", {iw: shard(1)}, shard(len(ctx.out.shape) - 1), 1.0 / ctx.t))
    for d, n in enumerate(idx.shape):
        if ctx.ok(n):
            res.append(ctx.mk(f"split{d}", {ii: shard(d), iw: "R"}, shard(d), 1.0 / ctx.t))
    return res


def _norm(ctx: _Ctx) -> list[Strategy]:
    acts = ctx.acts()
    if not acts or ctx.out is None:
        return []
    ix, r = acts[0], len(ctx.out.shape)
    f = 1.0 / ctx.t
    if ctx.node.op == "batch_norm":  # channel-parallel only (a batch split would need SyncBatchNorm)
        if r >= 2 and ctx.ok(ctx.out.shape[1]):
            ins = {i: shard(0) for i in ctx.params()} | {ix: shard(1)}
            return [ctx.mk("channel", ins, shard(1), f)]
        return []
    if ctx.node.op == "group_norm":
        return [ctx.mk("split0", {ix: shard(0)}, shard(0), f)] if ctx.ok(ctx.out.shape[0]) else []
    w = next((ctx.metas[i] for i in ctx.params()), None)
    nnorm = len(w.shape) if w is not None else 1
    return [ctx.mk(f"split{d}", {ix: shard(d)}, shard(d), f) for d in range(r - nnorm) if ctx.ok(ctx.out.shape[d])]


def _broadcast(ctx: _Ctx, d: int) -> dict[int, str]:
    assert ctx.out is not None
    r = len(ctx.out.shape)
    ins = {}
    for i, m in enumerate(ctx.metas):
        if m is None:
            continue
        di = d - (r - len(m.shape))
        ins[i] = shard(di) if di >= 0 and m.shape[di] == ctx.out.shape[d] else "R"
    return ins


def _pointwise(ctx: _Ctx) -> list[Strategy]:
    if ctx.out is None:
        return []
    res = [ctx.mk(f"S({d})", _broadcast(ctx, d), shard(d), 1.0 / ctx.t)
           for d, n in enumerate(ctx.out.shape) if ctx.ok(n)]
    tens = [i for i, m in enumerate(ctx.metas) if m is not None]
    fl = [i for i in tens if ctx.is_float(i)]
    op = ctx.node.op
    if ctx.out.dtype not in FLOAT_DTYPES or len(fl) != len(tens):
        return res
    if op in ("add", "sub") and len(tens) >= 2 and not ctx.node.attr("args"):
        res.append(ctx.mk("partial", {i: "P" for i in tens}, "P"))  # sum of partials is linear
    elif op in _LINEAR_PW and len(tens) == 1:
        res.append(ctx.mk("partial", {tens[0]: "P"}, "P"))
    elif op in ("mul", "div") and tens and not ctx.is_param[tens[0]]:
        others = [i for i in tens[1:]]
        if len(tens) == 1:
            res.append(ctx.mk("partial", {tens[0]: "P"}, "P"))
        else:  # (sum_i x_i) * y = sum_i (x_i * y): linear in the P operand; y's gradient is then partial
            ins = {tens[0]: "P"} | {i: "R" for i in others}
            res.append(ctx.mk("partial", ins, "P", grads={i: "P" for i in others}))
            if op == "mul" and len(tens) == 2 and not ctx.is_param[tens[1]]:
                res.append(ctx.mk("partial1", {tens[0]: "R", tens[1]: "P"}, "P", grads={tens[0]: "P"}))
    return res


def _softmax(ctx: _Ctx) -> list[Strategy]:
    assert ctx.out is not None
    r = len(ctx.out.shape)
    dims = _dims(ctx.node, r) or (r - 1,)
    ix = ctx.acts()[0]
    return [ctx.mk(f"S({d})", {ix: shard(d)}, shard(d), 1.0 / ctx.t)
            for d, n in enumerate(ctx.out.shape) if d not in dims and ctx.ok(n)]


def _reduction(ctx: _Ctx) -> list[Strategy]:
    acts = ctx.acts()
    if not acts or ctx.out is None:
        return []
    ix = acts[0]
    x = ctx.metas[ix]
    assert x is not None
    r = len(x.shape)
    op = ctx.node.op
    if op == "pool":
        return [ctx.mk(f"S({d})", {ix: shard(d)}, shard(d), 1.0 / ctx.t)
                for d in (0, 1) if r >= 3 and ctx.ok(x.shape[d]) and ctx.out.shape[d] == x.shape[d]]
    dims = _dims(ctx.node, r)
    if dims is None:
        dims = tuple(range(r)) if op not in _SCAN_OPS or op in ("sum", "mean", "prod", "any", "all") else (r - 1,)
    keep = len(ctx.out.shape) == r
    res = []
    for d in range(r):
        if d in dims or not ctx.ok(x.shape[d]):
            continue
        od = d if keep else d - sum(1 for e in dims if e < d)
        if od < len(ctx.out.shape) and ctx.out.shape[od] == x.shape[d]:
            res.append(ctx.mk(f"S({d})", {ix: shard(d)}, shard(od), 1.0 / ctx.t))
    if op in _P_REDUCE and ctx.out.dtype in FLOAT_DTYPES:
        res += [ctx.mk(f"reduce{d}", {ix: shard(d)}, "P", 1.0 / ctx.t) for d in dims if ctx.ok(x.shape[d])]
        res.append(ctx.mk("partial", {ix: "P"}, "P"))
    return res


def _loss(ctx: _Ctx) -> list[Strategy]:
    acts = ctx.acts()
    if len(acts) < 2 or ctx.out is None:
        return []
    x, y = ctx.metas[acts[0]], ctx.metas[acts[1]]
    assert x is not None and y is not None
    if not ctx.ok(x.shape[0]) or not y.shape or y.shape[0] != x.shape[0]:
        return []
    out = "P" if not ctx.out.shape else shard(0)
    return [ctx.mk("split0", {acts[0]: shard(0), acts[1]: shard(0)}, out, 1.0 / ctx.t)]


def _cat(ctx: _Ctx) -> list[Strategy]:
    assert ctx.out is not None
    tens = [i for i, m in enumerate(ctx.metas) if m is not None]
    if not tens:
        return []
    x = ctx.metas[tens[0]]
    assert x is not None
    r_in, r_out = len(x.shape), len(ctx.out.shape)
    stack = ctx.node.op == "stack"
    dims = _dims(ctx.node, r_out if stack else r_in)
    cd = dims[0] if dims else 0
    res = [ctx.mk("partial", {i: "P" for i in tens}, "P")] if ctx.out.dtype in FLOAT_DTYPES else []
    for d in range(r_in):
        od = d + 1 if stack and d >= cd else d
        if (stack or d != cd) and ctx.ok(x.shape[d]) and all(ctx.metas[i].shape[d] == x.shape[d]  # type: ignore
                                                             for i in tens):
            res.append(ctx.mk(f"S({d})", {i: shard(d) for i in tens}, shard(od), 1.0 / ctx.t))
    return res


def _identity_like(ctx: _Ctx) -> list[Strategy]:
    acts = ctx.acts()
    if len(acts) != 1 or ctx.out is None or ctx.metas[acts[0]] != ctx.out:
        return []
    ix = acts[0]
    res = [ctx.mk(f"S({d})", {ix: shard(d)}, shard(d), 1.0 / ctx.t)
           for d, n in enumerate(ctx.out.shape) if ctx.ok(n)]
    if ctx.out.dtype in FLOAT_DTYPES:
        res.append(ctx.mk("partial", {ix: "P"}, "P"))
    return res


def _view_pairs(ctx: _Ctx, x: TensorMeta) -> list[tuple[str, str]]:
    """(input placement, output placement) pairs for a single-input view."""
    assert ctx.out is not None
    node, src, dst = ctx.node, x.shape, ctx.out.shape
    if node.op in ("permute", "transpose", "t", "movedim") and len(src) == len(dst):
        perm = _perm(node, len(src))
        if perm is not None and all(dst[i] == src[p] for i, p in enumerate(perm)):
            return [(shard(p), shard(i)) for i, p in enumerate(perm) if ctx.ok(src[p])]
    if node.op in ("expand", "expand_as"):
        off = len(dst) - len(src)
        return [(shard(d), shard(d + off)) for d in range(len(src)) if src[d] == dst[d + off] and ctx.ok(src[d])]
    if math.prod(src) == math.prod(dst) and node.op not in ("getitem", "slice", "select", "narrow", "as_strided"):
        return reshape_pairs(src, dst, ctx.t)
    if node.op == "as_strided":
        return []
    return [(shard(i), shard(j)) for i, j in _align(src, dst).items() if ctx.ok(src[i])]


def _perm(node: Node, r: int) -> list[int] | None:
    args = node.attr("args") or node.attr("dims")
    if node.op == "t" and r == 2:
        return [1, 0]
    if not isinstance(args, (tuple, list)) or not all(isinstance(a, int) for a in args):
        return None
    if node.op == "permute" and len(args) == r:
        return [a % r for a in args]
    if node.op == "transpose" and len(args) == 2:
        a, b = args[0] % r, args[1] % r
        perm = list(range(r))
        perm[a], perm[b] = perm[b], perm[a]
        return perm
    return None


def _view(ctx: _Ctx) -> list[Strategy]:
    acts = ctx.acts()
    if len(acts) != 1 or ctx.out is None:
        return []
    ix, x = acts[0], ctx.metas[acts[0]]
    assert x is not None
    multi = len(ctx.node.outputs) > 1
    src_node = ctx.graph.node(ctx.node.inputs[ix]) if ctx.graph.has_node(ctx.node.inputs[ix]) else None
    res = [ctx.mk("partial", {ix: "P"}, "P")] if ctx.out.dtype in FLOAT_DTYPES else []
    if ctx.node.op == "getitem" and src_node is not None and len(src_node.outputs) > 1:
        pairs = [(shard(d), shard(d)) for d, n in enumerate(x.shape) if ctx.ok(n)]  # picks one output
    elif multi:  # split/chunk/unbind: dims other than the split dim carry over
        outs = ctx.node.outputs
        pairs = [(a, b) for a, b in [(shard(i), shard(j)) for i, j in _align(x.shape, outs[0].shape).items()]
                 if all(o.shape == outs[0].shape for o in outs) and ctx.ok(x.shape[parse_placement(a).dim])]
    else:
        pairs = _view_pairs(ctx, x)
    res += [ctx.mk(f"{a}->{b}", {ix: a}, b) for a, b in pairs]
    return res


_DISPATCH: dict[str, Any] = {
    "linear": _linear, "matmul": _matmul, "sdpa": _sdpa, "embedding": _embedding, "conv": None,
    "softmax": _softmax, "log_softmax": _softmax, "cat": _cat, "stack": _cat,
    "clone": _identity_like, "contiguous": _identity_like, "copy": _identity_like,
    "cross_entropy": _loss, "nll_loss": _loss, "mse_loss": _loss,
}
_KIND_DISPATCH: dict[str, Any] = {
    "norm": _norm, "pointwise": _pointwise, "reduction": _reduction, "view": _view,
    "input": _free_source, "creation": _free_source,
}


def _conv(ctx: _Ctx) -> list[Strategy]:
    acts, params = ctx.acts(), ctx.params()
    if len(acts) != 1 or not params or ctx.out is None or (ctx.node.attr("groups") or 1) != 1:
        return []
    ix, iw = acts[0], params[0]
    ib = params[1] if len(params) > 1 else None
    x, w = ctx.metas[ix], ctx.metas[iw]
    assert x is not None and w is not None
    f, res = 1.0 / ctx.t, []
    if ctx.ok(x.shape[0]):
        res.append(ctx.mk("split0", {ix: shard(0)}, shard(0), f))
    if ctx.ok(w.shape[0]):
        res.append(ctx.mk("out_channel", {ix: "R", iw: shard(0)} | ({ib: shard(0)} if ib else {}), shard(1), f))
    if ctx.ok(w.shape[1]):
        res.append(ctx.mk("in_channel", {ix: shard(1), iw: shard(1)}, "P", f, exempt=(ib,) if ib else ()))
    return res


_DISPATCH["conv"] = _conv


# ---- saved activations ----------------------------------------------------------------------------------------
def saved_tensors(graph: Graph, node: Node) -> tuple[SavedTensor, ...]:
    """What autograd keeps for ``node``'s backward (flash/efficient attention: no S^2 score matrix)."""
    op, kind = node.op, node.kind
    metas = [input_meta(graph, node, i) for i in range(len(node.inputs))]
    acts = [i for i, x in enumerate(node.inputs) if x not in node.params and metas[i] is not None]

    def inp(i: int) -> SavedTensor:
        return SavedTensor(i, storage_key(graph, node.inputs[i]) + "@in", metas[i])

    if not node.outputs or kind in ("view", "input", "creation"):
        return ()
    out = SavedTensor(-1, node.name + "@in", node.out)
    if kind in ("matmul", "conv"):
        return tuple(inp(i) for i in acts)
    if kind == "attention":
        q = metas[acts[0]] if acts else None
        lse = float(math.prod(q.shape[:-1]) * 4) if q is not None else 0.0  # fp32 logsumexp per query row
        return (*(inp(i) for i in acts[:3]), out, SavedTensor(-2, node.name + "@lse", None, lse))
    if kind == "norm":
        rows = node.out.numel // max(1, node.out.shape[-1] if node.out.shape else 1)
        nstats = 1 if op == "rms_norm" else 2
        return (*(inp(i) for i in acts[:1]), SavedTensor(-2, node.name + "@stats", None, 4.0 * nstats * rows))
    if kind == "softmax" or op in _SAVE_OUTPUT:
        return (out,)
    if op == "dropout":
        return (SavedTensor(-2, node.name + "@mask", None, float(node.out.numel)),)
    if op in _SAVE_INPUT:
        return tuple(inp(i) for i in acts[:1])
    if op in ("mul", "div"):
        return tuple(inp(i) for i in acts if metas[i] is not None and metas[i].dtype in FLOAT_DTYPES)  # type: ignore
    if kind == "embedding":
        return tuple(inp(i) for i in acts)
    if kind == "loss":
        return tuple(inp(i) for i in acts[:1])
    return ()
