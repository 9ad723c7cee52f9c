"""Matmul, nvdnn vs PyTorch (cuBLAS / cuBLASLt) in one process on the same inputs.

    python benchmarks/bench_matmul.py [--quick] [--json FILE]

TFLOP/s count 2*M*N*K per product. Rows: bf16 / fp16 4096^3 and 8192^3 (x @ w.T, w the (N, K)
weight), bias + GELU against F.gelu(torch.addmm(b, x, w.T)), fp8 e4m3 8192^3 with bias + ReLU +
amax against torch._scaled_mm + relu + amax (float32 sums against its default, fast accumulation
against use_fast_accum=True), tf32 and exact fp32. For each case every tile
candidate is timed too (the heuristic's marked *), so one run shows the best tile.
Reference points: 685 TFLOP/s (PyTorch bf16 8192^3, measured), ~990 (H200 dense bf16 datasheet).
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH: a tree named there runs
from common import start, table, time_ms, write_json  # noqa: E402

from nvdnn import launcher  # noqa: E402
from nvdnn.kernels import matmul as mm  # noqa: E402

MEASURED_BF16 = 685.0
DATASHEET_BF16 = 990.0

# (name, dtype, size, epilogue, precision)
CASES = [("bf16", "bfloat16", 8192, "plain", ""), ("bf16", "bfloat16", 4096, "plain", ""),
         ("fp16", "float16", 8192, "plain", ""), ("fp16", "float16", 4096, "plain", ""),
         ("bf16+bias", "bfloat16", 8192, "bias", ""), ("bf16+bias+gelu", "bfloat16", 8192, "bias_gelu", ""),
         ("bf16+bias+gelu", "bfloat16", 4096, "bias_gelu", ""),
         ("fp8e4m3+bias+relu+amax", "float8_e4m3", 8192, "bias_relu_amax", ""),
         ("fp8e4m3+bias+relu+amax-fast", "float8_e4m3", 8192, "bias_relu_amax", "fast"),
         ("tf32", "float32", 8192, "plain", "tf32"), ("fp32", "float32", 4096, "plain", "exact")]
QUICK = {("bf16", 8192), ("bf16", 4096), ("fp16", 8192), ("fp16", 4096), ("bf16+bias", 8192), ("bf16+bias+gelu", 8192),
         ("fp8e4m3+bias+relu+amax", 8192), ("fp8e4m3+bias+relu+amax-fast", 8192), ("tf32", 8192)}


def plans(dtype, size, epilogue, precision, sms=132):
    """The heuristic plan of a case and one plan per tile candidate (deviceless: also the pre-warm's)."""
    import math
    from nvdnn.kernels.pointwise import Operand
    fp8 = dtype.startswith("float8")
    a = Operand(dtype, (size, size), (size, 1))
    w = Operand(dtype, (size, size), (1, size))        # B = w.T, w (N, K) row-major
    kw = dict(precision=precision or "exact", arch="sm_90", sms=sms)
    if epilogue in ("bias", "bias_gelu"):
        kw.update(bias=Operand(dtype, (size,), (1,)), epilogue=[("gelu", "")] if epilogue == "bias_gelu" else [])
    if epilogue == "bias_relu_amax":
        kw.update(bias=Operand("bfloat16", (size,), (1,)), epilogue=[("relu", "")], params=(0.0, math.inf), amax=True,
                  out_dtype="bfloat16")
    base = mm.plan_matmul(a, w, **kw)
    spec = [l.spec for l in base.launches if isinstance(l.spec, mm.MatmulSpec)][0]
    return base, [mm.plan_matmul(a, w, tile=t, **kw) for t in mm.candidates(spec)], fp8


def _inputs(dtype, size, epilogue):
    import cupy
    import ml_dtypes
    from nvdnn import dtypes
    rng = np.random.default_rng(0)
    fp8 = dtype.startswith("float8")
    host = dtypes.BY_NAME[dtype].host
    x = rng.standard_normal((size, size), dtype=np.float32).astype(host)
    w = rng.standard_normal((size, size), dtype=np.float32).astype(host)
    t = {"a": cupy.asarray(x.view(np.uint8) if fp8 else x), "w": cupy.asarray(w.view(np.uint8) if fp8 else w)}
    t["b"] = t["w"].T
    out_dt = ml_dtypes.bfloat16 if fp8 or dtype == "bfloat16" else dtypes.BY_NAME[dtype].np
    t["y"] = cupy.empty((size, size), out_dt)
    if epilogue != "plain":
        t["bias"] = cupy.asarray(rng.standard_normal(size, dtype=np.float32).astype(
            ml_dtypes.bfloat16 if fp8 else dtypes.BY_NAME[dtype].np))
    if fp8:
        t["scale_a"] = cupy.ones(1, cupy.float32)
        t["scale_b"] = cupy.ones(1, cupy.float32)
        t["amax"] = cupy.zeros(1, cupy.float32)
    return t, x, w


def _torch_fn(torch, name, dtype, t, x, w, precision):
    import torch.nn.functional as F
    dev = "cuda"
    if dtype.startswith("float8"):
        a8 = torch.from_numpy(x.view(np.uint8)).to(dev).view(torch.float8_e4m3fn)
        w8 = torch.from_numpy(w.view(np.uint8)).to(dev).view(torch.float8_e4m3fn)
        b = torch.as_tensor(t["bias"].get().astype(np.float32), device=dev).to(torch.bfloat16)
        one = torch.ones((), device=dev)

        def fn(_):
            y = torch._scaled_mm(a8, w8.t(), scale_a=one, scale_b=one, bias=b, out_dtype=torch.bfloat16,
                                 use_fast_accum=precision == "fast")
            y = torch.relu(y)
            return y, y.abs().amax()
        return fn
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32), device=dev).to(tdt)
    wt = torch.as_tensor(np.asarray(w, dtype=np.float32), device=dev).to(tdt)
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    if "bias" in name:
        bt = torch.as_tensor(t["bias"].get().astype(np.float32), device=dev).to(tdt)
        if "gelu" not in name:
            return lambda _: torch.addmm(bt, xt, wt.t())
        return lambda _: F.gelu(torch.addmm(bt, xt, wt.t()))
    return lambda _: xt @ wt.t()


