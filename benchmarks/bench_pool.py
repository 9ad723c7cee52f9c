"""Pooling kernels, nvdnn vs PyTorch in one process on the same inputs.

    python benchmarks/bench_pool.py [--json FILE]

Effective bandwidth counts each input read once and each output written once. The first table
times every tile candidate of the target workload (max 3x3/2 pad 1, fp16 NHWC, 32x64x112x112).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COPY_CEILING_TBS, sets_for, start, table, tile_row, time_ms, write_json  # noqa: E402

from nvdnn import dtypes, launcher  # noqa: E402
from nvdnn.kernels import pool  # noqa: E402
from nvdnn.kernels.pointwise import Operand  # noqa: E402

TARGET = (32, 64, 112, 112)


def _nchw_view(stored, layout):
    return stored if layout == "NCHW" else stored.transpose(0, 3, 1, 2)


def _array(shape, dtype, layout, seed):
    import cupy
    n, c, h, w = shape
    stored = (n, c, h, w) if layout == "NCHW" else (n, h, w, c)
    host = np.random.default_rng(seed).standard_normal(stored, dtype=np.float32).astype(dtypes.BY_NAME[dtype].np)
    return _nchw_view(cupy.asarray(host), layout)


def _empty(shape, dtype, layout):
    import cupy
    n, c, h, w = shape
    return _nchw_view(cupy.empty((n, c, h, w) if layout == "NCHW" else (n, h, w, c),
                                 dtype=dtypes.BY_NAME[dtype].np), layout)


def _operand(a, dtype):
    return Operand(dtype, tuple(a.shape), tuple(s // a.dtype.itemsize for s in a.strides), 16)


def _rate(nbytes, ms):
    return nbytes / (ms * 1e-3) / 1e12


def bench_case(name, op, shape, dtype, layout, torch, **options):
    """Time one op (forward max/avg, max backward from indices, global avg) against torch."""
    import cupy
    itemsize = dtypes.BY_NAME[dtype].itemsize
    window = (3, 2, 1)
    out_shape = (shape[0], shape[1], 1, 1) if op == "global_avg" else pool.pool2d_output_shape(shape, *window)
    read = int(np.prod(shape if op != "max_backward" else out_shape)) * itemsize
    written = int(np.prod(out_shape if op != "max_backward" else shape)) * itemsize
    if op == "max_backward":
        read += int(np.prod(out_shape)) * 8  # int64 indices
    if options.get("return_indices"):
        written += int(np.prod(out_shape)) * 8
    count = sets_for(read + written)
    xs = [_array(shape if op != "max_backward" else out_shape, dtype, layout, i) for i in range(count)]
    if op in ("max", "avg"):
        plan = pool.plan_pool2d(op, _operand(xs[0], dtype), *window, **options)
        ys = [_empty(out_shape, dtype, layout) for _ in range(count)]
        idx = [_empty(out_shape, "int64", layout) for _ in range(count)] if options.get("return_indices") else None
        tensors = [{"y": ys[i], "x": xs[i], **({"indices": idx[i]} if idx else {})} for i in range(count)]
    elif op == "max_backward":
        h, w = shape[2:]
        flat = cupy.random.randint(0, h * w, size=out_shape).astype(cupy.int64)  # any valid index: same traffic
        ind = _empty(out_shape, "int64", layout)
        ind[...] = flat
        plan = pool.plan_pool2d_backward("max", _operand(xs[0], dtype), shape, *window,
                                         indices=_operand(ind, "int64"))
        tensors = [{"dx": _empty(shape, dtype, layout), "dy": xs[i], "indices": ind} for i in range(count)]
    else:
        plan = pool.plan_global_avg_pool2d(_operand(xs[0], dtype))
        tensors = [{"y": cupy.empty(out_shape, dtype=dtypes.BY_NAME[dtype].np), "x": xs[i]} for i in range(count)]
    workspace = cupy.empty(max(1, launcher.scratch_layout(plan)[1]), dtype=cupy.uint8)
    ms = time_ms(lambda i: launcher.run(plan, tensors[i], workspace=workspace), count)
    moved = read + written
    row = {"workload": name, "dtype": dtype, "layout": layout, "MB": f"{moved / 1e6:.1f}",
           "nvdnn_us": f"{ms * 1e3:.1f}", "nvdnn_TB/s": f"{_rate(moved, ms):.2f}",
           "of_ceiling": f"{_rate(moved, ms) / COPY_CEILING_TBS:.0%}",
           "spec": plan.launches[0].spec.uri}
    if torch is not None:
        F = torch.nn.functional
        txs = [torch.from_dlpack(x) for x in xs]
        if op == "max":
            with_indices = bool(options.get("return_indices"))
            theirs = lambda i: F.max_pool2d(txs[i], *window, return_indices=with_indices)  # noqa: E731
        elif op == "avg":
            theirs = lambda i: F.avg_pool2d(txs[i], *window)  # noqa: E731
        elif op == "max_backward":
            tind = torch.from_dlpack(ind)
            theirs = lambda i: torch.ops.aten.max_pool2d_with_indices_backward(  # noqa: E731
                txs[i], torch.empty(shape, dtype=txs[i].dtype, device="cuda",
                                    memory_format=torch.channels_last if layout == "NHWC" else torch.contiguous_format),
                [3, 3], [2, 2], [1, 1], [1, 1], False, tind)
        else:
            theirs = lambda i: F.adaptive_avg_pool2d(txs[i], 1)  # noqa: E731
        t_ms = time_ms(theirs, count)
        row.update({"torch_us": f"{t_ms * 1e3:.1f}", "torch_TB/s": f"{_rate(moved, t_ms):.2f}",
                    "speedup": f"{t_ms / ms:.2f}x"})
        if op in ("max", "avg", "global_avg"):
            launcher.run(plan, tensors[0], workspace=workspace)
            got = torch.from_dlpack(tensors[0]["y"]).float()
            want = theirs(0)
            want = (want[0] if isinstance(want, tuple) else want).float()
            row["max_diff"] = f"{float((got - want).abs().max()):.2g}"
    xs.clear(), tensors.clear()  # free the inputs before the next workload
    cupy.get_default_memory_pool().free_all_blocks()
    return row


def tile_sweep():
    """Every tile candidate of the target workload."""
    import cupy
    count = sets_for(64 << 20)
    xs = [_array(TARGET, "float16", "NHWC", i) for i in range(count)]
    out_shape = pool.pool2d_output_shape(TARGET, 3, 2, 1)
    ys = [_empty(out_shape, "float16", "NHWC") for _ in range(count)]
    moved = xs[0].nbytes + ys[0].nbytes
    base = pool.plan_pool2d("max", _operand(xs[0], "float16"), 3, 2, 1).launches[0].spec
    rows = []
    for tile in pool.candidates(base):
        plan = pool.plan_pool2d("max", _operand(xs[0], "float16"), 3, 2, 1, tile=tile)
        ms = time_ms(lambda i: launcher.run(plan, {"y": ys[i], "x": xs[i]}), count)
        rows.append(tile_row(f"b{tile.block} m{tile.min_blocks} t{tile.th}x{tile.tw}", tile == base, ms, moved))
    xs.clear(), ys.clear()
    cupy.get_default_memory_pool().free_all_blocks()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    args, torch, device, copy = start(parser)
    sweep = tile_sweep()
    print(table(sweep, ["tile", "us", "TB/s"]))
    rows = []
    for dtype in ("float16", "bfloat16", "float32"):
        rows.append(bench_case("max 3x3/2 p1 (target)", "max", TARGET, dtype, "NHWC", torch))
    rows += [bench_case("max 3x3/2 p1", "max", TARGET, "float16", "NCHW", torch),
             bench_case("max 3x3/2 p1 +indices", "max", TARGET, "float16", "NHWC", torch, return_indices=True),
             bench_case("avg 3x3/2 p1", "avg", TARGET, "float16", "NHWC", torch),
             bench_case("max backward (indices)", "max_backward", TARGET, "float16", "NHWC", torch),
             bench_case("global avg 32x2048x7x7", "global_avg", (32, 2048, 7, 7), "float16", "NHWC", torch),
             bench_case("global avg 32x2048x7x7", "global_avg", (32, 2048, 7, 7), "float16", "NCHW", torch),
             bench_case("global avg 1x64x112x112 (split)", "global_avg", (1, 64, 112, 112), "float16", "NHWC", torch)]
    print(table(rows, ["workload", "dtype", "layout", "MB", "nvdnn_us", "nvdnn_TB/s", "of_ceiling", "torch_us",
                       "torch_TB/s", "speedup", "max_diff", "spec"]))
    write_json(args.json, device=device, copy_tbs=copy, tiles=sweep, rows=rows)


if __name__ == "__main__":
    main()
