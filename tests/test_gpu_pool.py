"""Pooling kernels on the GPU against the float64 references: poisoned outputs, every dtype and
layout, the reference workload and odd shapes (N = 1; H, W of 1, 7, 13; C of 1, 3, 64), ceil_mode,
dilation, indices, epilogues, backward both ways, global average pool whole and split."""
from __future__ import annotations

import math

import numpy as np
import pytest

from nvdnn import launcher
from nvdnn import reference as ref
from nvdnn.errors import ValidationError
from nvdnn.kernels import pool
from nvdnn.kernels.pool import window as pool_window
from nvdnn.kernels.pointwise import Operand

from .gpu import check, poisoned, random, requires_gpu

pytestmark = requires_gpu
DTYPES = ("float32", "float16", "bfloat16")
LAYOUTS = ("NCHW", "NHWC")
ODD_SHAPES = [(1, 1, 7, 7), (1, 3, 13, 7), (2, 64, 13, 13), (1, 64, 1, 7), (1, 3, 7, 1), (3, 5, 13, 1)]
WINDOWS = [  # kernel, stride, padding, dilation, ceil_mode
    (3, 2, 1, 1, False), (3, 2, 1, 1, True), (2, 2, 0, 1, False), (2, 2, 1, 1, True), (3, 1, 1, 1, False),
    ((3, 2), (2, 1), (1, 0), 1, True), (3, 2, 1, 2, False), (2, 1, 1, 2, True)]


def _tensor(shape, dtype, layout, low=-4.0, high=4.0):
    """A random (N, C, H, W) device view stored in ``layout``, and its float64 value."""
    n, c, h, w = shape
    if layout == "NCHW":
        return random(shape, dtype, low, high)
    dev, host = random((n, h, w, c), dtype, low, high)
    return dev.transpose(0, 3, 1, 2), host.transpose(0, 3, 1, 2)


def _empty(shape, dtype, layout, fill=None):
    """A poisoned (NaN, or ``fill`` for integers) packed output, as an (N, C, H, W) view."""
    import cupy
    n, c, h, w = shape
    stored = (n, c, h, w) if layout == "NCHW" else (n, h, w, c)
    a = poisoned(stored, dtype) if fill is None else cupy.full(stored, fill, dtype=dtype)
    return a if layout == "NCHW" else a.transpose(0, 3, 1, 2)


