"""The harness shared by bench_calls.py and bench_sweep.py: a workload is a ``Case`` (input specs,
nvdnn's call, PyTorch's equivalent); its inputs are PyTorch tensors viewed by CuPy, so both
libraries read the same memory. Call time is the wall clock of back-to-back calls (synchronized
at the end of each trial), kernel time the device time torch.profiler records per call (CUPTI
sees CuPy's kernels too), and each sweep row is checked against PyTorch with nvdnn's output
poisoned with NaN first. ``summary`` applies the memory-bound targets per family."""
from __future__ import annotations

import functools
import math
import os
import statistics
import sys
import time
from typing import Callable, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import COPY_CEILING_TBS, time_ms  # noqa: E402

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8}  # int64: class labels
BIG_BYTES = 64 << 20     # rows moving at least this much: one input set, and the 3.5 TB/s target
MAX_SETS = 32            # input sets rotated (against L2) for rows below BIG_BYTES
TARGET_GEOMEAN, TARGET_WORST, TARGET_BIG_TBS = 1.3, 1.0, 3.5
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 2e-2}  # rms(nvdnn - torch) / rms(torch)


class Arr(NamedTuple):
    """One input: its logical shape and type; ``NHWC``: a 4-D (N, C, H, W) view of memory stored
    (N, H, W, C), as PyTorch's channels_last; values uniform in [low, high)."""
    shape: tuple
    dtype: str = "float32"
    layout: str = ""
    low: float = -3.0
    high: float = 3.0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]

    def describe(self) -> str:
        short = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "int64": "i64"}[self.dtype]
        return "x".join(map(str, self.shape)) + f" {short}" + (" NHWC" if self.layout else "")


class Case(NamedTuple):
    """A workload. ``nv(nvdnn, *arrays)`` and ``pt(torch, *tensors)`` return zero-argument callables
    (made once per input set, so the timed loop only calls); nvdnn's is a functools.partial,
    which ``with_out`` extends with ``out=``. ``pt_out``: True when PyTorch's callable (a partial)
    takes ``out=`` too, or a factory ``(torch, out, *tensors)`` of its out= form."""
    family: str
    name: str
    inputs: tuple
    nv: Callable
    pt: Callable
    moved: int = 0
    pt_out: object = None
    torch_call: str = ""
    quick: bool = False
    tol: float = 0.0     # the check's bound; 0: TOL by data type

    @property
    def dtype(self) -> str:
        return self.inputs[0].dtype


def with_out(call, out):
    """A partial with ``out=`` added to its keywords."""
    return functools.partial(call.func, *call.args, **{**call.keywords, "out": out})


def first(result):
    return result[0] if isinstance(result, tuple) else result


def require_libraries():
    """(cupy, torch, nvdnn), or exit with one clear line: both benchmarks need a GPU, CuPy and PyTorch."""
    try:
        import cupy
        import torch

        import nvdnn
    except ImportError as exc:
        sys.exit(f"needs CuPy, PyTorch and nvdnn importable: {exc}")
    if not torch.cuda.is_available() or cupy.cuda.runtime.getDeviceCount() == 0:
        sys.exit("needs a CUDA GPU visible to both CuPy and PyTorch")
    return cupy, torch, nvdnn


def tensor(torch, arr: Arr, seed: int):
    """A fresh random PyTorch tensor for ``arr`` (channels_last memory for NHWC)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    n, c, h, w = arr.shape if arr.layout else (0, 0, 0, 0)
    stored = (n, h, w, c) if arr.layout else arr.shape
    t = torch.empty(stored, dtype=torch.float32, device="cuda").uniform_(arr.low, arr.high, generator=gen)
    t = t.to(getattr(torch, arr.dtype))
    return t.permute(0, 3, 1, 2) if arr.layout else t


def cupy_view(torch, t):
    """The CuPy array over tensor t's memory (bfloat16 travels as int16 bits, then viewed back)."""
    import cupy
    if t.dtype == torch.bfloat16:
        import ml_dtypes
        return cupy.asarray(t.view(torch.int16)).view(ml_dtypes.bfloat16)
    return cupy.asarray(t)


