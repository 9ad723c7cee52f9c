"""Matmul on the GPU against float64 references, NaN-poisoned outputs: every input type and
transposition with the fused epilogues at odd shapes (M, N, K from {1, 7, 129, 1000, 4097}),
K = 1, batch 3 with broadcast, split-K (on Hopper finished in the GEMM's launch: every epilogue,
relaunches and CUDA-graph replays), fp8 with scales and amax, 4096^3 and 8192^3 bf16, and every
tile candidate of a few shapes. A failure names the kernel (spec uri), the first
mismatching index, the worst error and its bound.

The cases are plain data (``CASES``, ``case_plans``), so benchmarks/prewarm_gpu_check.py
compiles exactly their kernels on the CPU beforehand."""
from __future__ import annotations

import math

import numpy as np
import pytest

from .gpu import requires_gpu

pytestmark = requires_gpu

ODD = (1, 7, 129, 1000, 4097)
SHAPES = [(1, 7, 129), (7, 1, 4097), (129, 1000, 7), (1000, 129, 1), (4097, 7, 129), (129, 129, 129),
          (1000, 1000, 1000), (7, 4097, 1000), (1, 4097, 1), (129, 4097, 1000)]
MAJORS = [("k", "k"), ("k", "n"), ("m", "k"), ("m", "n")]
EPILOGUES = {  # name: (bias axis or None, activation, residual, alpha, beta, out dtype or None)
    "plain": (None, None, False, 1.0, 1.0, None),
    "bias_gelu": ("col", "gelu", False, 1.0, 1.0, None),
    "rowbias_relu": ("row", "relu", False, 1.0, 1.0, None),
    "residual_silu": (None, "silu", True, 2.0, 0.5, None),
    "gelu_tanh_f32": ("col", "gelu_tanh", False, 0.5, 1.0, "float32"),
}
# (rel to |ref|, rel to rms(ref)): fp32 accumulation, then the output's rounding
TOL = {"float32": (1e-5, 2e-5), "tf32": (3e-3, 5e-3), "float16": (2e-3, 2e-3), "bfloat16": (1e-2, 8e-3),
       "float8_e4m3": (7e-2, 4e-2), "float8_e5m2": (1.3e-1, 8e-2),
       "fp8_fast": (1e-2, 2e-2)}  # fp8 inputs, tensor-core sums throughout (bf16 output): ~1% of rms seen at K = 4096


