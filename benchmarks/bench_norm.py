"""Norm kernels (layer norm, RMS norm, softmax; forward and backward), nvdnn vs PyTorch in one
process on the same inputs.

    python benchmarks/bench_norm.py [--json FILE] [--no-sweep] [--targets long,medium] [--occupancy]
    python benchmarks/bench_norm.py --no-sweep --dtypes bfloat16,float32 --targets vocab,vocab-decode,odd

Effective bandwidth counts each input read once and each output written once (gamma / beta
and saved statistics included). Long rows run every way: the persistent cluster (sm_90, the
heuristic's), a cluster a row, and the portable two passes. The sweep times every tile
candidate of the target workloads, and the persistent grid at a cluster more and one fewer
than it takes; --occupancy asks the driver how many persistent clusters are co-resident.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COPY_CEILING_TBS, sets_for, start, table, tile_row, time_ms, write_json  # noqa: E402

from nvdnn import compiler, launcher, runtime  # noqa: E402
from nvdnn.dtypes import BY_NAME, of_array  # noqa: E402
from nvdnn.kernels import norm, tile_spec  # noqa: E402
from nvdnn.kernels.pointwise import Operand  # noqa: E402

TARGETS = [  # (name, rows, L, target TB/s)
    ("medium", 16384, 4096, 3.8), ("short", 65536, 128, 2.5), ("long", 256, 262144, 2.5),
    # rows of odd length (shifted 16-byte vectors): a vocabulary of 50257, a decode step over
    # Llama 3's 128256, and a medium row of 4099
    ("vocab", 4096, 50257, 3.5), ("vocab-decode", 8, 128256, 1.0), ("odd", 8192, 4099, 3.5)]
DEFAULT_TARGETS = ("medium", "short", "long")


def operand(a) -> Operand:
    return Operand(of_array(a, arg="x").name, tuple(a.shape), tuple(s // a.itemsize for s in a.strides), 16)


class Prepared:
    """A plan's launches with their argument tuples resolved per tensor set: the timed loop only
    launches (no lookups, no workspace allocation)."""

    def __init__(self, plan, sets: list[dict]):
        import cupy
        device = cupy.cuda.runtime.getDevice()
        self.fns = launcher.functions(plan, device)
        offsets, size = launcher.scratch_layout(plan)
        self.workspace = cupy.empty(max(size, 1), dtype=cupy.uint8)
        self.plan, self.calls = plan, []
        for tensors in sets:
            calls = []
            for launch, fn in zip(plan.launches, self.fns):
                ptrs = [np.uint64(self.workspace.data.ptr + offsets[int(r[7:])]) if r.startswith("scratch")
                        else tensors[r] for r in launch.pointers]
                grid = runtime.resident_grid(fn, launch.spec, launch.grid, launch.block, launch.shared_mem)
                calls.append((fn, grid, launch.block, (*ptrs, *launch.args), launch.shared_mem))
            self.calls.append(calls)

    def __call__(self, i: int) -> None:
        for fn, grid, block, args, shared in self.calls[i]:
            fn(grid, block, args, shared_mem=shared)


def _host(dtype: str):
    return BY_NAME[dtype].np


def _rand(cupy, shape, dtype, seed, low=-3.0, high=3.0):
    host = np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32).astype(_host(dtype))
    return cupy.asarray(host)


def workloads(dtype: str, rows: int, L: int):
    """(name, nvdnn plan factory (tile=), tensors per set, bytes moved, torch call per set) of each op."""
    import cupy
    itemsize = BY_NAME[dtype].itemsize
    row_bytes = rows * L * itemsize
    count = sets_for(2 * row_bytes)
    xs = [_rand(cupy, (rows, L), dtype, i) for i in range(count)]
    dys = [_rand(cupy, (rows, L), dtype, 100 + i) for i in range(count)]
    ys = [_rand(cupy, (rows, L), dtype, 300 + i, 0.0, 1.0) for i in range(count)]  # outputs; softmax bwd's y
    dxs = [cupy.empty_like(x) for x in xs]
    g = _rand(cupy, (L,), dtype, 200, 0.5, 1.5)
    b = _rand(cupy, (L,), dtype, 201, -0.5, 0.5)
    mean = cupy.zeros((rows,), dtype=cupy.float32)
    rstd = cupy.ones((rows,), dtype=cupy.float32)
    dg, db = cupy.empty_like(g), cupy.empty_like(b)
    ox, og = operand(xs[0]), operand(g)
    arch = compiler.device_arch()
    out = []

    def sets():
        return [dict(x=x, y=y, dy=dy, dx=dx, gamma=g, beta=b, mean=mean, rstd=rstd, dgamma=dg, dbeta=db)
                for x, y, dy, dx in zip(xs, ys, dys, dxs)]

    out.append(("layer_norm", lambda tile=None, a=arch: norm.plan_layer_norm(ox, 1, gamma=og, beta=og, arch=a,
                                                                                tile=tile),
                sets(), 2 * row_bytes + 2 * L * itemsize, "layer_norm"))
    out.append(("rms_norm", lambda tile=None, a=arch: norm.plan_rms_norm(ox, 1, gamma=og, arch=a, tile=tile),
                sets(), 2 * row_bytes + L * itemsize, "rms_norm"))
    out.append(("softmax", lambda tile=None, a=arch: norm.plan_softmax(ox, -1, arch=a, tile=tile),
                sets(), 2 * row_bytes, "softmax"))
    if L > 32768:
        out.append(("log_softmax", lambda tile=None, a=arch: norm.plan_softmax(ox, -1, log=True, arch=a, tile=tile),
                    sets(), 2 * row_bytes, "log_softmax"))
        # the other long-row forms: a cluster a row (the sm_90 candidate of the same reach) and
        # the portable heuristic's two passes
        for name in ("layer_norm", "rms_norm", "softmax"):
            make, moved = next((m, b) for n, m, _, b, _ in out if n == name)
            tile = next((c for c in norm.candidates(tile_spec(make())) if c.split == "cluster"), None)
            if tile is not None:
                out.append((f"{name} (cluster)", lambda tile=tile, make=make: make(tile=tile), sets(), moved, name))
            out.append((f"{name} (2-pass)", lambda tile=None, make=make: make(tile=tile, a=None), sets(), moved, name))
    ostat = operand(mean)
    out.append(("layer_norm bwd", lambda tile=None: norm.plan_layer_norm_backward(
        ox, ox, 1, mean=ostat, rstd=ostat, gamma=og, beta=og, tile=tile),
        sets(), 3 * row_bytes + 3 * L * itemsize + 8 * rows, "layer_norm_bwd"))
    out.append(("softmax bwd", lambda tile=None: norm.plan_softmax_backward(ox, ox, -1, tile=tile), sets(),
                3 * row_bytes, "softmax_bwd"))
    return out, (xs, ys, dys, dxs, g, b, mean, rstd)


def torch_call(torch, kind: str, x, g, b, dy, y, mean, rstd):
    F = torch.nn.functional
    L = x.shape[-1]
    if kind == "layer_norm":
        return lambda: F.layer_norm(x, (L,), g, b)
    if kind == "rms_norm":
        return lambda: F.rms_norm(x, (L,), g, eps=1e-6)
    if kind == "softmax":
        return lambda: torch.softmax(x, -1)
    if kind == "log_softmax":
        return lambda: torch.log_softmax(x, -1)
    if kind == "layer_norm_bwd":
        return lambda: torch.ops.aten.native_layer_norm_backward(dy, x, (L,), mean.view(-1, 1), rstd.view(-1, 1), g,
                                                                 b, [True, True, True])
    if kind == "softmax_bwd":
        return lambda: torch.ops.aten._softmax_backward_data(dy, y, -1, y.dtype)
    raise ValueError(kind)


def _grids(plan):
    """The plan, and for a persistent cluster the same with one cluster more and one fewer in its
    grid (does norm.PERSIST_CLUSTERS name the co-resident count?): (plan, label) pairs."""
    out = [(plan, "")]
    (launch, *rest) = plan.launches
    if launch.spec.split == "persist" and not rest:
        cl = launch.spec.cluster
        for clusters in (launch.grid[0] // cl + 1, launch.grid[0] // cl - 1):
            if clusters > 0:
                out.append((plan._replace(launches=(launch._replace(grid=(clusters * cl, 1, 1)),)),
                            f" [{clusters} clusters]"))
    return out


def resident_clusters() -> list[dict]:
    """The driver's count of co-resident clusters for each persistent cluster size (bf16 RMS norm
    rows of 2, 4 and 8 blocks), against the grid norm.PERSIST_CLUSTERS plans."""
    import cupy
    device = cupy.cuda.runtime.getDevice()
    out = []
    for L in (65536, 131072, 262144):
        x, g = Operand("bfloat16", (4096, L), (L, 1), 16), Operand("bfloat16", (L,), (1,), 16)
        plan = norm.plan_rms_norm(x, 1, gamma=g, arch=compiler.device_arch(device))
        (launch,) = plan.launches
        fn = launcher.functions(plan, device)[0]
        count = runtime.max_active_clusters(fn.ptr, launch.grid, launch.block, launch.shared_mem)
        out.append({"cluster": launch.spec.cluster, "shared_KB": launch.shared_mem // 1024,
                    "co-resident": count or "the driver refused", "planned": launch.grid[0] // launch.spec.cluster})
    return out


def bench(torch, dtype: str, label: str, rows: int, L: int, target: float, sweep: bool):
    import cupy
    ops, (xs, ys, dys, dxs, g, b, mean, rstd) = workloads(dtype, rows, L)
    rows_out, tuning = [], []
    for name, make, sets, moved, kind in ops:
        plan = make()
        run = Prepared(plan, sets)
        ms = time_ms(run, len(sets))
        uri = " + ".join(lnch.spec.uri.split("/")[-1] for lnch in plan.launches)
        tbs = moved / (ms * 1e-3) / 1e12
        row = {"workload": f"{name} {rows}x{L}", "dtype": dtype, "tile": uri, "nvdnn_us": f"{ms * 1e3:.1f}",
               "nvdnn_TB/s": f"{tbs:.2f}", "of_ceiling": f"{tbs / COPY_CEILING_TBS:.0%}",
               "target": f"{target:.2f}" if not name.endswith("bwd") else ""}
        if torch is not None:
            tg, tb = torch.from_dlpack(g), torch.from_dlpack(b)
            tmean, trstd = torch.from_dlpack(mean), torch.from_dlpack(rstd)
            calls = [torch_call(torch, kind, torch.from_dlpack(x), tg, tb, torch.from_dlpack(d), torch.from_dlpack(y),
                                tmean, trstd) for x, d, y in zip(xs, dys, ys)]
            t_ms = time_ms(lambda i: calls[i](), len(calls))
            row.update({"torch_us": f"{t_ms * 1e3:.1f}", "torch_TB/s": f"{moved / (t_ms * 1e-3) / 1e12:.2f}",
                        "speedup": f"{t_ms / ms:.2f}x"})
            if kind in ("layer_norm", "rms_norm", "softmax", "log_softmax"):
                run(0)
                want = calls[0]()
                row["max_diff"] = f"{float((torch.from_dlpack(ys[0]).float() - want.float()).abs().max()):.2g}"
        rows_out.append(row)
        if sweep and not name.endswith("bwd") and "(" not in name:
            base = tile_spec(plan)
            for cand in norm.candidates(base):
                if norm.unsupported_reason(cand, compiler.device_arch()):
                    continue
                for cplan, grid in _grids(make(tile=cand)):
                    cms = time_ms(Prepared(cplan, sets), len(sets), iters=20, trials=3)
                    tiles = " + ".join(lnch.spec.uri.split("/")[-1] for lnch in cplan.launches) + grid
                    tuning.append(tile_row(tiles, cand == base and not grid, cms, moved,
                                           workload=f"{name} {rows}x{L} {dtype}"))
    del xs, ys, dys, dxs, ops
    cupy.get_default_memory_pool().free_all_blocks()
    return rows_out, tuning


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--no-sweep", action="store_true", help="skip timing every tile candidate")
    parser.add_argument("--dtypes", default="bfloat16", help="comma-separated, e.g. bfloat16,float16,float32")
    parser.add_argument("--targets", default=",".join(DEFAULT_TARGETS),
                        help="comma-separated workloads: " + ", ".join(t[0] for t in TARGETS))
    parser.add_argument("--occupancy", action="store_true", help="print co-resident persistent clusters, then stop")
    args, torch, device, copy = start(parser)
    if args.occupancy:
        print(table(resident_clusters(), ["cluster", "shared_KB", "co-resident", "planned"]))
        return
    rows, tuning = [], []
    for dtype in args.dtypes.split(","):
        for label, n, L, target in (t for t in TARGETS if t[0] in args.targets.split(",")):
            r, t = bench(torch, dtype, label, n, L, target, sweep=not args.no_sweep and dtype == "bfloat16")
            rows += r
            tuning += t
    if tuning:
        print(table(tuning, ["workload", "tile", "us", "TB/s"]))
    print(table(rows, ["workload", "dtype", "tile", "nvdnn_us", "nvdnn_TB/s", "of_ceiling", "target", "torch_us",
                       "torch_TB/s", "speedup", "max_diff"]))
    write_json(args.json, device=device, copy_tbs=copy, rows=rows, tuning=tuning)


if __name__ == "__main__":
    main()
