"""Pooling on the CPU: the float64 references against independent formulas (padded-array loops,
the adjoint identity, finite differences, hand-checked PyTorch values), spec and plan errors,
plan choices, the whole preset compiled for sm_80 / sm_90 without spills, 128-bit NHWC loads."""
from __future__ import annotations

import dataclasses
import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from nvdnn import codegen, compiler
from nvdnn import reference as ref
from nvdnn.errors import DTypeError, UnsupportedError, ValidationError
from nvdnn.kernels import pool
from nvdnn.kernels.pool import window as pool_window
from nvdnn.kernels.pointwise import Operand
from nvdnn.spec import KernelSpec

from .presets import warmed_preset
from .sass import sass_of

ARCHS = ("sm_80", "sm_90")
RNG = np.random.default_rng(7)


def _x(shape, dtype="float16", layout="NCHW", align=16):
    return Operand(dtype, shape, pool.packed_strides(shape, layout), align)


# -- references against independent formulas ---------------------------------------------------------

def _size_by_counting(size, k, s, p, d, ceil_mode):
    """Windows counted one by one: a window starts at o * s - p; without ceil_mode it must end
    inside the padded input, with ceil_mode it must start inside the input or its left padding
    and its start must fit a ceil of the span."""
    span = Fraction(size + 2 * p - d * (k - 1) - 1, s)
    out = (math.ceil(span) if ceil_mode else math.floor(span)) + 1
    return sum(1 for o in range(out) if not ceil_mode or o * s - p < size)


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_output_size_matches_counting(ceil_mode):
    for size, k, s, d in itertools.product(range(1, 12), range(1, 6), range(1, 4), range(1, 3)):
        for p in range(k // 2 + 1):
            if size + 2 * p < d * (k - 1) + 1:
                continue
            assert pool.output_size(size, k, s, p, d, ceil_mode) == _size_by_counting(size, k, s, p, d, ceil_mode), \
                (size, k, s, p, d, ceil_mode)


def test_output_sizes_pytorch_gives():
    # torch.nn.functional.max_pool2d(torch.ones(1, 1, H, H), k, s, p, ceil_mode=...).shape[-1]
    assert pool.output_size(112, 3, 2, 1, 1, False) == 56
    assert pool.output_size(5, 2, 2, 0, 1, True) == 3
    assert pool.output_size(5, 2, 2, 0, 1, False) == 2
    assert pool.output_size(3, 2, 2, 1, 1, True) == 2   # a third window would start in the right padding
    assert pool.output_size(6, 3, 2, 1, 2, False) == 2
    assert pool.pool2d_output_shape((2, 3, 7, 13), (3, 2), (2, 1), (1, 0), 1, True) == (2, 3, 4, 12)


def _padded_max(x, k, s, p, d, ceil_mode):
    """Max and argmax by scanning a -inf padded copy (wide enough for ceil_mode's overhang)."""
    n, c, h, w = x.shape
    oh, ow = (pool.output_size(h, k[0], s[0], p[0], d[0], ceil_mode),
              pool.output_size(w, k[1], s[1], p[1], d[1], ceil_mode))
    extra = [max(0, (o - 1) * ss + (kk - 1) * dd + 1 - (size + 2 * pp)) for o, ss, kk, dd, size, pp in
             ((oh, s[0], k[0], d[0], h, p[0]), (ow, s[1], k[1], d[1], w, p[1]))]
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0] + extra[0]), (p[1], p[1] + extra[1])), constant_values=-np.inf)
    y = np.empty((n, c, oh, ow))
    idx = np.empty((n, c, oh, ow), dtype=np.int64)
    for b, ch, i, j in itertools.product(range(n), range(c), range(oh), range(ow)):
        best, arg = -np.inf, None
        for a, e in itertools.product(range(k[0]), range(k[1])):
            r, q = i * s[0] + a * d[0], j * s[1] + e * d[1]
            hh, ww = r - p[0], q - p[1]
            if not (0 <= hh < h and 0 <= ww < w):
                continue
            v = xp[b, ch, r, q]
            if arg is None:
                arg = hh * w + ww
            if v > best or np.isnan(v):
                best, arg = v, hh * w + ww
        y[b, ch, i, j], idx[b, ch, i, j] = best, arg
    return y, idx


