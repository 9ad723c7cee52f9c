"""Matmul over real-model shapes (issue 15's sweep), nvdnn vs PyTorch in one process on the same inputs.

    python benchmarks/bench_matmul_sweep.py [--quick] [--dtype bf16,fp8] [--filter REGEX] [--json FILE]
    python benchmarks/bench_matmul_sweep.py --list [--quick]     # no GPU: rows, planned kernels, estimate

Shapes (``SHAPES``): LLaMA-7B / 8B / 70B and GPT-2 / BERT projections and MLPs at 16-16384 tokens,
decode (M = 1-64 against a large weight), per-head attention (batch 32-64), ResNet-50 / BERT FC
layers, Mixtral experts, a 3-D x against a broadcast weight, prime sizes. Layouts as a user writes
them: ``x @ w.T`` (nn.Linear's (N, K) weight), NumPy's ``a @ b`` ((K, N) b), ``a.T @ b`` (the
layer's weight gradient dW = dY.T @ X: M, N, K = out, in, tokens), batched ``q @ k.transpose(-1,
-2)`` and ``p @ v``. Dtypes: bf16, fp16, tf32 (float32 with precision="tf32"; PyTorch allow_tf32),
exact fp32 (TF32 off), fp8 e4m3 (uint8 with a_dtype / b_dtype and float32 scales, bf16 out;
PyTorch's torch._scaled_mm, so x @ w.T only, N and K multiples of 16, no batch).
``include`` picks the matrix: every shape x layout in bf16 and fp16, tf32 up to 2 TFLOP a product,
exact fp32 up to 0.15 TFLOP (nvdnn's SIMT SGEMM runs ~14 TFLOP/s), fp8 where _scaled_mm applies.

Per row: a spot check (nvdnn's NaN-poisoned output against PyTorch's: rms(diff) / rms(torch) within
``TOL``; a failure reads FAIL in the ratio and check columns and sorts first), kernel time
(common.time_ms: back-to-back calls behind a spin kernel; input sets rotated through 256 MB, so
rows whose working set fits in the 50 MB L2 are not timed from cache), call time (wall clock of
back-to-back ``nvdnn.matmul(a, b, out=y)`` / ``torch.matmul(a, b, out=y)`` calls, synchronized at
the end), TFLOP/s, and for M <= 64 TB/s of A + B + Y against the 4.25 TB/s copy ceiling. ratio =
torch kernel ms / nvdnn kernel ms (> 1: nvdnn faster). The kernel column is the plan nvdnn.matmul
makes on these strides (``plans``: no GPU needed; benchmarks/prewarm_gpu_check.py compiles them).

GPU time (``estimate_s``; --list prints it): per row and library 3 warm-up calls, one call behind
a 3 ms spin to size the runs, min(1000, max(3, 20 ms / t)) wall-clock calls, 5 trials of a 3 ms
spin + max(3, 5 ms / t) calls (at most 60, and no more than 60% of the spin's worth of host
calls), each call max(t, 40 us of host); t is a roofline (FLOPs at rates a bit below nvdnn's
measured ones for the kernel planned, wgmma / mma.sync / SIMT, and cuBLAS's; bytes at 3 TB/s;
5 us at least); plus 60 ms a row for inputs and the check. Full: 518 rows, ~110 s; --quick: 120
rows, ~22 s; plus ~10 s of start-up and the copy ceiling, and compiles unless pre-warmed.
"""
from __future__ import annotations

import argparse
import itertools
import math
import os
import re
import sys
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH: a tree named there runs
from common import COPY_CEILING_TBS, host_us_per_call, sets_for, start, table, time_ms, write_json  # noqa: E402

from nvdnn.kernels import matmul as mm  # noqa: E402
from nvdnn.kernels.pointwise import Operand  # noqa: E402


