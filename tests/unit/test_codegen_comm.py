"""Communication check: under tp the collectives DTensor issues per block forward equal what the plan's op shardings
say (their ``comm`` fields), counted with CommDebugMode on a fake process group (one process, no spawn)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor.debug import CommDebugMode

from autopar import ir
from autopar.codegen.runtime.program import build_program
from autopar.codegen.runtime.tensor_parallel import expand_op_shardings
from autopar.zoo import build

from harness import make_plan


def _predicted(plan: ir.Plan, graph: ir.Graph, block: ir.LayerGroup) -> dict[str, int]:
    ops = expand_op_shardings(plan, graph)
    counts: dict[str, int] = {}
    for n in graph.group_nodes(block):
        op = ops.get(n.name)
        for c in (op.comm.split("+") if op is not None and op.comm else []):
            counts[c] = counts.get(c, 0) + 1
    return counts


def _name(op: object) -> str:
    return str(op).split(".")[-1].rstrip("_").replace("allreduce", "all_reduce")


def _per_group(stage: torch.nn.Module, cm: CommDebugMode) -> dict[int, dict[str, int]]:
    """Install hooks that record the collectives issued inside each layer-group module's forward."""
    seen: dict[int, dict[str, int]] = {}
    before: dict[int, dict[str, int]] = {}

    def snap() -> dict[str, int]:
        return {_name(k): v for k, v in cm.get_comm_counts().items()}

    for i, g in enumerate(stage.groups):
        g.register_forward_pre_hook(lambda m, a, i=i: before.__setitem__(i, snap()))
        g.register_forward_hook(lambda m, a, o, i=i: seen.__setitem__(
            i, {k: v - before[i].get(k, 0) for k, v in snap().items() if v - before[i].get(k, 0)}))
    return seen


@pytest.mark.parametrize("model", ["gpt-tiny", "llama-tiny"])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_collectives_per_block_match_plan(fake_world, model: str, tp: int) -> None:
    fake_world(tp)
    spec = build(model, batch=4, device="cpu", seq=16, seed=0)
    graph = ir.trace(spec.model, spec.example_inputs, frontend="fx")
    if model == "llama-tiny" and tp == 4:
        with pytest.raises(ValueError, match="kv|heads"):
            build_program(make_plan(graph, tp=tp, micro_batch=4), spec, graph=graph)
        return
    plan = make_plan(graph, tp=tp, micro_batch=4)
    prog = build_program(plan, spec, graph=graph)
    stage = prog.stages[0]
    cm = CommDebugMode()
    measured = _per_group(stage, cm)
    with cm, torch.no_grad():
        from autopar.codegen.runtime.tensor_parallel import implicit_replication

        with implicit_replication():
            stage(*spec.example_inputs)
    blocks = graph.blocks()
    for i, block in enumerate(blocks):
        predicted = _predicted(plan, graph, block)
        assert predicted == {"all_reduce": 2}, predicted  # Megatron: one after attention, one after the MLP
        assert measured[block.index] == predicted, (i, measured)
    # nothing else communicates in forward: embeddings, head and boundaries are replicated
    total = sum(cm.get_comm_counts().values())
    assert total == 2 * len(blocks)
