"""codegen: doing the plan -- the torch.distributed runtime (:mod:`codegen.runtime`) and fused Triton kernels."""
