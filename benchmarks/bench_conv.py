"""Convolution forward over real-model layers (issue 16's benchmark), nvdnn vs PyTorch (cuDNN) in one
process on the same inputs.

    python benchmarks/bench_conv.py [--set resnet50,unet,depthwise,layouts,backward] [--batch 32] [--json FILE]
    python benchmarks/bench_conv.py --list                   # no GPU: the rows

Sets: every distinct conv layer of ResNet-50 (nvdnn.models' preset table, NHWC fp16, batch 32 by
default), a U-Net / diffusion set (3x3, 64-1280 channels, 8-128 spatial), a depthwise set
(MobileNet / ConvNeXt, groups = C: nvdnn's direct kernel, kernels/conv_direct.py), and a few
layers in NCHW, bf16 and float32 (tf32), and ResNet-50's dgrad and wgrad (backward: nvdnn.conv2d_backward
against aten.convolution_backward, one gradient a row). Each forward layer is timed twice: "conv" (conv alone, against
F.conv2d) and "cbr" (conv + bias + ReLU, nvdnn's one fused plan against PyTorch eager's
F.conv2d(x, w, b) then relu). Per row (benchmarks/sweep.py): a check against PyTorch with
nvdnn's output NaN-poisoned first, call time (wall clock of back-to-back calls) and kernel time
(torch.profiler) of both; ratio = PyTorch / nvdnn (> 1: nvdnn faster). Targets printed per set:
cbr call ratio >= 1.2x on every layer and geomean >= 1.5x; conv alone kernel-time geomean >=
0.9x (NHWC 16-bit).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH: a tree named there runs
from common import table, write_json  # noqa: E402
from sweep import COLUMNS, ITEMSIZE, Arr, Case, cell, require_libraries, run_case, worst_first  # noqa: E402

F16, BF, F32 = "float16", "bfloat16", "float32"
TF32_TOL = 2e-3  # float32 rows run tf32 (10-bit mantissas) on both sides, in different orders


FLOPS: dict = {}   # row name -> the conv's FLOPs (for TFLOP/s)


# a layer: (n, c, h, w, k, r, s, stride, padding, groups)

def resnet50_layers(batch: int) -> list[tuple]:
    """The distinct conv geometries of the ResNet-50 preset (nvdnn warm --preset resnet50)."""
    from nvdnn import models
    values = {"n": batch, "dtype": F16, "layout": "NCHW", "bn": "separate"}   # the forward convs, once each
    out = []
    for row in models.rows_for(models.RESNET50, values):
        if row.op != "conv_fprop":
            continue
        dims = {role: d for role, d, _, _ in models.resolve(row, values)}
        attrs = dict(row.attrs)
        (n, c, h, w), (k, _, r, s) = dims["x"], dims["w"]
        out.append((n, c, h, w, k, r, s, attrs["stride"], attrs["padding"], 1))
    return list(dict.fromkeys(out))


def unet_layers(batch: int) -> list[tuple]:
    n = max(1, batch // 4)
    return [(n, c, side, side, c, 3, 3, 1, 1, 1) for c, side in
            ((64, 128), (128, 64), (320, 64), (256, 32), (640, 32), (512, 16), (1280, 16), (1280, 8))]


def depthwise_layers(batch: int) -> list[tuple]:
    return [(batch, c, side, side, c, r, r, 1, r // 2, c) for c, side, r in
            ((96, 56, 7), (192, 28, 7), (384, 14, 7), (768, 7, 7), (32, 112, 3), (144, 56, 3), (960, 7, 3))]


def layout_layers(batch: int) -> list[tuple]:
    """A 3x3 and a 1x1 layer of each stage's size: read in NCHW, bf16 and float32 below."""
    return [(batch, 64, 56, 56, 64, 3, 3, 1, 1, 1), (batch, 256, 56, 56, 64, 1, 1, 1, 0, 1),
            (batch, 256, 14, 14, 256, 3, 3, 1, 1, 1), (batch, 1024, 14, 14, 256, 1, 1, 1, 0, 1)]


def _out_size(h, r, stride, padding) -> int:
    return (h + 2 * padding - r) // stride + 1