def _cases():
    out = []
    for dt in ("bfloat16", "float16"):
        for (m, n, k), (am, bm) in [(s, mj) for s in SHAPES for mj in MAJORS]:
            epi = list(EPILOGUES)[(m + n + k + len(am + bm) * 3 + MAJORS.index((am, bm))) % len(EPILOGUES)]
            out.append(dict(dtype=dt, m=m, n=n, k=k, a_major=am, b_major=bm, epilogue=epi))
        for epi in EPILOGUES:  # every epilogue on the Hopper kernel and the fallback
            out.append(dict(dtype=dt, m=1000, n=1029, k=1032, a_major="k", b_major="k", epilogue=epi))
            out.append(dict(dtype=dt, m=1000, n=1029, k=1031, a_major="k", b_major="k", epilogue=epi))
        out.append(dict(dtype=dt, m=129, n=1000, k=4097, a_major="k", b_major="k", epilogue="bias_gelu", batch="a"))
        out.append(dict(dtype=dt, m=129, n=1000, k=1032, a_major="k", b_major="k", epilogue="residual_silu",
                        batch="b"))
        out.append(dict(dtype=dt, m=7, n=129, k=1000, a_major="m", b_major="n", epilogue="plain", batch="ab"))
        out.append(dict(dtype=dt, m=64, n=64, k=16384, a_major="k", b_major="k", epilogue="bias_gelu", amax=True))
        out.append(dict(dtype=dt, m=100, n=72, k=8200, a_major="k", b_major="n", epilogue="rowbias_relu", split_k=7))
    for precision in ("exact", "tf32"):
        for (m, n, k), (am, bm) in [((129, 1000, 7), ("k", "k")), ((1000, 129, 1), ("m", "n")),
                                    ((1000, 1000, 1000), ("k", "n")), ((7, 4097, 129), ("m", "k")),
                                    ((1, 7, 4097), ("k", "k"))]:
            out.append(dict(dtype="float32", precision=precision, m=m, n=n, k=k, a_major=am, b_major=bm,
                            epilogue="bias_gelu"))
        out.append(dict(dtype="float32", precision=precision, m=129, n=129, k=1000, a_major="k", b_major="k",
                        epilogue="residual_silu", batch="a"))
        for m, n, k, epi in ((1000, 1029, 1032, "bias_gelu"), (7, 129, 4096, "residual_silu"), (4097, 1, 8, "plain")):
            out.append(dict(dtype="float32", precision=precision, m=m, n=n, k=k, a_major="k", b_major="k", epilogue=epi))
        # few float32 rows on the mma kernel, both operands read as they lie (3xTF32 in registers
        # for exact): N-major B, prime sizes, a split K (second-launch sums), a batch
        for m, n, k, (am, bm), epi in ((16, 4099, 8192, ("k", "n"), "bias_gelu"), (33, 1031, 2053, ("m", "n"), "plain"),
                                       (64, 3000, 1000, ("k", "k"), "rowbias_relu"), (9, 520, 768, ("k", "n"),
                                                                                       "residual_silu")):
            out.append(dict(dtype="float32", precision=precision, m=m, n=n, k=k, a_major=am, b_major=bm, epilogue=epi))
        out.append(dict(dtype="float32", precision=precision, m=65, n=67, k=129, a_major="m", b_major="n",
                        epilogue="bias_gelu", batch="ab"))
    # tf32 on wgmma with an M-major A read in registers: a.T @ w.T as it lies; a @ b (N-major b)
    # as y^T = b^T a^T (bias, residual and y transposed; with a batch of a over a broadcast b); a.T
    # @ b with fewer rows than columns the same, a^T copied; split-K finished in the launch
    for m, n, k, (am, bm), epi, extra in ((1000, 1029, 1032, ("m", "k"), "bias_gelu", {}),
                                          (129, 1000, 1032, ("k", "n"), "residual_silu", dict(batch="a")),
                                          (520, 1031, 2053, ("m", "n"), "rowbias_relu", {}),
                                          (1000, 1029, 1031, ("k", "n"), "plain", dict(out_major="m")),
                                          (1535, 767, 3008, ("m", "k"), "bias_gelu", dict(splitk=1))):
        out.append(dict(dtype="float32", precision="tf32", m=m, n=n, k=k, a_major=am, b_major=bm, epilogue=epi,
                        **extra))
    # column-major y (its M stride 1): the epilogue's scalar stores through the strides
    for dt, k, epi in (("bfloat16", 1032, "bias_gelu"), ("float16", 1031, "residual_silu"), ("bfloat16", 1, "plain")):
        out.append(dict(dtype=dt, m=1000, n=1029, k=k, a_major="k", b_major="k", epilogue=epi, out_major="m"))
    out.append(dict(dtype="float8_e4m3", m=1000, n=1029, k=1024, a_major="k", b_major="k", epilogue="rowbias_relu",
                    out="float8_e4m3", amax=True, out_major="m"))
    for a8, b8 in (("float8_e4m3", "float8_e4m3"), ("float8_e5m2", "float8_e4m3")):
        # K of 1040 and 128: an odd count of 128-wide K slices, which the float32 drains take in pairs
        for m, n, k in ((1000, 1029, 1024), (129, 7, 4096), (1, 1000, 1040), (3, 200, 128), (257, 129, 40), (7, 7, 1)):
            for out_dtype in ("bfloat16", "float8_e4m3"):
                out.append(dict(dtype=a8, b_dtype=b8, m=m, n=n, k=k, a_major="k", b_major="k",
                                epilogue="rowbias_relu" if m % 2 else "bias_gelu", out=out_dtype, amax=True))
        out.append(dict(dtype=a8, b_dtype=b8, m=1000, n=1029, k=1040, a_major="k", b_major="k",
                        epilogue="rowbias_relu", out="bfloat16", amax=True, precision="fast"))
    return out + SPLIT_CASES