class Shape(NamedTuple):
    name: str
    m: int            # tokens (rows of x); attention: S
    n: int            # output features; attention: S (scores) or D (p @ v)
    k: int            # input features; attention: D (scores) or S (p @ v)
    batch: int = 1
    kind: str = "lin"  # lin: all three layouts; inf: no weight gradient; qk, pv, bat, bcast: one layout
    quick: bool = False


def _lin(model, layer, n, k, tokens, quick=(), kind=None):
    return [Shape(f"{model}.{layer}@{t}", t, n, k, kind=kind or ("lin" if t >= 512 else "inf"), quick=t in quick)
            for t in tokens]


SHAPES = [
    *_lin("llama7b", "qkv", 12288, 4096, (2048,)), *_lin("llama7b", "o", 4096, 4096, (128, 4096), quick=(4096,)),
    *_lin("llama7b", "up", 11008, 4096, (512, 4096)), *_lin("llama7b", "down", 4096, 11008, (4096, 16384)),
    *_lin("llama8b", "qkv", 6144, 4096, (4096,)), *_lin("llama8b", "gate_up", 28672, 4096, (2048, 16384)),
    *_lin("llama8b", "down", 4096, 14336, (2048,), quick=(2048,)), *_lin("llama8b", "lm_head", 128256, 4096, (512,)),
    *_lin("llama70b", "qkv", 10240, 8192, (4096,)), *_lin("llama70b", "o", 8192, 8192, (2048,), quick=(2048,)),
    *_lin("llama70b", "up", 28672, 8192, (4096, 16384)), *_lin("llama70b", "down", 8192, 28672, (4096,)),
    *_lin("gpt2", "qkv", 2304, 768, (4096,)), *_lin("gpt2", "up", 3072, 768, (16,)),
    *_lin("gpt2", "lm_head", 50257, 768, (512,), quick=(512,)),
    *_lin("bert", "o", 768, 768, (4096,)), *_lin("bert", "up", 3072, 768, (4096,), quick=(4096,)),
    *_lin("bert", "down", 768, 3072, (4096,)), *_lin("bert_large", "qkv", 3072, 1024, (2048,)),
    *_lin("bert_large", "up", 4096, 1024, (2048,)), *_lin("bert_large", "down", 1024, 4096, (2048,)),
    *_lin("bert_large", "o", 1024, 1024, (512,)),
    # decode: a few rows against a large weight (memory-bound: TB/s)
    *_lin("llama7b", "up", 11008, 4096, (1,), quick=(1,)), *_lin("llama7b", "o", 4096, 4096, (1, 8)),
    *_lin("llama7b", "lm_head", 32000, 4096, (1,)), *_lin("llama8b", "down", 4096, 14336, (8,)),
    *_lin("mixtral", "expert_up", 14336, 4096, (4,)),
    *_lin("llama8b", "gate_up", 28672, 4096, (16,)), *_lin("llama8b", "lm_head", 128256, 4096, (1,)),
    *_lin("llama70b", "down", 8192, 28672, (32,), quick=(32,)), *_lin("llama70b", "qkv", 10240, 8192, (64,)),
    # attention per head: scores q @ k^T (S x D @ D x S) and p @ v (S x S @ S x D)
    *[Shape(f"{model}.{part}.b{b}s{s}d{d}", s, s if part == "qk" else d, d if part == "qk" else s, b, part,
            quick=model == "llama7b")
      for model, b, s, d in (("llama7b", 32, 2048, 128), ("bert", 48, 512, 64), ("gpt2_medium", 64, 1024, 64),
                             ("llama70b", 64, 256, 128)) for part in ("qk", "pv")],
    # fully-connected heads
    *_lin("resnet50", "fc", 1000, 2048, (1, 32, 256), quick=(32,), kind="inf"),
    *_lin("bert", "pooler", 768, 768, (32,), kind="inf"),
    # Mixtral 8x7B experts: tokens per expert, and all 8 experts as one batched product
    *_lin("mixtral", "expert_up", 14336, 4096, (64, 256, 1024), quick=(256,)),
    *_lin("mixtral", "expert_down", 4096, 14336, (1024,)),
    Shape("mixtral.experts_up.e8@512", 512, 14336, 4096, 8, "bat", quick=True),
    Shape("llama7b.o.3d_x.b8@512", 512, 4096, 4096, 8, "bcast", quick=True),  # (8, 512, K) @ w.T: w broadcast
    # odd and prime sizes
    Shape("vit_b16.up@32x197", 6304, 3072, 768), Shape("clip.up@77", 77, 3072, 768, kind="inf"),
    Shape("prime.4093x4099x4091", 4093, 4099, 4091, quick=True), Shape("prime.127x1021x2039", 127, 1021, 2039),
    Shape("prime.decode.7x4099x4093", 7, 4099, 4093, kind="inf"),
]

