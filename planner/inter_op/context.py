"""Context parallelism (cp): the sequence of every attention split over ``cp`` ranks, costed per layer group.

Each cp rank holds ``2 cp`` sequence chunks' worth of tokens in two chunks, ``i`` and ``2cp-1-i`` (the causal
load-balanced split of Megatron-LM's context parallelism and of ring attention's "zigzag" layout, Liu et al. 2023,
"Ring Attention with Blockwise Transformers"; Brandon et al. 2023, "Striped Attention"), so that every rank does
``1/cp`` of the causal score blocks.  Every op but attention is token-wise: a rank's FLOPs, bytes, activations and
tensor-parallel collectives are those of ``1/cp`` of the micro-batch's tokens, and attention's FLOPs are ``1/cp`` too
under the balanced split.  A cp rank's table is therefore the intra-op table solved at ``micro_batch / cp`` (every op
costed at the shapes the rank runs: a kernel's launch overhead and its weights' bytes do not shrink with the tokens,
and small GEMMs run at their own efficiency, so scaling the whole micro-batch's times by ``1/cp`` would be optimistic
wherever ops are latency-bound), plus what attention must move to see every key: one of

* ``ring``: ``cp - 1`` steps, each sending a rank's K and V chunk (packed, one p2p) to the next rank while it computes
  the scores of the block it holds; only what a step's transfer outlasts its compute is exposed.  The backward sends
  the K/V gradients back the same way (``cp - 1`` p2p), overlapped with the backward's own block compute;
* ``all_gather``: K and V gathered whole before attention, their gradients reduced (reduce-scatter) after; not
  overlapped, but one collective each, which wins when per-step latency dominates (short chunks, many steps).

Both hold the other ranks' K/V for the backward (``cp - 1`` chunks per attention).  The method is chosen per layer
group by the smaller time, recorded on the attention op's sharding (``comm`` gains ``cp_ring`` or ``cp_all_gather``)
for the runtime (:mod:`autopar.codegen.runtime.context_parallel`).  Parameters, gradients and optimizer state are
whole on every cp rank, so the data-parallel group of gradients and ZeRO is ``dp * cp`` (as Megatron-LM reduces
gradients and shards its distributed optimizer over dp x cp).

Why cp can beat tp at long sequences: tp's per-layer collectives move ``tokens * hidden`` bytes and sit on the
critical path, while attention FLOPs grow with ``tokens^2``: the ring's ``tokens * kv_hidden`` bytes per step hide
behind ``(tokens/cp)^2`` work per step once chunks are long enough, and cp divides activations like tp's sequence
parallelism without tp's collectives.  At short sequences the steps cannot hide their transfers and the parameters
are not sharded, so tp (or data parallelism) wins.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from autopar.ir.graph import DTYPE_BYTES, Graph
from autopar.planner.inter_op.screen import LayerTable
from autopar.planner.intra_op.solve import GroupSolution
from autopar.profiles.cost import CostModel, interp_alpha_beta

__all__ = ["AttentionSite", "attention_sites", "cp_choices", "cp_table", "cp_method", "CP_METHODS", "seq_len",
           "cp_p2p_count"]

CP_METHODS = ("cp_ring", "cp_all_gather")


@dataclass(frozen=True, slots=True)
class AttentionSite:
    """One attention op at the traced batch: its node, FLOPs, sequence and K/V bytes (K and V, whole sequence)."""

    node: str
    group: int
    flops_fwd: float
    flops_bwd: float
    seq: int
    kv_bytes: float
    causal: bool


def attention_sites(graph: Graph) -> tuple[AttentionSite, ...]:
    return _sites(graph)


@lru_cache(maxsize=16)
def _sites(graph: Graph) -> tuple[AttentionSite, ...]:
    out = []
    for gi, g in enumerate(graph.layers):
        for node in graph.nodes[g.start:g.end]:
            if node.op != "sdpa" or len(node.inputs) < 3:
                continue
            k, v = graph.input_meta(node, 1), graph.input_meta(node, 2)
            if k is None or v is None or len(k.shape) != 4:
                continue
            kv = sum(m.numel * DTYPE_BYTES.get(m.dtype, 4) for m in (k, v))
            out.append(AttentionSite(node.name, gi, node.flops_fwd, node.flops_bwd, int(k.shape[-2]), kv,
                                     bool(dict(node.attrs).get("is_causal"))))
    return tuple(out)


def seq_len(graph: Graph) -> int:
    """The attention sequence length (0 when the model has no attention: cp does not apply)."""
    return max((s.seq for s in attention_sites(graph)), default=0)


def _hidden_chunk(graph: Graph, cost: CostModel, tp: int, dtype: str) -> float:
    """Fewest tokens per chunk for which one ring step's attention compute hides its K/V transfer on the fastest
    link (a chunk of ``T`` tokens: compute ``~ T^2``, bytes ``~ T``).  Shorter chunks leave most of the ring exposed
    and are dominated by a smaller cp, so the search does not try them."""
    sites = attention_sites(graph)
    if not sites:
        return float("inf")
    s = sites[0]
    item = DTYPE_BYTES.get(dtype, 4) / 4.0  # the trace is float32; training moves dtype-sized K/V
    per_token_bytes = s.kv_bytes * item / (graph.batch * s.seq) / tp
    per_token2_flops = s.flops_fwd * (0.5 if s.causal else 1.0) / (graph.batch * s.seq * s.seq) / tp
    rate = cost.compute_rate(dtype, "attention", s.flops_fwd)
    link = cost.profile.links.get("intra_node")
    if link is None or per_token2_flops <= 0:
        return float("inf")
    bw = interp_alpha_beta(link.p2p, 2)[1]
    # T^2 * f / rate >= T * b / bw  <=>  T >= b * rate / (f * bw)
    return per_token_bytes * rate / (per_token2_flops * bw)


def cp_choices(graph: Graph, cost: CostModel, rest: int, tp: int, dtype: str, pinned: int | None) -> list[int]:
    """cp degrees to try with ``rest = world / tp`` devices left: the pin, else 1 and every power of two whose
    load-balanced chunks (``seq / 2cp`` tokens) divide the sequence and are long enough to hide a ring step."""
    seq = seq_len(graph)
    if pinned is not None:
        return [pinned] if rest % pinned == 0 and (pinned == 1 or (seq and seq % (2 * pinned) == 0)) else []
    out = [1]
    if not seq:
        return out
    floor = _hidden_chunk(graph, cost, tp, dtype)
    c = 2
    while rest % c == 0 and seq % (2 * c) == 0 and seq / (2 * c) >= floor:
        out.append(c)
        c *= 2
    return out


def _site_times(site: AttentionSite, cost: CostModel, *, cp: int, tp: int, mb_scale: float, dtype: str
                ) -> dict[str, tuple[float, float]]:
    """(forward, backward) exposed seconds of each method for one attention site on one device per micro-batch."""
    item = DTYPE_BYTES.get(dtype, 4) / 4.0
    chunk = site.kv_bytes * item * mb_scale / tp / cp  # this rank's K and V
    work = 0.5 if site.causal else 1.0
    kind, seq = ("causal_attention", site.seq) if site.causal else ("attention", None)
    att_f = cost.op_time(site.flops_fwd * mb_scale * work / tp / cp, 0.0, dtype, kind, seq)
    att_b = cost.op_time(site.flops_bwd * mb_scale * work / tp / cp, 0.0, dtype, kind, seq)
    intra = cp * tp <= cost.profile.devices_per_node
    step = cost.p2p_time(chunk, intra_node=intra)
    sends_f, sends_b = cp_p2p_count(cp)  # what the runtime issues (checked against it by the parity test)
    ring = (sends_f * max(0.0, step - att_f / cp), sends_b * max(0.0, step - att_b / cp))
    span = cost.span(cp, tp)
    gather = (cost.collective_time("all_gather", chunk * cp, span=span),
              cost.collective_time("reduce_scatter", chunk * cp, span=span))
    return {"cp_ring": ring, "cp_all_gather": gather}


def cp_method(site: AttentionSite, cost: CostModel, *, cp: int, tp: int, mb_scale: float, dtype: str
              ) -> tuple[str, float, float]:
    """The cheaper method for ``site`` and its (forward, backward) exposed seconds (ring on ties)."""
    times = _site_times(site, cost, cp=cp, tp=tp, mb_scale=mb_scale, dtype=dtype)
    name = min(CP_METHODS, key=lambda k: (sum(times[k]), CP_METHODS.index(k)))
    return name, *times[name]


def cp_p2p_count(cp: int) -> tuple[int, int]:
    """Ring p2p sends per rank and attention op: (forward, backward)."""
    return cp - 1, cp - 1


def cp_table(graph: Graph, base: LayerTable, cost: CostModel, cp: int, dtype: str, micro_batch: int) -> LayerTable:
    """The table of a rank of a cp group at ``micro_batch``, from ``base``, the intra-op table solved at
    ``micro_batch / cp`` (the rank's tokens: its compute, activations, output bytes and tp collectives), plus each
    attention's K/V exchange (exposed time as tp-like communication on the critical path, the other ranks' K/V held
    for the backward, and the exchange redone by a full recomputation).  Works on a table without its per-group
    solutions (what screening workers hold); with them, each attention op's sharding names its method.  The result
    reports ``micro_batch`` (the sequences a micro-batch holds; each rank holds ``1/cp`` of their tokens)."""
    if cp == 1:
        return base
    tp, mb_scale = base.tp, micro_batch / graph.batch
    item = DTYPE_BYTES.get(dtype, 4) / 4.0
    n = len(base.fwd)
    fwd, bwd, held = [0.0] * n, [0.0] * n, [0.0] * n
    methods: list[list[tuple[str, float, float]]] = [[] for _ in range(n)]
    for s in attention_sites(graph):
        name, f, b = cp_method(s, cost, cp=cp, tp=tp, mb_scale=mb_scale, dtype=dtype)
        fwd[s.group] += f
        bwd[s.group] += b
        held[s.group] += s.kv_bytes * item * mb_scale / tp / cp * (cp - 1)
        methods[s.group].append((name, f, b))
    plus = lambda xs, ys: tuple(x + y for x, y in zip(xs, ys))  # noqa: E731
    act = {"none": plus(base.act["none"], held), "selective": plus(base.act["selective"], held),
           "full": base.act["full"]}
    sols = tuple(_cp_solution(sol, fwd[gi], bwd[gi], held[gi], methods[gi])
                 for gi, sol in enumerate(base.solutions))
    return replace(base, micro_batch=micro_batch, fwd=plus(base.fwd, fwd), bwd=plus(base.bwd, bwd),
                   recompute_fwd={"none": base.recompute_fwd["none"],
                                  "selective": base.recompute_fwd["selective"],
                                  "full": plus(base.recompute_fwd["full"], fwd)},
                   act=act, act_none=act["none"], solutions=sols)


def _cp_solution(sol: GroupSolution, fwd: float, bwd: float, held: float,
                 methods: list[tuple[str, float, float]]) -> GroupSolution:
    new = sol
    if not methods:
        return new
    # the solution may be shared with an identical block solved first: its op names are that block's
    attn = [o.node for o in new.op_shardings if o.op == "sdpa"]
    chosen = {node: m for node, m in zip(attn, methods)}
    ops = tuple(replace(o, comm_s=o.comm_s + chosen[o.node][1] + chosen[o.node][2],
                        comm="+".join(x for x in (o.comm, chosen[o.node][0]) if x))
                if o.node in chosen else o for o in new.op_shardings)
    colls = list(new.collectives) + [(node, d, m[0], t) for node, m in chosen.items()
                                     for d, t in (("fwd", m[1]), ("bwd", m[2]))]
    return replace(new, fwd_comm_s=new.fwd_comm_s + fwd, bwd_comm_s=new.bwd_comm_s + bwd,
                   act_bytes_none=new.act_bytes_none + held, act_bytes_selective=new.act_bytes_selective + held,
                   recompute_fwd_s_full=new.recompute_fwd_s_full + fwd, op_shardings=ops, collectives=tuple(colls))
