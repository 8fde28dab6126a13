"""Sharding rules for the ops that carry the FLOPs: linear, matmul, attention (sdpa), embedding and convolution.

Linear finds Megatron's column- and row-parallel splits (Shoeybi et al. 2019); when the output is reshaped into
``[k, ...]`` parts right after (a fused qkv) or the input comes from such a reshape, the interleaved variants
``column[k=..]``/``row[k=..]`` shard each part so every rank owns whole heads. Attention shards heads or batch,
embedding the vocabulary (partial output) or the hidden dim, convolution the batch or the output/input channels.
"""

from __future__ import annotations

from autopar.ir.placement import parse_placement, shard
from autopar.planner.intra_op.rules_shape import reshape_pairs
from autopar.planner.intra_op.strategy import Strategy, _Ctx


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
        src = ctx.graph.input_meta(p, 0) if p.inputs else None
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
