"""Convolution on the CPU: the float64 references against a direct loop definition, the graph
op's shape inference and errors, planning (what launches a conv becomes) and the templates'
NVRTC compiles."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from nvdnn import reference as ref


def _loops(x, w, stride, padding, dilation, groups):
    """y[n, k, p, q] = sum over c, r, s of x[n, g Cg + c, p sh - ph + r dh, q sw - pw + s dw] w[k, c, r, s]."""
    n_, c_, h_, w_ = x.shape
    k_, cg, r_, s_ = w.shape
    (sh, sw), (ph, pw), (dh, dw) = stride, padding, dilation
    p_ = (h_ + 2 * ph - dh * (r_ - 1) - 1) // sh + 1
    q_ = (w_ + 2 * pw - dw * (s_ - 1) - 1) // sw + 1
    y = np.zeros((n_, k_, p_, q_))
    kg = k_ // groups
    for n, k, p, q in itertools.product(range(n_), range(k_), range(p_), range(q_)):
        g = k // kg
        for c, r, s in itertools.product(range(cg), range(r_), range(s_)):
            h, wi = p * sh - ph + r * dh, q * sw - pw + s * dw
            if 0 <= h < h_ and 0 <= wi < w_:
                y[n, k, p, q] += x[n, g * cg + c, h, wi] * w[k, c, r, s]
    return y


CASES = [  # x shape, w shape, stride, padding, dilation, groups
    ((2, 3, 7, 5), (4, 3, 3, 3), (1, 1), (1, 1), (1, 1), 1),
    ((1, 5, 9, 8), (7, 5, 3, 2), (2, 1), (1, 0), (1, 2), 1),
    ((2, 4, 6, 7), (6, 2, 3, 3), (1, 2), (2, 1), (2, 1), 2),
    ((1, 3, 11, 13), (2, 3, 7, 7), (2, 2), (3, 3), (1, 1), 1),
    ((2, 6, 5, 5), (6, 1, 3, 3), (1, 1), (1, 1), (1, 1), 6),   # depthwise
    ((1, 4, 4, 4), (3, 4, 1, 1), (1, 1), (0, 0), (1, 1), 1),
]


@pytest.mark.parametrize("case", CASES)
def test_reference_fprop_matches_loops(case):
    xs, ws, stride, padding, dilation, groups = case
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    got = ref.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups)
    np.testing.assert_allclose(got, _loops(x, w, stride, padding, dilation, groups), rtol=1e-12, atol=1e-12)
    assert got.shape[2:] == ref.conv2d_output_size(xs, ws, stride, padding, dilation)


@pytest.mark.parametrize("case", CASES)
def test_reference_gradients_are_adjoint(case):
    """<dy, conv(x, w)> = <dgrad(dy, w), x> = <wgrad(dy, x), w>: conv is linear in each operand,
    so the gradients are its adjoints, checked against the loop definition's forward."""
    xs, ws, stride, padding, dilation, groups = case
    rng = np.random.default_rng(1)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    y = _loops(x, w, stride, padding, dilation, groups)
    dy = rng.standard_normal(y.shape)
    dx = ref.conv2d_backward_data(dy, w, xs, stride, padding, dilation, groups)
    dw = ref.conv2d_backward_weight(dy, x, ws, stride, padding, dilation, groups)
    assert dx.shape == xs and dw.shape == ws
    np.testing.assert_allclose(np.vdot(dx, x), np.vdot(dy, y), rtol=1e-10)
    np.testing.assert_allclose(np.vdot(dw, w), np.vdot(dy, y), rtol=1e-10)
    # and element by element: one-hot probes of the loop definition
    for idx in [(0, 0, 0, 0), tuple(s - 1 for s in xs)]:
        e = np.zeros(xs)
        e[idx] = 1.0
        np.testing.assert_allclose(dx[idx], np.vdot(dy, _loops(e, w, stride, padding, dilation, groups)), atol=1e-12)
    for idx in [(0, 0, 0, 0), tuple(s - 1 for s in ws)]:
        e = np.zeros(ws)
        e[idx] = 1.0
        np.testing.assert_allclose(dw[idx], np.vdot(dy, _loops(x, e, stride, padding, dilation, groups)), atol=1e-12)


def test_reference_epilogue_order():
    """activation(conv + bias + residual), as the fused GEMM epilogue computes it."""
    rng = np.random.default_rng(2)
    x, w = rng.standard_normal((1, 2, 5, 5)), rng.standard_normal((3, 2, 3, 3))
    b, res = rng.standard_normal(3), rng.standard_normal((1, 3, 3, 3))
    y = ref.conv2d(x, w, b, activation="relu", residual=res)
    np.testing.assert_allclose(y, np.maximum(_loops(x, w, (1, 1), (0, 0), (1, 1), 1) + b[:, None, None] + res, 0))


# -- the graph op: shape inference and errors ------------------------------------------------------------

import nvdnn  # noqa: E402
from nvdnn.errors import DeviceError, DTypeError, UnsupportedError, ValidationError  # noqa: E402
from nvdnn.graph.tensor import nhwc_strides  # noqa: E402
from nvdnn.kernels import conv, repack  # noqa: E402
from nvdnn.kernels.matmul import MatmulSpec  # noqa: E402
from nvdnn.kernels.matmul.tensor_maps import Im2colMapArg  # noqa: E402
from nvdnn.kernels.pointwise import Operand  # noqa: E402

from .gpu import gpu_count  # noqa: E402


def _graph(x_dims, w_dims, nhwc=True, dtype="float16", **attrs):
    g = nvdnn.Graph(io_data_type=dtype, arch="sm_90")
    x = g.tensor(dims=list(x_dims), strides=list(nhwc_strides(list(x_dims))) if nhwc else None, name="x")
    w = g.tensor(dims=list(w_dims), name="w")
    return g, x, w