LAYOUTS = {"x@w.T": (False, True), "a@b": (False, False), "a.T@b": (True, False),  # (A, B) stored transposed
           "q@k.T": (False, True), "p@v": (False, False)}
KIND_LAYOUTS = {"lin": ("x@w.T", "a@b", "a.T@b"), "inf": ("x@w.T", "a@b"), "qk": ("q@k.T",), "pv": ("p@v",),
                "bat": ("x@w.T",), "bcast": ("x@w.T",)}
DTYPES = {"bf16": ("bfloat16", "exact"), "fp16": ("float16", "exact"), "tf32": ("float32", "tf32"),
          "fp32": ("float32", "exact"), "fp8": ("float8_e4m3", "exact")}
TOL = {"bf16": 1e-2, "fp16": 1e-2, "tf32": 1e-2, "fp32": 1e-4, "fp8": 5e-2}  # rms(nvdnn - torch) / rms(torch)


class Row(NamedTuple):
    shape: Shape
    layout: str
    dtype: str        # a DTYPES key
    m: int            # the product's M, N, K (a.T @ b: the weight gradient's)
    n: int
    k: int

    @property
    def name(self):
        return f"{self.shape.name} {self.layout}"

    @property
    def dims(self):
        return (f"{self.shape.batch}x" if self.shape.batch > 1 else "") + f"{self.m}x{self.n}x{self.k}"

    @property
    def flops(self):
        return 2.0 * self.shape.batch * self.m * self.n * self.k

    @property
    def nbytes(self):  # A + B + Y
        width = {"fp8": 1, "tf32": 4, "fp32": 4}.get(self.dtype, 2)
        batch, b_batch = self.shape.batch, 1 if self.shape.kind == "bcast" else self.shape.batch
        return (batch * self.m * self.k + b_batch * self.k * self.n) * width + batch * self.m * self.n * max(width, 2)


def include(row: Row) -> bool:
    """The sweep's matrix: which dtype runs which shape x layout (GPU time, PyTorch's fp8 rules)."""
    if row.dtype == "fp8":
        return row.layout == "x@w.T" and row.shape.batch == 1 and row.n % 16 == 0 and row.k % 16 == 0
    return row.flops <= {"tf32": 2e12, "fp32": 1.5e11}.get(row.dtype, math.inf)


def rows(quick=False, dtypes=None, pattern="") -> list:
    out = []
    for dtype in dtypes or DTYPES:
        for shape in SHAPES:
            if quick and not shape.quick:
                continue
            for layout in KIND_LAYOUTS[shape.kind]:
                m, n, k = (shape.n, shape.k, shape.m) if layout == "a.T@b" else (shape.m, shape.n, shape.k)
                row = Row(shape, layout, dtype, m, n, k)
                if include(row) and re.search(pattern, f"{dtype} {row.name}"):
                    out.append(row)
    return out