MAX_CASES = [  # (shape, kernel, stride, padding, dilation, ceil_mode)
    ((2, 3, 7, 7), 3, 2, 1, 1, False), ((1, 2, 8, 9), 2, 2, 0, 1, True), ((1, 1, 13, 5), (3, 2), (2, 1), (1, 1), 1,
                                                                             True),
    ((2, 2, 9, 9), 3, 1, 1, 2, False), ((1, 3, 10, 11), 3, 3, 1, 2, True), ((1, 1, 1, 1), 1, 1, 0, 1, False),
    ((1, 1, 5, 5), 5, 2, 2, 1, True), ((1, 2, 6, 7), (2, 3), (3, 2), (1, 1), (1, 2), True)]


@pytest.mark.parametrize("case", MAX_CASES)
def test_max_pool_reference_matches_a_padded_scan(case):
    shape, kernel, stride, padding, dilation, ceil_mode = case
    x = RNG.standard_normal(shape)
    x.flat[RNG.integers(0, x.size, 2)] = np.nan
    k, s, p, d = (pool_window._pair(v, "v", 0) for v in (kernel, stride, padding, dilation))
    y, idx = ref.max_pool2d_with_indices(x, kernel, stride, padding, dilation, ceil_mode)
    want_y, want_idx = _padded_max(x, k, s, p, d, ceil_mode)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(idx, want_idx)


def test_max_pool_argmax_rules():
    x = np.array([[[[1.0, 3.0, 3.0], [np.nan, 0.0, np.nan], [-np.inf, -np.inf, -np.inf]]]])
    _, idx = ref.max_pool2d_with_indices(x[:, :, :1], (1, 3), 1)
    assert idx.ravel().tolist() == [1]            # ties: the first maximum
    y, idx = ref.max_pool2d_with_indices(x[:, :, 1:2], (1, 3), 1)
    assert np.isnan(y).all() and idx.ravel().tolist() == [2]   # NaN wins, and the last NaN is kept
    y, idx = ref.max_pool2d_with_indices(x[:, :, 2:], (1, 3), 1)
    assert y.ravel().tolist() == [-np.inf] and idx.ravel().tolist() == [0]   # all -inf: the first tap


def _padded_avg(x, k, s, p, ceil_mode, count_include_pad, divisor_override):
    n, c, h, w = x.shape
    oh, ow = pool.output_size(h, k[0], s[0], p[0], 1, ceil_mode), pool.output_size(w, k[1], s[1], p[1], 1, ceil_mode)
    y = np.empty((n, c, oh, ow))
    for i, j in itertools.product(range(oh), range(ow)):
        total, inside, padded = np.zeros((n, c)), 0, 0
        for a, e in itertools.product(range(k[0]), range(k[1])):
            hh, ww = i * s[0] - p[0] + a, j * s[1] - p[1] + e
            if hh < h + p[0] and ww < w + p[1]:
                padded += 1   # PyTorch counts padding only up to the padded edge
            if 0 <= hh < h and 0 <= ww < w:
                total += x[:, :, hh, ww]
                inside += 1
        y[:, :, i, j] = total / (divisor_override or (padded if count_include_pad else inside))
    return y


AVG_CASES = [((2, 3, 7, 7), 3, 2, 1, False), ((1, 2, 8, 9), 2, 2, 1, True), ((1, 1, 13, 5), (3, 2), (2, 1), (1, 1),
                                                                            True),
             ((1, 2, 5, 5), 3, 3, 1, True), ((1, 1, 1, 1), 1, 1, 0, False)]


@pytest.mark.parametrize("count_include_pad,divisor_override", [(True, None), (False, None), (True, 7)])
@pytest.mark.parametrize("case", AVG_CASES)
def test_avg_pool_reference_matches_a_direct_loop(case, count_include_pad, divisor_override):
    shape, kernel, stride, padding, ceil_mode = case
    x = RNG.standard_normal(shape)
    k, s, p = (pool_window._pair(v, "v", 0) for v in (kernel, stride, padding))
    got = ref.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    np.testing.assert_allclose(got, _padded_avg(x, k, s, p, ceil_mode, count_include_pad, divisor_override),
                               rtol=1e-13)


