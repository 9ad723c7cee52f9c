"""Reductions and channel norms, nvdnn vs PyTorch in one process on the same inputs.

    python benchmarks/bench_reduce.py [--json FILE]

Effective bandwidth counts each input read once and each output written once (statistics
passes re-read x: their time is in the number, not their bytes).
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (COPY_CEILING_TBS, graph_ms, sets_for, start, table, tile_row, time_ms,  # noqa: E402
                    torch_graph_ms, write_json)

from nvdnn import dtypes, launcher  # noqa: E402
from nvdnn.kernels import batchnorm as bn  # noqa: E402
from nvdnn.kernels import reduce as R  # noqa: E402
from nvdnn.kernels.pointwise import Operand  # noqa: E402


def operand(a) -> Operand:
    align = 16
    while a.data.ptr % align:
        align //= 2
    return Operand(dtypes.of_array(a, arg="x").name, tuple(a.shape), tuple(s // a.itemsize for s in a.strides), align)


def _nhwc(cupy, shape, dtype, seed):
    n, c, h, w = shape
    host = np.random.default_rng(seed).standard_normal((n, h, w, c), dtype=np.float32)
    return cupy.asarray(host.astype(dtypes.BY_NAME[dtype].np)).transpose(0, 3, 1, 2)


def _nchw(cupy, shape, dtype, seed):
    host = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32)
    return cupy.asarray(host.astype(dtypes.BY_NAME[dtype].np))


def _row(name, dtype, moved, t_ours, t_theirs=None, diff=None):
    tbs = moved / (t_ours * 1e-3) / 1e12
    row = {"workload": name, "dtype": dtype, "MB": f"{moved / 1e6:.1f}", "nvdnn_us": f"{t_ours * 1e3:.1f}",
           "nvdnn_TB/s": f"{tbs:.2f}", "of_ceiling": f"{tbs / COPY_CEILING_TBS:.0%}"}
    if t_theirs is not None:
        row.update({"torch_us": f"{t_theirs * 1e3:.1f}", "torch_TB/s": f"{moved / (t_theirs * 1e-3) / 1e12:.2f}",
                    "speedup": f"{t_theirs / t_ours:.2f}x", "max_diff": f"{diff:.2g}"})
    return row


def bench_reduction(name, opname, shape, axes, dtype, torch):
    import cupy
    item = dtypes.BY_NAME[dtype].itemsize
    count = sets_for(math.prod(shape) * item)
    xs = [_nchw(cupy, shape, dtype, i) for i in range(count)]
    norm = R.normalize_axes(axes, len(shape))
    out_shape = R.output_shape(shape, norm) or (1,)
    ys = [cupy.empty(out_shape, dtype=xs[0].dtype) for _ in xs]
    plan = R.plan_reduce(opname, operand(xs[0]), axes)
    _, size = launcher.scratch_layout(plan)
    work = cupy.empty(max(size, 1), dtype=cupy.uint8)
    ours = lambda i: launcher.run(plan, {"y": ys[i], "x": xs[i]}, workspace=work)  # noqa: E731
    moved = math.prod(shape) * item + math.prod(out_shape) * item
    t_ours = time_ms(ours, count)
    if torch is None:
        return _row(name, dtype, moved, t_ours)
    tx = [torch.from_dlpack(x) for x in xs]
    dims = list(norm)
    fns = {"sum": lambda t: t.sum(dims), "mean": lambda t: t.mean(dims), "amax": lambda t: t.abs().amax(dims),
           "max": lambda t: t.amax(dims), "norm2": lambda t: torch.linalg.vector_norm(t, 2, dims)}
    theirs = lambda i: fns[opname](tx[i])  # noqa: E731
    t_theirs = time_ms(theirs, count)
    ours(0)
    diff = float((torch.from_dlpack(ys[0]).float().reshape(-1) - theirs(0).float().reshape(-1)).abs().max())
    return _row(name, dtype, moved, t_ours, t_theirs, diff)


def _bn_inputs(cupy, mode, shape, layout, dtype):
    """Rotating input sets of one batch-norm workload: (count, xs, ys, the other tensors)."""
    n_elem = math.prod(shape)
    count = sets_for(2 * n_elem * dtypes.BY_NAME[dtype].itemsize)
    make = _nhwc if layout == "NHWC" else _nchw
    xs = [make(cupy, shape, dtype, i) for i in range(count)]
    if layout == "NHWC":  # y in x's memory order
        ys = [cupy.empty((shape[0], *shape[2:], shape[1]), dtype=x.dtype).transpose(0, 3, 1, 2) for x in xs]
    else:
        ys = [cupy.empty_like(x) for x in xs]
    c = shape[1]
    rng = np.random.default_rng(5)
    mean, var, gamma, beta = (cupy.asarray(rng.uniform(lo, hi, c).astype(np.float32))
                              for lo, hi in ((-1, 1), (0.5, 2), (0.5, 2), (-1, 1)))
    if mode == "inference":
        extra = {"mean": mean, "var": var, "gamma": gamma, "beta": beta}
    elif mode == "training":
        extra = {"gamma": gamma, "beta": beta, "running_mean": mean.copy(), "running_var": var.copy(),
                 "saved_mean": cupy.empty(c, np.float32), "saved_invstd": cupy.empty(c, np.float32)}
    else:
        extra = {"gamma": gamma, "beta": beta}
    return count, xs, ys, extra


RELU = ([("relu", "")], (0.0, math.inf))


def _bn_plan(mode, x, c, tile=None):
    vec = Operand("float32", (c,), (1,), 16)
    if mode == "inference":
        return bn.plan_batch_norm_inference(x, vec, vec, vec, vec, eps=1e-5, epilogue=RELU[0], params=RELU[1],
                                            tile=tile)
    if mode == "training":
        return bn.plan_batch_norm_training(x, vec, vec, vec, vec, eps=1e-5, momentum=0.1, epilogue=RELU[0],
                                           params=RELU[1])
    return bn.plan_group_norm(x, 32, vec, vec, eps=1e-5, epilogue=RELU[0], params=RELU[1])  # 32 groups


def _time_plan(cupy, plan, count, xs, ys, extra):
    _, size = launcher.scratch_layout(plan)
    work = cupy.empty(max(size, 1), dtype=cupy.uint8)
    ours = lambda i: launcher.run(plan, {"y": ys[i], "x": xs[i], **extra}, workspace=work)  # noqa: E731
    return ours, time_ms(ours, count)


def bench_batch_norm(name, mode, shape, layout, dtype, torch):
    import cupy
    count, xs, ys, extra = _bn_inputs(cupy, mode, shape, layout, dtype)
    moved = 2 * math.prod(shape) * dtypes.BY_NAME[dtype].itemsize
    ours, t_ours = _time_plan(cupy, _bn_plan(mode, operand(xs[0]), shape[1]), count, xs, ys, extra)
    if torch is None:
        return _row(name, dtype, moved, t_ours)
    F = torch.nn.functional
    fmt = torch.channels_last if layout == "NHWC" else torch.contiguous_format
    tx = [torch.from_dlpack(x).contiguous(memory_format=fmt) for x in xs]
    tg, tb = (torch.from_dlpack(extra[k]) for k in ("gamma", "beta"))
    if mode == "inference":
        tm, tv = (torch.from_dlpack(extra[k]) for k in ("mean", "var"))
        theirs = lambda i: F.relu(F.batch_norm(tx[i], tm, tv, tg, tb, False, 0.1, 1e-5))  # noqa: E731
    elif mode == "training":
        trm, trv = (torch.from_dlpack(extra[k]).clone() for k in ("running_mean", "running_var"))
        theirs = lambda i: F.relu(F.batch_norm(tx[i], trm, trv, tg, tb, True, 0.1, 1e-5))  # noqa: E731
    else:
        tg, tb = tg.to(tx[0].dtype), tb.to(tx[0].dtype)  # PyTorch's group_norm wants x's type for both
        theirs = lambda i: F.relu(F.group_norm(tx[i], 32, tg, tb, 1e-5))  # noqa: E731
    t_theirs = time_ms(theirs, count)
    ours(0)
    diff = float((torch.from_dlpack(ys[0]).float() - theirs(0).float()).abs().max())
    row = _row(name, dtype, moved, t_ours, t_theirs, diff)
    if mode == "inference":  # both again inside CUDA graphs (no launch gaps)
        g_ours, g_theirs = graph_ms(ours, count), torch_graph_ms(torch, theirs, count)
        row.update({"graph_us": f"{g_ours * 1e3:.1f}", "graph_TB/s": f"{moved / (g_ours * 1e-3) / 1e12:.2f}",
                    "torch_graph_us": f"{g_theirs * 1e3:.1f}", "graph_speedup": f"{g_theirs / g_ours:.2f}x"})
    return row


BN_TARGET = (32, 256, 56, 56)  # NHWC inference + ReLU: x read once, y written once (fp16: 102.8 MB)
SWEEP_DTYPES = ("float16", "bfloat16", "float32")


def bn_sweep_specs(dtype):
    """The heuristic's affine spec of the batch-norm target and every tile candidate of it."""
    x = Operand(dtype, BN_TARGET, (math.prod(BN_TARGET[1:]), 1, BN_TARGET[3] * BN_TARGET[1], BN_TARGET[1]))
    base = _bn_plan("inference", x, BN_TARGET[1]).launches[0].spec
    return base, list(dict.fromkeys([base, *bn.candidates(base)]))


