"""The reduce family on the GPU against float64 NumPy: every op x dtype at odd and large sizes
along the reduced dims (1, 7, 1000, 65537), leading / trailing / middle / all axes, transposed
inputs; batch_norm (inference, training with running statistics, backward), group_norm and
instance_norm in NCHW and NHWC with epilogues and other output types. Outputs start as NaN."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nvdnn import dtypes, launcher
from nvdnn import reference as ref
from nvdnn.kernels import batchnorm as bn
from nvdnn.kernels import reduce as R
from nvdnn.kernels.pointwise import Operand

from .gpu import host_dtype, poisoned, random, requires_gpu

pytestmark = requires_gpu
DTYPES = ("float32", "float16", "bfloat16")
# (rtol, atol) of one output rounding; accumulation error is bounded separately (see _close)
OUT_TOL = {"float32": (2e-6, 1e-6), "float16": (1e-3, 1e-4), "bfloat16": (8e-3, 1e-3)}


def operand(a) -> Operand:
    item = a.itemsize
    align = 16
    while a.data.ptr % align:
        align //= 2
    return Operand(dtypes.of_array(a, arg="x").name, tuple(a.shape), tuple(s // item for s in a.strides), align)


def _close(got, want, dtype, what, scale=None, acc=2e-6):
    """Within one output rounding plus ``acc`` x ``scale`` (the size of the summed terms)."""
    got = (got.get() if hasattr(got, "get") else np.asarray(got)).astype(np.float64)
    want = np.broadcast_to(np.asarray(want, dtype=np.float64), got.shape)
    assert not np.isnan(got[~np.isnan(want)]).any(), f"{what}: elements left unwritten (NaN)"
    assert np.array_equal(np.isnan(got), np.isnan(want)), f"{what}: NaN where the reference has none or back"
    rtol, atol = OUT_TOL[dtype]
    bound = atol + rtol * np.abs(want) + (0 if scale is None else acc * np.broadcast_to(scale, got.shape))
    err = np.where(np.isnan(want), 0, np.abs(got - want))
    bound = np.where(np.isnan(want), np.inf, bound)  # NaN places are checked above
    assert (err <= bound).all(), f"{what}: {int((err > bound).sum())} of {err.size} off, worst {err.max():.3g}"


def _run(plan, tensors):
    launcher.run(plan, tensors)


# -- reductions -------------------------------------------------------------------------------------

SHAPES = [((1,), None), ((7,), None), ((1000,), None), ((65537,), None), ((1 << 22,), None),
          ((3, 1), (1,)), ((3, 7), (1,)), ((5, 1000), (1,)), ((2, 65537), (1,)), ((64, 1 << 16), (1,)),
          ((7, 5), (0,)), ((1000, 33), (0,)), ((65537, 8), (0,)), ((4096, 1024), (0,)), ((2, 1000, 3), (1,)),
          ((4, 5, 6, 7), (0, 2)), ((4, 5, 6, 7), (1, 3)), ((3, 4, 5), ()), ((8, 64, 14, 14), (0, 2, 3)),
          # split reductions finished by their last block (test_gpu_split.py): odd column shapes
          ((1, 1), (0,)), ((4099, 3), (0,)), ((3, 4099), (1,)), ((3, 4099), (0,)), ((8191, 1025), (0,)),
          ((1025, 8191), (0,)), ((13, 4099, 3), (1,)), ((5, 7, 4099), (0, 1)), ((1 << 20,), None)]
SCALE = {"sum": "norm1", "mean": "norm1", "norm1": "norm1", "norm2": "norm2"}


def _reduce_case(opname, dtype, shape, axes, out_dtype=None, transpose=False, keepdims=False):
    low, high = (0.97, 1.03) if opname == "prod" else (-4.0, 4.0)
    if (out_dtype or dtype) == "float16" and opname in ("sum", "norm1"):
        # the summed terms must stay below float16's largest value, 65504
        terms = math.prod(shape[a] for a in R.normalize_axes(axes, len(shape)))
        high = min(1.0, 30000.0 / terms)
        low = -high
    x, x64 = random(tuple(reversed(shape)) if transpose else shape, dtype, low, high)
    if transpose:
        x, x64 = x.T, x64.T
    out_dtype = out_dtype or dtype
    norm = R.normalize_axes(axes, len(shape))
    y = poisoned(R.output_shape(shape, norm, keepdims) or (1,), out_dtype)
    _run(R.plan_reduce(opname, operand(x), axes, out_dtype=out_dtype), {"y": y, "x": x})
    want = getattr(ref, opname)(x64, norm, keepdims=keepdims).reshape(y.shape)
    count = math.prod(shape[a] for a in norm) if norm else 1
    scale = None
    if opname in SCALE:
        scale = getattr(ref, SCALE[opname])(x64, norm, keepdims=keepdims).reshape(y.shape)
        if opname == "mean":
            scale = scale / count
    elif opname == "prod":
        scale = np.abs(want) * count
    _close(y, want, out_dtype, f"{opname} {dtype}->{out_dtype} {shape} axes={axes}{' T' if transpose else ''}",
           scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("opname", list(R.OPS))
def test_reductions(opname, dtype):
    for shape, axes in SHAPES:
        if opname == "prod" and math.prod(shape) > 100000:
            continue
        _reduce_case(opname, dtype, shape, axes)


@pytest.mark.parametrize("dtype", DTYPES)
def test_transposed_inputs_and_keepdims(dtype):
    for shape, axes in (((1000, 33), (0,)), ((33, 1000), (1,)), ((4, 5, 6, 7), (0, 2)), ((65537, 3), None)):
        for opname in ("sum", "amax", "norm2"):
            _reduce_case(opname, dtype, shape, axes, transpose=True)
    _reduce_case("mean", dtype, (4, 5, 6, 7), (1, 3), keepdims=True)


@pytest.mark.parametrize("dtype", ("float16", "bfloat16"))
def test_float32_outputs_of_16_bit_inputs(dtype):
    for shape, axes in (((65537,), None), ((5, 1000), (1,)), ((1000, 33), (0,))):
        for opname in ("sum", "mean", "norm2"):
            _reduce_case(opname, dtype, shape, axes, out_dtype="float32")


@pytest.mark.parametrize("opname", ["max", "min", "amax"])
def test_nan_propagates(opname):
    import cupy
    for shape, axes, where in (((1000, 7), (0,), (500, 3)), ((7, 1000), (1,), (2, 999)),
                               ((65537,), None, (40000,))):
        x, x64 = random(shape, "float32")
        x[where] = np.nan
        x64[where] = np.nan
        norm = R.normalize_axes(axes, len(shape))
        y = cupy.zeros(R.output_shape(shape, norm) or (1,), dtype=np.float32)
        _run(R.plan_reduce(opname, operand(x), axes), {"y": y, "x": x})
        _close(y, getattr(ref, opname)(x64, norm).reshape(y.shape), "float32", f"{opname} NaN {shape}")


def test_results_are_deterministic():
    x, _ = random((1 << 22,), "float32")
    ys = []
    for _ in range(3):
        y = poisoned((1,), "float32")
        _run(R.plan_reduce("sum", operand(x)), {"y": y, "x": x})
        ys.append(float(y.get()[0]))
    assert ys[0] == ys[1] == ys[2]


# -- channel norms ----------------------------------------------------------------------------------

NORM_SHAPES = [(1, 3, 7, 7), (2, 16, 5, 3), (8, 64, 14, 14), (5, 256), (4, 8, 9), (3, 24, 1, 1), (2, 12, 17, 1)]
NORM_TOL = 2e-5   # float32 statistics: relative to the values' spread


def _tensor(shape, dtype, layout, low=-3.0, high=5.0):
    """A random (N, C, spatial...) array in NCHW or NHWC memory order, and its float64 values."""
    if layout == "NCHW" or len(shape) == 2:
        return random(shape, dtype, low, high)
    order = (0, *range(2, len(shape)), 1)
    phys, phys64 = random(tuple(shape[a] for a in order), dtype, low, high)
    back = tuple(np.argsort(order))
    return phys.transpose(back), phys64.transpose(back)


def _like(x, dtype):
    """A NaN array with x's shape and memory order."""
    import cupy
    order = np.argsort([-s for s in x.strides], kind="stable")
    phys = cupy.full(tuple(x.shape[a] for a in order), np.nan, dtype=host_dtype(dtype))
    return phys.transpose(tuple(np.argsort(order)))


