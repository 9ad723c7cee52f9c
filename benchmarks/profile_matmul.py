"""bf16 4096^3 x @ w.T, nvdnn's heuristic kernel and PyTorch's (cuBLAS), a few times each, for
a profiler to compare the two (the size where nvdnn trails cuBLAS most):

    ncu --clock-control none --launch-skip 6 --launch-count 4 --section SpeedOfLight \
        --section WarpStateStats --section ComputeWorkloadAnalysis python benchmarks/profile_matmul.py
"""
import cupy as cp
import ml_dtypes
import torch

import nvdnn

x = cp.random.standard_normal((4096, 4096), dtype=cp.float32).astype(ml_dtypes.bfloat16)
w = cp.random.standard_normal((4096, 4096), dtype=cp.float32).astype(ml_dtypes.bfloat16)
y = cp.empty_like(x)
xt, wt = (torch.as_tensor(a.view(cp.uint16), device="cuda").view(torch.bfloat16) for a in (x, w))
for _ in range(5):  # rounds 4 and 5 are profiled (nvdnn, then cuBLAS, each round)
    nvdnn.matmul(x, w.T, out=y)
    torch.matmul(xt, wt.t())
torch.cuda.synchronize()