def _operand(a, dtype) -> Operand:
    size = a.dtype.itemsize
    ptr = a.data.ptr
    return Operand(dtype, tuple(a.shape), tuple(s // size for s in a.strides), math.gcd(ptr, 16) if ptr else 16)


def _valid(shape, kernel, stride, padding, dilation, ceil_mode) -> bool:
    try:
        pool.pool2d_output_shape(shape, kernel, stride, padding, dilation, ceil_mode)
        return True
    except ValidationError:
        return False


def _has_empty_window(shape, window) -> bool:
    """A window with no tap inside the input: max backward refuses it (tests/test_pool.py)."""
    g = pool.geometry(shape, *window)
    return any(pool_window._empty_window(size, *args) is not None
               for size, *args in zip(shape[2:], g.kernel, g.stride, g.padding, g.dilation, g.out_shape[2:]))


def _max_forward(x, x64, dtype, layout, window, *, return_indices=False, index_dtype="int64", epilogue=(),
                 params=(), out_dtype=None):
    kernel, stride, padding, dilation, ceil_mode = window
    out_dtype = out_dtype or dtype
    plan = pool.plan_pool2d("max", _operand(x, dtype), kernel, stride, padding, dilation, ceil_mode=ceil_mode,
                            return_indices=return_indices, index_dtype=index_dtype, epilogue=epilogue,
                            params=params, out_dtype=out_dtype)
    out_shape = pool.pool2d_output_shape(x.shape, kernel, stride, padding, dilation, ceil_mode)
    y = _empty(out_shape, out_dtype, layout)
    tensors = {"y": y, "x": x}
    if return_indices:
        tensors["indices"] = _empty(out_shape, index_dtype, layout, fill=-7)
    launcher.run(plan, tensors)
    want = ref.max_pool2d_with_indices(x64, kernel, stride, padding, dilation, ceil_mode)
    return y, tensors.get("indices"), want


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_reference_workload(dtype, layout):
    x, x64 = _tensor((32, 64, 112, 112), dtype, layout)
    y, idx, (want, want_idx) = _max_forward(x, x64, dtype, layout, (3, 2, 1, 1, False), return_indices=True)
    check(y, want, dtype, f"max 3x3/2 {layout}")
    assert bool((idx == __import__("cupy").asarray(want_idx)).all()), "indices differ"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_odd_shapes_and_windows(dtype, layout):
    import cupy
    for shape in ODD_SHAPES:
        for window in WINDOWS:
            if not _valid(shape, *window):
                continue
            x, x64 = _tensor(shape, dtype, layout)
            for index_dtype in ("int32", "int64"):
                y, idx, (want, want_idx) = _max_forward(x, x64, dtype, layout, window, return_indices=True,
                                                        index_dtype=index_dtype)
                what = f"max {shape} {window} {layout} {index_dtype}"
                check(y, want, dtype, what)
                assert bool((idx == cupy.asarray(want_idx)).all()), f"{what}: indices differ"
            y, _, (want, _) = _max_forward(x, x64, dtype, layout, window)
            check(y, want, dtype, f"max {shape} {window} {layout} no indices")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_propagates_nan(dtype, layout):
    import cupy
    x, x64 = _tensor((2, 16, 9, 9), dtype, layout)
    hole = (1, 5, 4, 4)
    x[hole] = np.nan
    x64 = x64.copy()
    x64[hole] = np.nan
    y, idx, (want, want_idx) = _max_forward(x, x64, dtype, layout, (3, 2, 1, 1, False), return_indices=True)
    assert bool(cupy.isnan(y[1, 5, 2, 2]))  # the one 3x3/2 window (padding 1) that holds (4, 4)
    check(y, want, dtype, "NaN window")
    assert bool((idx == cupy.asarray(want_idx)).all())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("src,dst", [("float16", "float32"), ("bfloat16", "float16"), ("float32", "bfloat16")])
def test_max_pool_epilogue_and_output_dtype(src, dst, layout):
    x, x64 = _tensor((2, 64, 13, 13), src, layout)
    y, _, (want, _) = _max_forward(x, x64, src, layout, (3, 2, 1, 1, True), epilogue=[("relu", ""), ("mul", "p")],
                                   params=(0.0, math.inf, 0.5), out_dtype=dst)
    check(y, 0.5 * np.maximum(want, 0.0), dst, f"relu*0.5 {src}->{dst}")


def _avg_forward(x, x64, dtype, layout, window, count_include_pad, divisor_override, epilogue=(), params=()):
    kernel, stride, padding, _, ceil_mode = window
    plan = pool.plan_pool2d("avg", _operand(x, dtype), kernel, stride, padding, ceil_mode=ceil_mode,
                            count_include_pad=count_include_pad, divisor_override=divisor_override,
                            epilogue=epilogue, params=params)
    y = _empty(pool.pool2d_output_shape(x.shape, kernel, stride, padding, 1, ceil_mode), dtype, layout)
    launcher.run(plan, {"y": y, "x": x})
    return y, ref.avg_pool2d(x64, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_pool(dtype, layout):
    x, x64 = _tensor((32, 64, 112, 112), dtype, layout)
    y, want = _avg_forward(x, x64, dtype, layout, (3, 2, 1, 1, False), True, None)
    check(y, want, dtype, f"avg 3x3/2 {layout}")
    for shape in ODD_SHAPES:
        for window in WINDOWS:
            if window[3] != 1 or not _valid(shape, *window):
                continue
            x, x64 = _tensor(shape, dtype, layout)
            for count_include_pad, divisor_override in ((True, None), (False, None), (True, 3)):
                y, want = _avg_forward(x, x64, dtype, layout, window, count_include_pad, divisor_override)
                check(y, want, dtype, f"avg {shape} {window} {layout} pad={count_include_pad} div={divisor_override}")
    y, want = _avg_forward(x, x64, dtype, layout, (3, 2, 1, 1, True), True, None, [("sigmoid", "")])
    check(y, ref.sigmoid(want), dtype, "avg + sigmoid")


@pytest.mark.parametrize("source", ["indices", "x"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_max_pool_backward(dtype, layout, source):
    import cupy
    cases = [((32, 64, 112, 112), (3, 2, 1, 1, False))] + [(s, w) for s in ODD_SHAPES for w in WINDOWS]
    for shape, window in cases:
        if not _valid(shape, *window) or _has_empty_window(shape, window):
            continue
        kernel, stride, padding, dilation, ceil_mode = window
        x, x64 = _tensor(shape, dtype, layout)
        _, idx = ref.max_pool2d_with_indices(x64, kernel, stride, padding, dilation, ceil_mode)
        dy, dy64 = _tensor(idx.shape, dtype, layout)
        tensors = {"dy": dy}
        if source == "indices":
            packed = idx if layout == "NCHW" else idx.transpose(0, 2, 3, 1)
            tensors["indices"] = cupy.asarray(np.ascontiguousarray(packed))
            if layout == "NHWC":
                tensors["indices"] = tensors["indices"].transpose(0, 3, 1, 2)
            extra = {"indices": _operand(tensors["indices"], "int64")}
        else:
            tensors["x"] = x
            extra = {"x": _operand(x, dtype)}
        plan = pool.plan_pool2d_backward("max", _operand(dy, dtype), shape, kernel, stride, padding, dilation,
                                         ceil_mode=ceil_mode, **extra)
        tensors["dx"] = _empty(shape, dtype, layout)
        launcher.run(plan, tensors)
        check(tensors["dx"], ref.max_pool2d_backward(dy64, x64, kernel, stride, padding, dilation, ceil_mode), dtype,
              f"max backward {source} {shape} {window} {layout}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_avg_pool_backward(dtype, layout):
    cases = [((32, 64, 112, 112), (3, 2, 1, 1, False))] + [(s, w) for s in ODD_SHAPES for w in WINDOWS if w[3] == 1]
    for shape, window in cases:
        if not _valid(shape, *window):
            continue
        kernel, stride, padding, _, ceil_mode = window
        out_shape = pool.pool2d_output_shape(shape, kernel, stride, padding, 1, ceil_mode)
        dy, dy64 = _tensor(out_shape, dtype, layout)
        for count_include_pad, divisor_override in ((True, None), (False, None), (True, 3)):
            plan = pool.plan_pool2d_backward("avg", _operand(dy, dtype), shape, kernel, stride, padding,
                                             ceil_mode=ceil_mode, count_include_pad=count_include_pad,
                                             divisor_override=divisor_override)
            dx = _empty(shape, dtype, layout)
            launcher.run(plan, {"dx": dx, "dy": dy})
            x_like = np.broadcast_to(0.0, shape)  # the reference takes x for its shape, as nvdnn's call
            want = ref.avg_pool2d_backward(dy64, x_like, kernel, stride, padding, ceil_mode, count_include_pad,
                                           divisor_override)
            check(dx, want, dtype, f"avg backward {shape} {window} {layout} pad={count_include_pad}")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_global_avg_pool(dtype, layout):
    import cupy
    for shape in [(32, 2048, 7, 7), (1, 64, 112, 112), (2, 3, 13, 7), (1, 1, 1, 1), (3, 64, 1, 13), (1, 24, 56, 56),
                  (8, 64, 32, 32), (1, 3, 97, 89)]:
        x, x64 = _tensor(shape, dtype, layout)
        for out_dtype, epilogue, params in ((dtype, (), ()), ("float32", [("relu", "")], (0.0, math.inf))):
            plan = pool.plan_global_avg_pool2d(_operand(x, dtype), epilogue=epilogue, params=params,
                                               out_dtype=out_dtype)
            y = poisoned((shape[0], shape[1], 1, 1), out_dtype)
            workspace = cupy.full(launcher.scratch_layout(plan)[1] or 1, 255, dtype=cupy.uint8)  # garbage scratch
            for _ in range(2):  # the second launch finds the split's tile counters back at zero
                launcher.run(plan, {"y": y, "x": x}, workspace=workspace)
            want = ref.global_avg_pool2d(x64)
            check(y, want if not epilogue else np.maximum(want, 0.0), out_dtype, f"global avg {shape} {layout}")


def test_misaligned_and_strided_views():
    import cupy
    base, base64 = random((2 * 64 * 13 * 13 + 1,), "float16")
    x = base[1:].reshape(2, 13, 13, 64).transpose(0, 3, 1, 2)   # NHWC, 2-byte aligned: scalar channels
    x64 = base64[1:].reshape(2, 13, 13, 64).transpose(0, 3, 1, 2)
    y, idx, (want, want_idx) = _max_forward(x, x64, "float16", "NHWC", (3, 2, 1, 1, True), return_indices=True)
    check(y, want, "float16", "misaligned NHWC")
    assert bool((idx == cupy.asarray(want_idx)).all())
    big, big64 = _tensor((2, 64, 26, 26), "bfloat16", "NHWC")
    view, view64 = big[:, :, ::2, ::2], big64[:, :, ::2, ::2]
    y, _, (want, _) = _max_forward(view, view64, "bfloat16", "NHWC", (2, 2, 0, 1, False))
    check(y, want, "bfloat16", "strided NHWC view")
