"""vtc_jax: DNN compilation with virtual tensors for data-movement elimination, for JAX.

``optimize(fn)`` returns a jitted function computing the same values with the data-movement ops
(transpose, reshape, slice, concatenate, dynamic_update_slice, broadcast, pad, ...) replaced by
index maps that the neighbouring Pallas kernels read and write through. ``explain(fn)(*args)``
reports what it would do, without running anything.
"""
from . import compat  # noqa: F401  (jax-version shims; filters jax's Pallas Triton deprecation)
from .api import Optimized, VTCError, VTCFallbackWarning, VTCNotice, explain, optimize
from .report import Report

__all__ = ["optimize", "explain", "Optimized", "Report", "VTCError", "VTCFallbackWarning", "VTCNotice"]
__version__ = "0.1.0"