@pytest.mark.parametrize("nhwc", [True, False])
def test_graph_infers_the_output_dims_in_x_layout(nhwc):
    g, x, w = _graph((2, 5, 13, 11), (7, 5, 3, 3), nhwc)
    y = g.conv_fprop(x, w, padding=(1, 0), stride=(2, 1), dilation=(1, 2), name="y")
    assert y.dims == (2, 7, 7, 7)
    assert y.strides == (tuple(nhwc_strides([2, 7, 7, 7])) if nhwc else (343, 49, 7, 1))


@pytest.mark.parametrize("x_dims, w_dims, attrs, cls, words", [
    ((2, 6, 8, 8), (4, 4, 3, 3), {}, ValidationError, ["'w' dim 1", "x's C=6", "C = w's C * groups"]),
    ((2, 6, 8, 8), (4, 2, 3, 3), {"groups": 4}, ValidationError, ["'x' dim 1 (C) is 6", "groups=4"]),
    ((2, 6, 8, 8), (5, 2, 3, 3), {"groups": 3}, ValidationError, ["'w' dim 0 (K) is 5", "groups=3"]),
    ((2, 6, 3, 8), (4, 6, 5, 3), {}, ValidationError, ["'x' dim 2 (H) is 3", "R=5"]),
    ((2, 6, 8, 4), (4, 6, 3, 3), {"dilation": (1, 2)}, ValidationError, ["'x' dim 3 (W) is 4", "dilation 2"]),
    ((2, 6, 8, 8), (4, 6, 3, 3), {"padding": -1}, ValidationError, ["padding=-1", "an int >= 0"]),
    ((2, 6, 8, 8), (4, 6, 3, 3), {"stride": (1, 0)}, ValidationError, ["stride=(1, 0)", ">= 1"]),
    ((2, 6, 8, 8), (4, 6, 3, 3), {"dilation": 0}, ValidationError, ["dilation=0"]),
    ((2, 6, 8, 8), (4, 6, 3, 3), {"stride": 1.5}, ValidationError, ["stride=1.5"]),
    ((2, 6, 8, 8), (4, 6, 3, 3), {"groups": 0}, ValidationError, ["groups=0"]),
    ((6, 8, 8), (4, 6, 3, 3), {}, ValidationError, ["'x' has dims [6, 8, 8]", "rank 4"]),
    ((2, 6, 8, 8), (4, 6, 3), {}, ValidationError, ["'w' has dims [4, 6, 3]", "rank 4"]),
])
def test_graph_errors_name_the_tensor_the_dim_and_the_rule(x_dims, w_dims, attrs, cls, words):
    g, x, w = _graph(x_dims, w_dims, nhwc=False)
    with pytest.raises(cls) as info:
        g.conv_fprop(x, w, name="c", **attrs)
    for word in words + ["node 'c'"]:
        assert word in str(info.value), (word, str(info.value))


def test_graph_checks_bias_residual_and_types():
    g, x, w = _graph((2, 6, 8, 8), (4, 6, 3, 3))
    with pytest.raises(ValidationError, match=r"'bias' has dims \[6\]; needs \(4,\)"):
        g.conv_fprop(x, w, g.tensor(dims=[6], name="b"))
    with pytest.raises(ValidationError, match=r"'residual' has dims \[2, 4, 8, 8\]; needs y's \[2, 4, 6, 6\]"):
        g.conv_fprop(x, w, residual=g.tensor(dims=[2, 4, 8, 8], name="r"))
    with pytest.raises(DTypeError, match="'w' is float32; needs x's float16"):
        g.conv_fprop(x, g.tensor(dims=[4, 6, 3, 3], data_type="float32", name="w32"))
    g8 = nvdnn.Graph(io_data_type="float16", arch="sm_90")
    x8 = g8.tensor(dims=[2, 6, 8, 8], data_type="float8_e4m3", name="x8")
    g8.conv_fprop(x8, g8.tensor(dims=[4, 6, 3, 3], data_type="float8_e4m3", name="w8")).set_output(True)
    with pytest.raises(DTypeError, match="tensor 'x8' is float8_e4m3"):
        g8.validate()


def test_graph_runs_the_numpy_reference_with_its_epilogue():
    g, x, w = _graph((2, 5, 9, 7), (3, 5, 3, 3), dtype="float32")
    b, r = g.tensor(dims=[3], name="b"), g.tensor(dims=[2, 3, 5, 4], name="r")
    g.relu(g.conv_fprop(x, w, b, r, stride=(1, 2), padding=(0, 1), dilation=(2, 1)), name="y").set_output(True)
    g.build()
    rng = np.random.default_rng(3)
    pack = {n: rng.standard_normal(s).astype(np.float32) for n, s in
            (("x", (2, 5, 9, 7)), ("w", (3, 5, 3, 3)), ("b", (3,)), ("r", (2, 3, 5, 4)))}
    pack["y"] = np.empty((2, 3, 5, 4))
    g.execute(pack, backend="numpy")
    want = _loops(pack["x"].astype(np.float64), pack["w"].astype(np.float64), (1, 2), (0, 1), (2, 1), 1)
    np.testing.assert_allclose(pack["y"], np.maximum(want + pack["b"][:, None, None] + pack["r"], 0), atol=1e-12)


# -- planning ------------------------------------------------------------------------------------------

def _op(dtype, dims, layout):
    return Operand(dtype, dims, conv.packed_strides(dims, layout))


def _uris(plan):
    return [launch.spec.uri for launch in plan.launches]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_1x1_nhwc_is_one_gemm_over_x_as_it_lies(dtype):
    x, w = _op(dtype, (2, 64, 56, 56), "NHWC"), _op(dtype, (256, 64, 1, 1), "NCHW")
    plan = conv.plan_conv_fprop(x, w, bias=Operand(dtype, (256,), (1,)), residual=_op(dtype, (2, 256, 56, 56), "NHWC"),
                                epilogue=(("relu", ""),), params=(0.0, float("inf")), arch="sm_90")
    (launch,) = plan.launches
    assert isinstance(launch.spec, MatmulSpec) and launch.spec.kernel == "wgmma"
    assert (launch.spec.a_major, launch.spec.b_major, launch.spec.bias, launch.spec.epilogue) == (
        "k", "k", "col", (("relu", ""),))
    assert launch.pointers == ("y", "x", "w", "bias", "residual") and plan.scratch == ()
    m, n, k = launch.args[2:5]
    assert (m, n, k) == (2 * 56 * 56, 256, 64)   # the batch folds into M: NHWC rows step by one stride


