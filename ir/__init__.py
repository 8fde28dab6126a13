"""autopar's graph IR: what the model computes (trace -> Graph), op rules, the Plan type and its YAML form."""

from autopar.ir.errors import AutoparError, ExampleInputError, IRVerificationError, SchemaError, TraceError
from autopar.ir.graph import DTYPE_BYTES, Graph, LayerGroup, Node, ParamInfo, TensorMeta
from autopar.ir.ops import OpKind
from autopar.ir.passes import Pass, PassOptions, decompose_attention, default_pipeline, group_layers, run_passes
from autopar.ir.placement import Placement, Recompute, Schedule
from autopar.ir.plan import (
                     PLAN_SCHEMA_VERSION,
                     MemoryBreakdown,
                     MeshPlan,
                     OpSharding,
                     ParamSharding,
                     Plan,
                     SolverReport,
                     StagePlan,
                     TimeBreakdown,
                     dump_plan,
                     load_plan,
                     plan_from_yaml,
                     plan_to_yaml,
)
from autopar.ir.trace import TensorSpec, trace
from autopar.ir.verify import verify

__all__ = [
    "AutoparError", "ExampleInputError", "IRVerificationError", "SchemaError", "TraceError",
    "DTYPE_BYTES", "Graph", "LayerGroup", "Node", "ParamInfo", "TensorMeta",
    "OpKind", "Pass", "PassOptions", "decompose_attention", "default_pipeline", "group_layers", "run_passes",
    "TensorSpec", "trace", "verify", "Placement", "Recompute", "Schedule",
    "PLAN_SCHEMA_VERSION", "MemoryBreakdown", "MeshPlan", "OpSharding", "ParamSharding", "Plan", "SolverReport",
    "StagePlan", "TimeBreakdown", "dump_plan", "load_plan", "plan_from_yaml", "plan_to_yaml",
]