@pytest.mark.parametrize("count_include_pad,divisor_override", [(True, None), (False, None), (True, 5)])
@pytest.mark.parametrize("case", AVG_CASES)
def test_avg_pool_backward_is_the_adjoint(case, count_include_pad, divisor_override):
    shape, kernel, stride, padding, ceil_mode = case
    x = RNG.standard_normal(shape)
    y = ref.avg_pool2d(x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    dy = RNG.standard_normal(y.shape)
    dx = ref.avg_pool2d_backward(dy, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    assert dx.shape == shape
    assert np.vdot(y, dy) == pytest.approx(np.vdot(x, dx), rel=1e-12)


@pytest.mark.parametrize("case", MAX_CASES)
def test_max_pool_backward_matches_finite_differences(case):
    shape, kernel, stride, padding, dilation, ceil_mode = case
    x = RNG.permutation(np.arange(math.prod(shape), dtype=np.float64)).reshape(shape)  # distinct: no ties
    y = ref.max_pool2d(x, kernel, stride, padding, dilation, ceil_mode)
    dy = RNG.standard_normal(y.shape)
    dx = ref.max_pool2d_backward(dy, x, kernel, stride, padding, dilation, ceil_mode)
    v = RNG.standard_normal(shape)
    eps = 1e-4   # far below the 1.0 gap between values: the argmax stays put
    moved = ref.max_pool2d(x + eps * v, kernel, stride, padding, dilation, ceil_mode)
    assert np.vdot(moved - y, dy) / eps == pytest.approx(np.vdot(v, dx), rel=1e-6, abs=1e-9)


def test_global_avg_pool_reference():
    x = RNG.standard_normal((2, 3, 5, 7))
    got = ref.global_avg_pool2d(x)
    assert got.shape == (2, 3, 1, 1)
    np.testing.assert_allclose(got[1, 2, 0, 0], sum(x[1, 2].ravel()) / 35, rtol=1e-14)


# -- specs --------------------------------------------------------------------------------------------

def _forward_spec(**changes):
    base = dict(kind="max", layout="nhwc", dtype="float16", out_dtype="float16", indices="", divisor="",
                window=(3, 3, 2, 2), epilogue=(), vec=8, index="int32", block=256, min_blocks=2, th=1, tw=2)
    return pool.Pool2dSpec(**{**base, **changes})


@pytest.mark.parametrize("changes,arg", [
    (dict(kind="min"), "kind"), (dict(layout="nc"), "layout"), (dict(dtype="int32"), "dtype"),
    (dict(indices="int64", kind="avg", divisor="include_pad"), "indices"), (dict(divisor="include_pad"), "divisor"),
    (dict(kind="avg"), "divisor"), (dict(window=(5, 5, 2, 2)), "window"), (dict(window=(), tw=2), "th"),
    (dict(vec=16), "vec"), (dict(dtype="float32", vec=8), "vec"), (dict(layout="nchw"), "vec"),
    (dict(block=96), "block"), (dict(block=512, min_blocks=8), "min_blocks"), (dict(th=3), "th"),
    (dict(epilogue=(("relu", "x1"),)), "epilogue"), (dict(epilogue=(("mul", ""),)), "epilogue"),
    (dict(epilogue=(("bogus", ""),)), "epilogue.op"), (dict(epilogue=("relu",)), "epilogue"),
    (dict(index="int16"), "index")])
def test_forward_spec_validation(changes, arg):
    with pytest.raises(ValidationError) as info:
        _forward_spec(**changes)
    assert info.value.arg == arg


def test_other_spec_validation():
    base = dict(kind="max", source="indices", layout="nhwc", dtype="float16", dx_dtype="float16",
                indices="int64", divisor="", vec=8, index="int32")
    pool.Pool2dBackwardSpec(**base)
    for changes, arg in ((dict(source=""), "source"), (dict(source="x"), "source"),
                         (dict(indices=""), "indices"), (dict(kind="avg"), "source")):
        with pytest.raises(ValidationError) as info:
            pool.Pool2dBackwardSpec(**{**base, **changes})
        assert info.value.arg == arg
    gbase = dict(stage="full", layout="nhwc", dtype="float16", out_dtype="float16", epilogue=(), vec=8,
                 index="int32", cvb=8)
    pool.GlobalAvgPoolSpec(**gbase)
    for changes, arg in ((dict(stage="partial"), "stage"), (dict(layout=""), "layout"),
                         (dict(out_dtype="float8_e4m3"), "out_dtype"), (dict(layout="nchw"), "vec"),
                         (dict(cvb=64), "cvb")):
        with pytest.raises(ValidationError) as info:
            pool.GlobalAvgPoolSpec(**{**gbase, **changes})
        assert info.value.arg == arg


def test_specs_round_trip_and_uris_are_distinct():
    specs = pool.preset()
    assert 60 <= len(specs) <= 150 and len(set(specs)) == len(specs)
    assert len({s.uri for s in specs}) == len(specs)
    for spec in specs:
        assert KernelSpec.from_dict(spec.to_dict()) == spec


def test_candidates_keep_the_work_and_start_with_the_spec():
    for spec in pool.preset():
        cands = pool.candidates(spec)
        assert cands[0] == spec and len(set(cands)) == len(cands) >= 2
        for c in cands:
            same = {f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name not in c.tile_fields}
            assert same == {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)
                            if f.name not in c.tile_fields}


def test_unsupported_reason():
    spec = pool.preset()[0]
    assert pool.unsupported_reason(spec, "sm_90") is None
    assert "sm_80" in pool.unsupported_reason(spec, "sm_75")


# -- plans --------------------------------------------------------------------------------------------

TARGET = (32, 64, 112, 112)


def test_target_plan_uses_the_fixed_nhwc_kernel():
    plan = pool.plan_pool2d("max", _x(TARGET, layout="NHWC"), 3, 2, 1)
    (launch,) = plan.launches
    spec = launch.spec
    assert (spec.layout, spec.window, spec.vec, spec.index) == ("nhwc", (3, 3, 2, 2), 8, "int32")
    assert (spec.th, spec.tw, spec.min_blocks) == (1, 2, 2)
    assert launch.pointers == ("y", "x") and plan.scratch == ()
    assert launch.grid == (-(-32 * 56 * 28 * 8 // 256), 1, 1) and launch.block == (256, 1, 1)
    assert [int(a) for a in launch.args] == [32, 64, 112, 112, 56, 56, 112 * 112 * 64, 1, 112 * 64, 64, 1, 1]
    assert all(type(a) is np.int32 for a in launch.args)


def test_plan_arguments_for_dynamic_windows_and_options():
    x = _x((2, 3, 13, 7), "float32")
    plan = pool.plan_pool2d("max", x, (3, 2), (2, 1), (1, 1), (2, 1), ceil_mode=True, return_indices=True,
                            index_dtype="int32", epilogue=[("mul", "p")], params=(2.0,))
    (launch,) = plan.launches
    assert launch.pointers == ("y", "indices", "x") and launch.spec.indices == "int32"
    assert launch.spec.window == () and launch.spec.layout == "nchw" and launch.spec.vec == 1
    oh, ow = pool.output_size(13, 3, 2, 1, 2, True), pool.output_size(7, 2, 1, 1, 1, True)
    assert [float(a) for a in launch.args] == [2, 3, 13, 7, oh, ow, 273, 91, 7, 1, 1, 1, 3, 2, 2, 1, 2, 1, 2.0]
    assert type(launch.args[-1]) is np.float32
    avg = pool.plan_pool2d("avg", x, 2, divisor_override=3).launches[0]
    assert avg.spec.divisor == "override" and float(avg.args[-1]) == 3.0 and avg.spec.window == (2, 2, 2, 2)


@pytest.mark.parametrize("shape,layout,align,dtype,vec", [
    (TARGET, "NHWC", 16, "float16", 8), (TARGET, "NHWC", 8, "float16", 4), ((1, 3, 7, 7), "NHWC", 16, "float16", 1),
    ((1, 12, 7, 7), "NHWC", 16, "bfloat16", 4), (TARGET, "NHWC", 16, "float32", 4), (TARGET, "NCHW", 16, "float16", 1)])
def test_vector_width_follows_channels_and_alignment(shape, layout, align, dtype, vec):
    assert pool.plan_pool2d("max", _x(shape, dtype, layout, align), 3, 2, 1).launches[0].spec.vec == vec


def test_output_alignment_and_dtype_limit_the_vector():
    x = _x(TARGET, layout="NHWC")
    assert pool.plan_pool2d("max", x, 3, 2, 1, out_align=4).launches[0].spec.vec == 2
    spec = pool.plan_pool2d("max", x, 3, 2, 1, out_dtype="float32").launches[0].spec
    assert (spec.vec, spec.out_dtype) == (8, "float32")   # stored in 16-byte pieces


def test_layouts_and_strided_views():
    assert pool.layout_of(_x((2, 3, 4, 5), layout="NHWC")) == "NHWC"
    assert pool.layout_of(_x((2, 3, 4, 5))) == "NCHW"
    assert pool.layout_of(_x((2, 1, 4, 5), layout="NHWC")) == "NCHW"
    view = Operand("float16", (2, 64, 8, 8), (64 * 16 * 16, 1, 16 * 64 * 2, 64 * 2))   # x[:, :, ::2, ::2]
    assert pool.plan_pool2d("max", view, 2).launches[0].spec.vec == 8
    with pytest.raises(ValidationError) as info:
        pool.layout_of(Operand("float16", (2, 3, 4, 5), (60, 20, 1, 4)))
    assert info.value.arg == "x" and "neither NCHW nor NHWC" in str(info.value)


def test_big_tensors_take_64_bit_offsets():
    spec = pool.plan_pool2d("max", _x((1024, 64, 256, 256), layout="NHWC"), 3, 2, 1).launches[0].spec
    assert spec.index == "int64"


def test_empty_batch_plans_nothing():
    assert pool.plan_pool2d("max", _x((0, 3, 7, 7)), 3).launches == ()


@pytest.mark.parametrize("call,arg,words", [
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 3, 1, 2), "padding",
     "padding: 2 (H) is more than half the kernel size 3 (padding must be <= kernel // 2)"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 0), "kernel", "must be positive"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 2, (1, 0)), "stride", "0 (W) must be positive"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 2, 1, 0, 0), "dilation", "must be positive"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 2, 1, -1), "padding", "non-negative"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), (2, 2, 2)), "kernel", "pair"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 2, 8)), 3), "x", "output H would be 0"),
    (lambda: pool.plan_pool2d("max", Operand("float16", (1, 8, 8), (64, 8, 1)), 2), "x", "4-D"),
    (lambda: pool.plan_pool2d("max", Operand("float16", (1, 1, 1, 8, 8), (64,) * 4 + (1,)), 2), "x", "5-D"),
    (lambda: pool.plan_pool2d("max", Operand("float16", (1, 0, 8, 8), (0, 64, 8, 1)), 2), "x", "non-empty"),
    (lambda: pool.plan_pool2d("max", Operand("float16", (2, 3, 4, 5), (60, 20, 1, 4)), 2), "x", "neither"),
    (lambda: pool.plan_pool2d("avg", _x((1, 1, 8, 8)), 2, dilation=2), "dilation", "no dilation"),
    (lambda: pool.plan_pool2d("avg", _x((1, 1, 8, 8)), 2, divisor_override=0), "divisor_override", "nonzero"),
    (lambda: pool.plan_pool2d("avg", _x((1, 1, 8, 8)), 2, return_indices=True), "return_indices", "only max"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 2, return_indices=True, index_dtype="int16"),
     "index_dtype", "int16"),
    (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 2, epilogue=[("mul", "p")]), "params", "takes 1"),
    (lambda: pool.plan_pool2d("mean", _x((1, 1, 8, 8)), 2), "kind", "mean"),
    (lambda: pool.plan_pool2d_backward("max", _x((1, 1, 3, 3)), (1, 1, 8, 8), 2, indices=_x((1, 1, 4, 4), "int64")),
     "dy", "pooled shape (1, 1, 4, 4)"),
    (lambda: pool.plan_pool2d_backward("max", _x((1, 1, 4, 4)), (1, 1, 8, 8), 2), "indices", "exactly one"),
    (lambda: pool.plan_pool2d_backward("max", _x((1, 1, 4, 4)), (1, 1, 8, 8), 2, indices=_x((1, 1, 4, 4), "int64"),
                                       x=_x((1, 1, 8, 8))), "indices", "exactly one"),
    (lambda: pool.plan_pool2d_backward("max", _x((1, 1, 4, 4)), (1, 1, 8, 8), 2, x=_x((1, 1, 8, 9))), "x",
     "should be (1, 1, 8, 8)"),
    (lambda: pool.plan_pool2d_backward("avg", _x((1, 1, 4, 4)), (1, 1, 8, 8), 2, x=_x((1, 1, 8, 8))), "x",
     "neither"),
    (lambda: pool.plan_pool2d_backward("max", _x((1, 1, 4, 4)), (1, 1, 8), 2, x=_x((1, 1, 8, 8))),
     "input_shape", "4-D"),
])
def test_plan_errors_name_the_argument(call, arg, words):
    with pytest.raises(ValidationError) as info:
        call()
    assert info.value.arg == arg and words in str(info.value)


