"""The memory-bound families over real-model shapes, nvdnn vs PyTorch in one process on the same inputs.

    python benchmarks/bench_sweep.py [--family pointwise,norm,softmax,reduce,pool] [--quick] [--json FILE]
    python benchmarks/bench_sweep.py --list [--family F] [--quick]     # no GPU: the rows

Families (30+ shapes each): pointwise (unary on LLM activations and ResNet maps, casts, binary ops
with broadcasting, bias_act in NCHW and NHWC), norm (layer / RMS norm over hidden sizes 768-8192
and odd ones at 1-16k tokens, batch norm on ResNet maps and group norm on U-Net maps, NCHW and
NHWC), softmax (attention rows, vocabularies 32000 / 50257 / 128256 / 151936 at 1-4096 tokens,
log_softmax), reduce (innermost, axis 0, middle axes, all), pool (max / avg 2x2 and 3x3 stride
2 and global average on ResNet / U-Net maps, NCHW and NHWC), plus odd and prime sizes.

Per row (benchmarks/sweep.py): a check against PyTorch (nvdnn's output NaN-poisoned first),
call time (wall clock of back-to-back calls) and kernel time (torch.profiler) of both, TB/s of
the bytes the call must move (inputs read once, outputs written once) for the call and the
kernel against the 4.25 TB/s copy ceiling, ratio = PyTorch call time / nvdnn call time. Rows
sorted worst first; per family the geometric mean, the worst ratio and the targets: geomean
>= 1.3x, no row below 1.0x, rows moving 64 MB or more at >= 3.5 TB/s (call).

GPU time: ~0.5 s a row plus compiles (pre-warm the cache) and start-up: a family ~20 s,
all five ~2 min; --quick (every third row) ~8 s a family.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from functools import partial

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH: a tree named there runs
from common import table, write_json  # noqa: E402
from sweep import (COLUMNS, ITEMSIZE, Arr, Case, cell, flag_line, require_libraries, run_case, summary,  # noqa: E402
                   worst_first)

BF, F16, F32 = "bfloat16", "float16", "float32"
RESNET = [(32, 64, 112, 112), (32, 256, 56, 56), (32, 512, 28, 28), (32, 1024, 14, 14), (32, 2048, 7, 7)]
UNET = [(8, 320, 64, 64), (8, 640, 32, 32), (8, 1280, 16, 16), (2, 320, 96, 96)]
VOCABS = (32000, 50257, 128256, 151936)
TOKENS = (1, 16, 128, 1024, 4096)


def _numel(shape) -> int:
    return math.prod(shape)


def _act(torch, name):
    F = torch.nn.functional
    return {"relu": torch.relu, "gelu": F.gelu, "silu": F.silu, "identity": None}[name]


# -- pointwise ----------------------------------------------------------------------------------------

def _unary(op, shape, dtype=BF, layout="", positive=False, arg=None):
    x = Arr(shape, dtype, layout, *((0.5, 2.0) if positive else (-3.0, 3.0)))
    extra = () if arg is None else (arg,)

    def pt(t, x):
        if op == "gelu" and arg == "tanh":
            return partial(t.nn.functional.gelu, x, approximate="tanh")
        return partial(_TORCH_UNARY[op](t), x)
    return Case("pointwise", f"{op}{'(' + arg + ')' if arg else ''}", (x,),
                lambda n, x: partial(getattr(n, op), x, *extra), pt, 2 * x.nbytes, torch_call=op)


_TORCH_UNARY = {"gelu": lambda t: t.nn.functional.gelu, "silu": lambda t: t.nn.functional.silu,
                "relu": lambda t: t.relu, "sigmoid": lambda t: t.sigmoid, "exp": lambda t: t.exp,
                "tanh": lambda t: t.tanh, "rsqrt": lambda t: t.rsqrt, "neg": lambda t: t.neg}


def _cast(shape, src, dst):
    x = Arr(shape, src)
    return Case("pointwise", f"cast->{dst}", (x,), lambda n, x: partial(n.cast, x, dst),
                lambda t, x: partial(x.to, getattr(t, dst)), x.nbytes + _numel(shape) * ITEMSIZE[dst],
                torch_call="Tensor.to")


_TORCH_BINARY = {"add": "add", "sub": "sub", "mul": "mul", "div": "div", "maximum": "maximum"}


def _binary(op, a_shape, b_shape, dtype=BF):
    a, b = Arr(a_shape, dtype), Arr(b_shape, dtype, low=0.5 if op == "div" else -3.0)
    out = _numel([max(i, j) for i, j in zip((1,) * (len(b_shape) - len(a_shape)) + tuple(a_shape),
                                              (1,) * (len(a_shape) - len(b_shape)) + tuple(b_shape))])
    return Case("pointwise", op, (a, b), lambda n, a, b: partial(getattr(n, op), a, b),
                lambda t, a, b: partial(getattr(t, _TORCH_BINARY[op]), a, b),
                a.nbytes + b.nbytes + out * ITEMSIZE[dtype], torch_call=f"torch.{op}")


def _bias_act(act, shape, layout, dtype=F16):
    """bias_act on x (N, C, H, W) for NCHW or (N, H, W, C) / (tokens, C) for NHWC (channels last)."""
    x = Arr(shape, dtype)
    channels = shape[-1] if layout == "NHWC" else shape[1]
    b = Arr((channels,), dtype)

    def pt(t, x, b):
        fn, bias = _act(t, act), (b if layout == "NHWC" else b.view(-1, *(1,) * (x.dim() - 2)))
        return (lambda: x + bias) if fn is None else (lambda: fn(x + bias))
    return Case("pointwise", f"bias_act({act}) {layout}", (x, b),
                lambda n, x, b: partial(n.bias_act, x, b, act, layout=layout), pt, 2 * x.nbytes + b.nbytes,
                torch_call=f"{act}(x + b)")


def pointwise_cases():
    return [
        _unary("gelu", (16384, 4096)), _unary("gelu", (4096, 11008)), _unary("silu", (8192, 14336)),
        _unary("silu", (1, 14336)), _unary("gelu", (2048, 3072), F32, arg="tanh"), _unary("tanh", (2048, 5120)),
        _unary("relu", RESNET[0], F16), _unary("relu", RESNET[0], F16, "NHWC"), _unary("relu", RESNET[1], F32),
        _unary("sigmoid", (1000003,), F32), _unary("exp", (4097, 4099), F32),
        _unary("rsqrt", (8192, 8192), positive=True),
        _unary("neg", (7, 11, 13, 17, 19), F16), _unary("silu", UNET[0], F16, "NHWC"),
        _cast((16384, 4096), F32, BF), _cast((4096, 4096), BF, F32), _cast((32, 64, 112, 112), F32, F16),
        _binary("add", (16384, 4096), (16384, 4096)), _binary("add", (4096, 4096), (4096,)),
        _binary("mul", (8192, 14336), (8192, 14336)), _binary("mul", (32, 256, 56, 56), (1, 256, 1, 1), F32),
        _binary("mul", (32, 56, 56, 256), (32, 1, 1, 256), F16), _binary("add", (997, 4099), (997, 1), F32),
        _binary("sub", (1, 4096), (1, 4096)), _binary("maximum", (7919, 1021), (7919, 1021)),
        _binary("div", (4096, 4096), (4096, 1), F32), _binary("add", (2, 320, 96, 96), (2, 320, 1, 1), F16),
        _bias_act("relu", RESNET[0], "NCHW"), _bias_act("relu", (32, 112, 112, 64), "NHWC"),
        _bias_act("gelu", (16384, 4096), "NHWC", BF), _bias_act("silu", UNET[0], "NCHW"),
        _bias_act("silu", (8, 64, 64, 320), "NHWC"), _bias_act("relu", RESNET[1], "NCHW", F32),
        _bias_act("relu", (32, 28, 28, 512), "NHWC", BF), _bias_act("gelu", (7, 129, 31, 31), "NCHW", F32),
        _bias_act("identity", (1, 4096), "NHWC", BF), _bias_act("relu", (64, 2048, 7, 7), "NCHW"),
    ]


# -- norms ----------------------------------------------------------------------------------------------

def _layer_norm(tokens, hidden, dtype=BF):
    x, g, b = Arr((tokens, hidden), dtype), Arr((hidden,), dtype, low=0.5, high=1.5), Arr((hidden,), dtype)
    return Case("norm", "layer_norm", (x, g, b), lambda n, x, g, b: partial(n.layer_norm, x, g, b),
                lambda t, x, g, b: partial(t.nn.functional.layer_norm, x, (hidden,), g, b),
                2 * x.nbytes + 2 * g.nbytes, torch_call="F.layer_norm")


def _rms_norm(tokens, hidden, dtype=BF):
    x, g = Arr((tokens, hidden), dtype), Arr((hidden,), dtype, low=0.5, high=1.5)
    return Case("norm", "rms_norm", (x, g), lambda n, x, g: partial(n.rms_norm, x, g),
                lambda t, x, g: partial(t.nn.functional.rms_norm, x, (hidden,), g, 1e-6),
                2 * x.nbytes + g.nbytes, torch_call="F.rms_norm")


def _batch_norm(shape, dtype=F16, layout=""):
    channels = shape[1]
    x = Arr(shape, dtype, layout)
    mean, var = Arr((channels,), F32, low=-0.5, high=0.5), Arr((channels,), F32, low=0.5, high=2.0)
    g, b = Arr((channels,), F32, low=0.5, high=1.5), Arr((channels,), F32)
    return Case("norm", f"batch_norm {layout or 'NCHW'}", (x, mean, var, g, b),
                lambda n, x, m, v, g, b: partial(n.batch_norm, x, m, v, g, b),
                lambda t, x, m, v, g, b: partial(t.nn.functional.batch_norm, x, m, v, g, b, False, 0.1, 1e-5),
                2 * x.nbytes + 4 * channels * 4, torch_call="F.batch_norm")


def _group_norm(shape, groups, dtype=F16, layout=""):
    x = Arr(shape, dtype, layout)
    g, b = Arr((shape[1],), dtype, low=0.5, high=1.5), Arr((shape[1],), dtype)
    return Case("norm", f"group_norm/{groups} {layout or 'NCHW'}", (x, g, b),
                lambda n, x, g, b: partial(n.group_norm, x, groups, g, b),
                lambda t, x, g, b: partial(t.nn.functional.group_norm, x, groups, g, b, 1e-5),
                2 * x.nbytes + 2 * g.nbytes, torch_call="F.group_norm")


def norm_cases():
    return [
        *[_layer_norm(t, h) for t, h in ((1, 4096), (16, 4096), (128, 4096), (2048, 768), (4096, 1024),
                                         (4096, 4096), (16384, 4096), (4096, 5120), (2048, 8192), (16384, 768),
                                         (1000, 4095), (4096, 1600), (513, 1023))],
        _layer_norm(8192, 8192, F32),
        *[_rms_norm(t, h) for t, h in ((1, 4096), (32, 4096), (512, 5120), (4096, 4096), (16384, 4096),
                                       (8192, 8192), (4096, 3584), (2048, 7168), (1, 8192), (13, 2053),
                                       (16384, 2048))],
        *[_batch_norm(s, F16, layout) for s in RESNET[:4] for layout in ("", "NHWC")],
        _batch_norm((8, 64, 56, 56), F32), _batch_norm((3, 37, 31, 29), F32, "NHWC"),
        *[_group_norm(s, 32, F16, layout) for s in UNET[:3] for layout in ("", "NHWC")],
        _group_norm((3, 96, 37, 37), 8, F32),
    ]


# -- softmax --------------------------------------------------------------------------------------------

def _softmax(shape, dtype=BF, log=False, tag=""):
    x = Arr(shape, dtype, low=-8.0, high=8.0)
    op = "log_softmax" if log else "softmax"
    return Case("softmax", f"{op} {tag}".strip(), (x,), lambda n, x: partial(getattr(n, op), x),
                lambda t, x: partial(getattr(t, op), x, -1), 2 * x.nbytes, torch_call=f"torch.{op}")


def softmax_cases():
    vocab = [_softmax((tokens, v), log=(i + j) % 2 == 1, tag=f"vocab {v}")
             for i, v in enumerate(VOCABS) for j, tokens in enumerate(TOKENS)]
    attention = [_softmax(s, tag="attention") for s in ((32, 2048, 2048), (48, 512, 512), (64, 1024, 1024),
                                                       (16, 4096, 4096), (128, 128, 128), (8, 16, 1, 4096))]
    return vocab + attention + [
        _softmax((32, 16, 512, 512), F16, tag="attention 4-D"),
        _softmax((4096, 128256), F32, log=True, tag="fp32 logits"),
        _softmax((1024, 50257), F32, tag="fp32 logits"), _softmax((65536, 64), tag="short rows"),
        _softmax((1000, 1000), F32, tag="odd"), _softmax((4097, 4099), tag="prime"),
        _softmax((3, 7, 1, 65521), log=True, tag="prime"),
    ]


# -- reductions -----------------------------------------------------------------------------------------

_TORCH_REDUCE = {"sum": "sum", "mean": "mean", "max": "amax"}


def _reduce(op, shape, axis, dtype=BF):
    x = Arr(shape, dtype, low=0.0, high=2.0)  # mean 1: sums without cancellation, so float32 rounding stays ~1e-6
    axes = range(len(shape)) if axis is None else ((axis,) if isinstance(axis, int) else axis)
    out = _numel(shape) // _numel([shape[a] for a in axes])

    def pt(t, x):
        if op == "amax":  # nvdnn.amax is max |x|: PyTorch's one-kernel form is the inf-norm
            return partial(t.linalg.vector_norm, x, math.inf, axis)
        fn = getattr(t, _TORCH_REDUCE[op])
        return partial(fn, x) if axis is None else partial(fn, x, axis)
    where = "all" if axis is None else f"axis={axis}"
    return Case("reduce", f"{op} {where}", (x,), lambda n, x: partial(getattr(n, op), x, axis), pt,
                x.nbytes + out * ITEMSIZE[dtype], torch_call=op)


def reduce_cases():
    return [
        _reduce("sum", (16384, 4096), -1), _reduce("amax", (4096, 128256), -1), _reduce("sum", (65536, 128), -1),
        _reduce("mean", (7, 1000003), -1, F32), _reduce("max", (1, 4096), -1), _reduce("sum", (8192, 14336), -1),
        _reduce("mean", (512, 1023), -1, F32), _reduce("max", (131072, 32), -1, F16),
        _reduce("sum", (16384, 4096), 0), _reduce("sum", (4096, 11008), 0), _reduce("sum", (1 << 20, 16), 0, F32),
        _reduce("mean", (997, 4099), 0, F32), _reduce("sum", (32, 768), 0), _reduce("sum", (16384, 1024), 0, F32),
        _reduce("mean", (32, 256, 56 * 56), 2, F16), _reduce("mean", (32, 56 * 56, 256), 1, F16),
        _reduce("sum", (8, 4096, 32, 128), 1), _reduce("sum", (64, 1024, 64), 1, F32),
        _reduce("mean", (32, 2048, 7, 7), (2, 3), F16), _reduce("mean", (8, 320, 64, 64), (2, 3), F32),
        _reduce("max", (16, 4096, 4096), 1), _reduce("sum", (3, 1021, 7, 13), (0, 2)),
        _reduce("sum", (2, 1024, 1024, 16), (1, 2), F32), _reduce("mean", (17, 257, 129), 1, F32),
        _reduce("amax", (16384, 4096), None), _reduce("amax", (8192, 14336), None),
        _reduce("sum", (1 << 24,), None, F32),
        _reduce("mean", (1000003,), None, F32), _reduce("amax", (1, 4096), None), _reduce("max", (4097, 4099), None),
        _reduce("sum", (32, 1000), -1, F32), _reduce("sum", (4096, 50257), -1, F32),
    ]


# -- pooling --------------------------------------------------------------------------------------------

def _pooled(size, k, s, p) -> int:
    return (size + 2 * p - k) // s + 1


def _pool(kind, shape, k=3, s=2, p=1, dtype=F16, layout="NHWC"):
    x = Arr(shape, dtype, layout if layout == "NHWC" else "")
    n, c, h, w = shape
    out = n * c if kind == "global" else n * c * _pooled(h, k, s, p) * _pooled(w, k, s, p)
    moved = x.nbytes + out * ITEMSIZE[dtype]
    if kind == "global":
        return Case("pool", f"global_avg {layout}", (x,), lambda n, x: partial(n.global_avg_pool2d, x),
                    lambda t, x: partial(t.nn.functional.adaptive_avg_pool2d, x, 1), moved,
                    torch_call="F.adaptive_avg_pool2d")
    name = f"{kind}_pool2d"
    return Case("pool", f"{kind} {k}x{k}/{s} p{p} {layout}", (x,), lambda n, x: partial(getattr(n, name), x, k, s, p),
                lambda t, x: partial(getattr(t.nn.functional, name), x, k, s, p), moved, torch_call=f"F.{name}")


def pool_cases():
    unet_levels = [(8, 64, 256, 256), (8, 128, 128, 128), (8, 256, 64, 64), (8, 512, 32, 32)]
    return [
        *[_pool("max", s, 3, 2, 1, F16, layout) for s in ((32, 64, 112, 112), (1, 64, 112, 112), (128, 64, 112, 112))
          for layout in ("NHWC", "NCHW")],
        _pool("max", (32, 64, 112, 112), 3, 2, 1, F32, "NCHW"),
        *[_pool("max", s, 2, 2, 0, F16, layout) for s in unet_levels for layout in ("NHWC", "NCHW")],
        _pool("max", (4, 64, 571, 571), 2, 2, 0, F16, "NHWC"), _pool("max", (3, 37, 97, 101), 3, 2, 1, F32, "NCHW"),
        *[_pool("avg", s, 2, 2, 0, BF, layout) for s in unet_levels[:3] for layout in ("NHWC", "NCHW")],
        _pool("avg", (32, 256, 56, 56), 3, 2, 1, F16, "NHWC"), _pool("avg", (32, 256, 56, 56), 3, 2, 1, F16, "NCHW"),
        _pool("avg", (7, 129, 31, 31), 3, 2, 1, F32, "NCHW"),
        *[_pool("global", s, dtype=F16, layout=layout) for s in ((32, 2048, 7, 7), (32, 256, 56, 56), (1, 512, 7, 7))
          for layout in ("NHWC", "NCHW")],
        _pool("global", (32, 1280, 8, 8), dtype=F32, layout="NCHW"),
    ]


FAMILIES = {"pointwise": pointwise_cases, "norm": norm_cases, "softmax": softmax_cases, "reduce": reduce_cases,
            "pool": pool_cases}


def cases(families=None, quick=False) -> list:
    """Every row of the chosen families; --quick keeps every third row of each family."""
    out = []
    for family in families or FAMILIES:
        rows = FAMILIES[family]()
        out += [c._replace(quick=i % 3 == 0) for i, c in enumerate(rows) if not quick or i % 3 == 0]
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--family", default="", help=f"comma-separated, of {', '.join(FAMILIES)} (default all)")
    parser.add_argument("--quick", action="store_true", help="every third row of each family")
    parser.add_argument("--list", action="store_true", help="no GPU: print the rows and stop")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args()
    families = [f for f in args.family.split(",") if f] or None
    if set(families or ()) - set(FAMILIES):
        parser.error(f"--family {args.family}: not of {', '.join(FAMILIES)}")
    selected = cases(families, args.quick)
    if args.list:
        print(table([{"family": c.family, "row": c.name, "inputs": ", ".join(a.describe() for a in c.inputs),
                      "MB": f"{c.moved / 2**20:.1f}", "torch": c.torch_call} for c in selected],
                    ["family", "row", "inputs", "MB", "torch"]))
        counts = {f: sum(c.family == f for c in selected) for f in dict.fromkeys(c.family for c in selected)}
        print(f"{len(selected)} rows: " + ", ".join(f"{f} {n}" for f, n in counts.items()))
        return
    cupy, torch, nvdnn = require_libraries()
    device = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    print(f"device: {device}; torch {torch.__version__}; ratio = PyTorch call time / nvdnn call time")
    results = []
    for i, case in enumerate(selected):
        results.append(run_case(torch, nvdnn, case))
        cupy.get_default_memory_pool().free_all_blocks()
        torch.cuda.empty_cache()
        c = cell(results[-1])
        print(f"[{i + 1}/{len(selected)}] {case.family} {case.name} {c['inputs']}: ratio {c.get('ratio', '-')}, "
              f"check {c.get('check', '-')}, nvdnn {c.get('nv call us', '-')} us/call "
              f"({c.get('nv call TB/s', '-')} TB/s), torch {c.get('pt call us', '-')} us/call", flush=True)
        write_json(args.json, device=device, rows=results)
    stats = summary(results)
    for family in stats:
        print(f"\n{family}, worst first:")
        print(table([cell(r) for r in worst_first(r for r in results if r["family"] == family)], COLUMNS))
    print()
    for family, s in stats.items():
        print(flag_line(family, s))
    write_json(args.json, device=device, rows=results, summary=stats)


if __name__ == "__main__":
    main()