def test_1x1_nchw_is_a_batched_gemm_writing_nchw():
    x, w = _op("float16", (2, 64, 16, 16), "NCHW"), _op("float16", (32, 64, 1, 1), "NCHW")
    (launch,) = conv.plan_conv_fprop(x, w, arch="sm_90").launches
    assert launch.spec.kernel == "wgmma" and launch.spec.a_major == "m" and launch.pointers == ("y", "x", "w")
    assert tuple(int(v) for v in launch.args[2:6]) == (256, 32, 64, 2)   # M = P*Q, N, K, batch over n
    assert tuple(int(v) for v in launch.args[14:17]) == (1, 256, 32 * 256)  # y column-major: (p, q) stride 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_3x3_nhwc_on_hopper_is_one_implicit_gemm(dtype):
    """TMA's im2col mode reads A from x in place: no gather pass, no scratch."""
    x, w = _op(dtype, (2, 64, 56, 56), "NHWC"), _op(dtype, (64, 64, 3, 3), "NHWC")   # KRSC weight
    plan = conv.plan_conv_fprop(x, w, bias=Operand(dtype, (64,), (1,)), padding=1, arch="sm_90")
    (gemm,) = plan.launches
    assert gemm.spec.kernel == "wgmma" and gemm.spec.a_gather == "im2col" and ".im2col" in gemm.spec.uri
    assert gemm.pointers == ("y", "x", "w", "bias") and plan.scratch == ()
    a_map, b_map = gemm.args[:2]
    assert isinstance(a_map, Im2colMapArg) and a_map.pointer == 1
    assert (a_map.dims, a_map.strides) == ((64, 56, 56, 2), (128, 56 * 128, 56 * 56 * 128))
    assert (a_map.lower, a_map.upper, a_map.channels, a_map.steps) == ((-1, -1), (-1, -1), 64, (1, 1, 1, 1))
    assert b_map.dims[:2] == (576, 64)


def test_implicit_gemm_pads_each_tap_to_whole_channel_slices():
    """C = 72, asymmetric stride, padding and dilation: K runs over 2 slices of 64 a tap (the
    second past C reads zeros), B's map stops at R*S*C, the corners bound each tap's pixels."""
    x, w = _op("float16", (2, 72, 17, 9), "NHWC"), _op("float16", (33, 72, 3, 2), "NHWC")
    plan = conv.plan_conv_fprop(x, w, stride=(2, 1), padding=(1, 0), dilation=(1, 2), arch="sm_90")
    (gemm,) = plan.launches
    p, q = (17 + 2 - 2 - 1) // 2 + 1, (9 - 2 - 1) + 1
    m, n, k = (int(v) for v in gemm.args[2:5])
    assert (m, n, k) == (2 * p * q, 33, 3 * 2 * 128)
    a_map, b_map = gemm.args[:2]
    assert a_map.lower == (0, -1) and a_map.upper == ((q - 1) - (9 - 1), (p - 1) * 2 - 1 - 16)
    assert a_map.steps == (1, 1, 2, 1) and b_map.dims[0] == 3 * 2 * 72
    names = [p.split()[-1] for p in gemm.spec.render_context()["geometry_params"]]
    tail = {name: int(v) for name, v in zip(names, gemm.args[2:]) if name.startswith("conv_")}
    assert tail == dict(conv_c=72, conv_cb=2, conv_s=2, conv_pq=p * q, conv_q=q, conv_sh=2, conv_sw=1, conv_ph=1,
                        conv_pw=0, conv_dh=1, conv_dw=2)


@pytest.mark.parametrize("x, pitch, mode", [
    (_op("float16", (2, 64, 16, 16), "NCHW"), 64, "im2col"),
    (_op("float16", (2, 12, 16, 16), "NHWC"), 16, "im2col32"),      # pixels off 16-byte strides
    (_op("bfloat16", (2, 3, 16, 16), "NHWC"), 8, "im2col16"),       # the RGB stem
    (_op("float32", (2, 3, 16, 16), "NCHW"), 4, "im2col16"),
])
def test_an_x_no_im2col_map_reads_is_relaid_once_into_padded_nhwc(x, pitch, mode):
    """Not the gather's R * S copies: one pass writes x as NHWC with C padded to 16 bytes by zeros."""
    plan = conv.plan_conv_fprop(x, _op(x.dtype, (32, x.shape[1], 3, 3), "NHWC"), padding=1, arch="sm_90",
                                precision="tf32" if x.dtype == "float32" else "exact")
    relayout, gemm = plan.launches[0], plan.launches[-1]
    assert relayout.spec.pad and relayout.pointers == ("scratch0", "x") and int(relayout.args[-1]) == pitch
    width = 4 if x.dtype == "float32" else 2
    assert plan.scratch[0] == 2 * 16 * 16 * pitch * width
    assert gemm.spec.a_gather == mode and gemm.pointers[1] == "scratch0" and gemm.args[0].dims[0] == pitch


@pytest.mark.parametrize("why, x, kwargs", [
    ("corner past 127", _op("float16", (1, 64, 16, 16), "NHWC"), dict(padding=130)),
    ("Ampere", _op("float16", (2, 64, 16, 16), "NHWC"), dict(padding=1, arch="sm_80")),
    ("exact float32", _op("float32", (2, 64, 16, 16), "NHWC"), dict(padding=1)),
])
def test_the_gather_pass_stays_where_an_im2col_map_cannot_read(why, x, kwargs):
    kwargs = {"arch": "sm_90", **kwargs}
    plan = conv.plan_conv_fprop(x, _op(x.dtype, (32, x.shape[1], 3, 3), "NHWC"), **kwargs)
    assert plan.launches[0].spec.family == "im2col", why
    assert not getattr(plan.launches[-1].spec, "a_gather", ""), why


