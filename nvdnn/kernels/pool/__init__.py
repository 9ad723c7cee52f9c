"""Pooling: max_pool2d / avg_pool2d forward and backward, global average pool, PyTorch's semantics.

Windows follow torch.nn.functional: the output size with ceil_mode (the last window must start
inside the input or its left padding), padding at most half the kernel, NaN propagating through
max, argmax indices as the flat ``h * W + w`` within the plane (the first maximum, or the last
NaN), avg's count_include_pad and divisor_override (avg takes no dilation). x is (N, C, H, W),
read through its strides; its layout (``layout_of``) picks the kernel: NCHW folds one channel
per thread, NHWC 16-byte vectors of channels. Every output (y, indices, dx) is packed in x's
layout. A window with no tap inside the input (dilation past a one-pixel edge) gives -inf; max
backward refuses such a geometry (PyTorch routes its gradient to an element outside the window).
Backward is a gather (each dx pixel sums the windows that hold it): deterministic, no atomics.
Forward outputs take a pointwise epilogue chain and their own data type.
"""
from __future__ import annotations

from .plans import plan_global_avg_pool2d, plan_pool2d, plan_pool2d_backward
from .specs import (DIVISORS, DTYPES, FIXED, INDEX_DTYPES, KINDS, LAYOUTS, GlobalAvgPoolSpec, Pool2dBackwardSpec,
                    Pool2dSpec)
from .tune import candidates, preset, unsupported_reason
from .window import Geometry, geometry, layout_of, output_size, packed_strides, pool2d_output_shape

__all__ = ["DIVISORS", "DTYPES", "FIXED", "INDEX_DTYPES", "KINDS", "LAYOUTS", "Geometry", "GlobalAvgPoolSpec",
           "Pool2dBackwardSpec", "Pool2dSpec", "candidates", "geometry", "layout_of", "output_size",
           "packed_strides", "plan_global_avg_pool2d", "plan_pool2d", "plan_pool2d_backward",
           "pool2d_output_shape", "preset", "unsupported_reason"]