def test_max_backward_refuses_windows_with_no_tap_inside_the_input():
    # W = 1, kernel 2, dilation 2, padding 1: every window's W taps are -1 and 1
    from nvdnn.errors import UnsupportedError
    dy, idx = _x((1, 1, 7, 1)), _x((1, 1, 7, 1), "int64")
    with pytest.raises(UnsupportedError) as info:
        pool.plan_pool2d_backward("max", dy, (1, 1, 7, 1), 2, 1, 1, 2, ceil_mode=True, indices=idx)
    assert info.value.arg == "dilation" and "output W 0 of max_pool2d has no tap" in str(info.value)
    pool.plan_pool2d_backward("max", _x((1, 1, 7, 3)), (1, 1, 7, 3), 2, 1, 1, 2, ceil_mode=True,
                              indices=_x((1, 1, 7, 3), "int64"))  # W = 3: the taps -1 and 1 reach w = 1


def test_plan_dtype_errors():
    for call, arg in ((lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8), "int32"), 2), "x"),
                      (lambda: pool.plan_pool2d("max", _x((1, 1, 8, 8)), 2, out_dtype="int64"), "out_dtype"),
                      (lambda: pool.plan_pool2d_backward("max", _x((1, 1, 4, 4)), (1, 1, 8, 8), 2,
                                                         indices=_x((1, 1, 4, 4), "float32")), "indices"),
                      (lambda: pool.plan_global_avg_pool2d(_x((1, 1, 8, 8), "float8_e4m3")), "x")):
        with pytest.raises(DTypeError) as info:
            call()
        assert info.value.arg == arg


