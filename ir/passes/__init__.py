"""IR passes, each a pure function ``Graph -> Graph``, run in the order of one pipeline
(:mod:`autopar.ir.passes.pipeline`): capture -> group -> decompose -> fuse, with ``autopar.ir.verify`` after each."""

from autopar.ir.passes.decompose import decompose_attention
from autopar.ir.passes.fuse import FusionGroup, apply_fused_bytes, fused_bytes_saved, fusion_groups
from autopar.ir.passes.group import block_key, group_layers, structural_hash
from autopar.ir.passes.patterns import KERNEL_KINDS, Match, NodeView, match_patterns
from autopar.ir.passes.pipeline import PIPELINE, Pass, PassOptions, default_pipeline, run_passes, verify_after

__all__ = [
    "decompose_attention", "FusionGroup", "apply_fused_bytes", "fused_bytes_saved", "fusion_groups",
    "block_key", "group_layers", "structural_hash", "KERNEL_KINDS", "Match", "NodeView", "match_patterns",
    "PIPELINE", "Pass", "PassOptions", "default_pipeline", "run_passes", "verify_after",
]
