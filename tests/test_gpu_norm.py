"""Norm family on the GPU against float64 NumPy: layer / RMS norm and softmax / log-softmax,
forward and backward, every dtype, outputs poisoned (NaN) first, at the benchmark shapes and odd
ones (rows of 1, 7, 1000, 65537 elements; one row; primes and vocabulary sizes, read as shifted
16-byte vectors), every long-row strategy (persistent cluster, cluster, two passes), fused
options (residual, epilogue, cast, mask, causal), strided views."""
from __future__ import annotations

import numpy as np
import pytest

from nvdnn import compiler, dtypes, launcher, runtime
from nvdnn import reference as ref
from nvdnn.dtypes import of_array
from nvdnn.kernels import norm
from nvdnn.kernels.pointwise import Operand

from .gpu import check, poisoned, random, requires_gpu

pytestmark = requires_gpu
DTYPES = ("float32", "float16", "bfloat16")
# (rows, L): odd lengths and counts, one row, the benchmark classes (short, medium, long)
SHAPES = [(1, 1), (7, 7), (3, 1000), (2, 65537), (1, 4096), (33, 4096), (1000, 128), (257, 100), (5, 16384),
          (2, 40000), (3, 262144)]

# (rows, L): odd lengths, primes and vocabulary sizes (fewer rows as they grow); rows of each
# start at every place within a vector
ODD = [(5, 1), (9, 3), (33, 7), (17, 127), (9, 1021), (6, 4099), (3, 32000), (3, 50257), (2, 128256)]


def targets(L: int):
    """The portable plan, and the device's where it differs (long rows: a persistent cluster)."""
    return (None, arch()) if L > 16384 else (None,)


def shifted(plan, L: int) -> None:
    """Rows of odd length read 16-byte vectors (shifted), not elements one at a time."""
    for launch in plan.launches:
        spec = launch.spec
        if isinstance(spec, norm.RowSpec):
            assert spec.vec > 1 and spec.shift == (L % spec.vec != 0), spec.uri


def arch() -> str:
    return compiler.device_arch()