def test_backward_plans():
    shape, dy_shape = (2, 64, 13, 13), pool.pool2d_output_shape((2, 64, 13, 13), 3, 2, 1, ceil_mode=True)
    dy = _x(dy_shape, "bfloat16", "NHWC")
    idx = Operand("int64", dy_shape, dy.strides)
    launch = pool.plan_pool2d_backward("max", dy, shape, 3, 2, 1, ceil_mode=True, indices=idx).launches[0]
    assert launch.pointers == ("dx", "dy", "indices") and launch.spec.vec == 8
    assert [int(a) for a in launch.args[:6]] == [2, 64, 13, 13, 7, 7]
    plan = pool.plan_pool2d_backward("max", dy, shape, 3, 2, 1, ceil_mode=True, x=_x(shape, "float32", "NHWC"))
    forward, gather = plan.launches  # from x: the forward's argmax into scratch, then the gather from it
    assert forward.pointers == ("scratch0", "scratch1", "x") and forward.spec.indices == "int32"
    assert gather.pointers == ("dx", "dy", "scratch1") and gather.spec.source == "indices"
    assert plan.scratch == (4 * 2 * 64 * 7 * 7,) * 2
    launch = pool.plan_pool2d_backward("avg", dy, shape, 3, 2, 1, ceil_mode=True, count_include_pad=False,
                                       dx_dtype="float32").launches[0]
    assert launch.pointers == ("dx", "dy") and launch.spec.divisor == "exclude_pad"
    assert launch.spec.dx_dtype == "float32" and len(launch.args) == 6 + 4 + 6