def torch_view(torch, x):
    """The PyTorch tensor over CuPy array x's memory (strides kept)."""
    if x.dtype.name == "bfloat16":
        return torch.as_tensor(x.view("int16"), device="cuda").view(torch.bfloat16)
    return torch.as_tensor(x, device="cuda")


def input_sets(torch, case: Case, sets: int):
    """(PyTorch tensors, CuPy views) per input set."""
    ts = [[tensor(torch, arr, 1000 * k + j) for j, arr in enumerate(case.inputs)] for k in range(sets)]
    return ts, [[cupy_view(torch, t) for t in s] for s in ts]


def sets_for(case: Case) -> int:
    """Input sets to rotate so that a row's kernel is not timed from the 50 MB L2 (256 MB touched,
    at most MAX_SETS sets); one for rows of BIG_BYTES or more."""
    if case.moved >= BIG_BYTES:
        return 1
    return max(1, min(MAX_SETS, -(-(256 << 20) // max(case.moved, 1))))


def call_us(fn, sets: int = 1, calls: int = 1000, trials: int = 5, warmup: int = 3) -> float:
    """Median over ``trials`` of the wall clock per call (µs) of ``calls`` back-to-back
    ``fn(i % sets)``, synchronized only at the end of each trial."""
    import cupy
    sync = cupy.cuda.Device().synchronize
    for i in range(warmup):
        fn(i % sets)
    sync()
    return statistics.median(_trial_us(fn, sets, calls, sync) for _ in range(trials))


def _trial_us(fn, sets: int, calls: int, sync) -> float:
    """Wall clock per call (µs) of ``calls`` back-to-back ``fn(i % sets)``, synchronized at the end."""
    started = time.perf_counter_ns()
    for i in range(calls):
        fn(i % sets)
    sync()
    return (time.perf_counter_ns() - started) / calls / 1e3


def interleaved_us(fns: dict, trials: int = 7, warmup: int = 3) -> dict:
    """call_us of several callables (``fns``: name -> fn(i)) with their trials interleaved (one
    trial of each in turn), so a host whose speed drifts during the run (other tenants, clocks)
    slows them alike: name -> median µs a call. A callable that raises is left out; its error
    is under name + '!'."""
    import cupy
    sync = cupy.cuda.Device().synchronize
    calls, samples, out = {}, {}, {}
    for name, fn in fns.items():
        try:
            for i in range(warmup):
                fn(i)
            calls[name] = calls_for(fn, 1)
            samples[name] = []
        except Exception as exc:  # noqa: BLE001 - one variant failing must not hide the others
            out[name + "!"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:120]
    sync()
    for _ in range(trials):
        for name in samples:
            samples[name].append(_trial_us(fns[name], 1, calls[name], sync))
    out.update({name: statistics.median(v) for name, v in samples.items()})
    return out


def calls_for(fn, sets: int, budget_ms: float = 20.0, most: int = 2000) -> int:
    """Calls a trial makes so that it lasts about ``budget_ms`` (from a short first measurement)."""
    rough = call_us(fn, sets, calls=10, trials=1, warmup=2)
    return int(max(10, min(most, budget_ms * 1e3 / max(rough, 1e-3))))


_NOT_KERNELS = ("Activity Buffer Request",)  # device-typed events of the profiler's own


def kernel_us(torch, fn, sets: int = 1, calls: int = 50) -> float:
    """Device time per call (µs) that torch.profiler records over ``calls`` calls of fn(i % sets):
    the sum of every kernel, copy and fill, nvdnn's (launched through CuPy) or PyTorch's."""
    per_call = sum(us for _, us, _ in kernel_table(torch, fn, sets, calls))
    if per_call == 0:  # no device events in this PyTorch's profile: CUDA-event GPU time instead
        _say_once("torch.profiler recorded no kernels: kernel time is CUDA-event GPU time (common.time_ms)")
        return time_ms(fn, sets, iters=calls) * 1e3
    return per_call


def kernel_table(torch, fn, sets: int = 1, calls: int = 50) -> list:
    """(kernel name, device µs per call, launches per call) of every kernel, copy and fill that
    torch.profiler records over ``calls`` calls of fn(i % sets), the longest first."""
    from torch.profiler import ProfilerActivity, profile
    fn(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(calls):
            fn(i % sets)
        torch.cuda.synchronize()
    cuda, names = torch.autograd.DeviceType.CUDA, {}
    for e in prof.events():
        if e.device_type == cuda and not e.name.startswith(_NOT_KERNELS):
            us, count = names.get(e.name, (0.0, 0))
            names[e.name] = (us + e.time_range.elapsed_us(), count + 1)
    return sorted(((name, us / calls, count / calls) for name, (us, count) in names.items()), key=lambda r: -r[1])


@functools.cache
def _say_once(message: str) -> None:
    print(message)


def poison(x) -> None:
    """Every element NaN (all bits set is NaN in float32, float16 and bfloat16), any strides."""
    kind, ones = {2: ("uint16", 0xFFFF), 4: ("uint32", 0xFFFFFFFF)}[x.dtype.itemsize]
    x.view(kind).fill(ones)


def check(torch, nv_out, want, dtype: str) -> float:
    """rms(nvdnn - torch) / rms(torch) over the logical elements; inf where nvdnn left a NaN
    (an element never written) that PyTorch's result does not have."""
    got, want = torch_view(torch, nv_out).float(), want.float()
    if got.numel() != want.numel():
        raise ValueError(f"nvdnn's result has shape {tuple(got.shape)}, PyTorch's {tuple(want.shape)}")
    got, want = got.reshape(want.shape), want
    if bool((torch.isnan(got) & ~torch.isnan(want)).any()):
        return math.inf
    finite = torch.isfinite(want)
    diff = float(torch.linalg.vector_norm((got - want)[finite]))
    return diff / max(float(torch.linalg.vector_norm(want[finite])), 1e-30)


def run_case(torch, nvdnn, case: Case) -> dict:
    """One sweep row: the check, then call time and kernel time of nvdnn and PyTorch, TB/s, ratios."""
    import cupy
    out = dict(family=case.family, name=case.name, moved=case.moved, dtype=case.dtype, tol=case.tol or TOL[case.dtype],
               inputs=", ".join(a.describe() for a in case.inputs))
    try:
        sets = sets_for(case)
        ts, xs = input_sets(torch, case, sets)
        nv_calls = [case.nv(nvdnn, *x) for x in xs]
        pt_calls = [case.pt(torch, *t) for t in ts]
        result = first(nv_calls[0]())
        target = cupy.empty_like(result)
        poison(target)
        with_out(nv_calls[0], target)()
        out["err"] = check(torch, target, first(pt_calls[0]()), case.dtype)
        del result, target
        for who, fns in (("nv", nv_calls), ("pt", pt_calls)):
            def timed(i, fns=fns):
                fns[i]()
            calls = calls_for(timed, sets)
            out[f"{who}_call_us"] = call_us(timed, sets, calls=calls)
            out[f"{who}_kernel_us"] = kernel_us(torch, timed, sets, calls=max(3, min(50, calls // 4)))
        out["ratio"] = out["pt_call_us"] / out["nv_call_us"]
        out["kernel_ratio"] = out["pt_kernel_us"] / max(out["nv_kernel_us"], 1e-3)
        for key in ("nv_call", "nv_kernel", "pt_call", "pt_kernel"):
            out[f"{key}_tbs"] = case.moved / (out[f"{key}_us"] * 1e6)
    except Exception as exc:  # noqa: BLE001 - one row failing must not hide the others
        out["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:160]
    out["ok"] = "error" not in out and out.get("err", math.inf) <= out["tol"]
    return out


def summary(results) -> dict:
    """Per family: geometric mean and worst of the call-time ratio (torch / nvdnn) over the rows
    that pass their check, rows below 1.0x, rows of BIG_BYTES or more below 3.5 TB/s (call), and
    whether the three targets hold (a wrong or failed row fails them)."""
    out = {}
    for family in dict.fromkeys(r["family"] for r in results):
        mine = [r for r in results if r["family"] == family]
        good = [r for r in mine if r["ok"]]
        worst = min(good, key=lambda r: r["ratio"], default=None)
        s = dict(rows=len(mine), timed=len(good),
                 geomean=math.exp(statistics.fmean(math.log(r["ratio"]) for r in good)) if good else None,
                 worst=worst and worst["ratio"], worst_row=worst and worst["name"],
                 below_1=[r["name"] for r in good if r["ratio"] < TARGET_WORST],
                 slow_big=[r["name"] for r in good if r["moved"] >= BIG_BYTES and r["nv_call_tbs"] < TARGET_BIG_TBS],
                 wrong=[r["name"] for r in mine if not r["ok"] and "error" not in r],
                 errors=[r["name"] for r in mine if "error" in r])
        s["geomean_ok"] = s["geomean"] is not None and s["geomean"] >= TARGET_GEOMEAN
        s["worst_ok"] = bool(good) and not (s["below_1"] or s["wrong"] or s["errors"])
        s["big_ok"] = not s["slow_big"] and not s["errors"]
        out[family] = s
    return out


def cell(r: dict) -> dict:
    """A result row as table text."""
    c = {"row": r["name"], "inputs": r["inputs"], "MB": f"{r['moved'] / 2**20:.1f}"}
    if "ratio" in r:
        c["ratio"] = f"{r['ratio']:.2f}x"
        c["kernel ratio"] = f"{r['kernel_ratio']:.2f}x"
        for who, tag in (("nv", "nv"), ("pt", "pt")):
            c[f"{tag} call us"] = f"{r[who + '_call_us']:.1f}"
            c[f"{tag} kernel us"] = f"{r[who + '_kernel_us']:.1f}"
        c["nv call TB/s"] = f"{r['nv_call_tbs']:.2f} ({r['nv_call_tbs'] / COPY_CEILING_TBS:.0%})"
        c["nv kernel TB/s"] = f"{r['nv_kernel_tbs']:.2f} ({r['nv_kernel_tbs'] / COPY_CEILING_TBS:.0%})"
        c["pt call TB/s"] = f"{r['pt_call_tbs']:.2f}"
    if "error" in r:
        c["ratio"], c["check"] = "ERROR", r["error"]
    elif "err" in r:
        c["check"] = f"{r['err']:.1e}" if r["ok"] else f"FAIL {r['err']:.1e} > {r['tol']:.0e}"
        if not r["ok"]:
            c["ratio"] = "FAIL " + c.get("ratio", "")
    return c


COLUMNS = ["row", "inputs", "MB", "ratio", "kernel ratio", "check", "nv call us", "pt call us", "nv kernel us",
           "pt kernel us", "nv call TB/s", "nv kernel TB/s", "pt call TB/s"]


def worst_first(results):
    """Wrong or failed rows first, then the lowest call-time ratio."""
    return sorted(results, key=lambda r: (r["ok"], r.get("ratio", 0.0)))


def flag_line(family: str, s: dict) -> str:
    def mark(ok):
        return "ok" if ok else "MISSED"
    gm = "-" if s["geomean"] is None else f"{s['geomean']:.2f}x"
    worst = "-" if s["worst"] is None else f"{s['worst']:.2f}x ({s['worst_row']})"
    return (f"{family}: {s['rows']} rows, geomean {gm} [>= {TARGET_GEOMEAN}: {mark(s['geomean_ok'])}], worst {worst} "
            f"[none < {TARGET_WORST}: {mark(s['worst_ok'])}; below: {len(s['below_1'])}, wrong: {len(s['wrong'])}, "
            f"errors: {len(s['errors'])}], >= {BIG_BYTES >> 20} MB rows at >= {TARGET_BIG_TBS} TB/s: "
            f"{mark(s['big_ok'])} ({len(s['slow_big'])} short)")