# split-K finished inside the Hopper GEMM (the last range of a tile sums the partials): odd M, N,
# prime K (repacked), K past a multiple of 64 (the last slice zero-filled), batches, every epilogue
# (``splitk`` only names them: -k splitk); 9 rows and more: 8 or fewer run the skinny kernel
# (heuristic.skinny_rows; its own cases: test_gpu_matmul_skinny.py)
SPLIT_CASES = [
    dict(splitk=1, dtype="bfloat16", m=9, n=4111, k=4093, a_major="k", b_major="k", epilogue="bias_gelu"),
    dict(splitk=1, dtype="float16", m=15, n=1000, k=2056, a_major="k", b_major="k", epilogue="rowbias_relu", amax=True),
    dict(splitk=1, dtype="bfloat16", m=11, n=2056, k=8200, a_major="k", b_major="n", epilogue="residual_silu"),
    dict(splitk=1, dtype="float16", m=13, n=3072, k=3080, a_major="k", b_major="k", epilogue="gelu_tanh_f32"),
    dict(splitk=1, dtype="bfloat16", m=64, n=129, k=4104, a_major="k", b_major="k",
         epilogue="plain", amax=True, batch="a"),
    dict(splitk=1, dtype="float16", m=13, n=4099, k=3001, a_major="m", b_major="n", epilogue="bias_gelu"),
    dict(splitk=1, dtype="bfloat16", m=33, n=520, k=2048, a_major="k", b_major="k",
         epilogue="residual_silu", batch="b"),
    dict(splitk=1, dtype="float16", m=256, n=1000, k=2048, a_major="k", b_major="k",
         epilogue="residual_silu", amax=True),
    dict(splitk=1, dtype="bfloat16", m=15, n=1029, k=4096, a_major="k", b_major="k",
         epilogue="gelu_tanh_f32", amax=True),
    dict(splitk=1, dtype="float8_e4m3", m=9, n=1000, k=4096, a_major="k", b_major="k", epilogue="bias_gelu",
         out="float8_e4m3", amax=True),
    dict(splitk=1, dtype="float8_e4m3", b_dtype="float8_e5m2", m=15, n=1029, k=4160, a_major="k", b_major="k",
         epilogue="rowbias_relu", out="bfloat16", amax=True),
    dict(splitk=1, dtype="float32", precision="tf32", m=15, n=3072, k=768, a_major="k", b_major="k",
         epilogue="bias_gelu"),
    dict(splitk=1, dtype="float32", precision="exact", m=500, n=1029, k=4096, a_major="k", b_major="k",
         epilogue="residual_silu"),   # (fewer rows run the mma kernel: heuristic.mma_reads_in_place)
    # the last partial wave split (132 SMs): whole waves first (132 or 264 tiles), 128 x 192
    # tiles, MN-major operands, a prime K, fp8 drained in pairs, tf32
    dict(splitk=1, dtype="bfloat16", m=3071, n=1537, k=8200, a_major="k", b_major="k", epilogue="bias_gelu"),
    dict(splitk=1, dtype="float16", m=2047, n=2049, k=3001, a_major="k", b_major="k", epilogue="residual_silu"),
    dict(splitk=1, dtype="bfloat16", m=4093, n=1031, k=3001, a_major="k", b_major="k", epilogue="gelu_tanh_f32"),
    dict(splitk=1, dtype="bfloat16", m=1024, n=1032, k=8200, a_major="m", b_major="n", epilogue="rowbias_relu"),
    dict(splitk=1, dtype="float8_e4m3", m=3071, n=767, k=8200, a_major="k", b_major="k", epilogue="rowbias_relu",
         out="bfloat16", amax=True),
    dict(splitk=1, dtype="float32", precision="tf32", m=1535, n=767, k=3008, a_major="k", b_major="k",
         epilogue="bias_gelu"),
]

CASES = _cases()


def _name(c):
    return "-".join(f"{k}={v}" for k, v in c.items())


# -- building inputs ------------------------------------------------------------------------------

def _host_values(shape, dtype, rng, scale=1.0):
    """Random values exactly representable in ``dtype`` (fp8: through ml_dtypes)."""
    import ml_dtypes
    from nvdnn import dtypes
    v = rng.uniform(-scale, scale, size=shape).astype(np.float32)
    if dtype.startswith("float8"):
        h = v.astype(dtypes.BY_NAME[dtype].host)
        return h.view(np.uint8), h.astype(np.float64)
    h = v.astype(dtypes.BY_NAME[dtype].np)
    return h, h.astype(np.float64)


def _matrix(rows, cols, dtype, major_first: bool, batch: int, rng, scale=1.0):
    """A (batch?, rows, cols) device array whose first logical dim is contiguous when
    ``major_first`` (a transposed view), and its float64 value."""
    import cupy
    lead = (batch,) if batch else ()
    if major_first:
        h, v = _host_values(lead + (cols, rows), dtype, rng, scale)
        return cupy.asarray(h).swapaxes(-1, -2), np.swapaxes(v, -1, -2)
    h, v = _host_values(lead + (rows, cols), dtype, rng, scale)
    return cupy.asarray(h), v