def test_global_avg_plans_split_small_batches():
    whole = pool.plan_global_avg_pool2d(_x((32, 2048, 7, 7), "float16", "NHWC"))
    assert len(whole.launches) == 1 and whole.scratch == () and whole.launches[0].pointers == ("y", "x")
    split = pool.plan_global_avg_pool2d(_x((1, 64, 112, 112), "float16", "NHWC"), epilogue=[("relu", "")],
                                        params=(0.0, math.inf))
    only, = split.launches  # the last block of each tile adds the splits: one launch
    assert only.spec.stage == "split" and only.pointers == ("y", "scratch0", "x")
    splits = only.grid[1]
    assert splits > 1 and split.scratch == (splits * 64 * 4,)
    chunk = int(only.args[6])
    assert (splits - 1) * chunk < 112 * 112 <= splits * chunk
    assert float(only.args[7]) == pytest.approx(1 / 112 ** 2)
    nchw = pool.plan_global_avg_pool2d(_x((4, 3, 9, 9), "float32"))
    assert nchw.launches[0].spec.layout == "nchw"
    with pytest.raises(UnsupportedError):
        pool.plan_global_avg_pool2d(Operand("float32", (1, 3, 4, 4), (96, 32, 8, 1)))


# -- compiling the preset -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("pool-cache")
    jobs = [(spec, arch) for spec in pool.preset() for arch in ARCHS]
    return warmed_preset(folder, jobs)