def test_tf32_nhwc_runs_the_implicit_gemm_with_32_channel_slices():
    x, w = _op("float32", (2, 40, 9, 9), "NHWC"), _op("float32", (16, 40, 3, 3), "NHWC")
    (gemm,) = conv.plan_conv_fprop(x, w, padding=1, precision="tf32", arch="sm_90").launches
    assert gemm.spec.a_gather == "im2col" and gemm.spec.bk == 32 and int(gemm.args[4]) == 9 * 64


def test_kcrs_weight_is_reordered_by_the_same_gather():
    x, w = _op("float16", (1, 5, 13, 11), "NCHW"), _op("float16", (7, 5, 3, 3), "NCHW")
    plan = conv.plan_conv_fprop(x, w, padding=1, arch="sm_80")
    assert _uris(plan)[:2] == ["im2col/f16.v8/pad", "im2col/f16.v8/pad"]
    assert [l.pointers for l in plan.launches[:2]] == [("scratch0", "w"), ("scratch1", "x")]
    pitch = repack.pitch(45, "float16")
    assert plan.scratch[:2] == (7 * pitch * 2, 13 * 11 * pitch * 2)
    assert plan.launches[-1].pointers[:3] == ("y", "scratch1", "scratch0")


def test_gemm_scratch_follows_the_gather_scratch():
    """fp32 exact on Hopper's wgmma (256 output channels: fewer run mma.sync in place): the GEMM's
    own repacks (3xTF32 planes) and any split-K partials get the scratch slots after the
    gather's, and read the gathered columns."""
    x, w = _op("float32", (2, 64, 56, 56), "NCHW"), _op("float32", (256, 64, 3, 3), "NCHW")
    plan = conv.plan_conv_fprop(x, w, padding=1, arch="sm_90")
    pointers = [l.pointers for l in plan.launches]
    assert pointers[:4] == [("scratch0", "w"), ("scratch1", "x"), ("scratch2", "scratch1"), ("scratch3", "scratch0")]
    assert pointers[4][:3] == ("y", "scratch2", "scratch3") and len(plan.scratch) == len(
        {p for ps in pointers for p in ps if p.startswith("scratch")})


def test_gather_vectors_need_contiguous_aligned_channels():
    """Vector loads and stores where x's channels allow; where they give none, the pad kernel's
    16-byte stores of columns loaded one by one (the row pitch is the plan's own)."""
    cases = {("NHWC", 64, 16): (8, False), ("NHWC", 12, 16): (4, False), ("NHWC", 5, 16): (8, True),
             ("NCHW", 64, 16): (8, True), ("NHWC", 64, 4): (2, False)}
    for (layout, c, align), want in cases.items():
        x = Operand("float16", (1, c, 8, 8), conv.packed_strides((1, c, 8, 8), layout), align)
        plan = conv.plan_conv_fprop(x, _op("float16", (4, c, 3, 3), "NHWC"), arch="sm_80")   # no im2col maps
        assert (plan.launches[0].spec.vec, plan.launches[0].spec.pad) == want, (layout, c, align)


def test_gather_index_arithmetic_is_32_bit_until_it_cannot_be():
    w = _op("float32", (64, 64, 3, 3), "NCHW")
    for n, index in ((256, "int32"), (512, "int64")):   # 256 * 224^2 * 576 / 4 vectors fit 2^31 - 1; twice not
        plan = conv.plan_conv_fprop(_op("float32", (n, 64, 224, 224), "NCHW"), w, padding=1, arch="sm_80")
        (gather,) = [launch for launch in plan.launches if launch.pointers[1:] == ("x",)]
        assert gather.spec.index == index


def test_graph_explain_shows_the_reorder_and_the_implicit_gemm():
    g, x, w = _graph((2, 64, 56, 56), (64, 64, 3, 3))
    g.relu(g.conv_fprop(x, w, g.tensor(dims=[64], name="b"), padding=1), name="y").set_output(True)
    g.build()
    text = g.explain()
    assert "conv[conv_fprop -> relu](x, w, b) -> y" in text
    assert "launches: im2col/f16.v8/pad -> matmul/wgmma/f16.k.im2colxf16.k->f16/bias.col.f16/ep=relu/" in text


def test_ampere_runs_mma_and_float32_exact_small_runs_3xtf32_on_mma():
    x, w = _op("bfloat16", (2, 64, 28, 28), "NHWC"), _op("bfloat16", (64, 64, 3, 3), "NHWC")
    assert conv.plan_conv_fprop(x, w, padding=1, arch="sm_80").launches[-1].spec.kernel == "mma"
    x, w = _op("float32", (1, 3, 9, 9), "NCHW"), _op("float32", (4, 3, 3, 3), "NCHW")
    gemm = conv.plan_conv_fprop(x, w, arch="sm_90").launches[-1].spec
    assert (gemm.kernel, gemm.precision) == ("mma", "exact")
    assert conv.plan_conv_fprop(x, w, arch="sm_90", precision="tf32").launches[-1].spec.precision == "tf32"


def test_refusals_are_typed_and_named():
    x, w = _op("float16", (2, 6, 8, 8), "NHWC"), _op("float16", (6, 3, 3, 3), "NHWC")
    with pytest.raises(DTypeError, match="x: data type float8_e4m3"):
        conv.plan_conv_fprop(x._replace(dtype="float8_e4m3"), w, arch="sm_90")
    with pytest.raises(DTypeError, match="w: data type float32 does not match"):
        conv.plan_conv_fprop(x, _op("float32", (6, 6, 3, 3), "NHWC"), arch="sm_90")
    odd = (2 * 6 * 6 * 7, 1, 6 * 7, 7)  # (P, Q) rows of y that no one stride walks
    with pytest.raises(UnsupportedError, match="y: strides"):
        conv.plan_conv_fprop(x, _op("float16", (6, 6, 3, 3), "NHWC"), out_strides=(216, 1, 1, 36), arch="sm_90")
    assert conv.plan_conv_fprop(x, _op("float16", (6, 6, 3, 3), "NHWC"), out_strides=odd, arch="sm_90").launches


