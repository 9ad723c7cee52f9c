"""Matrix multiply with fused epilogues: y = act(norm(alpha * sa * sb * (A @ B) + bias) + beta * C) [* so],
norm an optional inference batch norm per column (a conv's folded batch_norm, ``Norm``).

A is (..., M, K), B is (..., K, N); batch dims broadcast (NumPy's rule, stride 0 where an operand
is broadcast) and fold into one kernel batch dim. Transposition is strides: A is K-major (row
major, stride of K = 1) or M-major, B K-major (the (N, K) weight of a linear layer) or N-major;
y is written through its strides. Three kernels, one epilogue (templates/common/gemm_epilogue.cuh.j2):

- ``wgmma`` (sm_90a): Hopper's warpgroup MMA on 128-byte-swizzled shared tiles loaded by TMA
  (a tensor map per operand, built at launch: ``TensorMapArg``), a ring of full / empty
  mbarriers, one producer warpgroup and one or two consumer warpgroups, a persistent grid
  walking tiles in groups of ``group_m`` tile rows for L2 reuse. fp16 / bf16 (k16) with A and B
  in either major-ness (wgmma's transpose mode reads M- or N-major tiles), tf32 K-major or with
  an M-major A loaded from its shared tile into registers (so an N-major B runs as y^T = b^T
  a^T: ``planning._transposed_plan``), fp8 e4m3 / e5m2 (k32) K-major; 16-byte aligned strides
  and addresses. A may also be a convolution's
  im2col matrix read in place from the NHWC image by TMA's im2col mode (``Im2colA``: implicit
  GEMM, kernels/conv.py). An operand it cannot read as it
  lies is copied K-major into scratch first (``kernels/repack.py``); exact float32 runs on it as
  3xTF32 (operands split into tf32 hi / lo planes, one tf32 GEMM over 3K, sums drained into
  float32). Tiles by a wave model (``heuristic._wgmma_tile``); split-K (``heuristic.wgmma_walk``):
  the whole waves of tiles whole, the last partial wave's tiles (or, on fewer tiles than SMs,
  all) cut into K ranges walked split by split, and the last range of a tile to finish sums
  the partials and applies the epilogue (common/grid_finish.cuh).
- ``mma`` (sm_80+): mma.sync m16n8k16 (fp16 / bf16) or m16n8k8 (tf32, or exact float32 as
  3xTF32 split in registers) fed by ldmatrix / shared loads from a cp.async multi-stage
  pipeline; any unit-stride layout of A and B read in place, so on Hopper it takes float32
  where wgmma's repacks would cost more than its faster products save (few rows, small
  products, a narrow exact product: ``heuristic.mma_reads_in_place``). Also split-K: fp32 partials in scratch and a
  ``MatmulReduceSpec`` launch that sums them and applies the epilogue.
- ``simt`` (any arch): float32 FMA on any strides and data types; the fallback.
- ``skinny`` (sm_80+, ``SkinnySpec``): decode rows (at most 8, batch folded in) against a weight
  read once, a memory-bound float32-FMA GEMV over either B layout, split over K and finished in
  its own launch (``skinny.py``; heuristic.skinny_rows says when: where it measured ahead).

fp8 inputs are uint8 arrays with a declared type; their per-tensor descale factors (``scale_a``,
``scale_b``) and the fp8 output's scale (``scale_out``) are one-element float32 device tensors;
``amax`` (a one-element float32 tensor) receives max |y| before quantization, reduced per block
and merged with one atomicMax on the float bits (zeroed by the plan's first launch).

The backward (dA, dB, dbias through an activation's derivative) plans these GEMMs over strided
views after one memory-bound dz / dbias pass: ``backward.py``.
"""
from __future__ import annotations

from .backward import MatmulDactSpec, batch_rule, plan_matmul_backward
from .heuristic import split_count
from .planning import Geometry, geometry, output_shape, plan_matmul, pointwise_contiguous
from .tensor_maps import Im2colA, TensorMapArg
from .specs import (EPI_DTYPES, FP8, HALF, IN_DTYPES, OUT_DTYPES, PRECISION_CHOICES, MatmulReduceSpec, MatmulSpec,
                    MatmulZeroSpec, Norm, check_operand_types, check_precision, unsupported_reason)
from .skinny import SkinnySpec
from .tune import candidates, layouts, preset

__all__ = ["EPI_DTYPES", "FP8", "HALF", "IN_DTYPES", "OUT_DTYPES", "PRECISION_CHOICES", "Geometry", "Im2colA",
           "MatmulDactSpec",
           "MatmulReduceSpec", "MatmulSpec", "MatmulZeroSpec", "Norm", "SkinnySpec", "TensorMapArg", "batch_rule",
           "candidates", "check_operand_types", "check_precision", "geometry", "layouts", "output_shape", "plan_matmul",
           "plan_matmul_backward", "pointwise_contiguous", "preset", "split_count", "unsupported_reason"]