def operands(row: Row):
    """(A, B) stored shapes and the views the product takes: (stored shape, transposed?) each."""
    a_t, b_t = LAYOUTS[row.layout]
    lead = (row.shape.batch,) if row.shape.batch > 1 else ()
    b_lead = () if row.shape.kind == "bcast" else lead
    a = (lead + ((row.k, row.m) if a_t else (row.m, row.k)), a_t)
    b = (b_lead + ((row.n, row.k) if b_t else (row.k, row.n)), b_t)
    return a, b


def plan(row: Row, sms=132, arch="sm_90"):
    """The plan nvdnn.matmul(a, b, out=y) makes for this row's strides (no GPU needed)."""
    kind, precision = DTYPES[row.dtype]
    ops = []
    for stored, transposed in operands(row):
        strides = list(mm.pointwise_contiguous(stored))
        shape = list(stored)
        if transposed:
            shape[-2:], strides[-2:] = shape[-1:-3:-1], strides[-1:-3:-1]
        ops.append(Operand(kind, tuple(shape), tuple(strides), 16))
    return mm.plan_matmul(*ops, out_dtype="bfloat16" if row.dtype == "fp8" else None, precision=precision, arch=arch,
                          sms=sms)


def kernel_uri(p) -> str:
    spec = [launch.spec for launch in p.launches if isinstance(launch.spec, (mm.MatmulSpec, mm.SkinnySpec))][0]
    return spec.uri + (f" +{len(p.launches) - 1} launch" if len(p.launches) > 1 else "")


def plans(sms=132, arch="sm_90", quick=False) -> list:
    """(row, plan) for every row of the sweep, deviceless: benchmarks/prewarm_gpu_check.py compiles them."""
    return [(row, plan(row, sms, arch)) for row in rows(quick)]


# -- GPU time estimate (no GPU): the measurement's call counts over a roofline of each library ------

NV_TFLOPS = {"wgmma": {"bf16": 550, "fp16": 550, "tf32": 280, "fp8": 900}, "mma": {"bf16": 180, "fp16": 180,
             "tf32": 90, "fp32": 30}, "simt": {"fp32": 13},
             "skinny": {"bf16": 50, "fp16": 50, "tf32": 50, "fp32": 50, "fp8": 50}}   # float32 FMA, memory bound
TORCH_TFLOPS = {"bf16": 650, "fp16": 650, "tf32": 330, "fp32": 48, "fp8": 1100}
WARMUP, TRIALS, TRIAL_MS, MAX_ITERS, CALL_MS, SPIN_MS, HOST_MS = 3, 5, 5.0, 60, 20.0, 3.0, 0.04  # common._spin: 3 ms


def _iters(t_ms, call_ms):
    """Calls per kernel-time trial: TRIAL_MS of GPU work, no more than the spin hides the host's queueing of."""
    return max(3, min(MAX_ITERS, round(TRIAL_MS / t_ms), int(0.6 * SPIN_MS / call_ms)))


def _calls(t_ms):
    return max(3, min(1000, math.ceil(CALL_MS / t_ms)))


def estimate_s(planned) -> float:
    total = 0.0
    for row, p in planned:
        kernel = kernel_uri(p).split("/")[1]
        for rate in (NV_TFLOPS[kernel].get(row.dtype, 5), TORCH_TFLOPS[row.dtype]):
            t = max(row.flops / (rate * 1e9), row.nbytes / 3.0e9, 0.005)
            call = max(t, HOST_MS)
            total += WARMUP * call + SPIN_MS + t + _calls(t) * call + TRIALS * (SPIN_MS + _iters(t, call) * t)
        total += 60.0
    return total / 1e3


# -- on the GPU -------------------------------------------------------------------------------------