@pytest.mark.skipif(gpu_count() > 0, reason="checks what a machine without a GPU says")
def test_functional_takes_groups_up_to_the_device():
    """A grouped conv passes every check; with no GPU the first thing it meets is the device."""
    with pytest.raises(DeviceError):
        nvdnn.conv2d(np.zeros((1, 4, 5, 5), np.float32), np.zeros((8, 1, 3, 3), np.float32), groups=4)


# -- the templates compiled ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    from tests.presets import warmed_preset
    gathers = [conv.Im2colSpec(dt, v, index) for dt in conv.DTYPES for v in (1, 2, 4, 8)
               for index in ("int32", "int64") if v * (2 if dt != "float32" else 4) <= 16]
    specs = list(dict.fromkeys(gathers + conv.preset()))
    jobs = [(s, a) for s in specs for a in ("sm_80", "sm_90") if not conv.unsupported_reason(s, a)]
    return warmed_preset(tmp_path_factory.mktemp("conv-cache"), jobs)


def _spilled(entries) -> set:
    return {k for k, e in entries.items() if e.meta["spill_bytes"] or e.meta["stack_bytes"]}


def test_every_conv_kernel_compiles_and_the_gathers_do_not_spill(warmed):
    assert warmed["report"].failed == [], warmed["report"].failed[:2]
    entries = warmed["entries"]
    assert {a for _, a in entries} == {"sm_80", "sm_90", "sm_90a"}
    gathers = {k: e for k, e in entries.items() if k[0].startswith("im2col/")}
    assert len([k for k in gathers if not k[0].endswith("/pad")]) == 2 * 22 and _spilled(gathers) == set()
    assert _spilled(entries) <= {(f"matmul/wgmma/f16.k{a}xf16.k->f16/bias.col.f16/ep=relu/256x128x64s4w2x1g8", "sm_90a")
                                 for a in ("", ".im2col")}


@pytest.mark.xfail(strict=True, reason="the matmul heuristic's wgmma 256x128 tile with bias + ReLU spills 4 bytes "
                   "on sm_90a (168 registers), with an im2col A too; nvdnn.matmul picks it too, e.g. "
                   "(32, 784, 1152) @ (1152, 128)")
def test_conv_gemms_do_not_spill(warmed):
    assert _spilled(warmed["entries"]) == set()


def test_gather_sass_moves_16_bytes_and_conv_gemms_use_hgmma(warmed):
    from tests.sass import sass_text

    def sass(e):
        return sass_text(e.cubin)

    entries = warmed["entries"]
    for arch in ("sm_80", "sm_90"):
        for uri in ("im2col/bf16.v8", "im2col/bf16.v8/i64"):
            text = sass(entries[(uri, arch)])
            assert "LDG.E.128" in text and "STG.E.128" in text and " STL" not in text, (uri, arch)
        assert "LDG.E.128" not in sass(entries[("im2col/f16.v1", arch)])
    gemm = next(e for (uri, _), e in entries.items() if uri.startswith("matmul/wgmma/bf16") and "/bias.col" in uri)
    text = sass(gemm)
    assert "HGMMA" in text and "UTMALDG" in text and " STL" not in text


# -- plans run by a NumPy emulator of their launches -------------------------------------------------------
# What no GPU here can show: that the planner wires the gather, the reorder, the GEMM's operands,
# tensor maps, output and residual strides and scratch slots together right. Each launch is run
# on flat float64 buffers by its kernel's contract (im2col.cu.j2 as its header states it, the
# repack copy, the GEMM y = epilogue(alpha * A @ B + bias + beta * residual) read through its
# tensor maps on wgmma, through its stride arguments elsewhere).

def _emulate_im2col(launch, mem):
    col, x = (mem[p] for p in launch.pointers)
    n_, c_, h_, w_, p_, q_, r_, s_, ph, pw, sth, stw, dh, dw = (int(v) for v in launch.args[:14])
    sn, sc, sh, sw, ld = (int(v) for v in launch.args[14:])
    assert launch.spec.vec == 1 or ld % launch.spec.vec == 0 and (launch.spec.pad or sc == 1 and c_ % launch.spec.vec == 0)
    n, p, q, r, s, c = np.indices((n_, p_, q_, r_, s_, c_))
    h, w = p * sth - ph + r * dh, q * stw - pw + s * dw
    inside = (h >= 0) & (h < h_) & (w >= 0) & (w < w_)
    src = np.where(inside, n * sn + c * sc + h * sh + w * sw, 0)
    if launch.spec.pad:   # whole rows: zeros past the taps' columns
        col[np.arange(n_ * p_ * q_ * ld)] = 0.0
    col[((n * p_ + p) * q_ + q) * ld + (r * s_ + s) * c_ + c] = np.where(inside, x[src], 0.0)


def _emulate_repack(launch, mem):
    dst, src = (mem[p] for p in launch.pointers)
    rows, cols, sb, sr, sc, pitch, dst_sb = (int(v) for v in launch.args)
    b, r, c = np.indices((launch.grid[2], rows, cols))
    dst[b * dst_sb + r * pitch + c] = src[b * sb + r * sr + c * sc]


def _read(buffer, dims, strides):
    index = sum(np.arange(d).reshape([-1 if i == a else 1 for i in range(len(dims))]) * s
                for a, (d, s) in enumerate(zip(dims, strides)))
    return buffer[index]


