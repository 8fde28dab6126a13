"""Sharding rules for ops that compute element by element or along a few dims: norms, pointwise ops, softmax,
reductions and losses.

Every dim an op does not reduce or normalize over can be sharded (inputs broadcast against the output follow it);
ops linear in an operand also run on partial sums (``P`` in, ``P`` out), and ``sum``/``mean`` over a sharded dim
produce partial sums.
"""

from __future__ import annotations

from autopar.ir.graph import FLOAT_DTYPES
from autopar.ir.placement import shard
from autopar.planner.intra_op.strategy import Strategy, _Ctx, _dims

_LINEAR_PW = frozenset({"neg", "cast", "identity", "clone", "contiguous", "copy", "alias", "detach"})
_P_REDUCE = frozenset({"sum", "mean"})
_SCAN_OPS = frozenset({"topk", "sort", "argmax", "argmin", "cumsum", "max", "min", "amax", "amin", "logsumexp",
                       "var", "std", "norm", "prod", "any", "all"})


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