def bn_tile_sweep(torch, dtype):
    """Every tile candidate of the batch-norm target, and what the same bytes cost elsewhere in
    the same process, timed the same way over the same tensors: PyTorch's y.copy_(x) and nvdnn's
    ReLU (a pointwise kernel, no coefficients)."""
    import cupy

    import nvdnn
    count, xs, ys, extra = _bn_inputs(cupy, "inference", BN_TARGET, "NHWC", dtype)
    moved = 2 * math.prod(BN_TARGET) * dtypes.BY_NAME[dtype].itemsize
    phys_x = [x.transpose(0, 2, 3, 1) for x in xs]  # (N, H, W, C), C-contiguous
    phys_y = [y.transpose(0, 2, 3, 1) for y in ys]
    rows = []
    if torch is not None:
        tx, ty = [torch.from_dlpack(a) for a in phys_x], [torch.from_dlpack(a) for a in phys_y]
        rows.append(tile_row("ceiling: torch y.copy_(x)", False, time_ms(lambda i: ty[i].copy_(tx[i]), count), moved,
                             dtype=dtype))
        rows.append(tile_row("ceiling: torch y.copy_(x), CUDA graph", False,
                             torch_graph_ms(torch, lambda i: ty[i].copy_(tx[i]), count), moved, dtype=dtype))
    rows.append(tile_row("ceiling: nvdnn.relu(x, out=y)", False,
                         time_ms(lambda i: nvdnn.relu(phys_x[i], out=phys_y[i]), count), moved, dtype=dtype))
    base, specs = bn_sweep_specs(dtype)
    x0 = operand(xs[0])
    for tile in specs:
        plan = _bn_plan("inference", x0, BN_TARGET[1], tile=tile)
        _, ms = _time_plan(cupy, plan, count, xs, ys, extra)
        rows.append(tile_row(tile.uri.rsplit("/", 1)[1], tile == base, ms, moved, dtype=dtype))
    return rows