def _device_arrays(row: Row, sets: int):
    """``sets`` input sets (A and B as stored, y) and one more y for PyTorch's result, all CuPy."""
    import cupy
    import ml_dtypes
    elem = {"bf16": ml_dtypes.bfloat16, "fp16": cupy.float16}.get(row.dtype, cupy.float32)

    def rand(shape):
        if row.dtype == "fp8":  # e4m3 bytes of +-[0.5, 2): sign, exponent 6 or 7, any mantissa (never NaN)
            return ((cupy.random.randint(0, 256, shape, dtype=cupy.int32) & 0x8F) | 0x30).astype(cupy.uint8)
        return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(elem)

    (a_shape, _), (b_shape, _) = operands(row)
    out_shape, out_dt = (row.shape.batch,) * (row.shape.batch > 1) + (row.m, row.n), (
        ml_dtypes.bfloat16 if row.dtype == "fp8" else elem)
    return [(rand(a_shape), rand(b_shape), cupy.empty(out_shape, out_dt)) for _ in range(sets)], \
        cupy.empty(out_shape, out_dt)


def _torch_view(torch, x, dtype):
    """The same device memory as a torch tensor (through an integer view: CuPy has no bf16 / fp8 types)."""
    return torch.as_tensor(x.view({1: "uint8", 2: "int16", 4: "int32"}[x.itemsize]), device="cuda").view(dtype)


def _fns(torch, row: Row, sets, y_ref, scale):
    """nvdnn's and PyTorch's call on input set i (writing its y; PyTorch's into y_ref with ref=True),
    and the check: rms(nvdnn - torch) / rms(torch) on set 0, nvdnn's output NaN-poisoned first."""
    import nvdnn
    kind, precision = DTYPES[row.dtype]
    a_t, b_t = LAYOUTS[row.layout]
    kw = dict(precision=precision)
    if row.dtype == "fp8":
        kw.update(a_dtype=kind, b_dtype=kind, scale_a=scale, scale_b=scale)
    views = [(a.swapaxes(-1, -2) if a_t else a, b.swapaxes(-1, -2) if b_t else b, y) for a, b, y in sets]

    def nv(i):
        a, b, y = views[i]
        nvdnn.matmul(a, b, out=y, **kw)
    if torch is None:
        return nv, None, lambda: None
    tdt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}.get(row.dtype, torch.float32)
    ydt = torch.bfloat16 if row.dtype == "fp8" else tdt
    tviews = []
    for a, b, y in sets:
        ta, tb = _torch_view(torch, a, tdt), _torch_view(torch, b, tdt)
        tviews.append((ta.transpose(-1, -2) if a_t else ta, tb.transpose(-1, -2) if b_t else tb,
                       _torch_view(torch, y, ydt)))
    t_ref = _torch_view(torch, y_ref, ydt)
    if row.dtype == "fp8":
        one = _torch_view(torch, scale, torch.float32).reshape(())

        def pt(i, ref=False):
            a, b, y = tviews[i]
            torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16, out=t_ref if ref else y)
    else:
        def pt(i, ref=False):
            a, b, y = tviews[i]
            torch.matmul(a, b, out=t_ref if ref else y)

    def check():
        sets[0][2].view("uint8").fill(0xFF)
        nv(0)
        pt(0, ref=True)
        got, want = tviews[0][2].float(), t_ref.float()
        if not bool(torch.isfinite(got).all()):
            return math.inf
        return float(torch.linalg.vector_norm(got - want)) / max(float(torch.linalg.vector_norm(want)), 1e-30)
    return nv, pt, check


def _measure(fn, sets):
    """(kernel ms, call us) of fn(i % sets). One call behind a spin sizes the runs; the wall clock
    per call comes next, and bounds the calls a kernel-time trial queues to what the spin hides."""
    rough = time_ms(fn, sets, iters=1, trials=1, warmup=WARMUP)
    counter = itertools.count()
    call_us = host_us_per_call(lambda: fn(next(counter) % sets), calls=_calls(rough), warmup=0)
    return time_ms(fn, sets, iters=_iters(rough, call_us * 1e-3), trials=TRIALS, warmup=0), call_us


