"""Compile-and-launch for generated Triton kernels: on-disk content-hash cache (:mod:`.cache`), launchers
(:mod:`.launch`), and autograd wrappers with the functional API the rewritten programs call (:mod:`.autograd`)."""

from autopar.codegen.kernels.autograd import (
                                      eager_add_norm,
                                      eager_bias_act,
                                      eager_softmax,
                                      eager_swiglu,
                                      fused_add_norm,
                                      fused_bias_act,
                                      fused_dropout,
                                      fused_softmax,
                                      fused_swiglu,
                                      use_triton,
)
from autopar.codegen.kernels.cache import cache_dir, load_kernels, load_source

__all__ = ["fused_bias_act", "fused_swiglu", "fused_add_norm", "fused_softmax", "fused_dropout", "eager_bias_act",
           "eager_swiglu", "eager_add_norm", "eager_softmax", "use_triton", "cache_dir", "load_kernels",
           "load_source"]