def operand(a) -> Operand:
    align = 16
    while align > 1 and a.data.ptr % align:
        align //= 2
    return Operand(of_array(a, arg="x").name, tuple(a.shape), tuple(s // a.itemsize for s in a.strides), align)


def uniform(shape, dtype, low, high):
    return random(shape, dtype, low, high)


def check_scaled(got, want, dtype, what):
    """Sums over many terms: errors relative to the largest magnitude, not to each element."""
    got = got.get() if hasattr(got, "get") else np.asarray(got)
    scale = max(1.0, float(np.abs(want).max()))
    check(got.astype(np.float64) / scale, np.asarray(want) / scale, dtype, what)


def run(plan, **tensors):
    launcher.run(plan, tensors)


# -- layer norm / RMS norm forward --------------------------------------------------------------------

def layer_norm_with_stats(xs, gs, bs, dtype, target):
    """Layer norm (gamma, beta, saved mean and rstd) of (device, float64) pairs x, gamma, beta
    against the reference; its plan."""
    (x, x64), (g, g64), (b, b64) = xs, gs, bs
    rows, L = x.shape
    y, mean, rstd = poisoned((rows, L), dtype), poisoned((rows,), "float32"), poisoned((rows,), "float32")
    plan = norm.plan_layer_norm(operand(x), 1, gamma=operand(g), beta=operand(b), save_stats=True, eps=1e-5,
                                arch=target)
    run(plan, y=y, x=x, gamma=g, beta=b, mean=mean, rstd=rstd)
    want, want_mean, want_rstd = ref.layer_norm(x64, g64, b64, eps=1e-5, return_stats=True)
    what = f"layer_norm {rows}x{L} {plan.launches[0].spec.uri}"
    check(y, want, dtype, what)
    check(mean, want_mean, "float32", what + " mean")
    check(rstd, want_rstd, "float32", what + " rstd")
    return plan


def norm_inputs(rows: int, L: int, dtype: str):
    """x, gamma, beta: (device, float64) pairs."""
    return random((rows, L), dtype), uniform((L,), dtype, 0.5, 1.5), uniform((L,), dtype, -0.5, 0.5)


@pytest.mark.parametrize("rows,L", SHAPES + ODD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_and_rms_norm(rows, L, dtype):
    (x, x64), (g, g64), (b, b64) = norm_inputs(rows, L, dtype)
    for target in targets(L):
        shifted(layer_norm_with_stats((x, x64), (g, g64), (b, b64), dtype, target), L)
        y = poisoned((rows, L), dtype)
        plan = norm.plan_rms_norm(operand(x), 1, gamma=operand(g), eps=1e-6, arch=target)
        shifted(plan, L)
        run(plan, y=y, x=x, gamma=g)
        check(y, ref.rms_norm(x64, g64, eps=1e-6), dtype, f"rms_norm {rows}x{L} {plan.launches[0].spec.uri}")
        y = poisoned((rows, L), dtype)
        run(norm.plan_layer_norm(operand(x), 1, arch=target), y=y, x=x)
        check(y, ref.layer_norm(x64), dtype, f"layer_norm without affine {rows}x{L}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_mean_small_spread_is_stable(dtype):
    base, base64 = random((64, 4096), dtype, -1.0, 1.0)
    x = (base + 300).astype(base.dtype)
    x64 = x.get().astype(np.float64)
    y = poisoned(x.shape, dtype)
    run(norm.plan_layer_norm(operand(x), 1), y=y, x=x)
    want = ref.layer_norm(x64)
    if dtype == "float32":
        # float32 cannot hold the mean closer than half an ulp of 300 (1.5e-5): (x - mean) * rstd
        # carries ~3e-5 of that alone; a one-pass E[x^2] - E[x]^2 would be off by ~1e-2
        got = y.get().astype(np.float64)
        assert not np.isnan(got).any() and np.abs(got - want).max() < 1e-4, "mean 300, spread 1"
    else:
        check(y, want, dtype, "mean 300, spread 1")


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_residual_epilogue_and_cast(dtype):
    rows, L = 129, 4096
    x, x64 = random((rows, L), dtype)
    r, r64 = random((rows, L), "float32")
    g, g64 = uniform((L,), dtype, 0.5, 1.5)
    # h = x + residual summed in float32, then rounded to x's dtype, as the kernel does (a float64
    # sum rounded once differs in rare double-rounding cases by an ulp of x's dtype)
    h64 = (x64.astype(np.float32) + r64.astype(np.float32)).astype(dtypes.BY_NAME[dtype].np).astype(np.float64)
    out = "bfloat16" if dtype == "float32" else "float32"
    y, h = poisoned((rows, L), out), poisoned((rows, L), dtype)
    plan = norm.plan_rms_norm(operand(x), 1, gamma=operand(g), residual=operand(r), write_sum=True,
                              epilogue=[("gelu", ""), ("mul", "p")], params=(0.5,), out_dtype=out)
    run(plan, y=y, x=x, residual=r, h=h, gamma=g)
    check(h, h64, dtype, "h = x + residual")
    check(y, 0.5 * ref.gelu(ref.rms_norm(h64, g64)), out, "gelu(rms_norm(h)) * 0.5")
    y = poisoned((rows, L), dtype)
    plan = norm.plan_layer_norm(operand(x), 1, gamma=operand(g), residual=operand(r),
                                epilogue=[("relu", "")], params=(0.0, np.inf))
    run(plan, y=y, x=x, residual=r, gamma=g)
    check(y, ref.relu(ref.layer_norm(h64, g64)), dtype, "relu(layer_norm(x + residual))")


def test_normalized_ndim_2_and_strided_views():
    x, x64 = random((6, 8, 130), "float32")
    y = poisoned((6, 8, 128), "float32")
    view, view64 = x[:, :, 1:129], x64[:, :, 1:129]  # misaligned rows of a wider tensor
    run(norm.plan_layer_norm(operand(view), 1), y=y, x=view)
    check(y, ref.layer_norm(view64), "float32", "row slices, misaligned")
    full, full64 = random((6, 8, 128), "bfloat16")
    y = poisoned((6, 8, 128), "bfloat16")
    run(norm.plan_layer_norm(operand(full), 2), y=y, x=full)
    check(y, ref.layer_norm(full64, normalized_ndim=2), "bfloat16", "normalized_ndim=2")
    t, t64 = random((300, 40), "float16")
    y = poisoned((40, 300), "float16")
    run(norm.plan_rms_norm(operand(t.T), 1), y=y, x=t.T)
    check(y, ref.rms_norm(t64.T), "float16", "transposed (strided elements)")
    y = poisoned((300, 40), "float16")
    run(norm.plan_rms_norm(operand(t[::-1]), 1), y=y, x=t[::-1])
    check(y, ref.rms_norm(t64[::-1]), "float16", "negative row stride")


# -- softmax forward --------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,L", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_and_log_softmax(rows, L, dtype):
    x, x64 = random((rows, L), dtype, -8.0, 8.0)
    for target in (None, arch()) if L > 32768 else (None,):
        for log in (False, True):
            y = poisoned((rows, L), dtype)
            plan = norm.plan_softmax(operand(x), -1, log=log, arch=target)
            run(plan, y=y, x=x)
            want = ref.log_softmax(x64) if log else ref.softmax(x64)
            check(y, want, dtype, f"{'log_' if log else ''}softmax {rows}x{L} {plan.launches[0].spec.uri}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_masks_causal_and_fully_masked_rows(dtype):
    b, h, sq, sk = 2, 3, 100, 130
    x, x64 = random((b, h, sq, sk), dtype)
    mask, mask64 = random((sq, sk), "bfloat16", -2.0, 2.0)
    for log in (False, True):
        y = poisoned(x.shape, dtype)
        run(norm.plan_softmax(operand(x), -1, log=log, mask=operand(mask), causal=True), y=y, x=x, mask=mask)
        f = ref.log_softmax if log else ref.softmax
        check(y, f(x64, mask=mask64, causal=True), dtype, f"mask + causal, log={log}")
    keys = np.zeros((sk,), np.float32)
    keys[::3] = -np.inf
    import cupy
    pad, pad64 = cupy.asarray(keys), keys.astype(np.float64)
    y = poisoned(x.shape, dtype)
    run(norm.plan_softmax(operand(x), -1, mask=operand(pad)), y=y, x=x, mask=pad)
    check(y, ref.softmax(x64, mask=pad64), dtype, "key padding mask (L,)")
    # Sk < Sq: the first Sq - Sk rows see nothing: 0 from softmax, -inf from log_softmax, never NaN
    x2, x264 = random((4, 9, 5), dtype)
    for log in (False, True):
        y = poisoned(x2.shape, dtype)
        run(norm.plan_softmax(operand(x2), -1, log=log, causal=True), y=y, x=x2)
        got = y.get().astype(np.float64)
        assert not np.isnan(got).any()
        check(y, (ref.log_softmax if log else ref.softmax)(x264, causal=True), dtype, f"fully masked rows, log={log}")
    rowmask = cupy.full((4, 9, 1), -np.inf, dtype=cupy.float32)
    y = poisoned(x2.shape, dtype)
    run(norm.plan_softmax(operand(x2), -1, mask=operand(rowmask)), y=y, x=x2, mask=rowmask)
    assert (y.get() == 0).all()


@pytest.mark.parametrize("shape,axis", [((7, 13, 3), 1), ((2, 50, 24), 1), ((64, 5), 0), ((3, 4, 5, 6), 1),
                                        ((5, 1000, 16), 1)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_along_inner_axes(shape, axis, dtype):
    x, x64 = random(shape, dtype, -8.0, 8.0)
    for log in (False, True):
        y = poisoned(shape, dtype)
        plan = norm.plan_softmax(operand(x), axis, log=log)
        assert plan.launches[0].spec.family == "softmax_cols"
        run(plan, y=y, x=x)
        check(y, (ref.log_softmax if log else ref.softmax)(x64, axis), dtype, f"axis {axis} of {shape}, log={log}")
        dy, dy64 = random(shape, dtype)
        y64 = y.get().astype(np.float64)  # the forward's output, rounded as the backward sees it
        dx = poisoned(shape, dtype)
        run(norm.plan_softmax_backward(operand(dy), operand(y), axis, log=log), dx=dx, dy=dy, y=y)
        backward = ref.log_softmax_backward if log else ref.softmax_backward
        check_scaled(dx, backward(dy64, y64, axis), dtype, f"backward axis {axis} of {shape}, log={log}")


# -- backward ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("rows,L", SHAPES + ODD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_norm_backward(rows, L, dtype):
    import cupy
    x, x64 = random((rows, L), dtype)
    dy, dy64 = random((rows, L), dtype)
    g, g64 = uniform((L,), dtype, 0.5, 1.5)
    _, mean64, rstd64 = ref.layer_norm(x64, eps=1e-5, return_stats=True)
    mean, rstd = cupy.asarray(mean64.astype(np.float32)), cupy.asarray(rstd64.astype(np.float32))
    dx, dgamma, dbeta = poisoned((rows, L), dtype), poisoned((L,), dtype), poisoned((L,), dtype)
    plan = norm.plan_layer_norm_backward(operand(dy), operand(x), 1, mean=operand(mean), rstd=operand(rstd),
                                         gamma=operand(g), beta=operand(g))
    shifted(plan, L)
    tensors = dict(dx=dx, dy=dy, x=x, mean=mean, rstd=rstd, gamma=g, dgamma=dgamma, dbeta=dbeta)
    run(plan, **tensors)
    want_dx, want_dg, want_db = ref.layer_norm_backward(dy64, x64, mean64, rstd64, g64, g64)
    what = f"layer_norm backward {rows}x{L} {plan.launches[0].spec.uri}"
    check_scaled(dx, want_dx, dtype, what + " dx")
    check_scaled(dgamma, want_dg, dtype, what + " dgamma")
    check_scaled(dbeta, want_db, dtype, what + " dbeta")
    first = dgamma.copy()
    run(plan, **tensors)
    assert bool(cupy.array_equal(first, dgamma)), "dgamma differs between two runs"
    _, rrstd64 = ref.rms_norm(x64, eps=1e-6, return_stats=True)
    rrstd = cupy.asarray(rrstd64.astype(np.float32))
    dx, dgamma = poisoned((rows, L), dtype), poisoned((L,), dtype)
    plan = norm.plan_rms_norm_backward(operand(dy), operand(x), 1, rstd=operand(rrstd), gamma=operand(g))
    run(plan, dx=dx, dy=dy, x=x, rstd=rrstd, gamma=g, dgamma=dgamma)
    want_dx, want_dg = ref.rms_norm_backward(dy64, x64, rrstd64, g64)
    check_scaled(dx, want_dx, dtype, f"rms_norm backward {rows}x{L} dx")
    check_scaled(dgamma, want_dg, dtype, f"rms_norm backward {rows}x{L} dgamma")
    dx = poisoned((rows, L), dtype)
    run(norm.plan_layer_norm_backward(operand(dy), operand(x), 1, mean=operand(mean), rstd=operand(rstd)),
        dx=dx, dy=dy, x=x, mean=mean, rstd=rstd)
    check_scaled(dx, ref.layer_norm_backward(dy64, x64, mean64, rstd64, None, None)[0], dtype,
                 "layer_norm backward without affine")


@pytest.mark.parametrize("rows,L", SHAPES + ODD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_backward(rows, L, dtype):
    x, x64 = random((rows, L), dtype, -8.0, 8.0)
    dy, dy64 = random((rows, L), dtype)
    for log in (False, True):
        y = poisoned((rows, L), dtype)
        run(norm.plan_softmax(operand(x), -1, log=log), y=y, x=x)
        y64 = y.get().astype(np.float64)
        dx = poisoned((rows, L), dtype)
        plan = norm.plan_softmax_backward(operand(dy), operand(y), -1, log=log)
        shifted(plan, L)
        run(plan, dx=dx, dy=dy, y=y)
        backward = ref.log_softmax_backward if log else ref.softmax_backward
        check_scaled(dx, backward(dy64, y64), dtype, f"{'log_' if log else ''}softmax backward {rows}x{L} "
                     f"{plan.launches[-1].spec.uri}")


def test_more_than_2_pow_31_elements():
    import cupy
    rows, L = (1 << 19) + 3, 4096
    x = cupy.empty((rows, L), dtype=cupy.float16)
    for start in range(0, rows, 1 << 16):
        stop = min(rows, start + (1 << 16))
        x[start:stop] = cupy.random.uniform(-4, 4, (stop - start, L), dtype=cupy.float32).astype(cupy.float16)
    y = cupy.full((rows, L), np.nan, dtype=cupy.float16)
    plan = norm.plan_rms_norm(operand(x), 1)
    assert plan.launches[0].spec.index == "int64"
    run(plan, y=y, x=x)
    pick = np.concatenate([np.arange(4), np.arange(rows - 4, rows), np.random.default_rng().integers(0, rows, 256)])
    idx = cupy.asarray(pick)
    check(y[idx], ref.rms_norm(x[idx].get()), "float16", "rows past 2^31 elements (sampled)")
    assert not bool(cupy.isnan(y).any()), "elements left unwritten"
    del x, y
    cupy.get_default_memory_pool().free_all_blocks()


# -- long rows on sm_90: the persistent cluster (bulk copies into shared memory) ---------------------

# 16-bit rows persist up to 8 blocks of 32768 elements, odd lengths too (100003: shifted vectors);
# 262151 is past that reach. 256 rows: 16 rows per cluster, both stages and both pushed-statistics
# slots cycle many times. Clusters between the powers of two: 151936 16-bit (5 blocks), 40000 and
# 100003 float32 (3 and 7).
LONG = [(1, 262144), (3, 262144), (5, 131072), (2, 40000), (2, 262151), (1, 100003), (256, 262144),
        (70, 151936)]


def sm90():
    if compiler.arch_number(arch()) < 90:
        pytest.skip("persistent clusters need sm_90")
    return arch()


def persists(plan, dtype: str, L: int, shift: bool = True) -> bool:
    """Whether the heuristic took the persistent cluster, checked where it must: 16-bit rows up
    to 8 blocks of 32768 elements (a shifted row spans up to (L + 7) / 8 vectors; ``shift``:
    whether the plan's operands let rows of odd length shift)."""
    split = plan.launches[0].spec.split
    if dtype != "float32" and (shift or L % 8 == 0) and -(-(L + (7 if L % 8 else 0)) // 8) <= 32768:
        assert split == "persist", plan.launches[0].spec.uri
    return split == "persist"


@pytest.mark.parametrize("rows,L", LONG)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_norms(rows, L, dtype):
    target = sm90()
    x, x64 = random((rows, L), dtype)
    g, g64 = uniform((L,), dtype, 0.5, 1.5)
    b, b64 = uniform((L,), dtype, -0.5, 0.5)
    persists(layer_norm_with_stats((x, x64), (g, g64), (b, b64), dtype, target), dtype, L)
    y, rstd = poisoned((rows, L), dtype), poisoned((rows,), "float32")
    plan = norm.plan_rms_norm(operand(x), 1, gamma=operand(g), save_stats=True, eps=1e-6, arch=target)
    persists(plan, dtype, L)
    run(plan, y=y, x=x, gamma=g, rstd=rstd)
    want, want_rstd = ref.rms_norm(x64, g64, eps=1e-6, return_stats=True)
    check(y, want, dtype, f"rms_norm {rows}x{L} {plan.launches[0].spec.uri}")
    check(rstd, want_rstd, "float32", f"rms_norm {rows}x{L} rstd")
    # x + residual, written as h: both rows staged, gamma and beta read from global memory
    r, r64 = random((rows, L), dtype)
    h64 = (x64.astype(np.float32) + r64.astype(np.float32)).astype(dtypes.BY_NAME[dtype].np).astype(np.float64)
    y, h = poisoned((rows, L), dtype), poisoned((rows, L), dtype)
    plan = norm.plan_layer_norm(operand(x), 1, gamma=operand(g), beta=operand(b), residual=operand(r),
                                write_sum=True, epilogue=[("relu", "")], params=(0.0, np.inf), arch=target)
    persists(plan, dtype, L)
    run(plan, y=y, x=x, residual=r, h=h, gamma=g, beta=b)
    check(h, h64, dtype, f"h = x + residual {rows}x{L}")
    check(y, ref.relu(ref.layer_norm(h64, g64, b64)), dtype, f"relu(layer_norm(x + r)) {plan.launches[0].spec.uri}")


@pytest.mark.parametrize("rows,L", LONG)
@pytest.mark.parametrize("dtype", DTYPES)
def test_long_rows_softmax(rows, L, dtype):
    target = sm90()
    x, x64 = random((rows, L), dtype, -8.0, 8.0)
    for log in (False, True):
        y = poisoned((rows, L), dtype)
        plan = norm.plan_softmax(operand(x), -1, log=log, arch=target)
        persists(plan, dtype, L)
        run(plan, y=y, x=x)
        want = ref.log_softmax(x64) if log else ref.softmax(x64)
        check(y, want, dtype, f"{'log_' if log else ''}softmax {rows}x{L} {plan.launches[0].spec.uri}")
    mask, mask64 = random((L,), dtype, -2.0, 2.0)  # one mask row for every row: staged again each row
    y = poisoned((rows, L), dtype)
    plan = norm.plan_softmax(operand(x), -1, mask=operand(mask), causal=True, arch=target)
    persists(plan, dtype, L, shift=False)  # an odd row starts where the mask's does only in row 0
    run(plan, y=y, x=x, mask=mask)
    check(y, ref.softmax(x64, mask=mask64, causal=True), dtype, f"softmax mask + causal {rows}x{L}")


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "softmax"])
def test_every_long_row_candidate(op):
    """Every tile the autotuner may pick at 3 x 262144 bf16 (persistent at each stage count, with
    and without staged gamma / beta; clusters; two passes), and the persistent grid smaller than
    the planner's."""
    target = sm90()
    rows, L, dtype = 3, 262144, "bfloat16"
    x, x64 = random((rows, L), dtype)
    g, g64 = uniform((L,), dtype, 0.5, 1.5)
    make = {"layer_norm": lambda t: norm.plan_layer_norm(operand(x), 1, gamma=operand(g), beta=operand(g),
                                                         arch=target, tile=t),
            "rms_norm": lambda t: norm.plan_rms_norm(operand(x), 1, gamma=operand(g), eps=1e-6, arch=target, tile=t),
            "softmax": lambda t: norm.plan_softmax(operand(x), -1, arch=target, tile=t)}[op]
    want = {"layer_norm": lambda: ref.layer_norm(x64, g64, g64), "rms_norm": lambda: ref.rms_norm(x64, g64, eps=1e-6),
            "softmax": lambda: ref.softmax(x64)}[op]()
    base = make(None).launches[0].spec
    assert base.split == "persist"
    for tile in norm.candidates(base):
        plan = make(tile)
        launch = plan.launches[0]
        grids = [plan] + ([plan._replace(launches=(launch._replace(grid=(launch.spec.cluster, 1, 1)),))]
                          if tile.split == "persist" else [])  # one cluster walks all three rows
        for p in grids:
            y = poisoned((rows, L), dtype)
            run(p, y=y, x=x, gamma=g, beta=g)
            check(y, want, dtype, f"{op} {tile.uri} grid {p.launches[0].grid}")


def test_persistent_grid_is_what_the_device_holds():
    """The launch asks the driver how many clusters of each persistent kernel fit at once and
    trims the plan's grid to that; the plan's table (PERSIST_CLUSTERS) is the H200's count."""
    import cupy
    target = sm90()
    x = Operand("bfloat16", (4096, 262144), (262144, 1), 16)  # many rows: the planned grid is the table's
    base = norm.plan_rms_norm(x, 1, eps=1e-6, arch=target).launches[0].spec
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    for tile in [t for t in norm.candidates(base) if t.split == "persist"]:
        launch = norm.plan_rms_norm(x, 1, eps=1e-6, arch=target, tile=tile).launches[0]
        fn = launcher.functions(norm.Plan((launch,), ()), 0, target)[0]
        active = runtime.max_active_clusters(fn.ptr, launch.grid, launch.block, launch.shared_mem)
        assert active > 0, tile.uri
        grid = runtime.resident_grid(fn, launch.spec, launch.grid, launch.block, launch.shared_mem)
        assert grid == (min(launch.grid[0], active * tile.cluster), 1, 1), (tile.uri, grid, active)
        if name == "NVIDIA H200":
            assert active == norm.PERSIST_CLUSTERS[tile.cluster], (tile.uri, active)


# -- rows of any length: aligned 16-byte vectors clipped to rows that start anywhere ----------------

@pytest.mark.parametrize("rows,L", ODD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_rows_norms_with_residual(rows, L, dtype):
    """h = x + residual written (clipped element stores at both ends of each row), gamma and beta
    read element by element where a row's vectors straddle theirs, and an epilogue."""
    (x, x64), (g, g64), (b, b64) = norm_inputs(rows, L, dtype)
    r, r64 = random((rows, L), dtype)
    h64 = (x64.astype(np.float32) + r64.astype(np.float32)).astype(dtypes.BY_NAME[dtype].np).astype(np.float64)
    for target in targets(L):
        y, h = poisoned((rows, L), dtype), poisoned((rows, L), dtype)
        plan = norm.plan_layer_norm(operand(x), 1, gamma=operand(g), beta=operand(b), residual=operand(r),
                                    write_sum=True, epilogue=[("relu", "")], params=(0.0, np.inf), arch=target)
        shifted(plan, L)
        run(plan, y=y, x=x, residual=r, h=h, gamma=g, beta=b)
        what = f"relu(layer_norm(x + r)) {rows}x{L} {plan.launches[0].spec.uri}"
        check(h, h64, dtype, what + " h")
        check(y, ref.relu(ref.layer_norm(h64, g64, b64)), dtype, what)


@pytest.mark.parametrize("rows,L", ODD)
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_rows_softmax(rows, L, dtype):
    x, x64 = random((rows, L), dtype, -8.0, 8.0)
    mask, mask64 = random((rows, L), dtype, -2.0, 2.0)
    for target in targets(L):
        for log in (False, True):
            f = ref.log_softmax if log else ref.softmax
            y = poisoned((rows, L), dtype)
            plan = norm.plan_softmax(operand(x), -1, log=log, arch=target)
            shifted(plan, L)
            run(plan, y=y, x=x)
            check(y, f(x64), dtype, f"{'log_' if log else ''}softmax {rows}x{L} {plan.launches[0].spec.uri}")
            # x as (Sq, Sk) = (rows, L): causal, with a full additive mask
            y = poisoned((rows, L), dtype)
            plan = norm.plan_softmax(operand(x), -1, log=log, mask=operand(mask), causal=True, arch=target)
            shifted(plan, L)
            run(plan, y=y, x=x, mask=mask)
            check(y, f(x64, mask=mask64, causal=True), dtype,
                  f"{'log_' if log else ''}softmax mask + causal {rows}x{L} {plan.launches[0].spec.uri}")


@pytest.mark.parametrize("rows,L", [(2000, 127), (3000, 7), (700, 1021), (300, 4099), (40, 50257)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_rows_norm_backward_over_many_rows(rows, L, dtype):
    """More rows than row groups: each group walks rows a grid step apart, which start at the
    same place in their vectors, so its dgamma / dbeta partials stay in the same registers (and,
    several rows a block, meet in shared memory by column)."""
    import cupy
    x, x64 = random((rows, L), dtype)
    dy, dy64 = random((rows, L), dtype)
    g, g64 = uniform((L,), dtype, 0.5, 1.5)
    _, rstd64 = ref.rms_norm(x64, eps=1e-6, return_stats=True)
    rstd = cupy.asarray(rstd64.astype(np.float32))
    dx, dgamma = poisoned((rows, L), dtype), poisoned((L,), dtype)
    plan = norm.plan_rms_norm_backward(operand(dy), operand(x), 1, rstd=operand(rstd), gamma=operand(g))
    shifted(plan, L)
    run(plan, dx=dx, dy=dy, x=x, rstd=rstd, gamma=g, dgamma=dgamma)
    want_dx, want_dg = ref.rms_norm_backward(dy64, x64, rstd64, g64)
    what = f"rms_norm backward {rows}x{L} {plan.launches[0].spec.uri} grid {plan.launches[0].grid}"
    check_scaled(dx, want_dx, dtype, what + " dx")
    check_scaled(dgamma, want_dg, dtype, what + " dgamma")


@pytest.mark.parametrize("rows,L", ODD + [(1000, 128), (4, 262144)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(rows, L, dtype):
    """Loss and dlogits in one pass against float64, int64 and int32 labels, an ignored row."""
    import cupy
    x, x64 = random((rows, L), dtype, -8.0, 8.0)
    for label_type in ("int64", "int32"):
        picked = np.random.default_rng().integers(0, L, rows)
        picked[rows // 2] = -100  # ignore_index
        labels = cupy.asarray(picked.astype(label_type))
        for target in targets(L):
            dx, loss = poisoned((rows, L), dtype), poisoned((rows,), "float32")
            plan = norm.plan_cross_entropy(operand(x), operand(labels), grad_scale=0.5, arch=target)
            shifted(plan, L)
            run(plan, dx=dx, x=x, labels=labels, loss=loss)
            want_dx, want_loss = ref.cross_entropy(x64, picked, grad_scale=0.5)
            what = f"cross_entropy {rows}x{L} labels {label_type} {plan.launches[-1].spec.uri}"
            check_scaled(dx, want_dx, dtype, what + " dx")
            check_scaled(loss, want_loss, "float32", what + " loss")