def _channels(c, dtype="float32", low=0.5, high=2.0):
    return random((c,), dtype, low, high)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batch_norm_inference(layout, dtype):
    for shape in NORM_SHAPES:
        c = shape[1]
        x, x64 = _tensor(shape, dtype, layout)
        (mean, m64), (var, v64) = _channels(c, low=-1, high=1), _channels(c)
        (gamma, g64), (beta, b64) = _channels(c), _channels(c, low=-1, high=1)
        for out_dtype, chain, params, act in ((dtype, (), (), lambda v: v),
                                              (dtype, [("relu", "")], (0.0, math.inf), lambda v: np.maximum(v, 0)),
                                              ("float16" if dtype != "float16" else "float32",
                                               [("mul", "p")], (0.5,), lambda v: 0.5 * v)):
            y = _like(x, out_dtype)
            plan = bn.plan_batch_norm_inference(operand(x), operand(mean), operand(var), operand(gamma),
                                                operand(beta), eps=1e-3, epilogue=chain, params=params,
                                                out_dtype=out_dtype, out_align=operand(y).align)
            _run(plan, {"y": y, "x": x, "mean": mean, "var": var, "gamma": gamma, "beta": beta})
            _close(y, act(ref.batch_norm(x64, m64, v64, g64, b64, eps=1e-3)), out_dtype, f"bn inference {layout} {shape}",
                   scale=1.0, acc=1e-5)


