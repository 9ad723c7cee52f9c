"""Run the memory-bound kernels still short of their targets a few times, for a profiler to
pick up: bias+GELU and GELU (bf16 16384x4096), batch-norm inference + ReLU (fp16 NHWC
32x256x56x56). Three warm-up rounds (planning, module load), then the profiled round:

    ncu --clock-control none --kernel-name regex:nvdnn_ --launch-skip 9 --launch-count 3 \
        --section SpeedOfLight --section Occupancy --section WarpStateStats \
        --section MemoryWorkloadAnalysis python benchmarks/profile_kernels.py
"""
import cupy as cp
import ml_dtypes

import nvdnn

x = cp.random.standard_normal((16384, 4096), dtype=cp.float32).astype(ml_dtypes.bfloat16)
b = cp.random.standard_normal(4096, dtype=cp.float32).astype(ml_dtypes.bfloat16)
y = cp.empty_like(x)
n, c, h, w = 32, 256, 56, 56
xb = cp.random.standard_normal((n, h, w, c), dtype=cp.float32).astype(cp.float16).transpose(0, 3, 1, 2)
stats = [cp.random.uniform(0.5, 1.5, c, dtype=cp.float32) for _ in range(4)]
yb = cp.empty((n, h, w, c), dtype=cp.float16).transpose(0, 3, 1, 2)
for _ in range(4):  # the fourth round is the profiled one
    nvdnn.bias_act(x, b, "gelu", layout="NHWC", out=y)
    nvdnn.gelu(x, out=y)
    nvdnn.batch_norm(xb, stats[0], stats[1], stats[2], stats[3], activation="relu", out=yb)
cp.cuda.Device().synchronize()