def warm_sweep():
    """Compile the sweep's kernels on every core first (a GPU machine may not have them cached)."""
    import nvdnn
    from nvdnn import compiler, warm
    arch = compiler.device_arch()
    report = warm.warm([(spec, arch) for dtype in SWEEP_DTYPES for spec in bn_sweep_specs(dtype)[1]],
                       nvdnn.default_cache())
    print(f"bn sweep kernels: {len(report.compiled)} compiled, {len(report.cached)} cached, "
          f"{len(report.failed)} failed in {report.seconds:.1f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", choices=["bn"], help="bn: the batch-norm tile sweep and batch-norm rows only")
    args, torch, device, copy = start(parser)
    warm_sweep()
    sweep = []
    for dtype in SWEEP_DTYPES:
        sweep += bn_tile_sweep(torch, dtype)
        print(table([r for r in sweep if r["dtype"] == dtype], ["dtype", "tile", "us", "TB/s"]), flush=True)
    rows = []
    for dtype in ("float16", "bfloat16", "float32"):
        rows.append(bench_batch_norm("bn+relu inference NHWC 32x256x56x56", "inference", (32, 256, 56, 56), "NHWC",
                                     dtype, torch))
        rows.append(bench_batch_norm("bn+relu inference NCHW 32x256x56x56", "inference", (32, 256, 56, 56), "NCHW",
                                     dtype, torch))
    for layout in ("NHWC", "NCHW"):
        rows.append(bench_batch_norm(f"bn+relu training {layout} 32x256x56x56", "training", (32, 256, 56, 56), layout,
                                     "float16", torch))
        rows.append(bench_batch_norm(f"group_norm(32)+relu {layout} 32x256x56x56", "group", (32, 256, 56, 56),
                                     layout, "float16", torch))
    for name, opname, shape, axes in () if args.only else (("amax whole tensor 64M", "amax", (1 << 26,), None),
                                      ("sum last axis 16384x4096", "sum", (16384, 4096), (1,)),
                                      ("mean first axis 16384x4096", "mean", (16384, 4096), (0,)),
                                      ("sum first axis 8192x8192", "sum", (8192, 8192), (0,)),
                                      ("norm2 last axis 4096x1024", "norm2", (4096, 1024), (1,)),
                                      ("sum channels NCHW 32x256x56x56", "sum", (32, 256, 56, 56), (0, 2, 3)),
                                      ("max last axis 65536x128", "max", (65536, 128), (1,))):
        for dtype in ("bfloat16", "float32"):
            rows.append(bench_reduction(name, opname, shape, axes, dtype, torch))
    columns = ["workload", "dtype", "MB", "nvdnn_us", "nvdnn_TB/s", "of_ceiling", "torch_us", "torch_TB/s",
               "speedup", "max_diff", "graph_us", "graph_TB/s", "torch_graph_us", "graph_speedup"]
    print(table(rows, columns))
    write_json(args.json, device=device, copy_tbs=copy, bn_tiles=sweep, rows=rows)


if __name__ == "__main__":
    main()
