"""Pointwise kernels, nvdnn vs PyTorch in one process on the same inputs.

    python benchmarks/bench_pointwise.py [--json FILE]

Effective bandwidth counts each input read once and the output written once.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COPY_CEILING_TBS, host_us_per_call, sets_for, start, table, tile_row, time_ms,  # noqa: E402
                    write_json)
from compile_times import compile_and_disk_times, memory_hit_us  # noqa: E402

import nvdnn  # noqa: E402

RESNET = [  # conv outputs of DESIGN.md's ResNet-50 layers, N = 32: (C, H, W)
    ("conv1 7x7/2 ->64@112", 64, 112, 112), ("3x3 64@56", 64, 56, 56), ("1x1 ->256@56", 256, 56, 56),
    ("3x3 128@28", 128, 28, 28), ("3x3 256@14", 256, 14, 14)]


def _inputs(shape, dtype, bias_len, count):
    import cupy
    host = nvdnn.dtypes.BY_NAME[dtype].np
    xs = [cupy.asarray(np.random.default_rng(i).standard_normal(shape, dtype=np.float32).astype(host))
          for i in range(count)]
    b = cupy.asarray(np.random.default_rng(99).standard_normal(bias_len, dtype=np.float32).astype(host))
    return xs, b


def bench_case(name, shape, dtype, activation, layout, torch):
    """Time nvdnn and torch on one workload; check they agree."""
    import cupy
    itemsize = nvdnn.dtypes.BY_NAME[dtype].itemsize
    nbytes = int(np.prod(shape)) * itemsize
    channels = None if layout is None else (shape[1] if layout == "NCHW" else shape[-1])
    count = sets_for(2 * nbytes)
    xs, b = _inputs(shape, dtype, channels or 1, count)
    ys = [cupy.empty_like(x) for x in xs]
    if layout is None:
        run = {"gelu": nvdnn.gelu}[activation]
        ours = lambda i: run(xs[i], out=ys[i])  # noqa: E731
        moved = 2 * nbytes
    else:
        ours = lambda i: nvdnn.bias_act(xs[i], b, activation, layout=layout, out=ys[i])  # noqa: E731
        moved = 2 * nbytes + channels * itemsize
    t_ours = time_ms(ours, count)
    row = {"workload": name, "dtype": dtype, "nvdnn_us": f"{t_ours * 1e3:.1f}",
           "nvdnn_TB/s": f"{moved / (t_ours * 1e-3) / 1e12:.2f}",
           "of_ceiling": f"{moved / (t_ours * 1e-3) / 1e12 / COPY_CEILING_TBS:.0%}"}
    if torch is not None:
        F = torch.nn.functional
        tx = [torch.from_dlpack(x) for x in xs]
        tb = torch.from_dlpack(b)
        if layout == "NCHW":
            tb = tb.view(channels, *([1] * (len(shape) - 2)))
        act = {"gelu": F.gelu, "relu": F.relu}[activation]
        theirs = (lambda i: act(tx[i])) if layout is None else (lambda i: act(tx[i] + tb))
        t_theirs = time_ms(theirs, count)
        got = torch.from_dlpack(ys[0]).float()
        want = theirs(0).float()
        err = float((got - want).abs().max())
        row.update({"torch_us": f"{t_theirs * 1e3:.1f}", "torch_TB/s": f"{moved / (t_theirs * 1e-3) / 1e12:.2f}",
                    "speedup": f"{t_theirs / t_ours:.2f}x", "max_diff": f"{err:.2g}"})
    del xs, ys
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def tune_table(torch):
    """Every tile candidate of the big workloads, through Graph.autotune (recorded for later builds)."""
    rows = []
    cases = [("GELU", "bfloat16", (16384, 4096), None), ("bias+GELU", "bfloat16", (16384, 4096), (1, 4096)),
             ("bias+ReLU NCHW 1x1 ->256@56", "float32", (32, 256, 56, 56), (1, 256, 1, 1))]
    for name, dtype, shape, bias_shape in cases:
        g = nvdnn.Graph(io_data_type=dtype, name=name)
        x = g.tensor(dims=list(shape), name="x")
        if bias_shape is None:
            g.gelu(x, name="y").set_output(True)
        else:
            b = g.tensor(dims=list(bias_shape), name="b")
            (g.gelu if "GELU" in name else g.relu)(g.add(x, b), name="y").set_output(True)
        g.build()
        pack = {t.name: _inputs(tuple(t.dims), dtype, 1, 1)[0][0] for t in g._io}
        moved = sum(a.nbytes for a in pack.values())
        report = g.autotune(pack)[0]
        for tile, ms in sorted(report["timings_ms"].items(), key=lambda kv: kv[1]):
            rows.append(tile_row(tile, tile == report["heuristic"], ms, moved, workload=name))
    return rows


def host_overhead(torch):
    """Host time per call when the GPU is not the bottleneck (tiny tensor, no sync)."""
    import cupy
    x = cupy.asarray(np.random.default_rng(0).standard_normal(1024).astype(np.float32))
    y = cupy.empty_like(x)
    per_call = host_us_per_call

    raw = cupy.RawKernel(r'''extern "C" __global__ void k(float* y, const float* x, int n) {
        int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < n) y[i] = x[i] > 0 ? x[i] : 0; }''', "k")
    n32 = np.int32(x.size)
    rows = {"nvdnn.gelu(x, out=y)": per_call(lambda: nvdnn.gelu(x, out=y)),
            "nvdnn.gelu(x)": per_call(lambda: nvdnn.gelu(x)),
            "nvdnn.bias_act(x2d, b, relu, NHWC)": None,
            "cupy RawKernel launch": per_call(lambda: raw((4,), (256,), (y, x, n32)))}
    x2 = x.reshape(16, 64)
    b = x[:64]
    rows["nvdnn.bias_act(x2d, b, relu, NHWC)"] = per_call(lambda: nvdnn.bias_act(x2, b, "relu", layout="NHWC"))
    if torch is not None:
        tx = torch.from_dlpack(x)
        rows["torch F.gelu(x)"] = per_call(lambda: torch.nn.functional.gelu(tx))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    args, torch, device, copy = start(parser)
    tuned = tune_table(torch)
    print(table(tuned, ["workload", "tile", "us", "TB/s"]))
    rows = [bench_case("GELU 16384x4096", (16384, 4096), "bfloat16", "gelu", None, torch),
            bench_case("bias+GELU 16384x4096", (16384, 4096), "bfloat16", "gelu", "NHWC", torch)]
    for name, c, h, w in RESNET:
        rows.append(bench_case(f"bias+ReLU NHWC {name}", (32, h, w, c), "float16", "relu", "NHWC", torch))
        rows.append(bench_case(f"bias+ReLU NCHW {name}", (32, c, h, w), "float32", "relu", "NCHW", torch))
    print(table(rows, ["workload", "dtype", "nvdnn_us", "nvdnn_TB/s", "of_ceiling", "torch_us", "torch_TB/s",
                       "speedup", "max_diff"]))
    overhead = host_overhead(torch)
    overhead["in-memory cache hit, KernelCache.get"] = memory_hit_us()
    print("\nhost time per call (us):")
    for k, v in overhead.items():
        print(f"  {k:48s} {v:8.2f}")
    compile_rows = compile_and_disk_times(runs=3)
    print("\ncompile and cache times on this machine's CPU:")
    for k, v in compile_rows.items():
        print(f"  {k:48s} {v:8.2f}")
    overhead.update(compile_rows)
    write_json(args.json, device=device, copy_tbs=copy, rows=rows, tuning=tuned, host_us=overhead)


if __name__ == "__main__":
    main()