# The affine pass's tiles at odd shapes: N = 1, C a multiple of 8, of 4, odd (fp16 vectors of 8,
# 4, 1 channels), H and W odd, fewer rows than one tile, more than one grid-strided round.
# (layout, x's dtype, shape, the parameters' dtype, streaming tiles too or plain ones only)
TILE_CASES = [("NHWC", "float16", (4, 64, 33, 31), "float32", True),
              ("NHWC", "float16", (1, 24, 5, 3), "float32", False),
              ("NHWC", "float16", (2, 7, 5, 5), "float32", False), ("NHWC", "float16", (5, 40), "float32", False),
              ("NHWC", "float16", (2, 32, 3, 5), "float16", False),
              ("NHWC", "bfloat16", (1, 256, 7, 7), "bfloat16", False),
              ("NHWC", "bfloat16", (3, 12, 9, 7), "float32", True),
              ("NCHW", "float16", (1, 3, 7, 7), "float32", False), ("NCHW", "bfloat16", (2, 16, 33, 5), "float32", False)]


def _warm(specs) -> None:
    """Compile kernels on every core before a test launches them one by one."""
    import nvdnn
    from nvdnn import compiler, warm
    report = warm.warm([(spec, compiler.device_arch()) for spec in specs], nvdnn.default_cache())
    assert report.failed == [], report.failed[:2]