def flops(layer) -> int:
    n, c, h, w, k, r, s, stride, padding, groups = layer
    return 2 * n * k * _out_size(h, r, stride, padding) * _out_size(w, s, stride, padding) * (c // groups) * r * s


def _torch_conv(torch, x, w, b, stride, padding, groups, relu):
    y = torch.nn.functional.conv2d(x, w, b, stride, padding, 1, groups)
    return torch.relu_(y) if relu else y


def case(group: str, layer, dtype: str = F16, layout: str = "NHWC", fused: bool = True) -> Case:
    n, c, h, w, k, r, s, stride, padding, groups = layer
    nhwc = "NHWC" if layout == "NHWC" else ""
    x, wt = Arr((n, c, h, w), dtype, nhwc, -1.0, 1.0), Arr((k, c // groups, r, s), dtype, nhwc, -1.0, 1.0)
    inputs = (x, wt, Arr((k,), dtype, "", -1.0, 1.0)) if fused else (x, wt)
    p, q = _out_size(h, r, stride, padding), _out_size(w, s, stride, padding)
    moved = sum(a.nbytes for a in inputs) + n * k * p * q * ITEMSIZE[dtype]
    prec = {"precision": "tf32"} if dtype == F32 else {}

    def nv(nvdnn, x, w, b=None):
        return partial(nvdnn.conv2d, x, w, b, stride, padding, 1, groups, activation="relu" if fused else None,
                       **prec)

    def pt(torch, x, w, b=None):
        return partial(_torch_conv, torch, x, w, b, stride, padding, groups, fused)

    short = {F16: "f16", BF: "bf16", F32: "tf32"}[dtype]
    name = (f"{'cbr' if fused else 'conv'} {c}->{k} {h}x{w} {r}x{s}/{stride}" + (f" g{groups}" if groups > 1 else "")
            + f" {layout} {short}")
    FLOPS[name] = flops(layer)
    return Case(f"{group}:{'cbr' if fused else 'conv'}", name, inputs, nv, pt, moved,
                torch_call="F.conv2d(x, w, b) + relu" if fused else "F.conv2d(x, w)",
                tol=TF32_TOL if dtype == F32 else 0.0)


def _nv_grad(nvdnn, which, dy, x, w, stride, padding, out=None):
    grads = nvdnn.conv2d_backward(dy, x, w, stride, padding, needs=(which,),
                                  **({f"out_{which}": out} if out is not None else {}))
    return grads[("dx", "dw").index(which)]


def _pt_grad(torch, which, dy, x, w, stride, padding):
    grads = torch.ops.aten.convolution_backward(dy, x, w, None, [stride] * 2, [padding] * 2, [1, 1], False, [0, 0],
                                                1, [which == "dx", which == "dw", False])
    return grads[("dx", "dw").index(which)]


def grad_case(layer, which: str) -> Case:
    """dgrad (dx) or wgrad (dw) of a layer, fp16 NHWC: conv2d_backward against aten's convolution_backward."""
    n, c, h, w, k, r, s, stride, padding, _ = layer
    p, q = _out_size(h, r, stride, padding), _out_size(w, s, stride, padding)
    inputs = (Arr((n, k, p, q), F16, "NHWC", -1.0, 1.0), Arr((n, c, h, w), F16, "NHWC", -1.0, 1.0),
              Arr((k, c, r, s), F16, "NHWC", -1.0, 1.0))
    out_bytes = (n * c * h * w if which == "dx" else k * c * r * s) * ITEMSIZE[F16]
    name = f"{which} {c}->{k} {h}x{w} {r}x{s}/{stride} NHWC f16"
    FLOPS[name] = flops(layer)
    return Case(f"backward:{which}", name, inputs,
                lambda nvdnn, dy, x, wt: partial(_nv_grad, nvdnn, which, dy, x, wt, stride, padding),
                lambda torch, dy, x, wt: partial(_pt_grad, torch, which, dy, x, wt, stride, padding),
                sum(a.nbytes for a in inputs) - (inputs[1].nbytes if which == "dx" else inputs[2].nbytes) + out_bytes,
                torch_call="aten.convolution_backward")


SETS = {
    "resnet50": lambda b: [case("resnet50", l, fused=f) for l in resnet50_layers(b) for f in (True, False)],
    "unet": lambda b: [case("unet", l, fused=f) for l in unet_layers(b) for f in (True, False)],
    "depthwise": lambda b: [case("depthwise", l, fused=f) for l in depthwise_layers(b) for f in (True, False)],
    "layouts": lambda b: [case("layouts", l, dt, lay, f) for l in layout_layers(b)
                          for dt, lay in ((F16, "NCHW"), (BF, "NHWC"), (F32, "NHWC"), (F32, "NCHW"))
                          for f in (True, False)],
    "backward": lambda b: [grad_case(l, which) for l in resnet50_layers(b) for which in ("dx", "dw")],
}


def summary(results) -> dict:
    """Per group: geomean and worst of the call ratio and the kernel ratio over rows that pass."""
    out = {}
    for group in dict.fromkeys(r["family"] for r in results):
        good = [r for r in results if r["family"] == group and r["ok"]]
        s = dict(rows=sum(r["family"] == group for r in results), timed=len(good))
        for key in ("ratio", "kernel_ratio"):
            if good:
                worst = min(good, key=lambda r: r[key])
                s[key] = dict(geomean=math.exp(statistics.fmean(math.log(r[key]) for r in good)),
                              worst=worst[key], worst_row=worst["name"])
        out[group] = s
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", default="", help=f"comma-separated, of {', '.join(SETS)} (default all)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--list", action="store_true", help="no GPU: print the rows and stop")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    chosen = [s for s in args.set.split(",") if s] or list(SETS)
    if set(chosen) - set(SETS):
        parser.error(f"--set {args.set}: not of {', '.join(SETS)}")
    selected = [c for s in chosen for c in SETS[s](args.batch)]
    if args.list:
        print(table([{"set": c.family, "row": c.name, "inputs": ", ".join(a.describe() for a in c.inputs),
                      "GFLOP": f"{FLOPS[c.name] / 1e9:.2f}", "torch": c.torch_call} for c in selected],
                    ["set", "row", "inputs", "GFLOP", "torch"]))
        print(f"{len(selected)} rows")
        return
    cupy, torch, nvdnn = require_libraries()
    torch.backends.cudnn.benchmark = True
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"device: {device}; torch {torch.__version__} cuDNN {torch.backends.cudnn.version()}; "
          "ratio = PyTorch / nvdnn (call time; kernel ratio: kernel time)")
    results = []
    for i, c in enumerate(selected):
        results.append(run_case(torch, nvdnn, c))
        for who in ("nv", "pt"):
            if f"{who}_kernel_us" in results[-1]:
                results[-1][f"{who}_tflops"] = FLOPS[c.name] / results[-1][f"{who}_kernel_us"] / 1e6
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        row = cell(results[-1])
        tf = results[-1].get("nv_tflops")
        print(f"[{i + 1}/{len(selected)}] {c.name}: ratio {row.get('ratio', '-')}, kernel {row.get('kernel ratio', '-')}"
              f", check {row.get('check', '-')}, nvdnn {row.get('nv kernel us', '-')} us kernel"
              + (f" ({tf:.0f} TFLOP/s, torch {results[-1]['pt_tflops']:.0f})" if tf else ""), flush=True)
        write_json(args.json, device=device, rows=results)
    stats = summary(results)
    columns = [col for col in COLUMNS if "TB/s" not in col] + ["nv TFLOP/s", "pt TFLOP/s"]
    for group in stats:
        print(f"\n{group}, worst first:")
        print(table([{**cell(r), **{f"{w} TFLOP/s": f"{r[w + '_tflops']:.0f}" for w in ("nv", "pt")
                                    if w + "_tflops" in r}}
                     for r in worst_first(r for r in results if r["family"] == group)], columns))
    print()
    for group, s in stats.items():
        parts = [f"{key} geomean {s[key]['geomean']:.2f}x worst {s[key]['worst']:.2f}x ({s[key]['worst_row']})"
                 for key in ("ratio", "kernel_ratio") if key in s]
        print(f"{group}: {s['timed']}/{s['rows']} rows timed; " + "; ".join(parts))
    write_json(args.json, device=device, rows=results, summary=stats)


if __name__ == "__main__":
    main()
