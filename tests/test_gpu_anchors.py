"""The anchor ops through the public API on the GPU: functional calls (reductions, norms,
pooling, backward) and graphs with fused epilogues, against float64 references, outputs
poisoned first. Kernel-level coverage of each family is in tests/test_gpu_<family>.py."""
from __future__ import annotations

import numpy as np
import pytest

import nvdnn
from nvdnn import reference as ref
from nvdnn.errors import ValidationError

from .gpu import check, poison_pool, poisoned, random, requires_gpu

pytestmark = requires_gpu
DTYPES = ("float32", "float16", "bfloat16")
# accumulations over thousands of terms: looser than one rounding
SUM_TOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 3e-2}


def nhwc(shape, dtype, low=-3.0, high=3.0):
    """A random (N, C, H, W) array stored channels-last, and its float64 value."""
    n, c, h, w = shape
    x, x64 = random((n, h, w, c), dtype, low, high)
    return x.transpose(0, 3, 1, 2), x64.transpose(0, 3, 1, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["sum", "mean", "max", "min", "amax", "norm1", "norm2"])
@pytest.mark.parametrize("shape, axis", [((7, 1000), 1), ((65537,), None), ((33, 5, 129), (0, 2)), ((1, 7), 0)])
def test_reductions(op, dtype, shape, axis):
    x, x64 = random(shape, dtype, -1, 1)  # sums of 65537 stay below float16's 65504
    want = getattr(ref, op)(x64, axis=axis, keepdims=True)
    poison_pool(want.shape, dtype)
    got = getattr(nvdnn, op)(x, axis=axis, keepdims=True)
    assert got.shape == want.shape
    scale = np.abs(x64).sum() / max(1, want.size) if op in ("sum", "mean", "norm1", "norm2") else 0
    err = np.abs(got.get().astype(np.float64) - want)
    assert not np.isnan(err).any() and (err <= 1e-2 * np.abs(want) + SUM_TOL[dtype] * (scale + 1)).all(), \
        f"{op} {dtype} {shape} axis={axis}: worst {err.max():.3g}"