def _torch_parts(torch, dtype, t, x, w):
    import torch.nn.functional as F
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    xt = torch.as_tensor(np.asarray(x, dtype=np.float32), device="cuda").to(tdt)
    wt = torch.as_tensor(np.asarray(w, dtype=np.float32), device="cuda").to(tdt)
    bt = torch.as_tensor(t["bias"].get().astype(np.float32), device="cuda").to(tdt)
    y = torch.addmm(bt, xt, wt.t())
    return (lambda _: torch.addmm(bt, xt, wt.t())), (lambda _: F.gelu(y))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="the reference workloads only, fewer iterations")
    parser.add_argument("--cases", default="", help="comma-separated case names (e.g. tf32,bf16+bias+gelu)")
    args, torch, device, _ = start(parser)
    import cupy
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    rows, numbers = [], []
    iters = 10 if args.quick else 30
    wanted = [c for c in args.cases.split(",") if c]
    order = sorted(CASES, key=lambda c: wanted.index(c[0]) if c[0] in wanted else len(wanted))  # --cases order
    for name, dtype, size, epilogue, precision in order:
        if args.quick and (name, size) not in QUICK:
            continue
        if wanted and name not in wanted:
            continue
        flops = 2.0 * size ** 3
        base, tiles, fp8 = plans(dtype, size, epilogue, precision, sms)
        t, x, w = _inputs(dtype, size, epilogue)
        torch_ms = None
        if torch is not None:
            try:
                fn = _torch_fn(torch, name, dtype, t, x, w, precision)
                torch_ms = time_ms(fn, iters=iters, trials=5)
                if "gelu" in name:  # its two kernels apart: cuBLASLt's addmm (bias epilogue), then F.gelu
                    parts = _torch_parts(torch, dtype, t, x, w)
                    print(f"{name} {size}: torch addmm {time_ms(parts[0], iters=iters, trials=5):.3f} ms, "
                          f"F.gelu {time_ms(parts[1], iters=iters, trials=5):.3f} ms, together {torch_ms:.3f} ms")
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"{name} {size}: PyTorch failed: {exc}")
        heuristic = [l.spec for l in base.launches if isinstance(l.spec, mm.MatmulSpec)][0]
        best = None
        for plan in tiles:
            spec = [l.spec for l in plan.launches if isinstance(l.spec, mm.MatmulSpec)][0]
            try:
                launcher.run(plan, t)
                ms = time_ms(lambda _: launcher.run(plan, t), iters=iters, trials=5)
            except Exception as exc:  # noqa: BLE001 - one tile failing must not hide the others
                print(f"{name} {size} {spec.uri}: failed: {exc}")
                continue
            tflops = flops / (ms * 1e-3) / 1e12
            row = {"case": f"{name} {size}^3", "tile": ("* " if spec == heuristic else "  ") + spec.uri,
                   "ms": f"{ms:.3f}", "TFLOP/s": f"{tflops:.0f}",
                   "torch ms": f"{torch_ms:.3f}" if torch_ms else "-",
                   "torch TFLOP/s": f"{flops / (torch_ms * 1e-3) / 1e12:.0f}" if torch_ms else "-",
                   "vs torch": f"{torch_ms / ms:.2f}x" if torch_ms else "-",
                   "vs 685": f"{tflops / MEASURED_BF16:.2f}", "vs 990": f"{tflops / DATASHEET_BF16:.2f}"}
            rows.append(row)
            numbers.append({"case": name, "size": size, "uri": spec.uri, "heuristic": spec == heuristic, "ms": ms,
                            "tflops": tflops, "torch_ms": torch_ms})
            best = ms if best is None else min(best, ms)
        del t
        cupy.get_default_memory_pool().free_all_blocks()
        print(table(rows, COLUMNS), flush=True)  # each case as it completes: a time limit keeps what ran
        rows = []
        write_json(args.json, device=device, rows=numbers)


COLUMNS = ["case", "tile", "ms", "TFLOP/s", "torch ms", "torch TFLOP/s", "vs torch", "vs 685", "vs 990"]


if __name__ == "__main__":
    main()