def run_row(torch, row: Row, sms: int) -> dict:
    import cupy

    from nvdnn.compiler import device_arch
    out = dict(dtype=row.dtype, name=row.name, layout=row.layout, batch=row.shape.batch, m=row.m, n=row.n, k=row.k,
               flops=row.flops, bytes=row.nbytes, tol=TOL[row.dtype])
    try:
        out["uri"] = kernel_uri(plan(row, sms, device_arch()))
        sets, y_ref = _device_arrays(row, sets_for(row.nbytes))
        scale = cupy.ones(1, cupy.float32)
        if torch is not None:
            torch.backends.cuda.matmul.allow_tf32 = row.dtype == "tf32"
        nv, pt, check = _fns(torch, row, sets, y_ref, scale)
        out["err"] = check()  # None without PyTorch
        out["nv_ms"], out["nv_call_us"] = _measure(nv, len(sets))
        if pt is not None:
            out["torch_ms"], out["torch_call_us"] = _measure(pt, len(sets))
            out["ratio"] = out["torch_ms"] / out["nv_ms"]
    except Exception as exc:  # noqa: BLE001 - one row failing must not hide the others
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    out["ok"] = "error" not in out and (out.get("err") is None or out["err"] <= out["tol"])
    for who in ("nv", "torch"):
        if f"{who}_ms" in out:
            out[f"{who}_tflops"] = row.flops / (out[f"{who}_ms"] * 1e9)
            if row.m <= 64:
                out[f"{who}_tbs"] = row.nbytes / (out[f"{who}_ms"] * 1e9)
    return out


def _cell(r, columns):
    c = {"row": r["name"], "MxNxK": (f"{r['batch']}x" if r["batch"] > 1 else "") + f"{r['m']}x{r['n']}x{r['k']}",
         "kernel": r.get("uri", "")}
    for who, tag in (("nv", "nv"), ("torch", "pt")):
        if f"{who}_ms" in r:
            c[f"{tag} ms"] = f"{r[who + '_ms']:.4f}"
            c[f"{tag} us/call"] = f"{r[who + '_call_us']:.1f}"
            c[f"{tag} TFLOP/s"] = f"{r[who + '_tflops']:.0f}"
            if f"{who}_tbs" in r:
                c[f"{tag} TB/s"] = f"{r[who + '_tbs']:.2f} ({r[who + '_tbs'] / COPY_CEILING_TBS:.0%})"
    c["ratio"] = f"{r['ratio']:.2f}x" if "ratio" in r else "-"
    if "error" in r:
        c["ratio"], c["check"] = "ERROR", r["error"]
    elif r.get("err") is None:
        c["check"] = "not checked"
    else:
        c["check"] = f"{r['err']:.1e}" if r["ok"] else f"FAIL {r['err']:.1e} > {r['tol']:.0e}"
        if not r["ok"]:
            c["ratio"] = "FAIL " + c["ratio"]
    return {k: c.get(k, "") for k in columns}


COLUMNS = ["row", "MxNxK", "ratio", "check", "nv ms", "pt ms", "nv us/call", "pt us/call", "nv TFLOP/s",
           "pt TFLOP/s", "nv TB/s", "pt TB/s", "kernel"]


