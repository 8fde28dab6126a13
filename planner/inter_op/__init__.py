"""Inter-op planning: everything across layer groups, for one candidate (mesh, micro-batching, schedule, ZeRO,
recomputation) of the outer search.

    screen.py         layer tables from the intra-op solutions; closed-form time and memory of a candidate
    dpcomm.py         data-parallel collectives (FSDP2 units, DDP buckets) and their overlap with compute
    partition.py      the stage partitioner: minmax_partition (screening) and partition_stages (exact, with memory)
    schedule.py       GPipe / 1F1B / interleaved 1F1B simulated event by event
    memory.py         per-device memory: model state by ZeRO level, activations in flight, reserves
    evaluate.py       exact evaluation of a screened candidate and the Plan it becomes
"""

from autopar.planner.inter_op.dpcomm import DpComm, dp_comm
from autopar.planner.inter_op.evaluate import build_plan, evaluate_stages, param_patterns
from autopar.planner.inter_op.memory import (
                                             GiB,
                                             MemoryReserve,
                                             activation_bytes,
                                             fits,
                                             in_flight_microbatches,
                                             korthikanti_layer_activation_bytes,
                                             memory_breakdown,
                                             model_state_bytes,
                                             zero3_transient_bytes,
)
from autopar.planner.inter_op.partition import (
                                             StagePartition,
                                             minmax_partition,
                                             partition_stages,
                                             rank_chunks,
                                             stage_cost,
)
from autopar.planner.inter_op.schedule import (
                                             SCHEDULES,
                                             OpEvent,
                                             ScheduleResult,
                                             chrome_trace,
                                             peak_in_flight,
                                             rank_order,
                                             simulate,
)
from autopar.planner.inter_op.screen import (
                                             ADAM_STEP_BYTES,
                                             Candidate,
                                             LayerTable,
                                             Screened,
                                             divisors,
                                             dp_time,
                                             group_placements,
                                             in_flight,
                                             layer_table,
                                             reserve_for,
                                             screen,
)

__all__ = [
    "Candidate", "LayerTable", "Screened", "layer_table", "screen", "group_placements", "divisors", "in_flight",
    "reserve_for", "dp_time", "ADAM_STEP_BYTES", "DpComm", "dp_comm",
    "StagePartition", "minmax_partition", "partition_stages", "stage_cost", "rank_chunks",
    "OpEvent", "ScheduleResult", "SCHEDULES", "rank_order", "simulate", "peak_in_flight", "chrome_trace",
    "GiB", "MemoryReserve", "model_state_bytes", "zero3_transient_bytes", "in_flight_microbatches",
    "activation_bytes", "memory_breakdown", "fits", "korthikanti_layer_activation_bytes",
    "build_plan", "evaluate_stages", "param_patterns",
]
