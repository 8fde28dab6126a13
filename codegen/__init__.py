"""codegen: doing the plan -- the torch.distributed runtime (:mod:`autopar.codegen.runtime`) and fused Triton
kernels."""