def _im2col_box(tmap, x, width, c0, w0, h0, n0, dw, dh):
    """One TMA im2col copy as the PTX ISA's im2col mode states it: ``tmap.pixels`` pixels walked
    from input pixel (n0, h0 + dh, w0 + dw) through the tap's bounding box (corners + offsets)
    at the map's steps, W, then H, then the next image from the box's corner; ``channels`` from
    c0; zeros outside the image and past C."""
    (c_, w_, h_, n_), (sw, sh, sn) = tmap.dims, (st // width for st in tmap.strides)
    lo_w, lo_h = tmap.lower[0] + dw, tmap.lower[1] + dh
    hi_w, hi_h = w_ - 1 + tmap.upper[0] + dw, h_ - 1 + tmap.upper[1] + dh
    out = np.zeros((tmap.pixels, tmap.channels))
    n, h, w = n0, h0 + dh, w0 + dw
    for i in range(tmap.pixels):
        if 0 <= n < n_ and 0 <= h < h_ and 0 <= w < w_:
            c = np.arange(c0, min(c0 + tmap.channels, c_))
            out[i, :len(c)] = x[n * sn + h * sh + w * sw + c]
        w += tmap.steps[1]
        if w > hi_w:
            w, h = lo_w, h + tmap.steps[2]
            if h > hi_h:
                h, n = lo_h, n + 1
    return out


def _origin(pixel, conv_args):
    """common/sm90_tma_im2col.cuh's im2col_origin: an output pixel's image and tap-0 input pixel."""
    _, _, _, pq, q, sh, sw, ph, pw, _, _ = conv_args
    img, ohw = divmod(pixel, pq)
    return img, (ohw // q) * sh - ph, (ohw % q) * sw - pw


def _im2col_operands(spec, a_map, x, width, b, m, k, conv_args, k0, bt):
    """A (M, K) and B (K, N) of batch ``bt`` as the wgmma producer loads them for an im2col A:
    per tile of BM rows its first pixel and tap-0 corner, per K slice (from ``k0``, the split's
    start) the channel slice and tap its counters walk, A by the im2col map, B's columns tap * C
    + cb * BK; "im2col16" / "im2col32": the slice's taps side by side, 16 / 32 bytes of channels
    each, zeros past the last tap, B's columns as they are."""
    c, cbs, s_, _, _, _, _, _, _, dh, dw = conv_args
    bk, bm = spec.bk, spec.bm
    a = np.zeros((-(-m // bm) * bm, k))
    b_rows = np.zeros((k, b.shape[1]))
    for tm in range(-(-m // bm)):
        img, h0, w0 = _origin(bt * m + tm * bm, conv_args)
        if spec.a_gather in ("im2col16", "im2col32"):
            row = int(spec.a_gather[6:])
            taps, cw = bk * width // row, row // width
            for tap in range(k0 // bk * taps, k // bk * taps):
                fr, fs = divmod(tap, s_) if tap < cbs else (0, 0)
                a[tm * bm:(tm + 1) * bm, tap * cw:(tap + 1) * cw] = _im2col_box(
                    a_map, x, width, 0 if tap < cbs else c, w0, h0, img, fs * dw, fr * dh)
            b_rows[:len(b)] = b
            continue
        cb = k0 // bk
        tap, cb = divmod(cb, cbs)
        fr, fs = divmod(tap, s_)
        for g in range(k0 // bk, k // bk):
            a[tm * bm:(tm + 1) * bm, g * bk:(g + 1) * bk] = _im2col_box(a_map, x, width, cb * bk, w0, h0, img,
                                                                       fs * dw, fr * dh)
            kcol = (fr * s_ + fs) * c + cb * bk
            rows = b[kcol:kcol + bk]
            b_rows[g * bk:g * bk + len(rows)] = rows
            cb += 1
            if cb == cbs:
                cb, fs = 0, fs + 1
                if fs == s_:
                    fs, fr = 0, fr + 1
    return a[:m, k0:], b_rows[k0:]


def _im2col_b(spec, b_map, x, width, n, k, conv_args):
    """B (K, N) of a b_gather GEMM as its producer loads it: per K slice of BK output pixels,
    each 64-column chunk one im2col box of one tap's channels."""
    c, _, s_, _, _, _, _, _, _, dh, dw = conv_args
    bk, chunk = spec.bk, 128 // width
    assert c % chunk == 0 and (b_map.pixels, b_map.channels) == (bk, chunk)
    b = np.zeros((-(-k // bk) * bk, -(-n // chunk) * chunk))
    for k0 in range(0, k, bk):
        img, h0, w0 = _origin(k0, conv_args)
        for col in range(0, n, chunk):
            tap, c0 = divmod(col, c)
            fr, fs = divmod(tap, s_)
            b[k0:k0 + bk, col:col + chunk] = _im2col_box(b_map, x, width, c0, w0, h0, img, fs * dw, fr * dh)
    return b[:k, :n]


def _emulate_gemm(launch, mem):
    spec, args = launch.spec, list(launch.args)
    assert not spec.amax and not spec.scaled   # a split-K finish sums the same products
    maps = [args.pop(0), args.pop(0)] if spec.kernel == "wgmma" else None
    m, n, k, batch = (int(v) for v in args[:4])
    a_sm, a_sk, a_sb, b_sk, b_sn, b_sb = (int(v) for v in args[4:10])
    args = args[10:]
    if maps:
        bmul = [int(args.pop(0)), int(args.pop(0))]
        conv_args = [int(args.pop(0)) for _ in range(11)] if spec.a_gather or spec.b_gather else None
        rows_args = [int(args.pop(0)) for _ in range(6)] if spec.c_rows else None
        ranges = [(0, k)]
        if spec.split:   # K chunks, the last one shorter
            chunk = int(args.pop(0))
            ranges = [(k0, min(k, k0 + chunk)) for k0 in range(0, k, chunk)]
        if spec.finish:   # a split tile's ranges (split p of S steps: steps p * S / splits ..); a whole
            whole, splits = int(args.pop(0)), int(args.pop(0))   # tile's sum is the same products
            assert splits > 1 and launch.pointers[-1].startswith("scratch")
            steps = -(-k // spec.bk)
            ranges = [(p * steps // splits * spec.bk, min(k, (p + 1) * steps // splits * spec.bk))
                      for p in range(splits)]
    if maps and spec.a_gather:   # every split's walk from its own start: together the whole K
        b_map, width = maps[1], 2 if spec.a_dtype != "float32" else 4
        assert b_map.dims[0] <= k and spec.b_major == "k"
        b_mat = _read(mem[launch.pointers[2]], b_map.dims[1::-1], (b_map.strides[0] // width, 1)).T
        a, b = [], []
        for bt in range(batch):
            parts = [_im2col_operands(spec, maps[0], mem[launch.pointers[1]], width, b_mat, m, k, conv_args, k0, bt)
                     for k0, _ in ranges]
            a.append(np.concatenate([p[0][:, :k1 - k0] for p, (k0, k1) in zip(parts, ranges)], 1))
            b.append(np.concatenate([p[1][:k1 - k0] for p, (k0, k1) in zip(parts, ranges)], 0))
        a, b = np.stack(a), np.stack(b)
    elif maps:
        ops = []
        for tmap, mul, rows in zip(maps, bmul, (m, n)):
            buffer = mem[launch.pointers[tmap.pointer]]
            width = 2 if spec.a_dtype != "float32" else 4
            if tmap.pointer == 2 and spec.b_gather:
                ops.append(_im2col_b(spec, tmap, buffer, width, n, k, conv_args).T[None])
                continue
            d0, d1, d2 = tmap.dims
            s1, s2 = (s // width for s in tmap.strides)
            if (spec.a_major if tmap.pointer == 1 else spec.b_major) == "k":   # (K, rows, batch)
                assert (d0, d1) == (k, rows)
                t = _read(buffer, (d2, d1, d0), (s2, s1, 1))
            else:                                                               # (rows, K, batch)
                assert (d0, d1) == (rows, k)
                t = _read(buffer, (d2, d1, d0), (s2, s1, 1)).transpose(0, 2, 1)
            ops.append(t[np.arange(batch) * mul % d2])
        a, b = ops[0], ops[1].transpose(0, 2, 1)
    else:
        a = _read(mem[launch.pointers[1]], (batch, m, k), (a_sb, a_sm, a_sk))
        b = _read(mem[launch.pointers[2]], (batch, k, n), (b_sb, b_sk, b_sn))
    c_sm, c_sn, c_sb = (int(v) for v in args[:3])
    args = args[3:]
    if spec.split:   # float32 partials of K chunks, [split][batch][M][N] (the reduce launch sums them)
        assert (c_sm, c_sn, c_sb) == (n, 1, m * n) and not (spec.bias or spec.residual or spec.epilogue)
        out = mem[launch.pointers[0]]
        for part, (k0, k1) in enumerate(ranges):
            out[part * batch * m * n:(part + 1) * batch * m * n] = np.matmul(a[..., k0:k1], b[:, k0:k1]).ravel()
        return
    y = np.matmul(a, b)
    if spec.residual:
        r_sm, r_sn, r_sb = (int(v) for v in args[:3])
        args = args[3:]
        res = _read(mem["residual"], (batch, m, n), (r_sb, r_sm, r_sn))
    alpha, *scalars = (float(v) for v in args)
    beta = scalars.pop(0) if spec.residual else 0.0
    y = y * alpha
    if spec.bias:
        y = y + mem["bias"][:n]
    if spec.norm:   # the folded batch norm, per column: its eps follows alpha (and beta)
        vec = {role: mem["norm_" + role][:n] for role in ("mean", "var", "gamma", "beta")
               if "norm_" + role in launch.pointers}
        y = (y - vec["mean"]) / np.sqrt(vec["var"] + scalars.pop(0)) * vec.get("gamma", 1.0) + vec.get("beta", 0.0)
    if spec.residual:
        y = y + beta * res
    y = ref.chain(y, spec.epilogue, scalars)
    out = mem[launch.pointers[0]]
    bi, mi, ni = np.indices((batch, m, n))
    if spec.c_rows:   # row m is image pixel (m / pq, m % pq / q, m % q) through three strides, from y_off
        pq, q, si, sh, sw, off = rows_args
        out[off + (mi // pq) * si + (mi % pq // q) * sh + (mi % q) * sw + ni * c_sn + bi * c_sb] = y
        return
    out[bi * c_sb + mi * c_sm + ni * c_sn] = y


def _emulate_reduce(launch, mem):
    """matmul_reduce with no epilogue but alpha: y = alpha * the sum of the split partials."""
    spec, args = launch.spec, launch.args
    assert not (spec.bias or spec.residual or spec.epilogue or spec.norm or spec.amax)
    m, n, batch, splits, c_sm, c_sn, c_sb = (int(v) for v in args[:7])
    parts = mem[launch.pointers[1]][:splits * batch * m * n].reshape(splits, batch, m, n)
    bi, mi, ni = np.indices((batch, m, n))
    mem[launch.pointers[0]][bi * c_sb + mi * c_sm + ni * c_sn] = float(args[7]) * parts.sum(axis=0)


def _run_plan(plan, mem):
    for size, slot in zip(plan.scratch, range(len(plan.scratch))):
        mem[f"scratch{slot}"] = np.full(size, np.nan)   # element slots (bytes over-count: harmless)
    for launch in plan.launches:
        {"im2col": _emulate_im2col, "repack": _emulate_repack, "matmul": _emulate_gemm}[launch.spec.family](launch, mem)


def _buffer(values, layout):
    """A flat buffer holding (N, C, H, W) ``values`` in ``layout`` memory, and its strides."""
    if layout == "NHWC" and values.ndim == 4:
        return np.ascontiguousarray(values.transpose(0, 2, 3, 1)).ravel(), conv.packed_strides(values.shape, "NHWC")
    return values.ravel().copy(), conv.packed_strides(values.shape, "NCHW") if values.ndim == 4 else (1,)


EMULATED = [  # x shape, w shape, stride, padding, dilation, dtype, arch, layouts (x, w)
    ((2, 8, 6, 5), (16, 8, 1, 1), 1, 0, 1, "float16", "sm_90", ("NHWC", "NHWC")),   # the GEMM over x itself
    ((2, 8, 6, 5), (16, 8, 1, 1), 1, 0, 1, "float16", "sm_90", ("NCHW", "NCHW")),
    ((2, 16, 9, 7), (24, 16, 3, 3), 1, 1, 1, "bfloat16", "sm_90", ("NHWC", "NHWC")),
    ((2, 16, 9, 7), (24, 16, 3, 3), 1, 1, 1, "bfloat16", "sm_90", ("NCHW", "NCHW")),
    ((2, 3, 15, 13), (8, 3, 7, 7), 2, 3, 1, "float16", "sm_90", ("NHWC", "NHWC")),    # the stem's shape
    ((3, 5, 13, 11), (7, 5, 3, 2), (2, 1), (1, 0), (1, 2), "float16", "sm_90", ("NCHW", "NHWC")),
    ((3, 5, 13, 11), (7, 5, 3, 3), 1, 1, 1, "float32", "sm_80", ("NHWC", "NCHW")),
    ((2, 8, 8, 8), (16, 8, 1, 1), 2, 0, 1, "bfloat16", "sm_80", ("NHWC", "NHWC")),    # 1x1 stride 2: gathered
    ((2, 64, 12, 12), (64, 64, 3, 3), 1, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),
    ((3, 5, 13, 11), (7, 5, 1, 1), 1, 0, 1, "float16", "sm_90", ("NHWC", "NCHW")),   # rows no tensor map reads
    ((8, 3, 64, 64), (64, 3, 7, 7), 2, 3, 1, "float16", "sm_90", ("NHWC", "NHWC")),   # B (R*S*C = 147) repacked
    ((3, 5, 13, 11), (7, 5, 1, 1), 1, 0, 1, "bfloat16", "sm_90", ("NCHW", "NCHW")),
    # implicit GEMM (TMA im2col): taps of 2 channel slices, the second partial; asymmetric
    # geometry; a KCRS weight reordered; few pixels, long K (split-K finish)
    ((2, 72, 17, 9), (33, 72, 3, 2), (2, 1), (1, 0), (1, 2), "float16", "sm_90", ("NHWC", "NHWC")),
    ((2, 16, 9, 7), (24, 16, 3, 3), 2, 1, 1, "bfloat16", "sm_90", ("NHWC", "NCHW")),
    ((1, 256, 5, 3), (64, 256, 3, 3), 1, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),
    # "im2col16" (C within 16 bytes): x relaid with zero channels, or read in place at C = 8;
    # 2 x 4 taps fill a K slice exactly; NCHW y (a batch over n of P * Q rows); few pixels, long K
    ((2, 1, 11, 7), (5, 1, 3, 3), 1, 1, 1, "float16", "sm_90", ("NHWC", "NHWC")),
    ((2, 8, 9, 7), (16, 8, 2, 4), (1, 2), (0, 1), (2, 1), "bfloat16", "sm_90", ("NHWC", "NHWC")),
    ((3, 3, 17, 13), (8, 3, 7, 7), 2, 3, 1, "tf32", "sm_90", ("NCHW", "NCHW")),
    ((1, 4, 3, 3), (64, 4, 7, 7), 1, 3, 1, "bfloat16", "sm_90", ("NCHW", "NHWC")),
]


@pytest.mark.parametrize("case", EMULATED, ids=[f"{c[0]}x{c[1]}-{c[5]}-{c[6]}-{c[7][0]}" for c in EMULATED])
@pytest.mark.parametrize("epilogue", ["plain", "bias_residual_relu"])
def test_plans_emulated_launch_by_launch_match_the_reference(case, epilogue):
    xs, ws, stride, padding, dilation, dtype, arch, (x_layout, w_layout) = case
    dtype, precision = ("float32", "tf32") if dtype == "tf32" else (dtype, "exact")
    rng = np.random.default_rng(4)
    x, w = rng.standard_normal(xs), rng.standard_normal(ws)
    mem, ops = {}, {}
    for role, values, layout in (("x", x, x_layout), ("w", w, w_layout)):
        mem[role], strides = _buffer(values, layout)
        ops[role] = Operand(dtype, values.shape, strides)
    extra, want = {}, {}
    p, q = ref.conv2d_output_size(xs, ws, stride, padding, dilation)
    y_dims = (xs[0], ws[0], p, q)
    if epilogue != "plain":
        want["bias"], want["residual"] = rng.standard_normal(ws[0]), rng.standard_normal(y_dims)
        mem["bias"], _ = _buffer(want["bias"], "NCHW")
        mem["residual"], r_strides = _buffer(want["residual"], x_layout)
        extra = dict(bias=Operand(dtype, (ws[0],), (1,)), residual=Operand(dtype, y_dims, r_strides),
                     epilogue=(("relu", ""),), params=(0.0, float("inf")))
        want["activation"] = "relu"
    y_strides = conv.packed_strides(y_dims, x_layout)   # (C = 1 leaves x's own layout ambiguous)
    plan = conv.plan_conv_fprop(ops["x"], ops["w"], stride=stride, padding=padding, dilation=dilation, arch=arch,
                                precision=precision, out_strides=y_strides, **extra)
    mem["y"] = np.full(int(np.prod(y_dims)), np.nan)
    _run_plan(plan, mem)
    got = _read(mem["y"], y_dims, y_strides)
    np.testing.assert_allclose(got, ref.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, **want),
                               atol=1e-10, err_msg=" -> ".join(_uris(plan)))


def test_a_conv_graph_round_trips_through_a_plan_blob():
    g, x, w = _graph((2, 5, 13, 11), (7, 5, 3, 3), nhwc=False, dtype="bfloat16")
    g.relu(g.conv_fprop(x, w, padding=1, stride=(2, 1)), name="y").set_output(True)
    g.build()
    again = nvdnn.Graph.deserialize(g.serialize())
    assert again.explain() == g.explain() and "launches: im2col/bf16.v8/pad -> im2col/bf16.v8/pad -> " in again.explain()
    assert again.get_workspace_size() == g.get_workspace_size() > 0
