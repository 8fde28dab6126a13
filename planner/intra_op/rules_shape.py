"""Sharding rules for ops that move data without computing on it: views and reshapes, concatenation, identity-like
copies, and the sources (inputs, creation ops) that can produce any slice of a value locally.

The core is :func:`reshape_pairs`: which placements map onto each other through a reshape (dims grouped into runs of
equal products; a shard of one run maps to a shard of the other when the elements outside the sharded factor agree).
Permutations map ``S(p)`` to ``S(i)``; indexing and slicing views keep the dims they carry over (:func:`_align`).
"""

from __future__ import annotations

import math
from typing import Sequence

from autopar.ir.graph import FLOAT_DTYPES, Node, TensorMeta
from autopar.ir.placement import parse_placement, shard
from autopar.planner.intra_op.strategy import Strategy, _Ctx, _dims

__all__ = ["reshape_pairs"]


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


def _free_source(ctx: _Ctx) -> list[Strategy]:
    """input/creation: every rank can produce any slice of the value locally."""
    assert ctx.out is not None
    return [ctx.mk(f"S({d})", {}, shard(d), 1.0 / ctx.t, default=None)
            for d, n in enumerate(ctx.out.shape) if ctx.ok(n)]


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