def test_every_preset_spec_compiles_without_spills(warmed):
    report = warmed["report"]
    assert report.failed == [], report.failed[:3]
    assert set(warmed["entries"]) == {(s.uri, a) for s, a in warmed["jobs"]}
    assert {k: e.meta["spill_bytes"] for k, e in warmed["entries"].items() if e.meta["spill_bytes"]} == {}
    assert all(0 < e.meta["registers"] <= 128 for e in warmed["entries"].values())


def test_nhwc_kernels_use_128_bit_loads(warmed):
    picked = {}
    for (uri, arch), e in sorted(warmed["entries"].items()):
        fields = e.meta["spec"]["fields"]
        if fields.get("layout") == "nhwc" and fields["vec"] * (4 if fields["dtype"] == "float32" else 2) == 16:
            kind = (e.meta["family"], fields.get("window", ()) != (), fields.get("source", ""), arch)
            picked.setdefault(kind, e)
    assert len(picked) >= 8
    for e, sass in zip(picked.values(), sass_of([e.cubin for e in picked.values()])):
        assert "LDG.E.128" in sass, f"{e.uri} [{e.arch}] has no 128-bit load"


def test_target_kernel_loads_each_patch_tap_once():
    """3x3/2 with two outputs per thread: a 3 x 5 patch, 15 loads of 16 bytes, 2 vector stores."""
    spec = pool.plan_pool2d("max", _x(TARGET, layout="NHWC"), 3, 2, 1).launches[0].spec
    result = compiler.compile_cubin(codegen.render(spec), name="pool.cu", options=compiler.options_for("sm_90"))
    assert result.spill_bytes == 0
    sass = sass_of([result.cubin])[0]
    assert sass.count("LDG.E.128") == 15 and sass.count("STG.E.128") == 2
    assert "HMNMX2" in sass   # 16-bit max on packed pairs, no conversions


def test_backward_unrolled_window_loops_visit_exactly_the_windows_holding_each_pixel():
    """Python replica of the gather's window bounds: with the plan's span, the unrolled loops
    (clamped to a real window, masked past the last) visit the same windows as the plain loops."""
    for size, k, s, p, d, ceil_mode, kind in itertools.product((1, 5, 8, 13), (1, 2, 3, 5), (1, 2, 3), (0, 1, 2),
                                                                (1, 2), (False, True), ("max", "avg")):
        if p > k // 2 or (kind == "avg" and d > 1):
            continue
        try:
            geo = pool.geometry((1, 1, size, size), k, s, p, d, ceil_mode)
        except ValidationError:
            continue
        out = geo.out_shape[2]
        dy = _x(geo.out_shape, "float32")
        source = {"indices": Operand("int32", geo.out_shape, dy.strides)} if kind == "max" else {}
        try:
            span = pool.plan_pool2d_backward(kind, dy, (1, 1, size, size), k, s, p, d, ceil_mode=ceil_mode,
                                             **source).launches[0].spec.span[0]
        except UnsupportedError:  # a max window with no tap inside the input
            continue
        extent = (k - 1) * d + 1 if kind == "max" else k
        for h in range(size):
            begin = 0 if h + p < extent else (h + p - extent) // s + 1
            end = min((h + p) // s + 1, out)
            plain = set(range(begin, end))
            assert plain == {o for o in range(out) if o * s - p <= h <= o * s - p + extent - 1}
            if span:
                visited = [min(begin + i, out - 1) for i in range(span)]
                assert all(0 <= o < out for o in visited)
                assert {o for i, o in enumerate(visited) if begin + i < end} == plain, (size, k, s, p, d, h)