def summary(results) -> dict:
    """Per dtype: geometric mean of the ratio over the rows that pass their check, worst, counts below 0.8x / 0.9x."""
    out = {}
    for dtype in dict.fromkeys(r["dtype"] for r in results):
        mine = [r for r in results if r["dtype"] == dtype]
        good = [r for r in mine if r["ok"] and "ratio" in r]
        worst = min(good, key=lambda r: r["ratio"], default=None)
        gmean = math.exp(sum(math.log(r["ratio"]) for r in good) / len(good)) if good else None
        out[dtype] = dict(rows=len(mine), timed=len(good), geomean=gmean, worst=worst and worst["ratio"],
                          worst_row=worst and worst["name"], below_0_8=sum(r["ratio"] < 0.8 for r in good),
                          below_0_9_big=sum(r["ratio"] < 0.9 and min(r["m"], r["n"], r["k"]) >= 2048 for r in good),
                          wrong=sum(not r["ok"] and "error" not in r for r in mine),
                          errors=sum("error" in r for r in mine))
        s = out[dtype]
        s["meets_issue_15"] = bool(good) and s["geomean"] >= 1.0 and not (s["below_0_8"] or s["below_0_9_big"]
                                                                            or s["wrong"] or s["errors"])
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the subset of shapes marked quick")
    parser.add_argument("--dtype", default="", help=f"comma-separated, of {', '.join(DTYPES)} (default all)")
    parser.add_argument("--filter", default="", help="regex on 'dtype name layout', e.g. 'llama70b|x@w.T'")
    parser.add_argument("--list", action="store_true", help="no GPU: the rows, their planned kernels, the estimate")
    if "--list" in sys.argv:
        parser.add_argument("--json", help=argparse.SUPPRESS)
        args = parser.parse_args()
    else:
        args, torch, device, copy = start(parser)
    dtypes = [d for d in args.dtype.split(",") if d] or None
    if set(dtypes or ()) - set(DTYPES):
        parser.error(f"--dtype {args.dtype}: not of {', '.join(DTYPES)}")
    selected = rows(args.quick, dtypes, args.filter)
    if args.list:
        planned = [(row, plan(row)) for row in selected]
        print(table([{"dtype": r.dtype, "row": r.name, "MxNxK": r.dims, "GFLOP": f"{r.flops / 1e9:.1f}",
                      "kernel": kernel_uri(p)} for r, p in planned], ["dtype", "row", "MxNxK", "GFLOP", "kernel"]))
        print(f"{len(selected)} rows, {len({r.shape for r in selected})} shapes; estimated GPU time "
              f"{estimate_s(planned):.0f} s")
        return
    import cupy
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    results = []
    for i, row in enumerate(selected):
        results.append(run_row(torch, row, sms))
        cupy.get_default_memory_pool().free_all_blocks()  # the row's arrays, before the next row's
        if torch is not None:
            torch.cuda.empty_cache()
        c = _cell(results[-1], COLUMNS)
        print(f"[{i + 1}/{len(selected)}] {row.dtype} {row.name} {row.dims}: ratio {c['ratio']}, check {c['check']}, "
              f"nvdnn {c['nv ms']} ms {c['nv us/call']} us/call, torch {c['pt ms']} ms {c['pt us/call']} us/call",
              flush=True)
        write_json(args.json, device=device, copy_tbs=copy, rows=results)
    stats = summary(results)
    for dtype, s in stats.items():
        mine = sorted((r for r in results if r["dtype"] == dtype),
                      key=lambda r: (r["ok"], r.get("ratio", 0.0)))  # wrong or failed first, then worst ratio
        print(f"\n{dtype}: {len(mine)} rows, worst ratio first (ratio = torch ms / nvdnn ms; > 1: nvdnn faster)")
        print(table([_cell(r, COLUMNS) for r in mine], COLUMNS))
    for dtype, s in stats.items():
        g = "-" if s["geomean"] is None else f"{s['geomean']:.3f}x"
        w = "-" if s["worst"] is None else f"{s['worst']:.2f}x ({s['worst_row']})"
        print(f"{dtype}: geomean {g} over {s['timed']} rows, worst {w}, below 0.8x: {s['below_0_8']}, below 0.9x "
              f"with M, N, K >= 2048: {s['below_0_9_big']}, check failures: {s['wrong']}, errors: {s['errors']}"
              f"{'  (meets issue 15)' if s['meets_issue_15'] else ''}")
    write_json(args.json, device=device, copy_tbs=copy, rows=results, summary=stats)


if __name__ == "__main__":
    main()