def test_prod_of_values_near_one():
    x, x64 = random((5, 300), "float32", 0.99, 1.01)
    check(nvdnn.prod(x, axis=1), ref.prod(x64, axis=1), "float32", "prod")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_batch_norm_inference_relu_and_training_backward(dtype, layout):
    shape = (3, 24, 7, 5)
    x, x64 = nhwc(shape, dtype) if layout == "NHWC" else random(shape, dtype, -3, 3)
    mean, m64 = random((24,), "float32", -1, 1)
    var, v64 = random((24,), "float32", 0.5, 2)
    gamma, g64 = random((24,), "float32", 0.5, 1.5)  # per-channel parameters share one type
    beta, b64 = random((24,), "float32", -1, 1)
    poison_pool(shape, dtype)
    y = nvdnn.batch_norm(x, mean, var, gamma, beta, eps=1e-3, activation="relu")
    assert y.strides == x.strides  # the layout is kept
    check(y, np.maximum(ref.batch_norm(x64, m64, v64, g64, b64, eps=1e-3), 0), dtype, f"bn+relu {layout}")
    run_mean, run_var = mean.copy(), var.copy()
    y, saved_mean, saved_invstd = nvdnn.batch_norm(x, run_mean, run_var, gamma, beta, training=True, momentum=0.2)
    want = ref.batch_norm_training(x64, g64, b64, m64, v64, momentum=0.2)
    check(y, want[0], dtype, "training y")
    if dtype == "float32":  # 16-bit inputs: the mean of rounded values, checked through y
        check(saved_mean, want[1], "float32", "saved mean")
    np.testing.assert_allclose(run_mean.get(), want[3], rtol=1e-3, atol=1e-3)
    np.testing.assert_allclose(run_var.get(), want[4], rtol=1e-3, atol=1e-3)
    dy, dy64 = random(shape, dtype, -1, 1) if layout == "NCHW" else nhwc(shape, dtype, -1, 1)
    dx, dgamma, dbeta = nvdnn.batch_norm_backward(dy, x, saved_mean, saved_invstd, gamma)
    want = ref.batch_norm_backward(dy64, x64, saved_mean.get(), saved_invstd.get(), g64)
    check(dx, want[0], dtype, "dx")
    np.testing.assert_allclose(dbeta.get().astype(np.float64), want[2], rtol=3e-2, atol=3e-1)
    np.testing.assert_allclose(dgamma.get().astype(np.float64), want[1], rtol=3e-2, atol=3e-1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_group_and_instance_norm(dtype):
    x, x64 = nhwc((2, 32, 9, 7), dtype)
    gamma, g64 = random((32,), dtype, 0.5, 1.5)
    beta, b64 = random((32,), dtype, -1, 1)
    check(nvdnn.group_norm(x, 4, gamma, beta), ref.group_norm(x64, 4, g64, b64), dtype, "group_norm")
    check(nvdnn.instance_norm(x, gamma, beta, activation="silu"),
          ref.silu(ref.instance_norm(x64, g64, b64)), dtype, "instance_norm+silu")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_pooling_forward_and_backward(dtype, layout):
    shape = (2, 16, 13, 11)
    x, x64 = nhwc(shape, dtype) if layout == "NHWC" else random(shape, dtype, -3, 3)
    y = nvdnn.max_pool2d(x, 3, 2, 1)
    check(y, ref.max_pool2d(x64, 3, 2, 1), dtype, "max_pool2d")
    check(nvdnn.avg_pool2d(x, 2, 2, 0, ceil_mode=True), ref.avg_pool2d(x64, 2, 2, 0, True), dtype, "avg_pool2d")
    check(nvdnn.global_avg_pool2d(x), ref.global_avg_pool2d(x64), dtype, "global_avg_pool2d")
    dy, dy64 = random(y.shape, dtype, -1, 1)
    dy = dy.transpose(0, 2, 3, 1).copy().transpose(0, 3, 1, 2) if layout == "NHWC" else dy
    check(nvdnn.max_pool2d_backward(dy, x, 3, 2, 1), ref.max_pool2d_backward(dy64, x64, 3, 2, 1), dtype,
          "max_pool2d_backward")


def test_pool_padding_beyond_half_the_window_is_refused():
    x, _ = random((1, 3, 9, 9), "float32")
    with pytest.raises(ValidationError, match="padding"):
        nvdnn.max_pool2d(x, 3, 2, 2)


def test_zero_size_input_is_a_named_error():
    x, _ = random((4, 0), "float32")
    with pytest.raises(ValidationError) as info:
        nvdnn.sum(x, axis=1)
    assert info.value.arg in ("x", "dims")


def test_graph_bn_relu_then_pool_keeps_nhwc_through_the_workspace():
    g = nvdnn.Graph(io_data_type="float16")
    dims = [4, 64, 14, 14]
    x = g.tensor(dims=dims, strides=list(nvdnn.graph.tensor.nhwc_strides(dims)), name="x")
    m, v = (g.tensor(dims=[64], data_type="float32", name=n) for n in ("m", "v"))
    h = g.relu(g.batch_norm(x, m, v))
    y = g.max_pool2d(h, kernel=2, stride=2, name="y").set_output(True)
    g.build()
    assert len(g.groups) == 2
    xa, x64 = nhwc(tuple(dims), "float16")
    ma, m64 = random((64,), "float32", -1, 1)
    va, v64 = random((64,), "float32", 0.5, 2)
    ws = poisoned((g.get_workspace_size() // 4 + 1,), "float32").view("uint8")  # NaN bytes: nothing relies on zeros
    out = poisoned((4, 7, 7, 64), "float16").transpose(0, 3, 1, 2)
    g.execute({"x": xa, "m": ma, "v": va, "y": out}, ws)
    want = ref.max_pool2d(np.maximum(ref.batch_norm(x64, m64, v64), 0), 2, 2)
    check(out, want, "float16", "graph bn->relu->pool")