@pytest.mark.parametrize("layout,dtype,shape,param,stream", TILE_CASES)
def test_batch_norm_inference_every_tile(layout, dtype, shape, param, stream):
    """Every autotune candidate of the affine pass (loops, pipelining, streaming accesses) against
    float64, with parameters aligned for vector loads and one element off (scalar loads)."""
    c = shape[1]
    x, x64 = _tensor(shape, dtype, layout)
    params = [_channels(c + 1, param, lo, hi) for lo, hi in ((-1, 1), (0.5, 2), (0.5, 2), (-1, 1))]
    relu = {"epilogue": [("relu", "")], "params": (0.0, math.inf)}
    cases = []
    widest = 16 // dtypes.BY_NAME[param].itemsize
    for offset in (0, 1):  # slices of 16-byte-aligned arrays at element 0, then at element 1
        vectors = [(a[offset:offset + c], a64[offset:offset + c]) for a, a64 in params]
        args = [operand(a) for a in (x, *(v for v, _ in vectors))]
        base = bn.plan_batch_norm_inference(*args, eps=1e-3, **relu).launches[0].spec
        assert base.cvec == (1 if offset or base.layout == "row" else min(base.vec, widest))
        tiles = [t for t in bn.candidates(base) if stream or not t.stream]
        cases += [(vectors, args, tile) for tile in tiles]
    _warm(tile for _, _, tile in cases)
    for vectors, args, tile in cases:
        (mean, m64), (var, v64), (gamma, g64), (beta, b64) = vectors
        y = _like(x, dtype)
        plan = bn.plan_batch_norm_inference(*args, eps=1e-3, out_align=operand(y).align, tile=tile, **relu)
        assert plan.launches[0].spec == tile
        _run(plan, {"y": y, "x": x, "mean": mean, "var": var, "gamma": gamma, "beta": beta})
        _close(y, np.maximum(ref.batch_norm(x64, m64, v64, g64, b64, eps=1e-3), 0), dtype,
               f"bn inference {layout} {shape} {tile.uri}", scale=1.0, acc=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batch_norm_training_and_backward(layout, dtype):
    import cupy
    for shape in NORM_SHAPES:
        if math.prod(shape) // shape[1] < 2:
            continue
        c = shape[1]
        x, x64 = _tensor(shape, dtype, layout, 10.0, 14.0)    # mean far from 0: the shifted sums matter
        (gamma, g64), (beta, b64) = _channels(c), _channels(c, low=-1, high=1)
        (rm, rm64), (rv, rv64) = _channels(c, low=-1, high=1), _channels(c)
        saved_mean, saved_invstd = poisoned((c,), "float32"), poisoned((c,), "float32")
        y = _like(x, dtype)
        plan = bn.plan_batch_norm_training(operand(x), operand(gamma), operand(beta), operand(rm), operand(rv),
                                           eps=1e-5, momentum=0.2, epilogue=[("relu", "")], params=(0.0, math.inf))
        _run(plan, {"y": y, "x": x, "gamma": gamma, "beta": beta, "running_mean": rm, "running_var": rv,
                    "saved_mean": saved_mean, "saved_invstd": saved_invstd})
        want, mu, invstd, new_rm, new_rv = ref.batch_norm_training(x64, g64, b64, rm64, rv64, 0.2, 1e-5)
        what = f"bn training {layout} {dtype} {shape}"
        _close(saved_mean, mu, "float32", what + " mean", scale=np.abs(mu), acc=1e-5)
        _close(saved_invstd, invstd, "float32", what + " invstd", scale=invstd, acc=1e-4)
        _close(rm, new_rm, "float32", what + " running_mean", scale=np.abs(new_rm), acc=1e-5)
        _close(rv, new_rv, "float32", what + " running_var", scale=new_rv, acc=1e-4)
        _close(y, np.maximum(want, 0), dtype, what + " y", scale=1.0, acc=1e-4)

        dy, dy64 = _tensor(shape, dtype, layout, -1.0, 1.0)
        dx = _like(x, dtype)
        dgamma, dbeta = poisoned((c,), "float32"), poisoned((c,), "float32")
        plan = bn.plan_batch_norm_backward(operand(dy), operand(x), operand(saved_mean), operand(saved_invstd),
                                           operand(gamma))
        _run(plan, {"dx": dx, "dy": dy, "x": x, "saved_mean": saved_mean, "saved_invstd": saved_invstd,
                    "gamma": gamma, "dgamma": dgamma, "dbeta": dbeta})
        s_mean, s_inv = saved_mean.get().astype(np.float64), saved_invstd.get().astype(np.float64)
        want_dx, want_dg, want_db = ref.batch_norm_backward(dy64, x64, s_mean, s_inv, g64)
        m = math.prod(shape) // c
        _close(dbeta, want_db, "float32", what + " dbeta", scale=m, acc=1e-6)
        _close(dgamma, want_dg, "float32", what + " dgamma", scale=m, acc=1e-5)
        _close(dx, want_dx, dtype, what + " dx", scale=np.abs(g64 * s_inv).max(), acc=1e-4)
        plan = bn.plan_batch_norm_backward(operand(dy), operand(x), operand(saved_mean), operand(saved_invstd))
        dx = _like(x, dtype)  # without gamma: dx only, as with gamma = 1
        _run(plan, {"dx": dx, "dy": dy, "x": x, "saved_mean": saved_mean, "saved_invstd": saved_invstd})
        want_dx = ref.batch_norm_backward(dy64, x64, s_mean, s_inv, np.ones_like(g64))[0]
        _close(dx, want_dx, dtype, what + " dx without gamma", scale=np.abs(s_inv).max(), acc=1e-4)
        cupy.cuda.Device().synchronize()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_group_and_instance_norm(layout, dtype):
    for shape, groups in (((1, 6, 7, 7), 3), ((2, 16, 5, 3), 4), ((8, 64, 14, 14), 32), ((2, 32, 9), 8),
                          ((4, 12), 3), ((3, 24, 1, 1), 24), ((2, 8, 17, 1), 1), ((2, 64, 40, 40), 8)):
        c = shape[1]
        x, x64 = _tensor(shape, dtype, layout, 2.0, 6.0)
        (gamma, g64), (beta, b64) = _channels(c), _channels(c, low=-1, high=1)
        out_dtype = "float32" if dtype != "float32" else "bfloat16"
        for out, chain, params, act in ((dtype, (), (), lambda v: v),
                                        (out_dtype, [("silu", "")], (), lambda v: v * ref.sigmoid(v))):
            y = _like(x, out)
            saved = {"saved_mean": poisoned((shape[0], groups), "float32"),
                     "saved_invstd": poisoned((shape[0], groups), "float32")}
            plan = bn.plan_group_norm(operand(x), groups, operand(gamma), operand(beta), eps=1e-5, epilogue=chain,
                                      params=params, out_dtype=out, out_align=operand(y).align, save_stats=True)
            _run(plan, {"y": y, "x": x, "gamma": gamma, "beta": beta, **saved})
            _close(y, act(ref.group_norm(x64, groups, g64, b64, eps=1e-5)), out, f"group_norm {layout} {shape} G={groups}",
                   scale=1.0, acc=1e-4)
            grouped = x64.reshape(shape[0], groups, -1)
            _close(saved["saved_mean"], grouped.mean(axis=2), "float32", "group_norm mean", scale=6.0, acc=1e-6)
        y = _like(x, dtype)
        _run(bn.plan_instance_norm(operand(x), eps=1e-5), {"y": y, "x": x})
        _close(y, ref.instance_norm(x64, eps=1e-5), dtype, f"instance_norm {layout} {shape}", scale=1.0, acc=1e-4)
        y = _like(x, dtype)  # per (sample, channel) statistics, gamma and beta by channel
        _run(bn.plan_instance_norm(operand(x), operand(gamma), operand(beta), eps=1e-5),
             {"y": y, "x": x, "gamma": gamma, "beta": beta})
        _close(y, ref.group_norm(x64, c, g64, b64, eps=1e-5), dtype, f"instance_norm affine {layout} {shape}",
               scale=1.0, acc=1e-4)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_dependent_launches_see_the_kernel_ahead(dtype):
    """On sm_90 the affine pass launches as a dependent grid, dispatched while the kernel ahead
    of it drains. A chain of them, each reading what the one ahead wrote and overwriting what
    that one read (two buffers in turn), the first reading what a CuPy kernel just wrote, in a
    stream and replayed from a CUDA graph, must give the float64 chain (rounded as each step
    rounds, up to about one rounding a step). A kernel that ran early reads NaN or old values."""
    import cupy
    from nvdnn import compiler, runtime
    shape, steps = (8, 256, 56, 56), 12  # 6.4M elements: each kernel spans several waves
    per_step = {"float32": 1e-6, "float16": 1e-3}[dtype]  # one output rounding
    src, src64 = _tensor(shape, dtype, "NHWC", -2.0, 2.0)
    c = shape[1]
    (mean, m64), (var, v64) = _channels(c, low=-0.1, high=0.1), _channels(c, low=0.9, high=1.1)
    (gamma, g64), (beta, b64) = _channels(c, low=0.9, high=1.0), _channels(c, low=-0.2, high=0.2)
    plan = bn.plan_batch_norm_inference(operand(src), operand(mean), operand(var), operand(gamma), operand(beta),
                                        eps=1e-3)
    if compiler.arch_number(compiler.device_arch()) >= 90:
        assert isinstance(launcher.functions(plan, cupy.cuda.runtime.getDevice())[0], runtime.DependentFunction)
    want = src64
    for _ in range(steps):
        want = ref.batch_norm(want, m64, v64, g64, b64, eps=1e-3).astype(host_dtype(dtype)).astype(np.float64)
    extra = {"mean": mean, "var": var, "gamma": gamma, "beta": beta}
    buffers = _like(src, dtype), _like(src, dtype)

    def chain(stream):
        a, b = buffers
        b.fill(np.nan)
        cupy.multiply(src, 1, out=a)  # a CuPy kernel right ahead of the first
        for _ in range(steps):
            launcher.run(plan, {"y": b, "x": a, **extra}, stream=stream)
            a, b = b, a
        return a

    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        got = chain(stream)
        stream.synchronize()
        _close(got, want, dtype, f"{steps} dependent launches in a stream", scale=steps, acc=per_step)
        stream.begin_capture()
        got = chain(stream)
        graph = stream.end_capture()
        for buffer in buffers:  # what the stream run left would pass: poison it first
            buffer.fill(np.nan)
        graph.launch(stream)
        stream.synchronize()
    _close(got, want, dtype, f"{steps} dependent launches in a CUDA graph", scale=steps, acc=per_step)