def _operand(x, dtype):
    from nvdnn import arrays
    from nvdnn.kernels.pointwise import Operand
    return Operand(dtype, tuple(x.shape), tuple(s // x.itemsize for s in x.strides), arrays.alignment(x.data.ptr))


def build(case, rng):
    """Device inputs, float64 values and the keyword arguments of nvdnn.matmul for a case."""
    import cupy
    c = dict(case)
    dt, bdt = c["dtype"], c.get("b_dtype", c["dtype"])
    m, n, k = c["m"], c["n"], c["k"]
    batch = c.get("batch", "")
    fp8 = dt.startswith("float8")
    scale = 1.0 if not fp8 else 2.0
    a, a64 = _matrix(m, k, dt, c["a_major"] == "m", 3 if "a" in batch else 0, rng, scale)
    b, b64 = _matrix(k, n, bdt, c["b_major"] == "k", 3 if "b" in batch else 0, rng, scale)
    bias_axis, act, residual, alpha, beta, out_dtype = EPILOGUES[c["epilogue"]]
    out_dtype = c.get("out", out_dtype)
    epi_dt = "bfloat16" if fp8 else ("float32" if dt == "float32" else dt)
    kw = dict(alpha=alpha, activation=act, precision=c.get("precision", "exact"))
    values = {}
    if bias_axis:
        bias, values["bias"] = _matrix(1, m if bias_axis == "row" else n, epi_dt, False, 0, rng)
        kw["bias"], kw["bias_axis"] = bias[0], bias_axis
        values["bias"] = values["bias"][0]
    lead = (3,) if batch else ()
    if residual:
        r, values["residual"] = _matrix(m, n, epi_dt, False, 3 if batch else 0, rng)
        kw["residual"], kw["beta"] = r, beta
    if fp8:
        kw.update(a_dtype=dt, b_dtype=bdt, scale_a=cupy.asarray([0.5], cupy.float32),
                  scale_b=cupy.asarray([1.5], cupy.float32))
        values.update(scale_a=0.5, scale_b=1.5)
        if out_dtype and out_dtype.startswith("float8"):
            kw["scale_out"] = cupy.asarray([0.25], cupy.float32)
            values["scale_out"] = 0.25
    if c.get("amax"):
        kw["amax"] = cupy.full(1, np.nan, cupy.float32)
    if c.get("split_k"):
        kw["split_k"] = c["split_k"]
    kind = out_dtype or ("bfloat16" if fp8 else dt)
    shape = lead + (m, n)
    from nvdnn import dtypes
    stored = lead + (n, m) if c.get("out_major") == "m" else shape
    out = cupy.full(stored, 0xFF, np.uint8) if kind.startswith("float8") else cupy.full(stored, np.nan,
                                                                                       dtypes.BY_NAME[kind].np)
    if c.get("out_major") == "m":
        out = out.swapaxes(-1, -2)
    if kind.startswith("float8"):
        kw["dtype"] = kind
    elif out_dtype:
        kw["dtype"] = kind
    return dict(a=a, b=b, a64=a64, b64=b64, kw=kw, values=values, out=out, kind=kind, act=act)


def case_plans(case, arch="sm_90", sms=132, tile=None):
    """The family plans nvdnn.matmul makes for a case (deviceless: for the pre-warm)."""
    from nvdnn import compiler  # noqa: F401
    from nvdnn.kernels import matmul as mm
    from nvdnn.kernels.pointwise import Operand
    c = dict(case)
    dt, bdt = c["dtype"], c.get("b_dtype", c["dtype"])
    m, n, k = c["m"], c["n"], c["k"]
    batch = c.get("batch", "")

    def op(rows, cols, dtype, major_first, batched):
        lead = (3,) if batched else ()
        if major_first:
            strides = ((rows * cols,) if batched else ()) + (1, rows)
        else:
            strides = ((rows * cols,) if batched else ()) + (cols, 1)
        return Operand(dtype, lead + (rows, cols), strides, 16)

    bias_axis, act, residual, alpha, beta, out_dtype = EPILOGUES[c["epilogue"]]
    out_dtype = c.get("out", out_dtype)
    fp8 = dt.startswith("float8")
    epi_dt = "bfloat16" if fp8 else ("float32" if dt == "float32" else dt)
    from nvdnn.functional_anchors import _activation
    from nvdnn.graph.ops import SCHEMAS
    a_ = _activation(act, {})
    steps = () if a_ is None else ((SCHEMAS[a_[0]].kernel_op, ""),)
    params = () if a_ is None else tuple(a_[1])
    return mm.plan_matmul(op(m, k, dt, c["a_major"] == "m", "a" in batch), op(k, n, bdt, c["b_major"] == "k",
                                                                              "b" in batch),
                          bias=Operand(epi_dt, (m if bias_axis == "row" else n,), (1,)) if bias_axis else None,
                          bias_axis=bias_axis or "col",
                          residual=op(m, n, epi_dt, False, bool(batch)) if residual else None, alpha=alpha, beta=beta,
                          epilogue=steps, params=params, out_dtype=out_dtype, precision=c.get("precision", "exact"),
                          amax=bool(c.get("amax")), arch=arch, split_k=c.get("split_k"), sms=sms, tile=tile)


def reference(case, built, product=None):
    """nvdnn.reference.matmul of the case; with ``product`` (a @ b in float64, computed
    elsewhere) only its epilogue, on the host."""
    from nvdnn import reference as ref
    v = built["values"]
    _, act, _, alpha, beta, _ = EPILOGUES[case["epilogue"]]
    a64, b64 = built["a64"], built["b64"]
    if product is not None:  # a @ I: the reference's epilogue on a product made elsewhere
        a64, b64 = product, None
    return ref.matmul_chain(a64, b64, v.get("bias"), bias_axis=EPILOGUES[case["epilogue"]][0] or "col",
                            alpha=alpha, beta=beta, residual=v.get("residual"), activation=act,
                            scale_a=v.get("scale_a", 1.0), scale_b=v.get("scale_b", 1.0),
                            scale_out=v.get("scale_out"), return_amax=True)


def compare(got, want, kind, what, k):
    """Every element written (no NaN where the reference has none), within the dtype's bound."""
    got = np.asarray(got, dtype=np.float64)
    rel, rms_rel = TOL[kind]
    rms = float(np.sqrt(np.mean(want ** 2))) if want.size else 0.0
    if kind == "float32":
        rms_rel *= max(1.0, math.sqrt(k) / 16)
    bound = rel * np.abs(want) + rms_rel * rms + 1e-30
    err = np.abs(got - want)
    bad = ~(err <= bound)  # NaN counts as bad
    if bad.any():
        first = np.unravel_index(int(np.argmax(bad)), bad.shape)
        worst = np.unravel_index(int(np.nanargmax(np.where(np.isnan(err), np.inf, err / bound))), bad.shape)
        raise AssertionError(f"{what}: {int(bad.sum())} of {bad.size} wrong; first at {first}: got {got[first]} "
                             f"want {want[first]}; worst at {worst}: got {got[worst]} want {want[worst]} (bound "
                             f"{bound[worst]:.3g}, rms(ref) {rms:.3g}); NaN left: {int(np.isnan(got).sum())}")


def _decode(y, kind):
    from nvdnn import dtypes
    h = y.get()
    if kind.startswith("float8"):
        return h.view(dtypes.BY_NAME[kind].host).astype(np.float64)
    return h.astype(np.float64)


def _uris(case):
    try:
        return " | ".join(l.spec.uri for l in case_plans(case).launches)
    except Exception as exc:  # noqa: BLE001 - a diagnostic only
        return f"(plan failed: {exc})"


def _tolerance_kind(case, kind):
    if case["dtype"] == "float32":
        return "tf32" if case.get("precision") == "tf32" else "float32"
    if kind.startswith("float8"):
        return kind
    if case["dtype"].startswith("float8"):
        return "fp8_fast" if case.get("precision") == "fast" else "bfloat16"
    return case["dtype"] if kind != "float32" else case["dtype"]


@pytest.mark.parametrize("case", CASES, ids=_name)
def test_matmul_against_float64(case):
    import nvdnn
    rng = np.random.default_rng(abs(hash(_name(case))) % (1 << 32))
    built = build(case, rng)
    y = nvdnn.matmul(built["a"], built["b"], out=built["out"], **built["kw"])
    want, amax = reference(case, built)
    what = f"{_name(case)} [{_uris(case)}]"
    compare(_decode(y, built["kind"]), want, _tolerance_kind(case, built["kind"]), what, case["k"])
    if case.get("amax"):
        got = float(built["kw"]["amax"].get()[0])
        assert math.isclose(got, amax, rel_tol=1e-2, abs_tol=1e-6), f"{what}: amax {got}, reference {amax}"


BIG = [dict(dtype="bfloat16", m=4096, n=4096, k=4096, a_major="k", b_major="k", epilogue="rowbias_relu"),
       dict(dtype="float16", m=4096, n=4096, k=4096, a_major="k", b_major="n", epilogue="plain"),
       dict(dtype="bfloat16", m=8192, n=8192, k=8192, a_major="k", b_major="k", epilogue="plain"),
       dict(dtype="float8_e4m3", m=4096, n=4096, k=4096, a_major="k", b_major="k", epilogue="rowbias_relu",
            out="bfloat16", amax=True),
       dict(dtype="float8_e4m3", m=4096, n=4096, k=4096, a_major="k", b_major="k", epilogue="rowbias_relu",
            out="bfloat16", amax=True, precision="fast")]


@pytest.mark.parametrize("case", BIG, ids=_name)
def test_large_matmul_against_float64(case):
    """The float64 product on the GPU (cuBLAS DGEMM), the epilogue on the host."""
    import cupy
    import nvdnn
    rng = np.random.default_rng(5)
    built = build(case, rng)
    y = nvdnn.matmul(built["a"], built["b"], out=built["out"], **built["kw"])
    prod = (cupy.asarray(built["a64"]) @ cupy.asarray(built["b64"])).get()
    want, amax = reference(case, built, product=prod)
    what = f"{_name(case)} [{_uris(case)}]"
    compare(_decode(y, built["kind"]), want, _tolerance_kind(case, built["kind"]), what, case["k"])
    if case.get("amax"):
        got = float(built["kw"]["amax"].get()[0])
        assert math.isclose(got, amax, rel_tol=1e-2), f"{what}: amax {got}, reference {amax}"


def plan_tensors(built, out):
    """The tensors of a plan's launches (role -> array) for a built case, writing ``out``."""
    tensors = {"a": built["a"], "b": built["b"], "y": out}
    for role in ("bias", "residual", "scale_a", "scale_b", "scale_out", "amax"):
        if built["kw"].get(role) is not None:
            tensors[role] = built["kw"][role]
    return tensors


TILE_CASES = [dict(dtype="bfloat16", m=1000, n=1029, k=1032, a_major="k", b_major="k", epilogue="bias_gelu"),
              dict(dtype="float16", m=257, n=520, k=1032, a_major="m", b_major="n", epilogue="residual_silu"),
              dict(dtype="float32", precision="tf32", m=257, n=520, k=1000, a_major="k", b_major="k",
                   epilogue="plain"),
              dict(dtype="float32", precision="exact", m=33, n=1031, k=2056, a_major="k", b_major="n",
                   epilogue="bias_gelu"),
              dict(dtype="float8_e4m3", m=1000, n=1029, k=1024, a_major="k", b_major="k", epilogue="rowbias_relu",
                   out="bfloat16", amax=True)]


def tile_plans(case, arch="sm_90", sms=132):
    """Every candidate tile of a case's heuristic plan (and the mma / simt fallbacks of wgmma)."""
    from nvdnn.kernels import matmul as mm
    base = case_plans(case, arch, sms)
    spec = [l.spec for l in base.launches if isinstance(l.spec, mm.MatmulSpec)][0]
    return mm.candidates(spec)


@pytest.mark.parametrize("case", TILE_CASES, ids=_name)
def test_every_tile_candidate(case):
    import cupy
    from nvdnn import launcher
    from nvdnn.kernels import matmul as mm
    rng = np.random.default_rng(3)
    built = build(case, rng)
    want, amax = reference(case, built)
    base = case_plans(case, sms=cupy.cuda.Device().attributes["MultiProcessorCount"])
    failures = []
    for tile in tile_plans(case):
        plan = case_plans(case, sms=cupy.cuda.Device().attributes["MultiProcessorCount"], tile=tile)
        got_spec = [l.spec for l in plan.launches if isinstance(l.spec, mm.MatmulSpec)][0]
        out = built["out"].copy()
        out.fill(np.nan) if out.dtype != np.uint8 else out.fill(0xFF)
        kw = built["kw"]
        launcher.run(plan, plan_tensors(built, out))
        try:
            compare(_decode(out, built["kind"]), want, _tolerance_kind(case, built["kind"]), got_spec.uri, case["k"])
            if case.get("amax"):
                got = float(kw["amax"].get()[0])
                assert math.isclose(got, amax, rel_tol=1e-2), f"{got_spec.uri}: amax {got}, reference {amax}"
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} candidates wrong (heuristic {base.launches[-1].spec.uri}):\n" + \
        "\n".join(failures)


RELAUNCH_CASES = [dict(dtype="bfloat16", m=9, n=1029, k=k, a_major="k", b_major="k", epilogue="bias_gelu")
                  for k in (2056, 1288, 1032)]   # one split-K kernel (64 x 64 tiles), three split counts


def test_split_k_plans_relaunched_and_replayed_from_a_graph():
    """One-launch split-K (common/grid_finish.cuh's counters, reset by each tile's last split):
    one kernel at three split counts back to back with fresh inputs and no sync between them,
    the same bits on a rerun, then two launches captured in a CUDA graph replayed twice."""
    import cupy
    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    cases = RELAUNCH_CASES
    plans = [case_plans(c, sms=sms) for c in cases]
    specs = {p.launches[-1].spec for p in plans}
    assert len(specs) == 1 and next(iter(specs)).finish, [p.launches[-1].spec.uri for p in plans]
    relaunch_and_replay(cases, plans, 21, "split-K")


def relaunch_and_replay(cases, plans, seed, what):
    """Runs one kernel's plans back to back with fresh inputs and no sync between them (cases
    0, 1, 0, 2, 0, 1), checks each against the reference, the same bits on a rerun, then two
    launches captured in a CUDA graph replayed twice."""
    import cupy
    from nvdnn import launcher
    rng = np.random.default_rng(seed)
    runs = []
    for i in (0, 1, 0, 2, 0, 1):
        built = build(cases[i], rng)
        launcher.run(plans[i], plan_tensors(built, built["out"]))
        runs.append((cases[i], built, plans[i]))
    for c, built, _ in runs:
        compare(_decode(built["out"], "bfloat16"), reference(c, built)[0], "bfloat16", f"back to back, K {c['k']}",
                c["k"])
    c, built, plan = runs[0]
    again = cupy.full_like(built["out"], np.nan)
    launcher.run(plan, plan_tensors(built, again))
    assert (again.view(cupy.uint16) == built["out"].view(cupy.uint16)).all(), f"{what} gave other bits on a rerun"
    outs = [cupy.full_like(built["out"], np.nan) for _ in range(2)]
    workspace = cupy.empty(launcher.scratch_layout(plan)[1], dtype=cupy.uint8)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        stream.begin_capture()
        for y in outs:
            launcher.run(plan, plan_tensors(built, y), workspace=workspace, stream=stream)
        graph = stream.end_capture()
    want = reference(c, built)[0]
    for replay in range(2):
        with stream:
            for y in outs:
                y.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
        for y in outs:
            compare(_decode(y, "bfloat16"), want, "bfloat16", f"graph replay {replay}", c["k"])
            assert (y.view(cupy.uint16) == built["out"].view(cupy.uint16)).all(), "graph replay: other bits"


def test_unsupported_requests_are_refused_with_a_reason():
    import cupy
    import nvdnn
    from nvdnn.errors import DTypeError, ValidationError
    a = cupy.zeros((8, 8), cupy.uint8)
    with pytest.raises(DTypeError, match="declare its fp8 type"):
        nvdnn.matmul(a, a)
    with pytest.raises(ValidationError, match="contracted dims"):
        nvdnn.matmul(cupy.zeros((4, 5), cupy.float16), cupy.zeros((6, 3), cupy.float16))


def matmul_graphs(arch="sm_90"):
    """Graphs of the graph test (deviceless builds: the pre-warm compiles their chosen kernels):
    bf16 x @ w.T + b -> GELU -> * 0.5 (wgmma, fused epilogue), and fp8 with scales -> ReLU and
    the amax of that (folded into the kernel)."""
    import nvdnn
    g = nvdnn.Graph(io_data_type="bfloat16", name="matmul_bias_gelu", arch=arch)
    x, w = g.tensor(dims=[3, 1000, 1032], name="x"), g.tensor(dims=[1032, 1029], strides=[1, 1032], name="w")
    b = g.tensor(dims=[1029], name="b")
    g.scale(g.gelu(g.matmul(x, w, b)), 0.5, name="y").set_output(True)
    f = nvdnn.Graph(io_data_type="bfloat16", name="matmul_fp8", arch=arch)
    x8 = f.tensor(dims=[1000, 1024], data_type="float8_e4m3", name="x")
    w8 = f.tensor(dims=[1024, 1029], strides=[1, 1024], data_type="float8_e4m3", name="w")
    sa, sb = (f.tensor(dims=[1], data_type="float32", name=n) for n in ("sa", "sb"))
    y8 = f.relu(f.matmul(x8, w8, scale_a=sa, scale_b=sb), name="y").set_output(True)
    f.amax(y8, name="m").set_output(True).set_data_type("float32")
    return [g, f]


def test_graph_execute_and_capture():
    """The graph path launches the Hopper kernel with its tensor maps resolved at each launch."""
    import cupy
    import ml_dtypes

    import nvdnn
    from nvdnn import reference as ref
    g, f = matmul_graphs(arch=None)
    g.build()
    rng = np.random.default_rng(9)
    x, x64 = _matrix(1000, 1032, "bfloat16", False, 3, rng)
    w, w64 = _matrix(1032, 1029, "bfloat16", True, 0, rng)
    b, b64 = _matrix(1, 1029, "bfloat16", False, 0, rng)
    y = cupy.full((3, 1000, 1029), np.nan, ml_dtypes.bfloat16)
    g.execute({"x": x, "w": w, "b": b[0], "y": y})
    want = ref.gelu(x64 @ w64 + b64[0]) * 0.5
    compare(y.get().astype(np.float64), want, "bfloat16", f"graph [{g.candidates[0][g.chosen[0]].uri}]", 1032)
    y.fill(np.nan)
    g.capture({"x": x, "w": w, "b": b[0], "y": y}).replay()
    cupy.cuda.Device().synchronize()
    compare(y.get().astype(np.float64), want, "bfloat16", "graph capture replay", 1024)
    key = b"a 32-byte signing key, for tests"
    signed = nvdnn.Graph.deserialize(g.serialize(key=key), key=key)  # the wgmma kernel, verified and loaded
    y.fill(np.nan)
    signed.execute({"x": x, "w": w, "b": b[0], "y": y})
    compare(y.get().astype(np.float64), want, "bfloat16", "signed blob", 1032)
    f.build()
    a8, a64 = _matrix(1000, 1024, "float8_e4m3", False, 0, rng, 2.0)
    w8, w864 = _matrix(1024, 1029, "float8_e4m3", True, 0, rng, 2.0)
    y8, m = cupy.full((1000, 1029), np.nan, ml_dtypes.bfloat16), cupy.full((), np.nan, cupy.float32)
    assert len(f.groups) == 1  # the amax folded into the matmul
    f.execute({"x": a8, "w": w8, "sa": cupy.asarray([0.5], cupy.float32), "sb": cupy.asarray([3.0], cupy.float32),
               "y": y8, "m": m})
    want8 = np.maximum(1.5 * (a64 @ w864), 0)
    compare(y8.get().astype(np.float64), want8, "bfloat16", f"fp8 graph [{f.candidates[0][f.chosen[0]].uri}]", 1024)
    assert math.isclose(float(m.get()), want8.max(), rel_tol=2e-3), (float(m.get()), want8.max())


def test_out_must_hold_the_output_type_and_not_overlap_the_inputs():
    import cupy

    import nvdnn
    from nvdnn.errors import DTypeError, ValidationError
    a = cupy.random.standard_normal((64, 64), dtype=cupy.float32).astype(cupy.float16)
    b = cupy.random.standard_normal((64, 64), dtype=cupy.float32).astype(cupy.float16)
    with pytest.raises(DTypeError, match="uint8 holds fp8 bytes"):
        nvdnn.matmul(a, b, out=cupy.empty((64, 64), cupy.uint8))
    with pytest.raises(DTypeError) as info:
        nvdnn.matmul(a, b, dtype="float32", out=cupy.empty((64, 64), cupy.float16))
    assert info.value.arg == "out"
    with pytest.raises(ValidationError, match="shares memory with a"):
        nvdnn.matmul(a, b, out=a)
    r = cupy.random.standard_normal((64, 64), dtype=cupy.float32).astype(cupy.float16)
    want = a.astype(cupy.float64) @ b.astype(cupy.float64) + r.astype(cupy.float64)
    nvdnn.matmul(a, b, residual=r, out=r)  # in place on the residual: each element read, then written
    assert float(cupy.abs(r.astype(cupy.float64) - want).max()) < 0.1


def test_an_empty_product_sets_amax_to_zero():
    import cupy

    import nvdnn
    amax = cupy.full(1, 7.0, cupy.float32)
    y = nvdnn.matmul(cupy.ones((0, 8), cupy.float16), cupy.ones((8, 4), cupy.float16), amax=amax)
    assert y.shape == (0, 4) and float(amax[0]) == 0.0
